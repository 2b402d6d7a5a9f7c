"""Sequence parallelism, split-gather mode (Megatron-style SP inside the TP group).

Notation: hidden states X are [batch, S, hidden]; p ranks, rank i.  S is
padded with zeros to S' = p * ceil(S / p); rank i holds the rows
X[:, i*S'/p : (i+1)*S'/p] (the last ranks may hold padding rows).

Between the blocks of a decoder the hidden states stay split along the
sequence: norms, dropouts and residual additions run on this rank's rows
only.  A block (attention, MLP) is a tensor-parallel region:

    region input    all-gather along S, padding dropped      (backward: pad, reduce-scatter)
    column layers   no copy_to_tp_region: the gather's backward sums dX
    row layers      no all-reduce: partial sums leave the block
    region output   pad, reduce-scatter along S              (backward: all-gather, drop padding)

so each block moves the same bytes as plain TP's all-reduce, split into an
all-gather and a reduce-scatter, and everything between blocks holds 1/p of
the activations.  Inside a block, the gathered input X that the column layers
save for their weight gradients is kept as this rank's rows only and
all-gathered again when backward first needs it (saved-tensor hooks, one
re-gather per block shared by q/k/v or gate/up): the full-sequence X never
outlives the block's forward.  The first decoder layer's input is split (backward:
all-gather) and the last decoder layer's output gathered (backward: this
rank's rows of the gradient, which is the same on every rank), so the model
keeps its inputs and outputs (full sequence).  Replicated parameters used on
this rank's rows only (the decoder layers' norms) get their gradients
all-reduced (shardformer.layer.replicated).

SequenceParallelRegion keeps the module it is applied to and adds the
forward hooks (role "split", "gather", "block", "enter", "rows"; Swin's
windowed blocks: "enter_output", "sum_grad", "leave", see
policies/shapes.py StageShape); SequenceState carries the unpadded length S
from the split to the blocks of one forward.  output_hidden_states: the
recorded states, this rank's rows, are marked and gathered in the model's
output (mark_rows, record_full_hidden_states).

Blocks whose row layer has a bias, or whose output passes a dropout or a
residual add inside the module (GPT-2, BERT, BLOOM, OPT: policies/shapes.py),
cannot leave the region at the module's output: the sum over ranks has to
come before the bias and the dropout.  There the module takes role "enter"
(the region input above, with the same saved-rows re-gather, and nothing at
its output) and the row layer leaves the region itself:
Linear1D_Row(sequence_parallel=True, reduce_scatter=True) pads and
reduce-scatters its partial sums along the tokens (reduce_scatter_rows;
backward: all-gather), then adds the bias on this rank's rows (bias gradient
all-reduced).  What follows inside the module (residual dropout, residual
add, post-norm) then runs on this rank's rows: such dropouts draw a
different mask on every rank (DropoutForParallelInput), and such norms get
their gradients all-reduced, like the norms between blocks.

With ShardConfig.enable_sequence_overlap a "block" (overlap=True: the
Llama-shaped decoders) gathers its input through
linear.gather_block_input: one all-gather, asynchronous on the shared-memory
backend, runs while the block's column layers (q/k/v or qkv; gate/up or
gate_up) multiply this rank's rows; then the other ranks' rows; the module
gets the gathered sequence and its column layers return the outputs already
computed.  Backward: one re-gather during the summed dX matmul, the
reduce-scatter of dX during the dW matmuls.  The output leaves as above.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import compile_refusal
from .. import distributed as D
from ..distributed.communicator import ShmBackend, _SHM_REDUCIBLE, communicator_for
from ..distributed.mappings import (
    _all_gather_seq, copy_to_tp_region, gather_from_sequence_region, reduce_scatter_to_sequence_region,
)
from . import recompute
from .parallel_module import ShardPlan, plan_directly

SEQ_DIM = 1
STATE_MARK = "_shardformer_sequence_state"     # a hooked module's SequenceState


class SequenceState:
    """The unpadded sequence length of the forward in progress (set by the
    split at the first decoder layer, read by the blocks and the gather),
    and `dim`, the sequence dimension of the hidden states the split, the
    blocks and the gather see: SEQ_DIM for [batch, S, hidden], 0 for models
    that run [S, batch, hidden] (ChatGLM2)."""

    def __init__(self, dim: int = SEQ_DIM, recompute: str | None = None):
        self.length: int | None = None
        self.dim = dim
        # ShardConfig.sequence_parallel_recompute: "selective" opens a saved-tensor scope per layer
        # (shardformer.layer.recompute) in the layers that carry the split / rows / gather roles
        self.recompute = recompute
        # whether the split ran in the forward in progress (begin() clears it): a pipeline
        # stage whose split comes before its layers (ALBERT: at the encoder's input) then
        # sends the unsplit layer-input shape, S = length, to the later stages
        self.split_in_forward = False

    def begin(self) -> None:
        """A forward starts (a pipeline stage's run): no split has run in it yet."""
        self.split_in_forward = False

    def __repr__(self) -> str:
        return f"SequenceState(length={self.length}, dim={self.dim})"

    def resume(self, full: torch.Tensor) -> None:
        """A forward that starts past the split (a later pipeline stage: its
        first layer receives this rank's rows from the previous stage);
        `full` is shaped like the unsplit layer input (the sequence along `dim`)."""
        self.length = full.shape[self.dim]

    def __deepcopy__(self, memo):
        # A deep copy of a model keeps its hooks' closures, which hold this
        # state: layers that read it (Linear1D_Col sequence_state) must too.
        return self


def _padded(x: torch.Tensor, n: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """x padded with zero rows along the sequence (`dim`) to a multiple of n."""
    extra = -x.shape[dim] % n
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


class _Split(torch.autograd.Function):
    """Forward: pad, keep this rank's rows.  Backward: all-gather the rows'
    gradients, drop the padding."""

    @staticmethod
    def forward(ctx, x, group, length, dim=SEQ_DIM):
        n, rank = D.world_size(group), D.rank(group)
        ctx.group, ctx.length, ctx.dim = group, length, dim
        x = _padded(x, n, dim)
        chunk = x.shape[dim] // n
        return x.narrow(dim, rank * chunk, chunk).contiguous()

    @staticmethod
    def backward(ctx, grad):
        full = _all_gather(grad.contiguous(), ctx.group, ctx.dim)
        return full.narrow(ctx.dim, 0, ctx.length), None, None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather, drop the padding.  Backward: this rank's rows of
    the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group, length, dim=SEQ_DIM):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x.contiguous(), group, dim).narrow(dim, 0, length)

    @staticmethod
    def backward(ctx, grad):
        n, rank, dim = D.world_size(ctx.group), D.rank(ctx.group), ctx.dim
        grad = _padded(grad, n, dim)
        chunk = grad.shape[dim] // n
        return grad.narrow(dim, rank * chunk, chunk).contiguous(), None, None, None


