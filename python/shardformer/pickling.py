"""Whole-model pickling (torch.save(model), pickle, copy.deepcopy) of sharded models.

A sharded model holds two kinds of objects plain pickle cannot write:

    process groups     torch's ProcessGroup is a live handle (sockets, a
                       store).  It pickles here as a reference: the global
                       ranks of the group and its name.  Unpickling resolves
                       the reference in the loading process: the existing
                       group with the same global ranks (the one of the same
                       name first, so copy.deepcopy keeps the very group).
                       Loading therefore needs torch.distributed initialized
                       and the group created (dist.new_group(ranks)) on the
                       same ranks as when it was saved; otherwise the load
                       raises a RuntimeError that names the ranks.  Nothing of
                       the group's state travels: a loaded model runs its
                       collectives on the loading process's group.
    bound methods      a policy's method_replacement (and a seam's forward)
                       is a function bound to one module instance.
                       types.MethodType pickles as getattr(module, name),
                       which on load finds the class's method, not the
                       replacement; BoundMethod pickles as (function,
                       module), both by reference, so the loaded module calls
                       the same replacement.

Refused (PickleRefusal, a no-op forward pre-hook first on the model, whose
pickling raises TypeError naming the model and the setting; copy.deepcopy
still works): models sharded with sequence_parallelism_mode "all_to_all" or
"ring_attn" (their split hooks are closures over the attention seams), and
pipeline stages (StageRuntime's hooks and the links to the neighbouring
stages).  Save those with state_dict / save_pretrained.

Hooks and replacements that carry state are small module-level callable
classes (or functools.partial of module-level functions), never closures:
closures cannot pickle.  Per-forward state (streams opened in a forward,
gathered tensors) is empty between forwards and is not pickled.  torch.save
drops a parameter's tensor hooks: the gradient all-reduce of parameters
replicated over the TP / SP group (layer.replicated.GradAllReduce) is
registered again by its holder at the loaded model's first forward.
"""
from __future__ import annotations

import copyreg
import importlib
import inspect
import types

import torch.distributed as dist


def _group_reference(group) -> tuple:
    """ProcessGroup -> (resolve_group, (global ranks, group name))."""
    return resolve_group, (tuple(dist.get_process_group_ranks(group)), getattr(group, "group_name", ""))


def resolve_group(ranks: tuple, name: str = ""):
    """The process group of this process with global ranks `ranks` (the one
    named `name` if several have them); RuntimeError when there is none."""
    ranks = tuple(ranks)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"loading a sharded model needs its process group of global ranks {list(ranks)}: "
                           "torch.distributed is not initialized in this process (init_process_group, then "
                           "dist.new_group(ranks) as when the model was sharded, before torch.load)")
    same = [g for g in dist.distributed_c10d._world.pg_group_ranks
            if tuple(dist.get_process_group_ranks(g)) == ranks]
    named = [g for g in same if getattr(g, "group_name", None) == name]
    if named or same:
        return (named or same)[0]
    raise RuntimeError(f"loading a sharded model needs its process group of global ranks {list(ranks)}, "
                       f"which this process does not have (create it with dist.new_group({list(ranks)}) "
                       f"before torch.load)")


def register() -> None:
    """Make ProcessGroup pickle as a reference (idempotent)."""
    if dist.is_available():
        copyreg.pickle(dist.ProcessGroup, _group_reference)


class BoundMethod:
    """`function` bound to `owner`: calling it calls function(owner, ...),
    like types.MethodType, but it pickles (and deep-copies) as the pair
    (function, owner), so a loaded module keeps its replacement.  A deep copy
    of the owner rebinds the copy's BoundMethod to the copy."""

    def __init__(self, function, owner):
        self.__func__ = function
        self.__self__ = owner

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return BoundMethod, (self.__func__, self.__self__)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __getattr__(self, name: str):
        if name in ("__func__", "__self__"):   # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self.__func__, name)

    def __repr__(self) -> str:
        return f"<shardformer bound {getattr(self.__func__, '__qualname__', self.__func__)!r} of " \
               f"{type(self.__self__).__name__}>"


# id(obj) -> (obj, module name, attribute): the objects that pickle by name.
# The object is held so that its id is never reused while registered.
_REFERENCES: dict[int, tuple[object, str, str]] = {}


def register_reference(obj, module_name: str, attr: str):
    """Declare that `obj` is bound to the module-level name `module_name`.`attr`
    (a module that imports without side effects), so that it pickles as that
    name (reference_of / resolve_reference).  Returns obj, for
    `NAME = register_reference(make(), __name__, "NAME")`."""
    _REFERENCES[id(obj)] = (obj, module_name, attr)
    return obj


def reference_of(obj) -> tuple[str, str] | None:
    """(module name, attribute) `obj` was registered under, or None."""
    entry = _REFERENCES.get(id(obj))
    return None if entry is None else entry[1:]


def resolve_reference(module_name: str, attr: str):
    """The object at `module_name`.`attr`, the module imported (unpickling)."""
    return getattr(importlib.import_module(module_name), attr)


def bind(function, owner) -> BoundMethod:
    """function bound to owner (the sharder's method_replacement binding)."""
    return BoundMethod(function, owner)


class PickleRefusal:
    """A no-op forward pre-hook whose pickling raises TypeError(`why`):
    registered first on a sharded model that cannot be pickled, so that
    torch.save fails with the reason rather than on an inner closure.
    copy.deepcopy copies it (deep copies keep working)."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, _module, _args) -> None:
        return None

    def __reduce__(self):
        raise TypeError(self.why)

    def __deepcopy__(self, memo) -> "PickleRefusal":
        return PickleRefusal(self.why)


def refusal_reason(name: str, shard_config, pipelined: bool) -> str | None:
    """Why a model sharded with `shard_config` cannot be pickled, or None."""
    mode = shard_config.sequence_parallelism_mode if shard_config.enable_sequence_parallelism else None
    if mode in ("all_to_all", "ring_attn"):
        why = f"sequence_parallelism_mode={mode!r}: its split hooks close over the attention seams"
    elif pipelined:
        why = "pipeline parallelism: the stage's runtime hooks hold the links to the neighbouring stages"
    else:
        return None
    return (f"{name}: a model sharded with {why}, and cannot be pickled (torch.save(model)); save its "
            f"weights with model.state_dict() or save_pretrained() instead")
