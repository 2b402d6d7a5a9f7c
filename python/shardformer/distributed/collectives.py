"""Collectives with backend dispatch.

Every collective here takes a tensor and an optional process group (None is
the default world group) and runs on the backend that `backend_for` picks:

    "torch"  torch.distributed (gloo on CPU, NCCL on CUDA); works everywhere
    "shm"    shared-memory backend for CPU ranks on one host (C core)
    "nccl"   direct NCCL calls for CUDA tensors (C core)

`SHARDFORMER_COMM=torch|shm|nccl` forces a backend.  The C backends are
reported unavailable until the build carries them; forcing an unavailable one
is an error rather than a silent fallback, so a benchmark never measures the
wrong thing.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

BACKENDS = ("torch", "shm", "nccl")

# torch renamed the flat-tensor collectives (2.13 deprecates the old names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Which C backends this build provides, with the reason when one is missing.
_UNAVAILABLE = {
    "shm": "the shared-memory backend is not built into this version of shardformer._C",
    "nccl": "the NCCL backend is not built into this version of shardformer._C",
}


def _forced() -> str | None:
    value = os.environ.get("SHARDFORMER_COMM", "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"SHARDFORMER_COMM={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def backend_for(t: torch.Tensor, group=None) -> str:
    """The backend that collectives on `t` over `group` use: "shm", "nccl" or "torch"."""
    forced = _forced()
    if forced is not None:
        if forced in _UNAVAILABLE:
            raise RuntimeError(f"SHARDFORMER_COMM={forced}: {_UNAVAILABLE[forced]}")
        return forced
    return "torch"


def world_size(group=None) -> int:
    """Size of `group`; 1 when torch.distributed is not initialized."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank(group=None) -> int:
    """This process's rank in `group`; 0 when torch.distributed is not initialized."""
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce(t: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of `t` over `group` (sum, or max); returns `t`."""
    if world_size(group) == 1:
        return t
    backend_for(t, group)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(t, op=reduce_op, group=group)
    return t


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    """out = concat over ranks (in rank order) of `t`, along dimension 0."""
    n = world_size(group)
    if out.shape[0] != t.shape[0] * n or out.shape[1:] != t.shape[1:]:
        raise ValueError(
            f"all_gather_into_tensor: out has shape {tuple(out.shape)}, expected "
            f"({t.shape[0] * n}, {', '.join(map(str, t.shape[1:]))}) for {n} ranks"
        )
    if n == 1:
        out.copy_(t)
        return out
    backend_for(t, group)
    _all_gather_single(out, t.contiguous(), group=group)
    return out


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    """out = rank i's chunk (along dimension 0) of the sum over ranks of `t`."""
    n = world_size(group)
    if t.shape[0] != out.shape[0] * n or out.shape[1:] != t.shape[1:]:
        raise ValueError(
            f"reduce_scatter_tensor: input has shape {tuple(t.shape)}, expected dimension 0 "
            f"= {out.shape[0]} * {n} ranks"
        )
    if n == 1:
        out.copy_(t)
        return out
    backend_for(t, group)
    _reduce_scatter_single(out, t.contiguous(), group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast of `t` from group rank `src`; returns `t`."""
    if world_size(group) == 1:
        return t
    backend_for(t, group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(t, global_src, group=group)
    return t


def send(t: torch.Tensor, dst: int, group=None) -> None:
    """Send `t` to group rank `dst` (for pipeline stages)."""
    backend_for(t, group)
    global_dst = dist.get_global_rank(group, dst) if group is not None else dst
    dist.send(t.contiguous(), global_dst, group=group)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into `t` from group rank `src`; returns `t`."""
    backend_for(t, group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.recv(t, global_src, group=group)
    return t