def _all_gather(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    return _all_gather_seq(x, dim, group)


def split_sequence(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    state.length = x.shape[state.dim]
    state.split_in_forward = True
    return _Split.apply(x, group, state.length, state.dim)


def gather_sequence(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    return _Gather.apply(x, group, state.length, state.dim)


def block_input(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Sequence-split -> full sequence: all-gather (backward: reduce-scatter), padding dropped."""
    # contiguous: the all-gather's [S, batch, hidden] layout seen as [batch, S, hidden] is not
    # (the layers would copy it anyway), and the saved-tensor hooks recognise it by its storage
    return gather_from_sequence_region(x, state.dim, group).narrow(state.dim, 0, state.length).contiguous()


def block_output(y: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's rows of the sum:
    padded, reduce-scatter (backward: all-gather)."""
    return reduce_scatter_to_sequence_region(_padded(y, D.world_size(group), state.dim), state.dim, group)


def split_rows(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """A full-sequence tensor that is the same on every rank (the output of
    an all-reduced row layer) -> this rank's rows along state.dim, padded as
    the split pads (backward: all-gather of the rows' gradients, padding
    dropped: the full gradient, as the all-reduce's identity backward needs)."""
    return _Split.apply(x, group, state.length, state.dim)


class _KeepRows(torch.autograd.Function):
    """Forward: a full-sequence tensor (every rank's copy may differ, e.g. a
    dropout mask per rank) -> this rank's rows, padded as _Split.  Backward:
    the rows' gradient in place, zeros elsewhere (no collective: the
    all-reduce that sums the ranks' rows sits upstream, sum_grad_over_ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        n, rank = D.world_size(group), D.rank(group)
        ctx.length = x.shape[SEQ_DIM]
        x = _padded(x, n)
        chunk = x.shape[SEQ_DIM] // n
        ctx.start, ctx.padded = rank * chunk, x.shape[SEQ_DIM]
        return x.narrow(SEQ_DIM, ctx.start, chunk).contiguous()

    @staticmethod
    def backward(ctx, grad):
        shape = list(grad.shape)
        shape[SEQ_DIM] = ctx.padded
        full = grad.new_zeros(shape)
        full.narrow(SEQ_DIM, ctx.start, grad.shape[SEQ_DIM]).copy_(grad)
        return full.narrow(SEQ_DIM, 0, ctx.length), None


def keep_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Full sequence -> this rank's rows (backward: zeros outside them)."""
    return _KeepRows.apply(x, group)


def sum_grad_over_ranks(y: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward, the gradient all-reduced over the group
    (each rank's gradient covers only the rows that rank kept: keep_rows)."""
    return copy_to_tp_region(y, group)


def token_dim(x: torch.Tensor) -> int:
    """The dimension of the tokens: SEQ_DIM of [batch, S, hidden], 0 of rows
    flattened to [batch * S, hidden] (OPT's MLP)."""
    return SEQ_DIM if x.dim() > 2 else 0


class _Done:
    """The handle of a collective that ran synchronously."""

    def wait(self, timeout=None):
        return None


def start_all_gather(out: torch.Tensor, t: torch.Tensor, group):
    """Start out = the ranks' `t` stacked along dim 0 (both contiguous);
    returns (handle, overlapped).  On the shared-memory backend the
    collective runs on its worker thread (async_op=True) while this thread
    computes, until handle.wait(); on the other backends it has run already
    when this returns (overlapped False)."""
    comm = communicator_for(t, group)
    if isinstance(comm, ShmBackend):
        return comm.shm.all_gather(out, t, async_op=True), True
    D.all_gather_into_tensor(out, t, group)
    return _Done(), False


def start_reduce_scatter(out: torch.Tensor, t: torch.Tensor, group):
    """Start out = this rank's dim-0 chunk of the sum over ranks of `t`;
    (handle, overlapped) as start_all_gather."""
    comm = communicator_for(t, group)
    if isinstance(comm, ShmBackend) and t.dtype in _SHM_REDUCIBLE:
        return comm.shm.reduce_scatter(out, t, async_op=True), True
    D.reduce_scatter_tensor(out, t, group)
    return _Done(), False


class _ReduceScatterDim0(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0 into a fresh tensor (not a view:
    the caller may add to it in place, e.g. Falcon's mlp_output +=).
    Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = D.world_size(group)
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        D.reduce_scatter_tensor(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = D.world_size(ctx.group)
        grad = grad.contiguous()
        full = grad.new_empty((grad.shape[0] * n,) + tuple(grad.shape[1:]))
        D.all_gather_into_tensor(full, grad, ctx.group)
        return full, None


def reduce_scatter_rows(y: torch.Tensor, group) -> torch.Tensor:
    """Partial sums over all tokens -> this rank's rows of their sum, for a
    row-parallel layer that leaves the region itself: padded with zero rows
    to a multiple of p along token_dim(y), reduce-scatter (backward:
    all-gather, padding dropped).  Flattened rows [B * S, hidden] come from
    a [B, S', hidden] tensor already padded (S' = p * rows per rank), so they
    divide p as they are, and reduce-scattering them along dim 0 gives each
    rank back the rows it had (the all-gather before stacked them rank by
    rank): only row-wise layers may run on such flattened rows."""
    n = D.world_size(group)
    if n == 1:
        return y
    dim = token_dim(y)
    rows = y.movedim(dim, 0)                      # a view autograd tracks: the result may be changed in place
    extra = -rows.shape[0] % n
    if extra:
        rows = F.pad(rows, [0, 0] * (rows.dim() - 1) + [0, extra])
    return _ReduceScatterDim0.apply(rows, group).movedim(0, dim)


class _Regathered:
    """This rank's rows of a block's gathered input, saved for backward in
    place of the full tensor; the first unpack all-gathers them again (every
    rank runs the same backward graph in the same order, so the collectives
    match) and the later ones reuse it.  `gathers` counts the re-gathers
    of this process (tests read it)."""

    gathers = 0

    def __init__(self, local, length: int, group, dim: int = SEQ_DIM):
        # local: the rows, or their Recipe under selective recompute (recompute.stored_value)
        self.local, self.length, self.group, self.dim = local, length, group, dim
        self.full: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.full is None:
            local = recompute.stored_value(self.local)
            self.full = _all_gather(local, self.group, self.dim).narrow(self.dim, 0, self.length).contiguous()
            _Regathered.gathers += 1
        return self.full


def _save_rows_only(full: torch.Tensor, local: torch.Tensor, state: SequenceState, group):
    """saved_tensors_hooks for a block's forward: the gathered input `full`
    (or a contiguous reshape of it: F.linear saves [B*S, H]) is saved as a
    _Regathered of this rank's rows; everything else as it is.  Plain
    closures, no reference cycle: the re-gathered tensor is freed as soon as
    the last node that saved it has run its backward.  Inside a selective-
    recompute scope (the layer's, shardformer.layer.recompute) the scope's
    hooks take the re-gather as an alias instead (hooks do not nest) and the
    rows are kept as the scope stores them (a Recipe where they are one)."""
    key = (full.data_ptr(), full.numel(), full.dtype)      # full is contiguous (block_input)
    scope = recompute.active_scope()
    if scope is not None:
        holder = _Regathered(scope.stored(local), state.length, group, state.dim)
        scope.aliases[key] = holder.get
        return contextlib.nullcontext()
    holder = _Regathered(local.detach(), state.length, group, state.dim)

    def pack(t):
        if isinstance(t, torch.Tensor) and t.is_contiguous() and (t.data_ptr(), t.numel(), t.dtype) == key:
            return (holder, tuple(t.shape))
        return t

    def unpack(p):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], _Regathered):
            return p[0].get().view(p[1])
        return p

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _first(args, kwargs):
    if args:
        return args[0], lambda v: ((v,) + tuple(args[1:]), kwargs)
    return kwargs["hidden_states"], lambda v: (args, {**kwargs, "hidden_states": v})


def _on_output(output, fn):
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]),) + tuple(output[1:])
    raise TypeError(f"sequence parallelism: a module returned {type(output).__name__}; expected the hidden "
                    f"states (a tensor, or a tuple starting with one)")


class SequenceParallelRegion:
    """Hooks of one role on a module that stays as it is: `role="split"` (the
    first decoder layer: its input is split), `"gather"` (the last decoder
    layer: its output is gathered), `"block"` (attention or MLP: input
    gathered, output reduce-scattered), `"enter"` (attention or MLP whose row
    layer reduce-scatters itself, Linear1D_Row(reduce_scatter=True): input
    gathered, saved as this rank's rows, output left as it is), `"rows"`
    (a layer between the split and the gather: its output, this rank's rows,
    marked for output_hidden_states, see mark_rows); for blocks
    that reshape the whole sequence between their modules (Swin's windows):
    `"enter_output"` (the module's output all-gathered, backward
    reduce-scatter), `"sum_grad"` (output unchanged, its gradient
    all-reduced in backward), `"leave"` (the input, a full-sequence tensor,
    cut to this rank's rows; backward zeros elsewhere); for a layer that
    reads its whole input before any of its modules runs and so runs whole,
    the same on every rank (Swinv2's post-norm layer): `"gather_input"`
    (its input, this rank's rows, all-gathered; backward: this rank's rows
    of the replicated gradient) and `"split_output"` (its output, the full
    sequence, cut to this rank's rows, setting the state's length; backward:
    all-gather of the rows' gradients); kwarg
    `state`: the model's SequenceState; `overlap=True` (role "block" only):
    the input gather overlaps the module's column layers' matmuls
    (linear.gather_block_input).  A module may take both "split" and
    "gather" (one layer)."""

    ROLES = ("split", "gather", "block", "enter", "rows", "enter_output", "sum_grad", "leave", "gather_input",
             "split_output")

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, role=None, state=None, overlap: bool = False,
                   **kwargs) -> ShardPlan:
        if role not in cls.ROLES and not (isinstance(role, tuple) and set(role) <= set(cls.ROLES)):
            raise ValueError(f"SequenceParallelRegion: role must be one of {cls.ROLES} (or a tuple of them), "
                             f"got {role!r}")
        if not isinstance(state, SequenceState):
            raise TypeError(f"SequenceParallelRegion: state must be a SequenceState, got {type(state).__name__}")
        if overlap and role != "block":
            raise ValueError(f"SequenceParallelRegion: overlap=True needs role 'block', got {role!r}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              role=None, state=None, overlap: bool = False, **kwargs) -> "_Hooks":
        if plan is None:
            plan = plan_directly(cls, module, process_group, role=role, state=state, overlap=overlap)
        roles = role if isinstance(role, tuple) else (role,)
        return _Hooks(module, roles if plan.tp_size > 1 else (), state, process_group, overlap)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           role=None, state=None, overlap: bool = False, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, role=role, state=state,
                                         overlap=overlap).commit()


class FullLengthKwarg:
    """A forward pre-hook that sets keyword argument `name` of the module's
    calls to the full sequence length S of the forward in progress
    (`state`, a SequenceState), where the HF caller computes it from its own
    input, which under split-gather SP is this rank's S'/p rows.  BEiT's
    relative position bias: BeitLayer passes dim_size=hidden_states.shape[1]
    (read with interpolate_pos_encoding=True), while the bias is added to the
    scores of the gathered, full-length attention: [heads, S, S].  No
    collective; calls before the first split (state.length unset) are left
    as they are."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, name=None, state=None, **kwargs) -> ShardPlan:
        if not isinstance(name, str):
            raise TypeError(f"FullLengthKwarg: name must be a keyword argument's name, got {name!r}")
        if not isinstance(state, SequenceState):
            raise TypeError(f"FullLengthKwarg: state must be a SequenceState, got {type(state).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              name=None, state=None, **kwargs) -> "_PreHook":
        if plan is None:
            plan = plan_directly(cls, module, process_group, name=name, state=state)

        pre = functools.partial(_full_length_pre, name, state)
        return _PreHook(module, pre if plan.tp_size > 1 else None)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           name=None, state=None, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, name=name, state=state).commit()


def _full_length_pre(name: str, state: SequenceState, _module, args, call_kwargs):
    """FullLengthKwarg's pre-hook: keyword `name` set to the unsplit length."""
    if name not in call_kwargs or state.length is None:
        return None
    return args, {**call_kwargs, name: state.length}


class _PreHook:
    """One forward pre-hook (with kwargs) on `module`: registered by commit(),
    removed by rollback(); none when `pre` is None (a group of one)."""

    def __init__(self, module: nn.Module, pre):
        self.module, self.pre, self.handle = module, pre, None

    def commit(self) -> nn.Module:
        if self.pre is not None:
            self.handle = self.module.register_forward_pre_hook(self.pre, with_kwargs=True)
        return self.module

    def rollback(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# ---- recorded hidden states (output_hidden_states=True) under any SP mode ----
#
# transformers records a layer's hidden states with forward hooks of its own
# (utils/output_capturing.py), installed on first use, so they may run before
# or after ours; what they record is the tensor object the layer returned
# (or, for the initial state, the first layer's input after our split).
# Those tensors are this rank's rows.  The SP hooks mark each such object
# with the function that gathers it (mark_rows), whichever order the hooks
# run in; a forward hook on every PreTrainedModel of the sharded model
# (record_full_hidden_states) then swaps each marked tensor in its output
# for the gathered full sequence: all-gather along S, rows put back in
# sequence order (ring_attn's zigzag undone), padding dropped; backward,
# this rank's rows of the gradient, which the loss computed alike on every
# rank makes the same everywhere.  Only the recorded copies are gathered:
# the layers go on with their rows.

_GATHER_MARK = "_shardformer_gather_rows"

#: recorded hidden states gathered by full_sequences, in this process (tests read it)
RECORDED_GATHERS = {"count": 0}


def mark_rows(t, gather):
    """Mark tensor `t` (this rank's rows of a sequence) with `gather`, the
    function that returns its full sequence; returns t.  Under torch.compile
    (a sequence-parallel submodule compiled on its own) refused by name:
    dynamo cannot trace the mark (compile_refusal)."""
    if isinstance(t, torch.Tensor):
        compile_refusal.refuse(t, compile_refusal.sequence_parallel_message("a sequence-parallel module"))
        t.__dict__[_GATHER_MARK] = gather
    return t


def full_sequences(value):
    """`value` with every marked tensor (in nested tuples) replaced by its
    gathered full sequence; anything else as it is."""
    if isinstance(value, torch.Tensor):
        gather = value.__dict__.get(_GATHER_MARK)
        if gather is None:
            return value
        RECORDED_GATHERS["count"] += 1
        return gather(value)
    if type(value) in (tuple, list):
        out = [full_sequences(v) for v in value]
        return value if all(a is b for a, b in zip(out, value)) else type(value)(out)
    return value


def _full_outputs(_module, _args, output):
    from transformers.utils import ModelOutput

    if isinstance(output, ModelOutput):
        for key in list(output.keys()):
            new = full_sequences(output[key])
            if new is not output[key]:
                output[key] = new
        return output
    if isinstance(output, tuple):
        return full_sequences(output)
    return None


def record_full_hidden_states(model: nn.Module) -> list:
    """Forward hooks on `model` and every transformers PreTrainedModel inside
    it: the recorded hidden states in their outputs become full-sequence
    tensors (see mark_rows).  Returns the hooks' handles."""
    from transformers import PreTrainedModel

    owners = [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    return [m.register_forward_hook(_full_outputs) for m in owners]


def mark_layer_rows(module: nn.Module, state: SequenceState, group) -> list:
    """Forward hooks marking `module`'s first input and its output's first
    tensor as this rank's rows (mark_rows), for a layer that runs between a
    split and a gather held elsewhere (ALBERT's shared layers, whose split
    and gather sit on the encoder).  Returns the hooks' handles."""
    pre, post = functools.partial(_mark_input, state, group), functools.partial(_mark_output, state, group)
    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]


def _mark_input(state: SequenceState, group, _module, args, kwargs) -> None:
    x, _ = _first(args, kwargs)
    mark_rows(x, _gatherer(state, group))


def _mark_output(state: SequenceState, group, _module, _args, output) -> None:
    mark_rows(output if isinstance(output, torch.Tensor) else output[0], _gatherer(state, group))


def _gatherer(state: SequenceState, group):
    """The gather of split_gather rows of the forward in progress (its length now)."""
    length = state.length
    return lambda t: _Gather.apply(t, group, length)


def refuse_recorded_hidden_states(model: nn.Module, name: str):
    """A forward pre-hook on the top-level `model`: output_hidden_states=True
    (in the call or the config) raises NotImplementedError, since between the
    layers each rank holds only its rows of the sequence (HF records the
    layers' outputs as they are).  Returns the hook's handle."""
    return model.register_forward_pre_hook(functools.partial(_refuse_hidden_states, name), with_kwargs=True)


def _refuse_hidden_states(name: str, module, args, kwargs) -> None:
    want = kwargs.get("output_hidden_states")
    if want is None:
        want = getattr(getattr(module, "config", None), "output_hidden_states", False)
    if want:
        raise NotImplementedError(
            f"{name}: output_hidden_states=True with sequence parallelism (split_gather): between the "
            f"layers each rank holds only its rows of the sequence; run that forward without it")


class _Hooks:
    """The forward hooks of some roles on `module`: registered by commit(),
    removed by rollback().  The hooks are this object's methods (not
    closures), so a model holding them pickles; `active` (the block's open
    saved-tensor hooks) lives only within a forward and is not pickled."""

    def __init__(self, module: nn.Module, roles: tuple, state: SequenceState, group, overlap: bool = False):
        self.module, self.roles, self.state, self.group = module, roles, state, group
        self.overlap = overlap and "block" in roles
        self.handles: list = []
        self.active: list = []

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "active"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, active=[])

    def commit(self) -> nn.Module:
        m = self.module
        if self.roles:
            m.__dict__[STATE_MARK] = self.state     # found by a pipeline stage that starts past the split
        if self.state.recompute == "selective" and {"split", "rows", "gather"} & set(self.roles):
            self.handles += recompute.layer_scope_hooks(m)
        pre_hooks = {"split": self._split_pre, "gather_input": self._gather_input_pre, "leave": self._leave_pre}
        post_hooks = {"rows": self._rows_post, "gather": self._gather_post, "split_output": self._split_output_post,
                      "enter_output": self._enter_output_post, "sum_grad": self._sum_grad_post}
        if "split" in self.roles:
            self.handles.append(m.register_forward_pre_hook(pre_hooks["split"], with_kwargs=True))
        if "block" in self.roles or "enter" in self.roles:
            self.handles.append(m.register_forward_pre_hook(self._block_pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._block_post, always_call=True))
        for role in ("rows", "gather", "enter_output", "sum_grad"):
            if role in self.roles:
                self.handles.append(m.register_forward_hook(post_hooks[role]))
        if "leave" in self.roles:
            self.handles.append(m.register_forward_pre_hook(pre_hooks["leave"], with_kwargs=True))
        # the roles of a layer that runs on the full sequence, replicated over the
        # group, between layers that hold this rank's rows (Swinv2: policies/swinv2.py)
        if "gather_input" in self.roles:
            self.handles.append(m.register_forward_pre_hook(pre_hooks["gather_input"], with_kwargs=True))
        if "split_output" in self.roles:
            self.handles.append(m.register_forward_hook(post_hooks["split_output"]))
        return m

    def _mark(self, y):
        """y marked as this rank's rows of the forward in progress (mark_rows)."""
        return mark_rows(y, _gatherer(self.state, self.group))

    def _split_pre(self, _module, args, kwargs):
        """split: the first input cut to this rank's rows."""
        x, rebuild = _first(args, kwargs)
        return rebuild(self._mark(split_sequence(x, self.state, self.group)))

    def _block_pre(self, module, args, kwargs):
        """block / enter: the block's input gathered to the full sequence;
        in training only this rank's rows of it are saved for backward."""
        x, rebuild = _first(args, kwargs)
        if self.overlap:
            from .linear import gather_block_input

            full = gather_block_input(module, x, self.state, self.group)
        else:
            full = block_input(x, self.state, self.group)
        if torch.is_grad_enabled():
            hooks = _save_rows_only(full, x, self.state, self.group)
            hooks.__enter__()
            self.active.append(hooks)
        return rebuild(full)

    def _block_post(self, module, _args, output):
        """block: the output reduce-scattered to this rank's rows ("enter":
        left as it is); always called, so the saved-tensor scope closes."""
        while self.active:
            self.active.pop().__exit__(None, None, None)
        if self.overlap:
            from .linear import release_block_input

            release_block_input(module)
        if output is None or "block" not in self.roles:  # raised (always_call), or "enter": output as it is
            return None
        return _on_output(output, functools.partial(block_output, state=self.state, group=self.group))

    def _rows_post(self, _module, _args, output):
        return _on_output(output, self._mark)

    def _gather_post(self, _module, _args, output):
        return _on_output(output, lambda y: gather_sequence(self._mark(y), self.state, self.group))

    def _gather_input_pre(self, _module, args, kwargs):
        """gather_input (a layer on the full sequence): its input gathered;
        the gather's backward keeps this rank's rows of the gradient every
        rank computes in full and alike."""
        x, rebuild = _first(args, kwargs)
        return rebuild(gather_sequence(x, self.state, self.group))

    def _split_output_post(self, _module, _args, output):
        """split_output: the full output cut back to this rank's rows (backward:
        the rows' gradients all-gathered)."""
        return _on_output(output, lambda y: split_sequence(y, self.state, self.group))

    def _enter_output_post(self, _module, _args, output):
        """enter_output (Swin's windowed blocks: policies/shapes.py StageShape)."""
        return _on_output(output, lambda y: block_input(y, self.state, self.group))

    def _sum_grad_post(self, _module, _args, output):
        return _on_output(output, lambda y: sum_grad_over_ranks(y, self.group))

    def _leave_pre(self, _module, args, kwargs):
        x, rebuild = _first(args, kwargs)
        return rebuild(keep_rows(x, self.group))

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.module.__dict__.pop(STATE_MARK, None)
