"""Hooks that follow both models module by module.

On the unsharded reference, `Recorder` keeps every sub-module's output (its
floating-point tensors) and input gradient (the `grad_input` of a full
backward hook: the gradient of the loss with respect to the module's
positional tensor inputs), keyed by (module path, n-th call).  On the
sharded copy, `Comparer` compares each one as it is produced with the
reference's under the same key, and remembers, for the modules running
when the forward raises, the innermost one.

A sharded module's output or input gradient is either whole (an attention
or MLP block after its row layer's all-reduce, a column layer's input
gradient after its copy's all-reduce) or this rank's shard of one dimension
(a column layer's output, a row layer's input).  A shard is compared with
the reference cut by the nearest recorded layout of that length (see
`nearest_layouts` and compare.compare_maybe_sharded); a shard no layout
fits is counted as not comparable.
"""
from __future__ import annotations

from torch import nn

from ..layer.parallel_module import ParallelModule
from .compare import compare_maybe_sharded, float_tensors
from .report import MODULE_INPUT_GRAD, MODULE_OUTPUT, Entry


def _subtree_layouts(model: nn.Module) -> dict[str, list]:
    """{module path: the DimShards recorded by the ParallelModules in its
    subtree, its own first}."""
    out: dict[str, list] = {}

    def walk(path: str, module: nn.Module) -> list:
        own = [shard for _, shard in module.sharded_params.values()] if isinstance(module, ParallelModule) else []
        below = [s for name, child in module.named_children()
                 for s in walk(f"{path}.{name}" if path else name, child)]
        out[path] = own + below
        return out[path]

    walk("", model)
    return out


def nearest_layouts(path: str, subtree: dict[str, list]) -> list:
    """The layouts recorded in `path`'s subtree, then its parent's, ... up to
    the whole model's: the nearest layer's layout is tried first."""
    seen, result = set(), []
    parts = path.split(".") if path else []
    for n in range(len(parts), -1, -1):
        for shard in subtree.get(".".join(parts[:n]), ()):
            if id(shard) not in seen:
                seen.add(id(shard))
                result.append(shard)
    return result


class _Hooks:
    """Forward, forward-pre and full backward hooks on every sub-module
    (not the root: its output is the model's, checked separately)."""

    def __init__(self, model: nn.Module):
        self.handles = []
        self.forward_calls: dict[str, int] = {}
        self.backward_calls: dict[str, int] = {}
        self.finished = 0
        self.backward_fired = 0
        self.first_fired: dict[str, int] = {}
        self.running: list[str] = []
        for path, module in model.named_modules():
            if not path:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(path)))
            self.handles.append(module.register_forward_hook(self._post(path)))
            self.handles.append(module.register_full_backward_hook(self._back(path)))

    def _pre(self, path):
        def hook(module, args):
            self.running.append(path)
        return hook

    def _post(self, path):
        def hook(module, args, output):
            if self.running and self.running[-1] == path:
                self.running.pop()
            n = self.forward_calls.get(path, 0)
            self.forward_calls[path] = n + 1
            self.on_output(path, n, self.finished, output)
            self.finished += 1
        return hook

    def _back(self, path):
        def hook(module, grad_input, grad_output):
            n = self.backward_calls.get(path, 0)
            self.backward_calls[path] = n + 1
            self.first_fired.setdefault(path, self.backward_fired)
            self.on_input_grad(path, n, self.backward_fired, grad_input)
            self.backward_fired += 1
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _grads(grad_input) -> dict[str, object]:
    return {str(i): g for i, g in enumerate(grad_input) if g is not None and g.is_floating_point()}


class Recorder(_Hooks):
    """The reference's module outputs and input gradients, detached copies."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.outputs: dict[tuple, dict] = {}
        self.input_grads: dict[tuple, dict] = {}

    def on_output(self, path, n, order, output):
        self.outputs[path, n] = {k: v.detach().clone() for k, v in float_tensors(output).items()}

    def on_input_grad(self, path, n, order, grad_input):
        self.input_grads[path, n] = {k: v.detach().clone() for k, v in _grads(grad_input).items()}


class Comparer(_Hooks):
    """The sharded model's module outputs and input gradients against a
    Recorder's, as Entries (check "modules")."""

    def __init__(self, model: nn.Module, reference: Recorder, rtol: float):
        super().__init__(model)
        self.reference, self.rtol = reference, rtol
        self.subtree = _subtree_layouts(model)
        self.entries: list[Entry] = []

    def _compare(self, phase, order, path, n, label, got: dict, expected: dict | None):
        if expected is None:
            return
        layouts = nearest_layouts(path, self.subtree)
        call = f" (call {n + 1})" if n else ""
        for key, ref in expected.items():
            what = label if key == "0" and len(expected) == 1 else f"{label} '{key}'"
            t = got.get(key)
            if t is None:
                self.entries.append(Entry("modules", (phase, order), path, what + call,
                                          note="missing from the sharded model's output", missing=True))
                continue
            d = compare_maybe_sharded(t, ref, self.rtol, layouts)
            note = "" if d is not None else (f"a shard {list(t.shape)} of {list(ref.shape)} whose layout no "
                                             "nearby layer recorded")
            self.entries.append(Entry("modules", (phase, order), path, what + call, d, note))

    def on_output(self, path, n, order, output):
        self._compare(MODULE_OUTPUT, order, path, n, "output", float_tensors(output),
                      self.reference.outputs.get((path, n)))

    def on_input_grad(self, path, n, order, grad_input):
        self._compare(MODULE_INPUT_GRAD, order, path, n, "input grad", _grads(grad_input),
                      self.reference.input_grads.get((path, n)))

    def raised_in(self) -> tuple[str, tuple]:
        """(innermost module running, its place in forward order) after the forward raised."""
        return (self.running[-1] if self.running else ""), (MODULE_OUTPUT, self.finished, 1)
