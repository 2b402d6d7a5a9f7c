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

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import distributed as D
from .. import ops
from ..distributed.mappings import (
    GatherRowsLinear,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_rows,
    scatter_to_tp_region,
    sync_replicated_grad,
    token_dim,
)
from ..layout import Fused, Split, SplitSpec, Vocab
from .dropout import DropoutForParallelInput
from .parallel_module import ParallelModule, ShardPlan, check_param, shapes_only


#: The calls ShardConfig.enable_skinny_linear sends to the C kernel: float32
#: inputs of SKINNY_MIN_ROWS to SKINNY_MAX_ROWS rows (tokens), as in a decode
#: step of 2 to 4 sequences.  Measured on this project's 2-core machine
#: (benchmarks/skinny_linear.py, one thread, per-rank TP=2 weights of SmolLM2
#: and a 302M Llama): 1.18-1.99x torch at 2 rows, 0.88-2.31x at 4, where torch
#: switches from its one-row product to a blocked matmul that reads the
#: weights at half the rate; at 1 row torch's own product is as fast (0.84-1.10x),
#: past 4 rows it wins.
SKINNY_MIN_ROWS = 2
SKINNY_MAX_ROWS = 4

#: bfloat16 goes to the kernel from one row (batch-1 decoding) to
#: SKINNY_MAX_ROWS, on CPUs where its path is AVX512-BF16 (vdpbf16ps): median
#: over the shapes 1.09 / 0.97 / 1.14x torch at 1 / 2 / 4 rows in one run, 1.26 /
#: 1.18 / 1.23x in another (benchmarks/skinny_linear.py, one thread, machine
#: loaded: results/skinny_linear_paths.json), and 0.48-0.68x the time of the
#: fastest float32 product of the same layer.  Its AVX2 path (bf16 widened by
#: shifts) measured 0.58-0.72x torch from 2 rows, so without AVX512-BF16
#: bfloat16 stays with torch.  float16 stays with torch: the kernel's F16C path
#: measured 0.48-0.62x at 1 row and 0.72-0.73x at 2, ahead only from 4.
SKINNY_MIN_ROWS_BF16 = 1


@functools.lru_cache(maxsize=None)
def skinny_min_rows(dtype: torch.dtype) -> int | None:
    """The fewest rows of a call of `dtype` the kernel takes on this CPU (up
    to SKINNY_MAX_ROWS), None when that dtype stays with torch."""
    if dtype == torch.float32:
        return SKINNY_MIN_ROWS
    if dtype == torch.bfloat16 and ops.skinny_linear_path(torch.bfloat16) == "avx512_bf16":
        return SKINNY_MIN_ROWS_BF16
    return None


