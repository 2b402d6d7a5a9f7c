"""The overlapped sequence gather of a windowed block (Swin, Swinv2):
ShardConfig.enable_sequence_overlap for blocks that cut the (height, width)
map into windows before their projections.

Notation: X [B, S, C] the gathered rows of the map (S = H W, row-major),
Xr this rank's rows, P_k(x) = x A_k^T + b_k the attention's column layers
(q, k, v; this rank's heads).  The block views X as [B, H, W, C], pads it
with zero tokens at the bottom / right to multiples of the window w, rolls
it by the shift (-s, -s) and cuts it into windows [B nW, w w, C]: a map
pi from window positions to tokens of X or to a padding token.  pi only
moves tokens, and each P_k acts per token, so

    P_k(windows of X)[j] = P_k(X)[pi(j)]      (a token of X)
                         = b_k                (a padding token: P_k(0))

So P_k(X) is computed in sequence order while the rows are gathered (one
GatherRowsLinear pass: this rank's rows multiplied while the others' are in
flight, then theirs), and the windows the block hands its attention get
P_k(X) indexed by pi.  pi is computed once per (H, W, w, s) by running the
block's own padding (maybe_pad), the roll and the model's own
window_partition on the map of token numbers 1..S (0: padding), so the
order is the model's.

Where the gather sits:
    gather_at="layernorm_before"  (Swin, pre-norm) the norm runs on this rank's
        rows; its output is gathered.  The gathered norm output feeds only
        the windows, so dX = sum over ranks of the projections' input
        gradients: the pass's reduce-scatter.
    gather_at=None  (Swinv2, post-norm) the block's own input is gathered
        (it replaces "gather_input").  The gathered X is also the block's
        shortcut, whose gradient is the same on every rank (the block runs
        as plain TP after its projections); the reduce-scatter would add it
        p times, so the shortcut's X passes through own_rows_grad: identity
        forward, backward zero outside this rank's rows: the sum over ranks
        then holds it once.

Backward: one re-gather of X for the weight gradients, one reduce-scatter
of dX (GatherRowsLinear), both overlapped.  A projection the block does not
call keeps its output unused (counted in GatherRowsLinear.unused).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .. import distributed as D
from ..distributed.mappings import GatherRowsLinear
from .linear import Linear1D_Col
from .parallel_module import ShardPlan, plan_directly

__all__ = ["WindowedGatherOverlap", "window_order"]


def window_order(layer: nn.Module, height: int, width: int, device) -> torch.Tensor:
    """pi of `layer` (a Swin / Swinv2 block) on an (height, width) map: a
    long tensor [nW w w] of token numbers 1..H W in window order, 0 where
    the block pads.  Built with the block's maybe_pad, its roll by
    -shift_size and its module's window_partition."""
    partition = sys.modules[type(layer).__module__].window_partition
    numbers = torch.arange(1, height * width + 1, dtype=torch.float64, device=device).view(1, height, width, 1)
    padded, _ = layer.maybe_pad(numbers, height, width)
    shift = int(layer.shift_size)
    if shift > 0:
        padded = torch.roll(padded, shifts=(-shift, -shift), dims=(1, 2))
    return partition(padded, int(layer.window_size)).reshape(-1).round().long()


class _OwnRowsGrad(torch.autograd.Function):
    """Identity forward; backward, the gradient kept on rows [lo, hi) of
    dimension 1 only (zero elsewhere)."""

    @staticmethod
    def forward(ctx, x, lo: int, hi: int):
        ctx.lo, ctx.hi = lo, hi
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = torch.zeros_like(grad)
        out[:, ctx.lo:ctx.hi] = grad[:, ctx.lo:ctx.hi]
        return out, None, None


