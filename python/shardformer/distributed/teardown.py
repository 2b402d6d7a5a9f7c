"""Exit teardown: the process groups end while the interpreter is still whole.

A process group's backend owns native threads (gloo: its work loop and the
transport's event loop; their owners join them in the destructors).  The
destructor runs when the last reference to the group goes; if that happens
during interpreter finalization (a module's globals cleared, the final
garbage collection) or not at all (then process exit tears the threads down
under the static destructors), the process can die at exit with SIGABRT,
"terminate called without an active exception": the exit output is right and
the exit status is not.  Rare: once in 87 torchrun runs of the
sentence-embedding example on a loaded 2-core machine, once in CI.

Why a group outlives `dist.destroy_process_group()`: a module imported after
`init_process_group` that names the group in a default argument,
`def all_reduce(tensor, op=ReduceOp.SUM, group=group.WORLD)`, captures the
group object then.  torch.distributed.nn.functional does (imported by
torch._dynamo, so by transformers' modeling_utils, DCP, FSDP, ...), and so do
ZeroRedundancyOptimizer and ShardedGradScaler; destroy_process_group() forgets
the group in its tables, but these defaults keep it alive until finalization.
Imported before `init_process_group`, the same default is None (the default
group at call time), which is what `_release_captured_groups` restores.

`_at_exit` (registered when shardformer is imported, so it runs before the
handlers registered earlier, e.g. by the program before that import) does,
in order:

  1. stop the shm communicators' async workers (shm._close_all: no daemon
     thread inside a torch op at finalization);
  2. destroy the process groups if the program did not
     (`dist.destroy_process_group()`; never waits for a peer);
  3. release the groups captured by function defaults in the loaded
     torch.distributed modules and drop shardformer's own caches of groups,
     so the destructors, and the joins of the backends' threads, run now.

A program that still needs the default group in an exit handler must
register that handler after importing shardformer (handlers run last-in,
first-out) or destroy the group itself.  See docs/exit.md.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import types
import weakref


def _process_group_type():
    try:
        from torch.distributed import ProcessGroup
    except ImportError:       # torch built without distributed support
        return None
    return ProcessGroup


def _live_groups() -> set:
    """Ids of the groups torch.distributed still knows (empty when uninitialized)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return set()
    from torch.distributed import distributed_c10d as c10d

    return {id(g) for g in c10d._world.pg_map}


def _functions_of(module: types.ModuleType):
    """The module's own functions and the methods of its own classes."""
    name = module.__name__
    for value in list(vars(module).values()):
        kind = type(value)          # not isinstance: a deprecated alias warns when its __class__ is read
        if kind is types.FunctionType and value.__module__ == name:
            yield value
        elif issubclass(kind, type) and value.__module__ == name:
            for attr in list(vars(value).values()):
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                if isinstance(attr, types.FunctionType):
                    yield attr


def _release_captured_groups(prefix: str = "torch.distributed") -> list:
    """Reset to None every default argument, in the loaded modules named
    `prefix` or `prefix.*`, that holds a process group torch.distributed no
    longer knows.  Returns weak references to the groups released."""
    pg_type = _process_group_type()
    if pg_type is None:
        return []
    live = _live_groups()
    released: dict[int, weakref.ref] = {}

    def stale(value) -> bool:
        # type(), not isinstance: a deprecated alias among the defaults warns when its __class__ is read
        if issubclass(type(value), pg_type) and id(value) not in live:
            released.setdefault(id(value), weakref.ref(value))
            return True
        return False

    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        for fn in _functions_of(module):
            defaults, kwdefaults = fn.__defaults__, fn.__kwdefaults__
            if defaults and any([stale(v) for v in defaults]):
                fn.__defaults__ = tuple(None if id(v) in released else v for v in defaults)
            if kwdefaults and any([stale(v) for v in kwdefaults.values()]):
                fn.__kwdefaults__ = {k: (None if id(v) in released else v) for k, v in kwdefaults.items()}
    return list(released.values())


#: Callables that drop a cache of groups held above this module (parallel_mesh
#: registers its mesh cache): release_groups runs them after destroying the
#: groups, so that nothing keeps a group alive into finalization.
_FORGETTERS: list = []


def on_release(forget) -> None:
    """Have release_groups call `forget()` (no arguments) to drop the
    references to process groups a higher module caches."""
    if forget not in _FORGETTERS:
        _FORGETTERS.append(forget)


def release_groups() -> None:
    """Destroy the process groups (if still initialized) and drop every
    reference shardformer and the torch.distributed modules' defaults hold to
    them, so their backends' threads are joined now.  A no-op without
    torch.distributed or without groups."""
    pg_type = _process_group_type()
    if pg_type is None:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):      # exiting: a failed teardown must not mask the exit status
            dist.destroy_process_group()
    for forget in _FORGETTERS:
        forget()
    if any(ref() is not None for ref in _release_captured_groups()):
        gc.collect()       # a released group still reachable from a reference cycle goes now, not at finalization


def _at_exit() -> None:
    from . import shm

    shm._close_all()
    release_groups()


def register() -> None:
    """Register the exit teardown (once; shardformer/__init__ calls it)."""
    if not getattr(register, "_done", False):
        atexit.register(_at_exit)
        register._done = True
