"""Weight gradients taken out of the backward pass (zero-bubble schedules).

A linear product y = x W^T + b (W: [out, in]; or y = x W + b for HF Conv1D
and the conv1d layout, W: [in, out]) has, with the rows of x and of the
output gradient g flattened to X [n, in] and G [n, out], the gradients

    dx = G W          (Conv1D: G W^T)     needed at once by the layer below
    dW = G^T X        (Conv1D: X^T G)     needed only by the optimizer
    db = sum over rows of G

A zero-bubble schedule runs the first in its B pass (and sends dx upstream
at once) and the other two later, in its W pass, where they fill time the
stage would otherwise wait.  Inside `deferring(sink)` every linear product
whose weight is a leaf parameter that requires a gradient and has no
gradient hooks, made while grad mode is on, runs as _DeferredLinear:

    F.linear(x, W, b)           (nn.Linear, shardformer's column / row layers)
    x @ W, torch.matmul(x, W)   (the conv1d layout)
    torch.addmm(b, x, W)        (HF Conv1D)

Its backward returns dx only and appends (W, b, X, G) to `sink`;
`apply(sink)` adds dW and db to W.grad and b.grad as autograd would have.
Everything else -- norms, embeddings, a linear whose bias or weight is not a
plain leaf (TP's replicated rows), a weight with hooks (the all-reduce of a
parameter replicated over a sequence-parallel group) -- gets its gradient in
the B pass, unchanged.  The products are caught with a TorchFunctionMode,
so no module is rewritten.  Under gradient checkpointing the schedules do
not defer (a layer recomputed in B must save what its forward saved, and
the recomputation does not run under the mode): every gradient is then
computed in B.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["deferring", "apply", "COUNTS"]

# Linear products deferred / weight gradients applied by this process (for tests: proof the split ran).
COUNTS = {"deferred": 0, "applied": 0}

_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_ADDMM = {torch.addmm, torch.Tensor.addmm}


def _plain_leaf(t) -> bool:
    """A parameter whose gradient autograd would only accumulate (no hooks to run)."""
    return (isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad
            and not t._backward_hooks and not getattr(t, "_post_accumulate_grad_hooks", None))


def _product(func, args, kwargs):
    """(x, W, b, conv1d) when this call is a linear product with a deferrable weight, else None."""
    if func in _LINEAR:
        x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        if len(args) + len(kwargs) > 3 or not isinstance(x, torch.Tensor):
            return None
        conv = False
    elif func in _MATMUL:
        if kwargs or len(args) != 2:
            return None
        (x, w), b, conv = args, None, True
    elif func in _ADDMM:
        if kwargs or len(args) != 3:
            return None
        b, x, w = args
        conv = True
    else:
        return None
    if not (_plain_leaf(w) and w.dim() == 2 and isinstance(x, torch.Tensor) and x.dim() >= 1):
        return None
    if x.shape[-1] != w.shape[0 if conv else 1] or (b is not None and not _plain_leaf(b)):
        return None
    if func in _ADDMM and x.dim() != 2:
        return None
    return x, w, b, conv


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b (conv1d: x W + b); backward gives dx, and leaves (W, b, x, g) in the sink."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv: bool, sink: list):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.sink, ctx.bias = conv, sink, bias
        if conv:
            y = x @ weight
            return y if bias is None else y + bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (g @ (weight.t() if ctx.conv else weight).to(g.dtype)).to(x.dtype)
        ctx.sink.append((weight, ctx.bias, x, g, ctx.conv))
        return dx, None, None, None, None


class _Defer(TorchFunctionMode):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            found = _product(func, args, kwargs)
            if found is not None:
                x, w, b, conv = found
                COUNTS["deferred"] += 1
                return _DeferredLinear.apply(x, w, b, conv, self.sink)
        return func(*args, **kwargs)


@contextlib.contextmanager
def deferring(sink: list):
    """Linear products made inside leave their weight gradients in `sink` (see the module docstring)."""
    with _Defer(sink):
        yield sink


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype).reshape(param.shape)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


@torch.no_grad()
def apply(sink: list) -> None:
    """The W pass: dW = G^T X (conv1d: X^T G) and db = sum of G's rows into .grad, in the order of the sink."""
    for weight, bias, x, g, conv in sink:
        X, G = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        X = X.to(G.dtype)
        _accumulate(weight, X.t() @ G if conv else G.t() @ X)
        if bias is not None:
            _accumulate(bias, G.sum(0))
        COUNTS["applied"] += 1
    sink.clear()
