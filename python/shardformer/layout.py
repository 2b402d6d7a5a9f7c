"""Shard layouts: which indices of a dimension each tensor-parallel rank holds.

A *split spec* (Split, Heads.q / Heads.kv, Fused, Vocab) describes how one
dimension of a weight is cut; policies pass one to a layer as `split=`.
A spec is data: `spec.data` is a small tuple (see csrc/layout_spec.c) that the C
layout arithmetic reads directly, so the sharder resolves every layout in C
without calling back into Python.  `spec.resolve(full, tp_size, rank)` is
the same arithmetic for code outside the sharder (one `_C.resolve_split`
call): it checks the numbers and returns a `DimShard`: this rank's (offset,
length) ranges of the full dimension, every other rank's, and whether some
indices are replicated.

Per-rank attribute values (`PerRank`) let a policy say "this rank's number of
heads" as data; the sharder resolves them while planning (head counts from
`Heads.local_*()` in C, from their data; other PerRank by their function).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import copy

import torch

from . import _C


@dataclass(frozen=True)
class DimShard:
    """One rank's part of a dimension of length `full` split over `tp_size` ranks.

    The rank's shard is its `ranges` of the full dimension laid back to back,
    followed by zero padding up to `length` (vocabulary padding).
    """

    full: int
    length: int
    ranges: tuple[tuple[int, int], ...]
    all_ranges: tuple[tuple[tuple[int, int], ...], ...]
    all_lengths: tuple[int, ...]
    rank: int
    tp_size: int
    replicated: bool = False

    @property
    def real(self) -> int:
        """Number of real (non-padding) indices held by this rank."""
        return sum(n for _, n in self.ranges)

    @property
    def chunk(self) -> int:
        """Stride of one rank's block in a gather buffer: the longest shard."""
        return max(self.all_lengths)

    @property
    def is_contiguous(self) -> bool:
        return len(self.ranges) <= 1

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """For each full index, its position in a buffer of all ranks' shards
        (rank r's shard at [r * chunk, r * chunk + length_r))."""
        idx = _C.gather_index(self.all_ranges, self.full, self.chunk)
        return torch.from_numpy(idx)


class SplitSpec(ABC):
    """Base class of split specs.  Subclasses say what they are as `data`
    (the tuple the C layout arithmetic reads, see csrc/layout_spec.c)."""

    @property
    @abstractmethod
    def data(self) -> tuple:
        """(kind, description, fields...): see csrc/layout_spec.c."""

    def expected_full(self) -> int | None:
        """The full length this spec describes, when it knows it."""
        return None

    def resolve(self, full: int, tp_size: int, rank: int, what: str = "dimension") -> DimShard:
        return DimShard(*_C.resolve_split(self.data, full, tp_size, rank, what))

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Split(SplitSpec):
    """Plain split in pieces of `unit` indices; uneven counts give the first
    ranks one unit more.  Split() is the feature split of MLP layers."""

    unit: int = 1

    @property
    def data(self):
        return ("split", self.describe(), self.unit)

    def describe(self):
        return f"Split(unit={self.unit})"


@dataclass(frozen=True)
class Vocab(SplitSpec):
    """Vocabulary rows padded to a multiple of tp_size * `multiple`, split evenly;
    each rank's padding rows (past the real vocabulary) are zeros."""

    multiple: int = 1

    @property
    def data(self):
        return ("vocab", self.describe(), self.multiple)

    def describe(self):
        return f"Vocab(multiple={self.multiple})"


@dataclass(frozen=True)
class Fused(SplitSpec):
    """Several tensors fused along one dimension ([q | k | v], [gate | up]):
    each segment is split by its own spec and the rank keeps its piece of
    each, in segment order.  Segment lengths come from the specs, or are equal
    when none says (Fused.equal)."""

    segments: tuple[SplitSpec, ...]

    @staticmethod
    def equal(n: int, unit: int = 1) -> "Fused":
        return Fused(tuple(Split(unit) for _ in range(n)))

    @property
    def data(self):
        return ("fused", self.describe(), tuple(s.data for s in self.segments))

    def expected_full(self):
        known = [s.expected_full() for s in self.segments]
        return sum(known) if all(k is not None for k in known) else None

    def describe(self):
        return "Fused(" + ", ".join(s.describe() for s in self.segments) + ")"


