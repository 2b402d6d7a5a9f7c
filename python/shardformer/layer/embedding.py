"""Parallel embeddings.

VocabParallelEmbedding1D: the table E [V, d] is split by rows (vocabulary),
padded to V' = a multiple of tp_size * make_vocab_size_divisible_by; rank i
holds rows [i V'/p, (i+1) V'/p).  Each rank looks up the ids that fall in its
rows, writes zeros for the others, and reduce_from_tp_region sums the
partial lookups (all-reduce forward, identity backward): exactly one rank
contributes each token's row.

Embedding1D: the table is split by columns (embedding dimension); each rank
looks up its columns and gather_from_tp_region all-gathers them (backward:
each rank keeps its columns of the gradient).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..distributed.mappings import gather_from_tp_region, reduce_from_tp_region
from ..layout import Split, Vocab
from .parallel_module import ParallelModule, ShardPlan, check_param, shapes_only


def check_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """IndexError when an id is outside [0, vocab), in the message HF models
    give; one min / max pass (a device sync on accelerators)."""
    if ids.numel() == 0:
        return
    lo, hi = (int(t) for t in torch.aminmax(ids))
    if lo < 0 or hi >= vocab:
        raise IndexError(f"index {hi if hi >= vocab else lo} is out of range for the vocabulary of "
                         f"{vocab} (token ids must be in [0, {vocab}))")


class _EmbeddingShard(ParallelModule):
    """The table E [num_embeddings, embedding_dim] split along `split_dim`."""

    split_dim = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.split_params = {"weight": (cls.split_dim, "weight")}

    @classmethod
    def _spec(cls, kwargs):
        """The split spec of the split dimension (each subclass says which)."""
        raise NotImplementedError(f"{cls.__name__} does not say how its table is split (_spec)")

    @classmethod
    def plan_shard(cls, module, tp_size, rank, **kwargs):
        weight = check_param(module, "weight", 2, cls.__name__)
        what = "num_embeddings" if cls.split_dim == 0 else "embedding_dim"
        return ShardPlan(tp_size, rank).split("weight", cls._spec(kwargs), weight.shape[cls.split_dim], what=what)

    @classmethod
    def native_args(cls, module):
        weight = module.weight
        return dict(num_embeddings=weight.shape[0], embedding_dim=weight.shape[1],
                    padding_idx=getattr(module, "padding_idx", None), dtype=weight.dtype, device=weight.device)

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, process_group=None,
                 plan: ShardPlan | None = None, dtype=None, device=None, **kwargs):
        built_directly = plan is None
        if plan is None:   # not from the sharder: plan a table of this shape
            plan = self.plan_for(shapes_only(weight=(num_embeddings, embedding_dim)), process_group, **kwargs)
        super().__init__(plan, process_group)
        self._reset_after_init = built_directly   # (the subclass initializes once it is complete)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard = plan["weight"]
        self.padding_idx = padding_idx
        shape = [num_embeddings, embedding_dim]
        shape[self.split_dim] = self.shard.length
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))

    def reset_parameters(self) -> None:
        """nn.Embedding's initialization (N(0, 1), padding row zeroed)."""
        nn.init.normal_(self.weight)
        local = self._local_padding_idx()
        if local is not None:
            with torch.no_grad():
                self.weight[local].zero_()

    def _local_padding_idx(self):
        return None

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, local={tuple(self.weight.shape)}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class VocabParallelEmbedding1D(_EmbeddingShard):
    """Embedding with the vocabulary (rows) split and padded; see module doc."""

    split_dim = 0

    @classmethod
    def _spec(cls, kwargs):
        return Vocab(kwargs.get("make_vocab_size_divisible_by", 64))

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, process_group=None,
                 make_vocab_size_divisible_by: int = 64, embed_scale: float | None = None, **kwargs):
        super().__init__(num_embeddings, embedding_dim, padding_idx, process_group,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by, **kwargs)
        self.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        # Multiplies the looked-up rows (Gemma's scaled embeddings: sqrt(hidden)).
        self.embed_scale = embed_scale
        self.vocab_start = self.tp_rank * self.shard.length
        self.vocab_end = self.vocab_start + self.shard.real  # real rows only
        if self._reset_after_init:
            self.reset_parameters()

    def _local_padding_idx(self):
        p = self.padding_idx
        if p is not None and self.vocab_start <= p < self.vocab_end:
            return p - self.vocab_start
        return None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # An id outside [0, num_embeddings) is an IndexError, as in the unsharded
        # nn.Embedding (not a row of zeros): ids are the same on every rank, so
        # each checks them locally (one min / max pass), with no collective.
        if ops.fused_input(self.weight):
            # one pass in the kernel (C on CPU, CUDA on a GPU): the id check, our
            # rows looked up, other ids zeroed; backward scatter-adds
            out = ops.vocab_embedding(input_ids, self.weight, self.vocab_start,
                                      self.vocab_end - self.vocab_start, self._local_padding_idx(),
                                      vocab_size=self.num_embeddings)
        else:
            check_token_ids(input_ids, self.num_embeddings)
            outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
            local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight, self._local_padding_idx())
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_from_tp_region(out, self.process_group)
        if self.embed_scale is not None:
            out = out * torch.tensor(self.embed_scale, dtype=self.weight.dtype)
        return out


class Embedding1D(_EmbeddingShard):
    """Embedding with the embedding dimension (columns) split, gathered after
    lookup; with `gather_output=False` each rank keeps its columns (e.g. a
    relative-position bias table [buckets, heads] split by heads)."""

    split_dim = 1

    @classmethod
    def _spec(cls, kwargs):
        return kwargs.get("split") or Split()

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, process_group=None,
                 gather_output: bool = True, **kwargs):
        super().__init__(num_embeddings, embedding_dim, padding_idx, process_group, **kwargs)
        self.gather_output = gather_output
        if self._reset_after_init:
            self.reset_parameters()

    def _local_padding_idx(self):
        return self.padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight, self.padding_idx)
        if not self.gather_output:
            return out
        return gather_from_tp_region(out, -1, self.shard, self.process_group)
