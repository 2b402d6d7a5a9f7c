"""Collectives with backend dispatch.

Every collective here takes a tensor and an optional process group (None is
the default world group) and runs on the backend that `backend_for` picks:

    "torch"  torch.distributed (gloo on CPU, NCCL on CUDA); works everywhere
    "shm"    shared-memory backend for CPU ranks on one host (C core)
    "nccl"   direct NCCL calls for CUDA tensors (C core)

`SHARDFORMER_COMM=torch|shm|nccl` forces a backend; forcing one that cannot
run raises (with the reason) rather than falling back, so a benchmark never
measures the wrong thing.  Left alone, CPU tensors of a group whose ranks
all mapped one shared-memory segment use "shm", CUDA tensors use "nccl" when
NCCL loads, and everything else uses "torch".

The first collective on a group sets up its shm communicator, itself a
collective over the group (see shm.py), so `backend_for` must be called by
every rank of the group at the same point, as the collectives below do.
send/recv only use a communicator that already exists (they involve two
ranks, which cannot set one up for the group).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import nccl as _nccl
from . import shm as _shm

BACKENDS = ("torch", "shm", "nccl")

# torch renamed the flat-tensor collectives (2.13 deprecates the old names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _forced() -> str | None:
    value = os.environ.get("SHARDFORMER_COMM", "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"SHARDFORMER_COMM={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def _group_name(group) -> str:
    if not dist.is_initialized():
        return "the default group (torch.distributed not initialized)"
    return f"the group of global ranks {dist.get_process_group_ranks(group or dist.group.WORLD)}"


def backend_for(t: torch.Tensor, group=None) -> str:
    """The backend that collectives on `t` over `group` use: "shm", "nccl" or "torch".

    Collective on first use for a group (it may set up the shm segment)."""
    return _pick(t, group, setup=True)


def _pick(t: torch.Tensor, group, setup: bool) -> str:
    forced = _forced()
    multi = dist.is_initialized() and world_size(group) > 1
    if forced == "torch":
        return "torch"
    if forced == "shm":
        if t.device.type != "cpu":
            raise RuntimeError(f"SHARDFORMER_COMM=shm: tensor is on {t.device}; shm is CPU-only")
        if multi:
            comm = _shm.communicator(group) if setup else _shm.existing(group)
            if comm is None:
                why = _shm.reason(group) or (
                    f"send/recv need the shm communicator of {_group_name(group)} set up first: "
                    "call shardformer.distributed.shm.communicator(group) on every rank")
                raise RuntimeError(f"SHARDFORMER_COMM=shm: {why}")
        return "shm"
    if forced == "nccl":
        ok, why = _nccl.available()
        if not ok:
            raise RuntimeError(f"SHARDFORMER_COMM=nccl: {why}")
        if not t.is_cuda:
            raise RuntimeError(f"SHARDFORMER_COMM=nccl: tensor is on {t.device}, not CUDA")
        return "nccl"
    if not multi:
        return "torch"
    if t.device.type == "cpu":
        comm = _shm.communicator(group) if setup else _shm.existing(group)
        return "shm" if comm is not None else "torch"
    if t.is_cuda and _nccl.available()[0]:
        if setup or _nccl._COMMS.get(group if group is not None else dist.group.WORLD):
            return "nccl"
    return "torch"


def _reduce_backend(t: torch.Tensor, group) -> str:
    backend = backend_for(t, group)
    # Auto-picked shm cannot reduce every dtype (bool, int8, ...); torch can.
    if backend == "shm" and t.dtype not in _shm.REDUCIBLE and _forced() is None:
        return "torch"
    return backend


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
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op={op!r}, expected 'sum' or 'max'")
    backend = _reduce_backend(t, group)
    if backend == "shm":
        _shm.communicator(group).all_reduce(t, op)
        return t
    if backend == "nccl":
        _nccl.communicator(group).all_reduce(t, op)
        return t
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
    backend = backend_for(t, group)
    if backend == "shm":
        _shm.communicator(group).all_gather(out, t)
        return out
    if backend == "nccl":
        _nccl.communicator(group).all_gather(out, t.contiguous())
        return out
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
    backend = _reduce_backend(t, group)
    if backend == "shm":
        _shm.communicator(group).reduce_scatter(out, t)
        return out
    if backend == "nccl":
        _nccl.communicator(group).reduce_scatter(out, t.contiguous())
        return out
    _reduce_scatter_single(out, t.contiguous(), group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast of `t` from group rank `src`; returns `t`."""
    if world_size(group) == 1:
        return t
    backend = backend_for(t, group)
    if backend == "shm":
        _shm.communicator(group).broadcast(t, src)
        return t
    if backend == "nccl":
        _nccl.communicator(group).broadcast(t, src)
        return t
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(t, global_src, group=group)
    return t


def send(t: torch.Tensor, dst: int, group=None) -> None:
    """Send `t` to group rank `dst` (for pipeline stages)."""
    backend = _pick(t, group, setup=False)
    if backend == "shm":
        _shm.existing(group).send(t, dst)
        return
    if backend == "nccl":
        _nccl.communicator(group).send(t.contiguous(), dst)
        return
    global_dst = dist.get_global_rank(group, dst) if group is not None else dst
    dist.send(t.contiguous(), global_dst, group=group)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into `t` from group rank `src`; returns `t`."""
    backend = _pick(t, group, setup=False)
    if backend == "shm":
        _shm.existing(group).recv(t, src)
        return t
    if backend == "nccl":
        _nccl.communicator(group).recv(t, src)
        return t
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.recv(t, global_src, group=group)
    return t
