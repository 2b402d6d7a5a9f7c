"""DistributedDataParallel over ranks that hold different shards: refused.

DDP assumes every rank of its group holds the same parameters.  Wrapped
around a sharded model over a group that contains two ranks of one tensor-
parallel group (or two stages of one pipeline), as `DistributedDataParallel
(model)` with the default group does, and as transformers.Trainer and
accelerate's prepare() do under torchrun, its construction broadcasts rank
0's state over the group (every rank's shards overwritten by rank 0's) and
its backward averages gradients of different shards; its sampler feeds the
tensor-parallel ranks different rows.  Nothing fails.

The hook: before any collective, DDP's constructor reads the module's
`_ddp_params_and_buffers_to_ignore` (torch's own list of names DDP leaves
alone, set by `DistributedDataParallel._set_params_and_buffers_to_ignore_
for_model`) and iterates it.  optimize() sets that attribute to a Guard:
the same list of names, whose iteration, when it comes from a DDP
constructor, compares that DDP's process group with the model's groups and
raises ValueError naming the shared ranks and the fix
(shardformer.data_parallel(model, mesh): DDP over mesh.dp).  Any other
reader sees a plain list of names.
"""
from __future__ import annotations

import sys

import torch.distributed as dist
from torch import nn
from .compile_refusal import refuse_ddp_optimizer_compile

GUARD_ATTR = "_ddp_params_and_buffers_to_ignore"


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _constructing_ddp(frame, depth: int = 6):
    """(the DistributedDataParallel whose __init__ is among the `depth` frames
    above `frame`, the module it wraps), or (None, None)."""
    from torch.nn.parallel import DistributedDataParallel

    while frame is not None and depth > 0:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, DistributedDataParallel) and frame.f_code.co_name == "__init__":
            return candidate, frame.f_locals.get("module")
        frame, depth = frame.f_back, depth - 1
    return None, None


class Guard:
    """The names DDP must leave alone (`names`), and the groups (`groups`:
    (process group, what)) whose ranks a DDP group may not span."""

    def __init__(self, model_name: str, groups: list[tuple[object, str]], names=()):
        self.model_name = model_name
        self.groups = groups
        self.names = list(names)

    def __iter__(self):
        ddp, module = _constructing_ddp(sys._getframe(1))
        if ddp is not None:
            self.check(getattr(ddp, "process_group", None))
            if isinstance(module, nn.Module):   # allowed: torch.compile of it must not use the DDPOptimizer
                refuse_ddp_optimizer_compile(module, self.model_name)
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name) -> bool:
        return name in self.names

    def __repr__(self) -> str:
        return f"Guard({self.names!r})"

    def check(self, dp_group) -> None:
        """ValueError when `dp_group` (None: the world) holds two ranks of one
        of the model's groups."""
        if not dist.is_available() or not dist.is_initialized():
            return
        dp_ranks = _ranks(dp_group)
        for group, what in self.groups:
            shared = sorted(set(dp_ranks) & set(_ranks(group)))
            if len(shared) > 1:
                scope = " (the default group: the whole world)" if dp_group is None or \
                    dp_group is dist.group.WORLD else ""
                raise ValueError(
                    f"{self.model_name}: DistributedDataParallel over ranks {dp_ranks}{scope} contains ranks "
                    f"{shared} of this model's {what} group, which hold different shards: "
                    f"it would overwrite their shards with rank {dp_ranks[0]}'s, average gradients of different "
                    f"shards and, with its sampler, give them different rows. Wrap the sharded model over the "
                    f"data-parallel group only: shardformer.data_parallel(model, m) with m = shardformer.mesh("
                    f"tp=..., pp=...) (or DistributedDataParallel(model, process_group=m.dp)), and sample over "
                    f"m.dp. transformers.Trainer and accelerate's prepare() wrap the model over the whole world "
                    f"under torchrun: drive the sharded model with your own loop (or a trainer that wraps it "
                    f"over m.dp)")


def install(model, name: str, groups: list[tuple[object, str]]) -> None:
    """Put a Guard for `groups` (the ranks holding different shards) in
    `model`'s DDP ignore list, keeping the names already there."""
    groups = [(g, what) for g, what in groups if len(_ranks(g)) > 1] \
        if dist.is_available() and dist.is_initialized() else []
    if not groups:
        return
    model.__dict__[GUARD_ATTR] = Guard(name, groups, model.__dict__.get(GUARD_ATTR, ()))


def set_ignored(model, names) -> None:
    """DDP's ignore list of `model` set to `names`, keeping a Guard in place."""
    guard = model.__dict__.get(GUARD_ATTR)
    if isinstance(guard, Guard):
        guard.names = list(names)
    else:
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(names))