class _Hooks:
    """The hooks of one block (methods, so the model pickles): the block's
    pre-hook records (H, W) and, with gather_at None, gathers its input; the
    gather_at module's forward hook gathers its output; the attention's
    pre-hook hands each projection its windows of P_k(X); the attention's
    post-hook (always called) drops what was not used."""

    def __init__(self, block: nn.Module, state, group, gather_at: str | None, attention: str):
        self.block, self.state, self.group = block, state, group
        self.gather_at, self.attention = gather_at, attention
        self.handles: list = []
        self.pending = None             # (H, W, P_k(X) of every projection, the projections)
        self.dims = None
        self.orders: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pending": None, "dims": None, "orders": {}}

    def commit(self) -> nn.Module:
        block = self.block
        attention = block.get_submodule(self.attention)
        self.handles.append(block.register_forward_pre_hook(self._block_pre, with_kwargs=True))
        if self.gather_at is not None:
            self.handles.append(block.get_submodule(self.gather_at).register_forward_hook(self._gather_output))
        self.handles.append(attention.register_forward_pre_hook(self._attention_pre, with_kwargs=True))
        self.handles.append(attention.register_forward_hook(self._attention_post, always_call=True))
        return block

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _projections(self) -> list:
        attention = self.block.get_submodule(self.attention)
        return [m for m in attention.children() if isinstance(m, Linear1D_Col) and not m.gather_output]

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [B, S'/p, C] -> X [B, S, C], P_k(X) computed meanwhile (kept in `pending`)."""
        layers = self._projections()
        params = []
        for m in layers:
            params += list(m._local_params())
        outs = GatherRowsLinear.apply(rows.movedim(1, 0), False, self.group, self.state.length, True, True,
                                       *params)
        full = outs[0].movedim(0, 1)
        self.pending = (self.dims, [y.movedim(0, 1) for y in outs[1:]], layers)
        return full

    def _block_pre(self, _block, args, kwargs):
        dims = kwargs["input_dimensions"] if "input_dimensions" in kwargs else args[1]
        self.dims = (int(dims[0]), int(dims[1]))
        if self.gather_at is not None:
            return None
        rows = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        full = self._gather(rows)
        s = rows.shape[1]
        r = D.rank(self.group)
        full = _OwnRowsGrad.apply(full, min(r * s, full.shape[1]), min((r + 1) * s, full.shape[1]))
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": full}
        return (full, *args[1:]), kwargs

    def _gather_output(self, _module, _args, output):
        return self._gather(output)

    def _attention_pre(self, _attention, args, kwargs):
        if self.pending is None:
            return None
        (height, width), ys, layers = self.pending
        self.pending = None
        windows = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        key = (height, width, int(self.block.window_size), int(self.block.shift_size), windows.device)
        order = self.orders.get(key)
        if order is None:
            order = self.orders[key] = window_order(self.block, height, width, windows.device)
        for m, y in zip(layers, ys):
            bias = m._local_params()[1]
            fill = bias if bias is not None else y.new_zeros(y.shape[-1])
            padded = torch.cat([fill.expand(y.shape[0], 1, y.shape[-1]), y], dim=1)      # token 0: padding
            m._precomputed = (windows, padded[:, order].reshape(*windows.shape[:-1], y.shape[-1]))
        return None

    def _attention_post(self, attention, _args, _output):
        for m in attention.children():
            if getattr(m, "_precomputed", None) is not None:
                m._precomputed = None
                GatherRowsLinear.unused += 1
        self.pending = None
        return None


class WindowedGatherOverlap:
    """Policy target (a Sub on each block, `blocks.*`): the overlapped gather
    above.  Kwargs: `state` (the stage's SequenceState), `gather_at` (the
    path of the module whose output is gathered, or None: the block's
    input), `attention` (the path of the module whose Linear1D_Col children
    are the projections).  No hooks in a group of one."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, state=None, gather_at=None,
                   attention="attention", **kwargs) -> ShardPlan:
        from .sequence import SequenceState

        if not isinstance(state, SequenceState):
            raise TypeError(f"WindowedGatherOverlap: state must be a SequenceState, got {type(state).__name__}")
        for path in (attention,) + ((gather_at,) if gather_at else ()):
            try:
                module.get_submodule(path)
            except AttributeError:
                raise ValueError(f"WindowedGatherOverlap: {type(module).__name__} has no submodule {path!r}") \
                    from None
        for attr in ("window_size", "shift_size", "maybe_pad"):
            if not hasattr(module, attr):
                raise ValueError(f"WindowedGatherOverlap: {type(module).__name__} has no {attr!r}: not a "
                                 f"windowed block (docs/sequence-parallelism.md)")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              state=None, gather_at=None, attention="attention", **kwargs):
        if plan is None:
            plan = plan_directly(cls, module, process_group, state=state, gather_at=gather_at, attention=attention)
        if plan.tp_size == 1:
            return _Nothing(module)
        return _Hooks(module, state, process_group, gather_at, attention)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           state=None, gather_at=None, attention="attention", **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, state=state, gather_at=gather_at,
                                         attention=attention).commit()


class _Nothing:
    def __init__(self, module):
        self.module = module

    def commit(self):
        return self.module

    def rollback(self):
        pass

