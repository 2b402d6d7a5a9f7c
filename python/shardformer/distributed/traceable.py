"""Collectives as torch.compile sees them: custom ops over our communicator.

Eager collectives look the communicator up in a cache (a lock in shm.py) and
call the backend from Python, and the region operators of mappings.py reduce
in place when nothing else reads the tensor (`_overwritable`: use counts) --
none of which dynamo can trace.  While torch.compile traces
(`torch.compiler.is_compiling()`), collectives.py and mappings.py call this
module instead:

  * each collective is one opaque `torch.library` custom op,
    `shardformer::all_reduce` / `all_gather` / `reduce_scatter` /
    `all_to_all`, whose real implementation is the eager communicator of the
    group (shm, gloo or NCCL, chosen exactly as in eager: same cache, same
    backend, same cross-rank checks) and whose fake implementation gives the
    output's shape from the group size alone;
  * the group travels as its name (a str, as functional collectives pass it;
    "" is the default group) and its size as an int, both fixed at trace time;
  * out of place: each op returns a new tensor (the functional form the
    compiler needs); collectives.py's out-parameter calls copy it into the
    caller's tensor, and the region operators that reduce in place in eager
    (copy_to / reduce_from the TP region) and the all-to-all (which holds a
    communicator in its autograd context) have twins here.  The others
    (scatter / gather, sequence all-gather / reduce-scatter, replicated
    gradients) are mappings.py's own, whose collectives are then these ops.

Every op works along dimension 0 (the layout our communicators take); the
movedim / pad / index_select around it are plain torch ops in the graph.

    op              forward                         output shape (p ranks)
    all_reduce      sum (or max) over ranks         x.shape
    all_gather      rank blocks stacked in order    [p * x.shape[0], ...]
    reduce_scatter  own block of the sum            [x.shape[0] // p, ...]
    all_to_all      block j to rank j               x.shape
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import DimShard
from .communicator import communicator_for

_LIB = "shardformer"


def group_name(group) -> str:
    """The name the ops take for `group`: "" for the default group (None)."""
    return "" if group is None else group.group_name


def _group(name: str):
    """The process group of a name from group_name()."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_LIB}::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """Sum (or max) of x over the group, into a new tensor."""
    out = _fresh(x)
    communicator_for(out, _group(group)).all_reduce(out, op)
    return out


@all_reduce.register_fake
def _(x, group, op="sum"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_LIB}::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """The ranks' x stacked along dimension 0 in rank order (size: the group's)."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    communicator_for(x, _group(group)).all_gather_into_tensor(out, x)
    return out


@all_gather.register_fake
def _(x, group, size):
    return x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))


@torch.library.custom_op(f"{_LIB}::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """This rank's block (dimension 0 cut in `size`) of the sum over ranks."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    communicator_for(x, _group(group)).reduce_scatter_tensor(out, x)
    return out


@reduce_scatter.register_fake
def _(x, group, size):
    return x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))


@torch.library.custom_op(f"{_LIB}::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, group: str) -> torch.Tensor:
    """Block j of dimension 0 to rank j; block i of the result from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    communicator_for(x, _group(group)).all_to_all_single(out, x)
    return out


@all_to_all.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- the conjugate pairs -----------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_dim(x, dim: int, shard: DimShard, group) -> torch.Tensor:
    """Full tensor along `dim` from every rank's shard, padding stripped
    (mappings.gather_along, with the index built from torch ops)."""
    group = group_name(group)
    x = x.movedim(dim, 0)
    chunk = max(shard.all_lengths)
    if x.shape[0] < chunk:
        x = torch.cat([x, x.new_zeros((chunk - x.shape[0],) + tuple(x.shape[1:]))], 0)
    buf = all_gather(x, group, shard.tp_size)
    index = _gather_index(shard, chunk, buf.device)
    if index is None:
        return buf.movedim(0, dim)
    return buf.index_select(0, index).movedim(0, dim)


def _gather_index(shard: DimShard, chunk: int, device):
    """For each full index, its row in the gather buffer (rank r's block at
    r * chunk); None when that is the identity."""
    pieces, identity, expect = [], True, 0
    for r, ranges in enumerate(shard.all_ranges):
        pos = r * chunk
        for off, n in sorted(ranges):
            pieces.append((off, pos, n))
            identity = identity and off == expect and pos == off
            expect = off + n
            pos += n
    if identity and expect == shard.full and chunk * shard.tp_size == shard.full:
        return None
    pieces.sort()
    return torch.cat([torch.arange(pos, pos + n, device=device) for _, pos, n in pieces])


def _a2a(x, scatter_dim: int, gather_dim: int, group: str, size: int) -> torch.Tensor:
    chunk = x.shape[scatter_dim] // size
    send = x.unflatten(scatter_dim, (size, chunk)).movedim(scatter_dim, 0)
    recv = all_to_all(send, group)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, size):
        ctx.args = (scatter_dim, gather_dim, group, size)
        return _a2a(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group, size = ctx.args
        return _a2a(grad, gather_dim, scatter_dim, group, size), None, None, None, None


# ---- the entries collectives.py and mappings.py call while compiling -----------------------

def size_of(group) -> int:
    """The group's size at trace time (1 without torch.distributed)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank_of(group) -> int:
    """This process's rank in the group at trace time (0 without torch.distributed)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


# The out-parameter collectives of collectives.py: the op's result copied
# into the caller's tensor (functionalization makes that one more graph value).

def all_reduce_into(t, group, op: str):
    return t.copy_(all_reduce(t, group_name(group), op)) if size_of(group) > 1 else t


def all_gather_into(out, t, group):
    return out.copy_(all_gather(t, group_name(group), size_of(group)).view_as(out))


def reduce_scatter_into(out, t, group):
    return out.copy_(reduce_scatter(t, group_name(group), size_of(group)).view_as(out))


def all_to_all_into(out, t, group):
    return out.copy_(all_to_all(t, group_name(group)))


def copy_to_tp_region(x, group):
    if not (x.requires_grad and torch.is_grad_enabled()) or size_of(group) == 1:
        return x
    return _CopyToTP.apply(x, group_name(group))


def reduce_from_tp_region(x, group):
    if size_of(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group_name(group))


def all_to_all_along(x, scatter_dim, gather_dim, group):
    return _AllToAll.apply(x, scatter_dim, gather_dim, group_name(group), size_of(group))
