"""Selective recompute of elementwise intermediates under split-gather SP
(ShardConfig(sequence_parallel_recompute="selective")).

During the forward of a decoder layer a saved_tensors_hooks scope is open
(opened by the layer's SequenceParallelRegion hooks).  Every tensor autograd
saves for backward passes through `_Scope.pack`, which keeps it as it is
unless it is the output Z of one of these elementwise ops whose inputs are
themselves saved by some node of the same layer (so they stay alive anyway):

    Z = A * B           (MulBackward0: both factors saved, e.g. the RMSNorm's
                         x * rsqrt(mean(x^2) + eps), its weight * x_hat, and
                         the SwiGLU product silu(gate) * up)
    Z = silu(A)         (SiluBackward0: A saved by the silu node)
    Z = gelu(A)         (GeluBackward0, either approximation)

or a view of such a Z covering all of it (F.linear saves its [B, S, I]
input as [B*S, I]).  Then only a Recipe is saved: the op and its inputs (the
tensors themselves or their own Recipes); the first unpack in backward runs
the op again on the same inputs, which gives the same bits (the same
elementwise kernel, same operands), and the later unpacks reuse that value
until the backward nodes holding the Recipe are freed.  The graph, and so
every backward formula, is the model's own: only where a saved value comes
from changes.  An input changed in place after it was saved makes unpack
raise, as autograd's own version check would.

With the scope open, a block's gathered input X (sequence.block_input) is
saved as this rank's rows (the re-gather of _save_rows_only), and the rows
themselves (the norm's output, weight * x_hat) as a Recipe too: per layer a
Llama keeps the norms' inputs and rsqrt, q/k/v, the attention output and
LSE, and the MLP's gate and up outputs; not the x_hat of the norms, their
outputs, the SiLU output or the product (see benchmarks/sequence_parallel.py).

Not opened when autograd is off (no_grad, eval without grad), nor under
another saved_tensors_hooks scope (gradient checkpointing: the layer is
recomputed in backward anyway; the inner scope would override its hooks).
`COUNTS` counts, in this process, the tensors saved as Recipes ("packed")
and the ops rerun in backward ("recomputed"); tests read them.
"""
from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

COUNTS = {"packed": 0, "recomputed": 0}
_LOCAL = threading.local()          # .scopes: the open scopes of this thread, innermost last


class Recipe:
    """A saved tensor kept as fn(*inputs): inputs are tensors (with the
    version each had when saved) or Recipes."""

    __slots__ = ("fn", "inputs", "versions", "cached")

    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, tuple(inputs)
        self.versions = tuple(t._version if isinstance(t, torch.Tensor) else None for t in self.inputs)
        self.cached = None

    def value(self) -> torch.Tensor:
        if self.cached is None:
            args = [_materialize(t, v) for t, v in zip(self.inputs, self.versions)]
            self.cached = self.fn(*args)
            COUNTS["recomputed"] += 1
        return self.cached


class Deferred:
    """A saved tensor produced by `get()` in backward (a block's re-gathered
    input: sequence._Regathered), viewed as `shape`."""

    __slots__ = ("get", "shape")

    def __init__(self, get, shape):
        self.get, self.shape = get, shape

    def value(self) -> torch.Tensor:
        return self.get().view(self.shape)


def _materialize(t, version):
    if isinstance(t, torch.Tensor):
        if t._version != version:
            raise RuntimeError("selective recompute (sequence_parallel_recompute): an input of a recomputed "
                               f"tensor ({tuple(t.shape)}) was modified in place after it was saved")
        return t
    return t.value()


def stored_value(s) -> torch.Tensor:
    """What `s` (a tensor or a Recipe, see _Scope.stored) holds."""
    return s if isinstance(s, torch.Tensor) else s.value()


def _view(shape, base):
    return base.view(shape)


_OPS = {
    "MulBackward0": lambda node: torch.mul,
    "SiluBackward0": lambda node: F.silu,
    "GeluBackward0": lambda node: functools.partial(F.gelu, approximate=node._saved_approximate),
}


def _covers(view: torch.Tensor, base: torch.Tensor) -> bool:
    """`view` is `base`'s memory, element for element (both contiguous)."""
    return (view.is_contiguous() and base.is_contiguous() and view.data_ptr() == base.data_ptr()
            and view.numel() == base.numel() and view.dtype == base.dtype)


def _key(t: torch.Tensor):
    return (t.data_ptr(), t.numel(), t.dtype)


class _Scope:
    """The saved-tensor hooks of one decoder layer's forward: `saved` maps
    the autograd edge (node, output number) of every tensor saved so far to
    how it is stored, `aliases` maps a block input's memory (_key) to its
    re-gather."""

    def __init__(self):
        self.saved: dict = {}
        self.aliases: dict = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _lookup(self, edge):
        node, nr = edge
        if node is None:
            return None
        if hasattr(node, "variable"):                    # AccumulateGrad: a leaf (a parameter)
            return node.variable
        return self.saved.get((node, nr))

    def recipe(self, t: torch.Tensor):
        """A Recipe computing `t` from tensors saved in this scope, or None."""
        base = t if t._base is None else t._base
        if base is not t and not _covers(t, base):
            return None
        node = base.grad_fn
        op = _OPS.get(node.name()) if node is not None else None
        if op is None:
            return None
        inputs = [self._lookup(edge) for edge in node.next_functions]
        if any(i is None for i in inputs):
            return None
        made = Recipe(op(node), inputs)
        return made if base is t else Recipe(functools.partial(_view, t.shape), [made])

    def stored(self, t: torch.Tensor):
        """How to keep `t` for backward: the stored form of a tensor saved
        in this scope, a Recipe, or `t` itself (detached)."""
        if t.grad_fn is not None and (t.grad_fn, t.output_nr) in self.saved:
            return self.saved[(t.grad_fn, t.output_nr)]
        return self.recipe(t) or t.detach()

    def pack(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_contiguous() and _key(t) in self.aliases:
            return Deferred(self.aliases[_key(t)], tuple(t.shape))
        packed = self.recipe(t) if t.requires_grad else None
        if packed is not None:
            COUNTS["packed"] += 1
        if t.grad_fn is not None:
            self.saved[(t.grad_fn, t.output_nr)] = t if packed is None else packed
        return t if packed is None else packed

    @staticmethod
    def unpack(p):
        return p.value() if isinstance(p, (Recipe, Deferred)) else p


def active_scope() -> _Scope | None:
    """The innermost open scope of this thread, if it is the innermost
    saved-tensor hooks too (None inside other hooks opened within it)."""
    scopes = getattr(_LOCAL, "scopes", None)
    if not scopes:
        return None
    scope = scopes[-1][1]
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return scope if top is not None and top[0] == scope.pack else None


def layer_scope_hooks(module: torch.nn.Module) -> list:
    """Forward pre- and post-hooks (always_call) on `module` that open a
    _Scope for its forward; returns their handles."""
    def pre(_module, _args):
        if torch.is_grad_enabled() and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            scope = _Scope()
            scope.hooks.__enter__()
            stack = getattr(_LOCAL, "scopes", None)
            if stack is None:
                stack = _LOCAL.scopes = []
            stack.append((module, scope))

    def post(_module, _args, _output):
        stack = getattr(_LOCAL, "scopes", None)
        if stack and stack[-1][0] is module:
            _, scope = stack.pop()
            scope.hooks.__exit__(None, None, None)
            scope.saved.clear()
            scope.aliases.clear()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]
