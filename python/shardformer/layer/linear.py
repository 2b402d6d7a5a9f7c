"""Column- and row-parallel linear layers (nn.Linear and HF Conv1D layouts).

Notation: X is [..., in], an nn.Linear weight A is [out, in] (Y = X A^T + b);
an HF Conv1D weight is [in, out] (Y = X W + b).  p ranks, rank i.

Column parallel: the output features are split, A = [A_1; ...; A_p]; rank i
computes Y_i = X A_i^T + b_i.  X enters through copy_to_tp_region (its
gradient is all-reduced backward); with gather_output the Y_i are
all-gathered into Y.

Row parallel: the input features are split, A = [A_1 ... A_p]; rank i
computes X_i A_i^T and reduce_from_tp_region sums the partial products
(all-reduce forward); b is added once, after the sum.

Splits follow a split spec (shardformer.layout): uneven, fused ([q|k|v]),
per-head and padded (vocabulary) layouts all go through the same code.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    sync_replicated_grad,
)
from ..layout import DimShard, Fused, Split, SplitSpec, Vocab
from .parallel_module import ParallelModule, check_param, group_size_and_rank, shard_of


class _LinearShard(ParallelModule):
    """Shared machinery: the weight layout ([out, in] or Conv1D [in, out]),
    the split dimension, and cutting shards out of a native module."""

    conv1d_layout = False  # weight stored [in, out] (HF Conv1D) instead of [out, in]
    column = True          # split output features (column) or input features (row)
    default_gather_output = False

    @classmethod
    def _default_split(cls, kwargs) -> SplitSpec:
        return Split()

    @classmethod
    def _weight_dims(cls) -> tuple[int, int]:
        """(dimension of out features, dimension of in features) of the weight."""
        return (1, 0) if cls.conv1d_layout else (0, 1)

    @classmethod
    def _split_dim(cls) -> int:
        out_dim, in_dim = cls._weight_dims()
        return out_dim if cls.column else in_dim

    @classmethod
    def plan_shard(cls, module, tp_size, rank, split: SplitSpec | None = None, **kwargs):
        weight = check_param(module, "weight", 2, cls.__name__)
        spec = split if split is not None else cls._default_split(kwargs)
        what = "out_features" if cls.column else "in_features"
        shard = spec.resolve(weight.shape[cls._split_dim()], tp_size, rank, what=what)
        if not cls.column and shard.replicated:
            raise ValueError(f"{cls.__name__}: a row-parallel input split cannot replicate rows")
        if cls.column and kwargs.get("gather_output", cls.default_gather_output) and shard.replicated:
            raise ValueError(f"{cls.__name__}: gather_output is not supported with replicated heads")
        return shard

    def __init__(self, in_features: int, out_features: int, bias: bool = True, process_group=None,
                 split: SplitSpec | None = None, shard: DimShard | None = None,
                 dtype=None, device=None, **kwargs):
        super().__init__(process_group)
        self.in_features, self.out_features = in_features, out_features
        if shard is None:
            spec = split if split is not None else self._default_split(kwargs)
            full = out_features if self.column else in_features
            shard = spec.resolve(full, self.tp_size, self.tp_rank,
                                 what="out_features" if self.column else "in_features")
        self.shard = shard
        local_out = shard.length if self.column else out_features
        local_in = in_features if self.column else shard.length
        shape = (local_in, local_out) if self.conv1d_layout else (local_out, local_in)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.sharded_params["weight"] = (self._split_dim(), shard)
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype, device=device))
            if self.column:
                self.sharded_params["bias"] = (0, shard)
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, applied to the shard."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: DimShard | None = None,
                           **kwargs):
        tp_size, rank = group_size_and_rank(process_group)
        if plan is None:
            plan = cls.plan_shard(module, tp_size, rank, **kwargs)
        weight = module.weight
        out_dim, in_dim = cls._weight_dims()
        bias = getattr(module, "bias", None)
        kwargs.pop("split", None)
        layer = cls(weight.shape[in_dim], weight.shape[out_dim], bias=bias is not None,
                    process_group=process_group, shard=plan, dtype=weight.dtype,
                    device=weight.device, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(shard_of(weight, cls._split_dim(), plan))
            if bias is not None:
                layer.bias.copy_(shard_of(bias, 0, plan) if cls.column else bias.detach())
        layer.weight.requires_grad_(weight.requires_grad)
        if bias is not None:
            layer.bias.requires_grad_(bias.requires_grad)
        return layer

    def _matmul(self, x, weight, bias):
        if self.conv1d_layout:
            out = x @ weight
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"local={tuple(self.weight.shape)}, tp={self.tp_rank}/{self.tp_size}")


class Linear1D_Col(_LinearShard):
    """Column-parallel nn.Linear: Y_i = X A_i^T + b_i with A's output rows split.

    Forward: copy_to_tp_region(X) (backward: all-reduce dX), local matmul, and
    with `gather_output=True` an all-gather of Y along the last dimension.
    Rows replicated across ranks (KV heads fewer than ranks) get their
    gradients summed over the ranks holding them.
    """

    column = True

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 gather_output: bool | None = None, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, **kwargs)
        self.gather_output = self.default_gather_output if gather_output is None else gather_output
        if kwargs.get("shard") is None:
            self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(x, self.process_group)
        weight, bias = self.weight, self.bias
        if self.shard.replicated:
            weight = sync_replicated_grad(weight, self._split_dim(), self.shard, self.process_group)
            if bias is not None:
                bias = sync_replicated_grad(bias, 0, self.shard, self.process_group)
        y = self._matmul(x, weight, bias)
        if self.gather_output:
            y = gather_from_tp_region(y, -1, self.shard, self.process_group)
        return y


class Linear1D_Row(_LinearShard):
    """Row-parallel nn.Linear: Y = sum_i X_i A_i^T + b with A's input columns split.

    Forward: the input is already split when `input_is_parallel=True` (the
    output of a column-parallel layer), else scatter_to_tp_region cuts it;
    local matmul; reduce_from_tp_region (all-reduce forward, identity
    backward); then the full bias.
    """

    column = False

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 input_is_parallel: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, **kwargs)
        self.input_is_parallel = input_is_parallel
        if kwargs.get("shard") is None:
            self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, -1, self.shard, self.process_group)
        y = self._matmul(x, self.weight, None)
        y = reduce_from_tp_region(y, self.process_group)
        return y if self.bias is None else y + self.bias


class FusedLinear1D_Col(Linear1D_Col):
    """Column-parallel nn.Linear whose output is several projections fused
    ([q | k | v], [gate | up]): each rank keeps its slice of every segment.
    `n_fused` equal segments by default, or pass `split=Fused(...)`."""

    @classmethod
    def _default_split(cls, kwargs):
        return Fused.equal(kwargs.get("n_fused", 3))

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 n_fused: int = 3, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, n_fused=n_fused, **kwargs)


class GPT2FusedLinearConv1D_Col(FusedLinear1D_Col):
    """Column-parallel HF Conv1D (weight [in, out], Y = X W + b), e.g. GPT-2's
    c_attn with fused [q | k | v] outputs (n_fused=3) or c_fc (n_fused=1)."""

    conv1d_layout = True


class GPT2FusedLinearConv1D_Row(Linear1D_Row):
    """Row-parallel HF Conv1D (weight [in, out]): input rows of W split."""

    conv1d_layout = True


class VocabParallelLMHead1D(Linear1D_Col):
    """Output projection over a vocabulary split by rows, padded to a multiple
    of tp_size * `make_vocab_size_divisible_by`.  Logits are all-gathered to
    the full (unpadded) vocabulary by default; `gather_output=False` returns
    this rank's vocabulary shard for `cross_entropy_1d`.  The weight is tied
    to a VocabParallelEmbedding1D with the same padding when the model ties
    its embeddings (the policy's postprocess does the tying)."""

    default_gather_output = True

    @classmethod
    def _default_split(cls, kwargs):
        return Vocab(kwargs.get("make_vocab_size_divisible_by", 64))

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 make_vocab_size_divisible_by: int = 64, **kwargs):
        super().__init__(in_features, out_features, bias, process_group,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by, **kwargs)

    @property
    def vocab_start(self) -> int:
        return self.shard.rank * self.shard.length

    @property
    def vocab_size(self) -> int:
        return self.shard.full