def _skinny_applies(x: torch.Tensor, weight: torch.Tensor, bias, max_rows: int) -> bool:
    """A call the skinny kernel takes: CPU, a dtype it serves here
    (skinny_min_rows) with its fewest rows to max_rows rows, a weight whose
    rows it reads in place (contiguous, or a column shard mapped from a
    checkpoint: a strided view of the whole tensor), no gradient to record."""
    low = skinny_min_rows(x.dtype) if x.device.type == "cpu" and weight.dtype == x.dtype else None
    return (low is not None and weight.device.type == "cpu" and ops._rows_in_place(weight)
            and x.dim() > 0 and low * x.shape[-1] <= x.numel() <= max_rows * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def set_skinny_linear(model: nn.Module, on: bool = True) -> None:
    """ShardConfig.enable_skinny_linear on a sharded model (the sharder calls
    it; benchmarks switch it per run): every linear layer of ours with the
    [out, in] weight layout sends its qualifying calls (_skinny_applies) to
    ops.skinny_linear, or none of them with on=False."""
    for module in model.modules():
        if isinstance(module, _LinearShard) and not module.conv1d_layout:
            module.skinny_rows = SKINNY_MAX_ROWS if on else 0


class _LinearShard(ParallelModule):
    """Shared machinery: the weight layout ([out, in] or Conv1D [in, out]),
    the split dimension, and what is cut out of a native module: the weight
    along the split dimension, the bias with it (column) or whole (row)."""

    conv1d_layout = False  # weight stored [in, out] (HF Conv1D) instead of [out, in]
    skinny_rows = 0        # > 0: calls of at most this many rows run ops.skinny_linear (set by the sharder)
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
        if self.skinny_rows and _skinny_applies(x, weight, bias, self.skinny_rows):
            return ops.skinny_linear(x, weight, bias)
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

    `sequence_parallel=True, gather_input=True` (Megatron's sequence-parallel
    column layer, for an MLP that is no module of its own, e.g. OPT's fc1):
    the layer enters the region itself.  X_r is this rank's rows (token
    dimension T: 1 of [batch, S/p, in], 0 of flattened rows [B*S/p, in]):

        forward:   X = all-gather of the X_r along T (padding rows kept),
                   Y_i = X A_i^T + b_i; only X_r is saved
        backward:  X all-gathered again for dA_i = dY_i^T X, db_i = sum dY_i;
                   dX_r = reduce-scatter along T of dY_i A_i (the sum over
                   ranks of every rank's partial dX)

    The rows keep their padding and the order of the gather, so only
    row-wise layers (an MLP up to its reduce-scattering row layer) may
    follow.  With `sequence_state` (the model's SequenceState; [batch, S/p,
    in] input) only the first S rows are computed: the exact sequence, for an
    attention whose only input is this layer's output (GPT-2's c_attn).
    `overlap=True`: the collectives overlap the matmuls (GatherRowsLinear;
    ShardConfig.enable_sequence_overlap).

    In a sequence-parallel "block" with overlap (Llama-shaped decoders), the
    block's pre-hook computes this layer's output together with its
    siblings' in one overlapped gather (gather_block_input); forward then
    returns that output when called with the tensor the hook handed the
    module.
    """

    column = True

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 gather_output: bool | None = None, sequence_parallel: bool = False, gather_input: bool = False,
                 sequence_state=None, overlap: bool = False, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, gather_output=gather_output, **kwargs)
        self._check_gather_input(type(self).__name__, sequence_parallel, gather_input, sequence_state, overlap)
        self.gather_output = self.default_gather_output if gather_output is None else gather_output
        self.sequence_parallel = sequence_parallel
        self.gather_input = gather_input
        self.sequence_state = sequence_state
        self.overlap = overlap
        self._precomputed = None      # (block input, this layer's output): gather_block_input

    @staticmethod
    def _check_gather_input(name, sequence_parallel, gather_input, sequence_state, overlap):
        if gather_input and not sequence_parallel:
            raise ValueError(f"{name}: gather_input=True needs sequence_parallel=True")
        if (sequence_state is not None or overlap) and not gather_input:
            raise ValueError(f"{name}: sequence_state / overlap need gather_input=True")

    @classmethod
    def plan_shard(cls, module, tp_size, rank, split=None, sequence_parallel: bool = False,
                   gather_input: bool = False, sequence_state=None, overlap: bool = False, **kwargs):
        cls._check_gather_input(cls.__name__, sequence_parallel, gather_input, sequence_state, overlap)
        return super().plan_shard(module, tp_size, rank, split=split, **kwargs)

    def _local_params(self):
        """(weight, bias) as the matmul uses them: rows replicated across
        ranks get their gradients summed over the ranks holding them."""
        weight, bias = self.weight, self.bias
        if self.shard.replicated:
            weight = sync_replicated_grad(weight, self._split_dim(), self.shard, self.process_group)
            if bias is not None:
                bias = sync_replicated_grad(bias, 0, self.shard, self.process_group)
        return weight, bias

    def forward(self, x: torch.Tensor, addend=None) -> torch.Tensor:
        """`addend` (a LoRA adapter, layer/lora.py): a function of the layer's
        input inside the region (after copy_to_tp_region, so the gradient it
        sends to X is summed with the layer's own) giving a term of this
        rank's output features, added before gather_output.  Not with
        gather_input (the rows of X are gathered inside the matmul)."""
        pre = self._precomputed
        if pre is not None and pre[0] is x and addend is None:  # the block's overlapped gather computed it
            self._precomputed = None
            return pre[1]
        if not self.sequence_parallel:       # with SP the block's all-gather of X sums dX backward
            x = copy_to_tp_region(x, self.process_group)
        weight, bias = self._local_params()
        if addend is not None and self.gather_input:
            raise NotImplementedError(f"{type(self).__name__}: an addend (LoRA) with gather_input=True")
        if self.gather_input and self.tp_size > 1:
            dim = token_dim(x)
            length = self.sequence_state.length if self.sequence_state is not None else None
            y = GatherRowsLinear.apply(x.movedim(dim, 0), self.conv1d_layout, self.process_group,
                                        length, self.overlap, False, weight, bias).movedim(0, dim)
        else:
            y = self._matmul(x, weight, bias)
        if addend is not None:
            y = y + addend(x)
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

    `sequence_parallel=True, reduce_scatter=True` (Megatron's sequence-
    parallel row layer, for blocks whose output goes through a dropout or a
    residual add inside the module, e.g. GPT-2, BERT): the layer leaves the
    parallel region itself.  With P = X_i A_i^T over the full sequence
    ([batch, S, out], or flattened rows [B*S, out]) and T the token dimension
    (1, or 0 for 2-D input), padded with zero rows to a multiple of p:

        Y_r = (sum_i P_i)[rows of rank r along T] + b
        forward:   reduce-scatter along T, then the bias on this rank's rows
        backward:  dP = all-gather of dY along T (padding dropped by the pad's
                   backward); db = all-reduce over the group of sum(dY_r)

    Each rank's bias gradient covers only its own rows, so the all-reduce
    makes it the full sequence's (copy_to_tp_region on the bias: identity
    forward, all-reduce backward).  Padding rows get the bias too; nothing
    downstream reads them (the next gather drops them), so their gradient
    is zero.  `dropout=p` (with reduce_scatter): a dropout on the output
    rows, after the bias, with a mask per rank (DropoutForParallelInput,
    module `output_dropout`), for models whose residual dropout is a
    functional call after the row layer (OPT, BLOOM: the policy sets the
    model's own probability to 0 and moves it here).  `input_dropout=p`: a
    dropout on this rank's input features X_i before the matmul, a mask per
    rank (module `input_dropout`), for a functional dropout on the split
    activation between a column and this layer (Whisper's
    activation_dropout, which the policy sets to 0): drawn from torch's
    generator, its mask would repeat across ranks and its uneven share of
    features would move the ranks' generators apart.
    """

    column = False

    def __init__(self, in_features, out_features, bias=True, process_group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, reduce_scatter: bool = False,
                 dropout: float = 0.0, input_dropout: float = 0.0, **kwargs):
        super().__init__(in_features, out_features, bias, process_group, **kwargs)
        if reduce_scatter and not sequence_parallel:
            raise ValueError(f"{type(self).__name__}: reduce_scatter=True needs sequence_parallel=True")
        if dropout and not reduce_scatter:
            raise ValueError(f"{type(self).__name__}: dropout={dropout} needs reduce_scatter=True")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.reduce_scatter = reduce_scatter

        self.output_dropout = DropoutForParallelInput(dropout, process_group=process_group) if dropout else None
        self.input_dropout = (DropoutForParallelInput(input_dropout, process_group=process_group)
                              if input_dropout else None)

    @classmethod
    def plan_shard(cls, module, tp_size, rank, split=None, sequence_parallel: bool = False,
                   reduce_scatter: bool = False, dropout: float = 0.0, input_dropout: float = 0.0, **kwargs):
        if reduce_scatter and not sequence_parallel:
            raise ValueError(f"{cls.__name__}: reduce_scatter=True needs sequence_parallel=True")
        if dropout and not reduce_scatter:
            raise ValueError(f"{cls.__name__}: dropout={dropout} needs reduce_scatter=True")
        for what, p in (("dropout", dropout), ("input_dropout", input_dropout)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{cls.__name__}: {what} probability has to be between 0 and 1, got {p}")
        if sequence_parallel and not reduce_scatter and getattr(module, "bias", None) is not None:
            raise ValueError(f"{cls.__name__}: sequence parallelism (split_gather) with a bias on a row-parallel "
                             f"layer ({type(module).__name__} of {tuple(module.weight.shape)}) is not supported: "
                             f"the bias would have to be added after the block's reduce-scatter "
                             f"(reduce_scatter=True does that in the layer)")
        return super().plan_shard(module, tp_size, rank, split=split, **kwargs)

    def forward(self, x: torch.Tensor, addend=None) -> torch.Tensor:
        """`addend` (a LoRA adapter, layer/lora.py): a function of this
        rank's input features X_i giving a partial output, summed over the
        ranks with X_i A_i^T by the same reduction (one all-reduce or
        reduce-scatter for both)."""
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, -1, self.shard, self.process_group)
        if self.input_dropout is not None:
            x = self.input_dropout(x)
        y = self._matmul(x, self.weight, None)
        if addend is not None:
            y = y + addend(x)
        if self.sequence_parallel:
            if not self.reduce_scatter:      # partial sums: the block's reduce-scatter adds them up
                return y
            y = reduce_scatter_rows(y, self.process_group)   # this rank's rows of the sum
            if self.bias is not None:
                y = y + copy_to_tp_region(self.bias, self.process_group)
            return y if self.output_dropout is None else self.output_dropout(y)
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