class PerRank:
    """An attribute value that differs per rank: `fn(tp_size, rank) -> value`,
    called by the sharder while planning (so its errors come before any change)."""

    __shardformer_per_rank__ = True

    def __init__(self, fn: Callable[[int, int], object], describe: str = "per-rank value"):
        self.fn = fn
        self.description = describe

    def resolve(self, tp_size: int, rank: int):
        return self.fn(tp_size, rank)

    def __repr__(self):
        return f"PerRank({self.description})"


@dataclass(frozen=True)
class Heads:
    """Attention heads split over the ranks, with grouped-query attention.

    KV heads are split over ranks and each query head stays with its KV head;
    when there are fewer KV heads than ranks, a KV head is replicated on
    tp_size / num_kv_heads ranks that split its query heads (uneven splits
    allowed).  `q`, `kv` and `qkv` are split specs for the projections;
    `local_*()` are per-rank attribute values.
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def layout(self, tp_size: int, rank: int) -> tuple[int, int, int, int]:
        """(q_start, q_count, kv_start, kv_count) in heads."""
        return _C.heads_layout(self.num_heads, self.kv_heads, tp_size, rank)

    @property
    def q(self) -> "HeadSplit":
        return HeadSplit(self, "q")

    @property
    def kv(self) -> "HeadSplit":
        return HeadSplit(self, "kv")

    @property
    def qkv(self) -> Fused:
        return Fused((self.q, self.kv, self.kv))

    @property
    def grouped_qkv(self) -> "GroupedQKV":
        """Fused rows grouped per KV head: [q_1 .. q_g | k | v] for each group."""
        return GroupedQKV(self)

    #: what a per-rank head attribute holds (Heads.attributes)
    COUNTS = ("heads", "kv_heads", "groups", "width", "config")

    def attributes(self, counts: dict, config=None) -> dict:
        """{attribute: this rank's value} for {attribute: what it holds}, the
        one place per-rank head attributes are made (the built-in policies
        name theirs, DerivedPolicy finds them on the module:
        shardformer.derived_rules).  With q / kv this rank's query / KV heads
        (layout()) and d = head_dim:

            "heads"     q                       (local_heads)
            "kv_heads"  kv                      (local_kv_heads)
            "groups"    q / kv                  (local_groups: num_key_value_groups)
            "width"     q * d                   (local_width: all_head_size, embed_dim, ...)
            "config"    a copy of `config` with this rank's q and kv (local_config)

        An unknown kind raises ValueError naming the attribute."""
        bad = {name: kind for name, kind in counts.items() if kind not in self.COUNTS}
        if bad:
            raise ValueError(f"Heads.attributes: {bad} is not one of {self.COUNTS}")
        if "config" in counts.values() and config is None:
            raise ValueError(f"Heads.attributes: {[n for n, k in counts.items() if k == 'config']} needs the config")
        made = {"heads": self.local_heads, "kv_heads": self.local_kv_heads, "groups": self.local_groups,
                "width": lambda: self.local_width(self.head_dim), "config": lambda: self.local_config(config)}
        return {name: made[kind]() for name, kind in counts.items()}

    def local_heads(self) -> PerRank:
        return HeadCount(self, HeadCount.QUERY, 1, f"query heads of {self}")

    def local_kv_heads(self) -> PerRank:
        return HeadCount(self, HeadCount.KV, 1, f"KV heads of {self}")

    def local_groups(self) -> PerRank:
        """Query heads per KV head on this rank (num_key_value_groups)."""
        return HeadCount(self, HeadCount.GROUPS, 1, f"query groups of {self}")

    def local_width(self, head_dim: int) -> PerRank:
        """This rank's query heads times `head_dim` (e.g. all_head_size)."""
        return HeadCount(self, HeadCount.QUERY, head_dim, f"width of {self}")

    def local_config(self, config) -> PerRank:
        """A per-rank shallow copy of a model `config` with this rank's
        num_attention_heads and num_key_value_heads, for an attention whose
        forward reads its head counts from `self.config`: one copy per
        (tp_size, rank), shared by every layer of the rank."""
        made = {}

        def local(tp_size: int, rank: int):
            if (tp_size, rank) not in made:
                _, q, _, kv = self.layout(tp_size, rank)
                made[(tp_size, rank)] = c = copy.copy(config)
                c.num_attention_heads, c.num_key_value_heads = q, kv
            return made[(tp_size, rank)]

        return PerRank(local, f"config with this rank's heads of {self}")


class HeadCount(PerRank):
    """A per-rank head count, as data: (num_heads, num_kv_heads, which,
    factor) in `__shardformer_heads__`, which the sharder's C planner turns
    into this rank's count times `factor` with the heads layout (no Python
    call).  `resolve` gives the same number from Python."""

    QUERY, KV, GROUPS = 0, 1, 2

    def __init__(self, heads: "Heads", which: int, factor: int, describe: str):
        self.__shardformer_heads__ = (heads.num_heads, heads.kv_heads, which, factor)
        super().__init__(self._count, describe)

    def __eq__(self, other) -> bool:
        """Equal by value (the heads, which count, the factor): a spec holding
        it (a Setting row) compares equal across builds."""
        if not isinstance(other, HeadCount):
            return NotImplemented
        return self.__shardformer_heads__ == other.__shardformer_heads__

    def __hash__(self) -> int:
        return hash(self.__shardformer_heads__)

    def _count(self, tp_size: int, rank: int) -> int:
        num_heads, kv_heads, which, factor = self.__shardformer_heads__
        _, qc, _, kc = _C.heads_layout(num_heads, kv_heads, tp_size, rank)
        return (qc if which == self.QUERY else kc if which == self.KV else qc // kc) * factor


@dataclass(frozen=True)
class HeadSplit(SplitSpec):
    heads: Heads
    part: str  # "q" or "kv"

    def _count(self):
        return self.heads.num_heads if self.part == "q" else self.heads.kv_heads

    @property
    def data(self):
        h = self.heads
        return ("heads", self.describe(), h.num_heads, h.kv_heads, h.head_dim or 0,
                0 if self.part == "q" else 1)

    def expected_full(self):
        if self.heads.head_dim is None:
            return None
        return self._count() * self.heads.head_dim

    def describe(self):
        h = self.heads
        dim = f" x head_dim={h.head_dim}" if h.head_dim else ""
        if self.part == "q":
            return f"num_attention_heads={h.num_heads}{dim}"
        return f"num_key_value_heads={h.kv_heads}{dim}"


@dataclass(frozen=True)
class GroupedQKV(SplitSpec):
    """A fused projection whose rows are grouped per KV head, each group
    [q_1 .. q_g | k | v] with g = num_heads / num_kv_heads (Falcon's
    new_decoder_architecture).  Each rank keeps, for every KV head it holds,
    its query heads of that group followed by the group's k and v, so its
    shard has the same grouped layout with its own head counts."""

    heads: Heads

    def expected_full(self):
        h = self.heads
        return None if h.head_dim is None else (h.num_heads + 2 * h.kv_heads) * h.head_dim

    @property
    def data(self):
        h = self.heads
        return ("grouped", self.describe(), h.num_heads, h.kv_heads, h.head_dim or 0)

    def describe(self):
        h = self.heads
        return f"GroupedQKV(num_heads={h.num_heads}, num_kv_heads={h.kv_heads}, head_dim={h.head_dim})"
