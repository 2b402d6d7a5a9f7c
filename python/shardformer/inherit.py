"""What a replacement module takes over from the module it replaces.

A sharded model must behave like the model the user handed in, including the
state that lives on modules rather than in weights.  When the sharder swaps
`native` for `replacement` (a parallel layer), the replacement inherits:

    training           the flag of `native`, on every module the replacement
                       brought (so eval() before optimize() stays eval: dropout
                       off, HF's `self.training` branches unchanged)
    requires_grad      per parameter name; a parameter with no namesake is
                       frozen when every parameter of `native` was frozen
    module hooks       forward / forward-pre / backward / state-dict hooks, the
                       same dicts moved over, so handles the user holds still
                       remove them
    HF flags           `_is_hf_initialized` (HF's init skips modules it has
                       already initialized)

Modules that enter the tree with no module they replace (created by a
policy's pre/postprocess) take the training flag of their parent.

The sharder calls adopt while it builds the replacements, before it swaps
any in: the only change adopt makes to a native module is adding the
replacement's own hooks to the native's hook dicts (shared with the
replacement), and undo() takes those out again when the optimize() fails.

Refused before anything changes: a module whose `forward` was patched on
the instance (accelerate's dispatch hooks, monkey patches): the patch wraps
the native module's own forward, which the replacement does not have.
"""
from __future__ import annotations

import weakref

from torch import nn

# Hook dicts of nn.Module that travel with the module (each removable handle
# holds a weak reference to its dict, so moving the dict keeps handles live).
_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HF_FLAGS = ("_is_hf_initialized",)


def check_replaceable(model_name: str, ops: list) -> None:
    """Refuse plans that would drop run-time behaviour silently (before apply)."""
    for op in ops:
        if op.kind != "sub":
            continue
        path, native = op.path, op.native
        if isinstance(native, nn.Module) and "forward" in vars(native):
            raise ValueError(
                f"{model_name}: {path}: {type(native).__name__}.forward is patched on the instance "
                f"({getattr(vars(native)['forward'], '__qualname__', 'a callable')}), e.g. by accelerate's "
                f"device-map hooks; the parallel layer that replaces it cannot keep that patch. Load the "
                f"model without a device_map / offloading (or remove the patch) before optimize()")


class Inheritance:
    """The sharder's `adopt` callback, plus the pass over the finished tree."""

    def __init__(self, model: nn.Module):
        # Weak sets, not ids: a replaced module is freed during apply and its
        # id may be reused by a new one; and holding the originals would keep
        # their full weights alive.
        self.original = weakref.WeakSet(model.modules())
        self.adopted: weakref.WeakSet = weakref.WeakSet()
        self.hooked: list[str] = []
        self.tensor_hooked: list[str] = []
        # (native's hook dict, keys added to it from the replacement's), for undo()
        self.merged: list[tuple[dict, list]] = []

    def __call__(self, path: str, native: nn.Module, replacement: nn.Module) -> None:
        if not isinstance(replacement, nn.Module):
            return
        kept = {id(m) for m in native.modules()} if isinstance(native, nn.Module) else set()
        training = getattr(native, "training", True)
        for m in replacement.modules():
            if id(m) in kept:
                continue
            m.training = training
            self.adopted.add(m)
        if not isinstance(native, nn.Module):
            return
        self._requires_grad(path, native, replacement)
        self._hooks(path, native, replacement)
        for flag in _HF_FLAGS:
            if flag in vars(native):
                object.__setattr__(replacement, flag, vars(native)[flag])

    def _requires_grad(self, path: str, native: nn.Module, replacement: nn.Module) -> None:
        old = dict(native.named_parameters())
        all_frozen = bool(old) and not any(p.requires_grad for p in old.values())
        for name, p in replacement.named_parameters():
            if name in old:
                p.requires_grad_(old[name].requires_grad)
            elif all_frozen:
                p.requires_grad_(False)
        kept = {id(q) for q in replacement.parameters()}
        for name, p in old.items():
            if id(p) in kept:    # the same parameter lives on: its hooks still see all of it
                continue
            if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
                self.tensor_hooked.append(f"{path}.{name}")

    def _hooks(self, path: str, native: nn.Module, replacement: nn.Module) -> None:
        if any(getattr(native, d, None) for d in _FORWARD_HOOKS):
            self.hooked.append(path)
        for d in _HOOK_DICTS:
            theirs = getattr(native, d, None)
            if not theirs:
                continue
            ours = getattr(replacement, d, None)
            if ours and ours is not theirs:
                added = [k for k in ours if k not in theirs]
                theirs.update(ours)
                self.merged.append((theirs, added))
            object.__setattr__(replacement, d, theirs)

    def undo(self) -> None:
        """Take the replacements' hooks back out of the native modules' hook
        dicts (the one change adopt makes to a native module), after a
        failed optimize() whose swaps were all undone."""
        for theirs, added in reversed(self.merged):
            for key in added:
                theirs.pop(key, None)
        self.merged.clear()

    def finish(self, model: nn.Module, model_name: str) -> list[str]:
        """New modules with no predecessor take their parent's flag.  Returns
        the warnings about hooks that now see shards, for the sharder to
        emit once the model is complete (a warning turned into an error must
        not interrupt a half-finished optimize())."""
        stack = [(model, model.training)]
        while stack:
            module, parent_training = stack.pop()
            if module not in self.original and module not in self.adopted:
                module.training = parent_training
            for child in module.children():
                stack.append((child, module.training))
        messages = []
        if self.hooked:
            messages.append(
                f"{model_name}: hooks registered on {', '.join(self.hooked[:5])}"
                f"{' ...' if len(self.hooked) > 5 else ''} moved to the parallel layers that replace them; "
                f"they now see this rank's shard of those layers' weights and, for column-parallel layers "
                f"without gather_output, of their outputs")
        if self.tensor_hooked:
            messages.append(
                f"{model_name}: gradient hooks on {', '.join(self.tensor_hooked[:5])}"
                f"{' ...' if len(self.tensor_hooked) > 5 else ''} were registered on the full parameters, "
                f"which optimize() replaced by shards; register them again on the sharded model's parameters")
        self.merged.clear()
        return messages
