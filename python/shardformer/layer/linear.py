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
from ..layout import Fused, Split, SplitSpec, Vocab
from .parallel_module import ParallelModule, ShardPlan, check_param, shapes_only


class _LinearShard(ParallelModule):
    """Shared machinery: the weight layout ([out, in] or Conv1D [in, out]),
    the split dimension, and what is cut out of a native module: the weight
    along the split dimension, the bias with it (column) or whole (row)."""

    conv1d_layout = False  # weight stored [in, out] (HF Conv1D) instead of [out, in]
    column = True          # split output features (column) or input features (row)
    default_gather_output = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.column:
            cls.split_params = {"weight": (cls._split_dim(), "features"), "bias": (0, "features")}
            cls.whole_params = ()
        else:
            cls.split_params = {"weight": (cls._split_dim(), "features")}
            cls.whole_params = ("bias",)

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
        if not cls.column:
            no_replicate = f"{cls.__name__}: a row-parallel input split cannot replicate rows"
        elif (cls.default_gather_output if kwargs.get("gather_output") is None else kwargs["gather_output"]):
            no_replicate = f"{cls.__name__}: gather_output is not supported with replicated heads"
        else:
            no_replicate = None
        return ShardPlan(tp_size, rank).split(
            "features", spec, weight.shape[cls._split_dim()],
            what="out_features" if cls.column else "in_features", no_replicate=no_replicate)

    @classmethod
    def native_args(cls, module):
        weight = module.weight
        out_dim, in_dim = cls._weight_dims()
        return dict(in_features=weight.shape[in_dim], out_features=weight.shape[out_dim],
                    bias=getattr(module, "bias", None) is not None, dtype=weight.dtype, device=weight.device)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, process_group=None,
                 plan: ShardPlan | None = None, dtype=None, device=None, **kwargs):
        shape = (in_features, out_features) if self.conv1d_layout else (out_features, in_features)
        built_directly = plan is None
        if plan is None:   # not from the sharder: plan a weight of this shape
            plan = self.plan_for(shapes_only(weight=shape), process_group, **kwargs)
        super().__init__(plan, process_group)
        self.in_features, self.out_features = in_features, out_features
        self.shard = plan["features"]
        local_out = self.shard.length if self.column else out_features
        local_in = in_features if self.column else self.shard.length
        shape = (local_in, local_out) if self.conv1d_layout else (local_out, local_in)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if built_directly:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, applied to the shard."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

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
    `sequence_parallel=True` (inside a sequence-parallel block, see
    layer/sequence.py): X comes from the block's all-gather along the
    sequence, whose backward reduce-scatter sums dX, so no copy_to_tp_region.
    Rows replicated across ranks (KV heads fewer than ranks) get their
    gradients summed over the ranks holding them.
    """

    column = True

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 gather_output: bool | None = None, sequence_parallel: bool = False, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, gather_output=gather_output, **kwargs)
        self.gather_output = self.default_gather_output if gather_output is None else gather_output
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:       # with SP the block's all-gather of X sums dX backward
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
    backward); then the full bias.  `sequence_parallel=True`: the partial
    sums X_i A_i^T are returned as they are, for the sequence-parallel
    block's reduce-scatter (no bias allowed).
    """

    column = False

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, **kwargs)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel

    @classmethod
    def plan_shard(cls, module, tp_size, rank, split=None, sequence_parallel: bool = False, **kwargs):
        if sequence_parallel and getattr(module, "bias", None) is not None:
            raise ValueError(f"{cls.__name__}: sequence parallelism (split_gather) with a bias on a row-parallel "
                             f"layer ({type(module).__name__} of {tuple(module.weight.shape)}) is not supported: "
                             f"the bias would have to be added after the block's reduce-scatter")
        return super().plan_shard(module, tp_size, rank, split=split, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, -1, self.shard, self.process_group)
        y = self._matmul(x, self.weight, None)
        if self.sequence_parallel:           # partial sums: the block's reduce-scatter adds them up
            return y
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
