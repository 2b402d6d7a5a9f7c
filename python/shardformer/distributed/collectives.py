"""Collectives with backend dispatch.

Every collective here takes a tensor and an optional process group (None is
the default world group) and runs on the group's communicator for the
tensor's device type (communicator.py), one per (group, device type):

    "torch"  torch.distributed (gloo on CPU, NCCL on CUDA); works everywhere
    "shm"    shared-memory backend for CPU ranks on one host (C core)
    "nccl"   direct NCCL calls for CUDA tensors (C core)

`SHARDFORMER_COMM=torch|shm|nccl` forces a backend; forcing one that cannot
run raises (with the reason) rather than falling back, so a benchmark never
measures the wrong thing.  Left alone, CPU tensors of a group whose ranks
all mapped one shared-memory segment use "shm", and everything else --
CUDA tensors included -- uses "torch" (the group's own backend: NCCL, or
gloo, through CPU memory for the operations gloo cannot run on CUDA
tensors; see communicator.py, "CUDA tensors", and docs/gpu.md).  The direct
NCCL path is chosen with SHARDFORMER_COMM=nccl.  An auto-picked "shm" hands
the dtypes it cannot reduce (bool, int8, ...) to torch.distributed.

The variable is read once per (group, device type), when the group's first
collective on that device type creates its communicator; later changes are
ignored for that group (`backend_for` raises if it sees one), so one group
never mixes backends.  `reset_communicators()` (every rank, same point)
forgets the choices, for tests that switch backends.

The first collective on a group sets up its communicator (the shm segment,
the NCCL id), itself a collective over the group, so it must be called by
every rank of the group at the same point, as collectives are.  send/recv
only use a communicator that already exists (they involve two ranks, which
cannot set one up for the group).

Each function below is one lookup and one call on the communicator, which
holds the group's size and rank; every collective passes through it.  While
torch.compile traces, each is instead a custom op over that same
communicator (traceable.py), out of place, its result copied into the
caller's tensor.  Ranks
that disagree on a collective (sizes, dtypes, operation, root) raise on every
rank: the shm backend checks every call in C; for the torch and nccl backends
`SHARDFORMER_CHECK_COLLECTIVES=1` (read once per group and device type, like
SHARDFORMER_COMM) adds a check before each call, at the cost of one small
all-gather (see communicator.py, "Cross-rank checks").

A group's communicators go with the group: `dist.destroy_process_group(g)`
needs no call of ours (see communicator.py and shm.py, "Lifetime").
"""
from __future__ import annotations

import torch

from . import traceable
from .communicator import (  # noqa: F401 - all_gather_flat, reduce_scatter_flat: for tests and benchmarks
    BACKENDS,
    all_gather_flat,
    reduce_scatter_flat,
    check_unchanged,
    communicator_for,
    existing_communicator,
    get_communicator,
    group_info,
    reset_communicators,
)

__all__ = [
    "BACKENDS", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "backend_for", "broadcast",
    "get_communicator", "rank", "recv", "reduce_scatter_tensor", "reset_communicators", "send",
    "world_size",
]

def backend_for(t: torch.Tensor, group=None) -> str:
    """The backend that collectives on `t` over `group` use: "shm", "nccl" or "torch".

    Collective on first use for a group (it may set up the shm segment).
    Raises if SHARDFORMER_COMM changed since the group's backend was chosen."""
    comm = communicator_for(t, group)
    check_unchanged(comm)
    return comm.backend


def world_size(group=None) -> int:
    """Size of `group`; 1 when torch.distributed is not initialized."""
    if torch.compiler.is_compiling():
        return traceable.size_of(group)
    return group_info(group).size


def rank(group=None) -> int:
    """This process's rank in `group`; 0 when torch.distributed is not initialized."""
    if torch.compiler.is_compiling():
        return traceable.rank_of(group)
    return group_info(group).rank


def all_reduce(t: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of `t` over `group` (sum, or max); returns `t`."""
    if torch.compiler.is_compiling():
        return traceable.all_reduce_into(t, group, op)
    return communicator_for(t, group).all_reduce(t, op)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    """out = concat over ranks (in rank order) of `t`, along dimension 0."""
    if torch.compiler.is_compiling():
        return traceable.all_gather_into(out, t, group)
    return communicator_for(t, group).all_gather_into_tensor(out, t)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    """out = rank i's chunk (along dimension 0) of the sum over ranks of `t`."""
    if torch.compiler.is_compiling():
        return traceable.reduce_scatter_into(out, t, group)
    return communicator_for(t, group).reduce_scatter_tensor(out, t)


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all over `group` of p ranks: `t` and `out` have the same shape
    and dtype, dimension 0 of length p * c; rows [j*c, (j+1)*c) of `t` go to
    group rank j, and rows [i*c, (i+1)*c) of `out` come from group rank i.
    Arguments are checked (ValueError) before anything is sent; returns `out`."""
    if torch.compiler.is_compiling():
        return traceable.all_to_all_into(out, t, group)
    return communicator_for(t, group).all_to_all_single(out, t)


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast of `t` from group rank `src`; returns `t`."""
    return communicator_for(t, group).broadcast(t, src)


def send(t: torch.Tensor, dst: int, group=None) -> None:
    """Send `t` to group rank `dst` (for pipeline stages)."""
    existing_communicator(t, group).send(t, dst)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into `t` from group rank `src`; returns `t`."""
    return existing_communicator(t, group).recv(t, src)
