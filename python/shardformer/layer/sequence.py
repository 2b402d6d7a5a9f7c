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
forward hooks (role "split", "gather" or "block"); SequenceState carries the
unpadded length S from the split to the blocks of one forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import distributed as D
from ..distributed.mappings import _all_gather_seq, gather_from_sequence_region, reduce_scatter_to_sequence_region
from .parallel_module import ShardPlan, plan_directly

SEQ_DIM = 1


class SequenceState:
    """The unpadded sequence length of the forward in progress (set by the
    split at the first decoder layer, read by the blocks and the gather)."""

    def __init__(self):
        self.length: int | None = None

    def __repr__(self) -> str:
        return f"SequenceState(length={self.length})"


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """x padded with zero rows along the sequence to a multiple of n."""
    extra = -x.shape[SEQ_DIM] % n
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - SEQ_DIM) + [0, extra]
    return F.pad(x, pad)


class _Split(torch.autograd.Function):
    """Forward: pad, keep this rank's rows.  Backward: all-gather the rows'
    gradients, drop the padding."""

    @staticmethod
    def forward(ctx, x, group, length):
        n, rank = D.world_size(group), D.rank(group)
        ctx.group, ctx.length = group, length
        x = _padded(x, n)
        chunk = x.shape[SEQ_DIM] // n
        return x.narrow(SEQ_DIM, rank * chunk, chunk).contiguous()

    @staticmethod
    def backward(ctx, grad):
        full = _all_gather(grad.contiguous(), ctx.group)
        return full.narrow(SEQ_DIM, 0, ctx.length), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather, drop the padding.  Backward: this rank's rows of
    the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group, length):
        ctx.group = group
        return _all_gather(x.contiguous(), group).narrow(SEQ_DIM, 0, length)

    @staticmethod
    def backward(ctx, grad):
        n, rank = D.world_size(ctx.group), D.rank(ctx.group)
        grad = _padded(grad, n)
        chunk = grad.shape[SEQ_DIM] // n
        return grad.narrow(SEQ_DIM, rank * chunk, chunk).contiguous(), None, None


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _all_gather_seq(x, SEQ_DIM, group)


def split_sequence(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    state.length = x.shape[SEQ_DIM]
    return _Split.apply(x, group, state.length)


def gather_sequence(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    return _Gather.apply(x, group, state.length)


def block_input(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Sequence-split -> full sequence: all-gather (backward: reduce-scatter), padding dropped."""
    # contiguous: the all-gather's [S, batch, hidden] layout seen as [batch, S, hidden] is not
    # (the layers would copy it anyway), and the saved-tensor hooks recognise it by its storage
    return gather_from_sequence_region(x, SEQ_DIM, group).narrow(SEQ_DIM, 0, state.length).contiguous()


def block_output(y: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's rows of the sum:
    padded, reduce-scatter (backward: all-gather)."""
    return reduce_scatter_to_sequence_region(_padded(y, D.world_size(group)), SEQ_DIM, group)


class _Regathered:
    """This rank's rows of a block's gathered input, saved for backward in
    place of the full tensor; the first unpack all-gathers them again (every
    rank runs the same backward graph in the same order, so the collectives
    match) and the later ones reuse it.  `gathers` counts the re-gathers
    of this process (tests read it)."""

    gathers = 0

    def __init__(self, local: torch.Tensor, length: int, group):
        self.local, self.length, self.group = local, length, group
        self.full: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.full is None:
            self.full = _all_gather(self.local, self.group).narrow(SEQ_DIM, 0, self.length).contiguous()
            _Regathered.gathers += 1
        return self.full


def _save_rows_only(full: torch.Tensor, local: torch.Tensor, state: SequenceState, group):
    """saved_tensors_hooks for a block's forward: the gathered input `full`
    (or a contiguous reshape of it: F.linear saves [B*S, H]) is saved as a
    _Regathered of this rank's rows; everything else as it is.  Plain
    closures, no reference cycle: the re-gathered tensor is freed as soon as
    the last node that saved it has run its backward."""
    key = (full.data_ptr(), full.numel(), full.dtype)      # full is contiguous (block_input)
    holder = _Regathered(local.detach(), state.length, group)

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
    gathered, output reduce-scattered); kwarg `state`: the model's
    SequenceState.  A module may take both "split" and "gather" (one layer)."""

    ROLES = ("split", "gather", "block")

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, role=None, state=None, **kwargs) -> ShardPlan:
        if role not in cls.ROLES and not (isinstance(role, tuple) and set(role) <= set(cls.ROLES)):
            raise ValueError(f"SequenceParallelRegion: role must be one of {cls.ROLES} (or a tuple of them), "
                             f"got {role!r}")
        if not isinstance(state, SequenceState):
            raise TypeError(f"SequenceParallelRegion: state must be a SequenceState, got {type(state).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              role=None, state=None, **kwargs) -> "_Hooks":
        if plan is None:
            plan = plan_directly(cls, module, process_group, role=role, state=state)
        roles = role if isinstance(role, tuple) else (role,)
        return _Hooks(module, roles if plan.tp_size > 1 else (), state, process_group)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           role=None, state=None, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, role=role, state=state).commit()


class _Hooks:
    """The forward hooks of some roles on `module`: registered by commit(),
    removed by rollback()."""

    def __init__(self, module: nn.Module, roles: tuple, state: SequenceState, group):
        self.module, self.roles, self.state, self.group = module, roles, state, group
        self.handles: list = []

    def commit(self) -> nn.Module:
        state, group, m = self.state, self.group, self.module
        active: list = []                      # the block's open saved-tensor hooks (block role)
        if "split" in self.roles:
            def pre(_module, args, kwargs):
                x, rebuild = _first(args, kwargs)
                return rebuild(split_sequence(x, state, group))

            self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        if "block" in self.roles:
            def pre(_module, args, kwargs):
                x, rebuild = _first(args, kwargs)
                full = block_input(x, state, group)
                if torch.is_grad_enabled():
                    hooks = _save_rows_only(full, x, state, group)
                    hooks.__enter__()
                    active.append(hooks)
                return rebuild(full)

            def post(_module, _args, output):
                while active:
                    active.pop().__exit__(None, None, None)
                if output is None:                 # the forward raised (always_call): let its error through
                    return None
                return _on_output(output, lambda y: block_output(y, state, group))

            self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(post, always_call=True))
        if "gather" in self.roles:
            def post(_module, _args, output):
                return _on_output(output, lambda y: gather_sequence(y, state, group))

            self.handles.append(m.register_forward_hook(post))
        return m

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
