"""Shard layouts: which indices of a dimension each tensor-parallel rank holds.

A *split spec* (Split, Heads.q / Heads.kv, Fused, Vocab) describes how one
dimension of a weight is cut; policies pass one to a layer as `split=`.
`spec.resolve(full, tp_size, rank)` checks the numbers and returns a
`DimShard`: this rank's (offset, length) ranges of the full dimension, every
other rank's, and whether some indices are replicated.  The arithmetic and
its checks run in C (`_C.split_units`, `_C.heads_layout`, `_C.vocab_layout`).

Per-rank attribute values (`PerRank`) let a policy say "this rank's number of
heads" as data; the sharder resolves them while planning.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

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


class SplitSpec:
    """Base class of split specs.  Subclasses implement `_rank_ranges`."""

    def expected_full(self) -> int | None:
        """The full length this spec describes, when it knows it."""
        return None

    def _rank_ranges(self, full: int, tp_size: int, rank: int) -> tuple[list[tuple[int, int]], int]:
        """(ranges of the full dimension, shard length) held by `rank`."""
        raise NotImplementedError

    def resolve(self, full: int, tp_size: int, rank: int, what: str = "dimension") -> DimShard:
        expected = self.expected_full()
        if expected is not None and expected != full:
            raise ValueError(f"{what}={full} does not match {self.describe()} = {expected}")
        per_rank = [self._rank_ranges(full, tp_size, r) for r in range(tp_size)]
        all_ranges = tuple(tuple(rr) for rr, _ in per_rank)
        lengths = tuple(n for _, n in per_rank)
        covered = sum(n for rr in all_ranges for _, n in rr)
        return DimShard(
            full=full,
            length=lengths[rank],
            ranges=all_ranges[rank],
            all_ranges=all_ranges,
            all_lengths=lengths,
            rank=rank,
            tp_size=tp_size,
            replicated=covered > full,
        )

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Split(SplitSpec):
    """Plain split in pieces of `unit` indices; uneven counts give the first
    ranks one unit more.  Split() is the feature split of MLP layers."""

    unit: int = 1

    def _rank_ranges(self, full, tp_size, rank):
        if self.unit < 1 or full % self.unit:
            raise ValueError(f"length {full} is not a multiple of the split unit {self.unit}")
        start, count = _C.split_units(full // self.unit, tp_size, rank)
        return [(start * self.unit, count * self.unit)], count * self.unit

    def describe(self):
        return f"Split(unit={self.unit})"


@dataclass(frozen=True)
class Vocab(SplitSpec):
    """Vocabulary rows padded to a multiple of tp_size * `multiple`, split evenly;
    each rank's padding rows (past the real vocabulary) are zeros."""

    multiple: int = 1

    def _rank_ranges(self, full, tp_size, rank):
        _, start, per_rank, real = _C.vocab_layout(full, tp_size, rank, self.multiple)
        return ([(start, real)] if real else []), per_rank

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

    def _segment_lengths(self, full):
        known = [s.expected_full() for s in self.segments]
        if all(k is not None for k in known):
            return known
        if any(k is not None for k in known):
            rest = full - sum(k for k in known if k is not None)
            unknown = sum(1 for k in known if k is None)
            if rest < 0 or rest % unknown:
                raise ValueError(f"length {full} cannot hold the fused segments {self.describe()}")
            return [k if k is not None else rest // unknown for k in known]
        if full % len(self.segments):
            raise ValueError(f"length {full} is not divisible into {len(self.segments)} fused segments")
        return [full // len(self.segments)] * len(self.segments)

    def expected_full(self):
        known = [s.expected_full() for s in self.segments]
        return sum(known) if all(k is not None for k in known) else None

    def _rank_ranges(self, full, tp_size, rank):
        ranges, length, base = [], 0, 0
        for spec, seg_len in zip(self.segments, self._segment_lengths(full)):
            seg_ranges, seg_shard = spec._rank_ranges(seg_len, tp_size, rank)
            ranges += [(base + off, n) for off, n in seg_ranges]
            length += seg_shard
            base += seg_len
        return ranges, length

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

    def local_heads(self) -> PerRank:
        return PerRank(lambda tp, r: self.layout(tp, r)[1], f"query heads of {self}")

    def local_kv_heads(self) -> PerRank:
        return PerRank(lambda tp, r: self.layout(tp, r)[3], f"KV heads of {self}")

    def local_groups(self) -> PerRank:
        """Query heads per KV head on this rank (num_key_value_groups)."""
        def groups(tp, r):
            _, qc, _, kc = self.layout(tp, r)
            return qc // kc
        return PerRank(groups, f"query groups of {self}")

    def local_width(self, head_dim: int) -> PerRank:
        """This rank's query heads times `head_dim` (e.g. all_head_size)."""
        return PerRank(lambda tp, r: self.layout(tp, r)[1] * head_dim, f"width of {self}")


@dataclass(frozen=True)
class HeadSplit(SplitSpec):
    heads: Heads
    part: str  # "q" or "kv"

    def _count(self):
        return self.heads.num_heads if self.part == "q" else self.heads.kv_heads

    def expected_full(self):
        if self.heads.head_dim is None:
            return None
        return self._count() * self.heads.head_dim

    def _rank_ranges(self, full, tp_size, rank):
        count = self._count()
        if full % count:
            raise ValueError(
                f"length {full} is not a multiple of the {count} "
                f"{'query' if self.part == 'q' else 'key/value'} heads"
            )
        hd = full // count
        qs, qc, ks, kc = self.heads.layout(tp_size, rank)
        start, n = (qs, qc) if self.part == "q" else (ks, kc)
        return [(start * hd, n * hd)], n * hd

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

    def _rank_ranges(self, full, tp_size, rank):
        h = self.heads
        if h.num_heads % h.kv_heads:
            raise ValueError(f"num_attention_heads={h.num_heads} is not a multiple of num_kv_heads={h.kv_heads}")
        rows = h.num_heads + 2 * h.kv_heads
        if full % rows:
            raise ValueError(f"length {full} is not a multiple of the {rows} grouped q/k/v heads")
        hd, g = full // rows, h.num_heads // h.kv_heads
        qs, qc, ks, kc = h.layout(tp_size, rank)
        ranges, length = [], 0
        for j in range(ks, ks + kc):
            base = j * (g + 2) * hd
            first, last = max(qs, j * g), min(qs + qc, (j + 1) * g)
            if last > first:
                ranges.append((base + (first - j * g) * hd, (last - first) * hd))
            ranges.append((base + g * hd, 2 * hd))
            length += (max(last - first, 0) + 2) * hd
        return ranges, length

    def describe(self):
        h = self.heads
        return f"GroupedQKV(num_heads={h.num_heads}, num_kv_heads={h.kv_heads}, head_dim={h.head_dim})"
