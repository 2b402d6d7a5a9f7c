"""Tensor-parallel regions: replicated <-> split along the last (or any) dimension.

    operator                forward            backward
    copy_to_tp_region       identity           all-reduce
    reduce_from_tp_region   all-reduce         identity (in place when nothing else reads x)
    scatter_to_tp_region    keep own slice     all-gather
    gather_from_tp_region   all-gather         keep own slice
    sync_replicated_grad    identity           sum grads over ranks that hold the same rows

Slices follow a `DimShard`, so uneven splits, padding and fused layouts
gather back to exactly the full tensor.
"""
from __future__ import annotations

import functools

import torch

from ...layout import DimShard
from .. import collectives as C
from .. import traceable
from ..communicator import parallel_communicator

_increment_version = torch.autograd.graph.increment_version

try:  # how many tensors share a storage (torch >= 2.0)
    from torch._C import _storage_Use_Count as _storage_use_count

    def _storage_users(t: torch.Tensor) -> int:
        storage = t.untyped_storage()  # held across the call: the count is of a live storage
        return _storage_use_count(storage._cdata)

    _SOLE_STORAGE = _storage_users(torch.empty(1))  # a tensor alone on its storage
except (ImportError, AttributeError):  # pragma: no cover - older torch: always copy
    _storage_use_count = None


def _overwritable(t: torch.Tensor) -> bool:
    """True when nothing but the caller's Python object can read `t`'s memory,
    so reducing it in place cannot change a value anyone else uses.

    No other tensor handle (`_use_count`: a copy saved for backward by an op
    that took t as input, an autograd buffer holding the same gradient, a view
    of t keeping it as its base), no other tensor on its storage (a view, a
    detach(), an op that saved t as its output), not itself a view, and not a
    leaf that requires grad (a parameter).  Python names bound to the same
    object are the caller's business: the region operators consume their
    input, as Megatron's do."""
    return (_storage_use_count is not None and t._use_count() == 1 and t._base is None
            and t.is_contiguous() and not (t.requires_grad and t.grad_fn is None)
            and _storage_users(t) == _SOLE_STORAGE)


def _reduce(x: torch.Tensor, comm) -> torch.Tensor:
    """Sum x over the group: in place when nothing else can read x, else in
    one copy.  Returns the summed tensor.

    No autograd.Function: the all-reduce's backward is the identity, which is
    what autograd already does with a tensor overwritten behind its back -- the
    gradient of the result flows to x's own grad_fn (the matmul that made it),
    or through the copy's CloneBackward.  That is sound only because nothing
    saved x's old value (`_overwritable`); the version counter is bumped all
    the same (the C backends write through a raw pointer), so a tensor that
    autograd had saved could never be read back silently changed."""
    if not _overwritable(x):
        x = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x.detach() if x.requires_grad else x)
    _increment_version(x)
    return x


def gather_along(x: torch.Tensor, dim: int, shard: DimShard, group) -> torch.Tensor:
    """Full tensor along `dim` from every rank's shard (padding stripped)."""
    if torch.compiler.is_compiling():
        return traceable.gather_dim(x, dim, shard, group)
    x = x.movedim(dim, 0)
    chunk = shard.chunk
    if x.shape[0] < chunk:
        pad = x.new_zeros((chunk - x.shape[0],) + tuple(x.shape[1:]))
        x = torch.cat([x, pad], 0)
    buf = x.new_empty((chunk * shard.tp_size,) + tuple(x.shape[1:]))
    C.all_gather_into_tensor(buf, x.contiguous(), group)
    if buf.shape[0] == shard.full and _is_identity(shard):
        return buf.movedim(0, dim)  # even split, no padding: already in order
    index = shard.gather_index.to(buf.device)
    return buf.index_select(0, index).movedim(0, dim)


@functools.lru_cache(maxsize=4096)
def _is_identity(shard: DimShard) -> bool:
    """Whether the gather buffer of `shard` is the full dimension in order."""
    pos = 0
    for r, ranges in enumerate(shard.all_ranges):
        if shard.all_lengths[r] != shard.chunk:
            return False
        for off, n in ranges:
            if off != pos:
                return False
            pos += n
        if pos != (r + 1) * shard.chunk:
            return False
    return pos == shard.full


def split_along(x: torch.Tensor, dim: int, shard: DimShard) -> torch.Tensor:
    """This rank's shard of a full tensor along `dim` (padding zero-filled)."""
    pieces = [x.narrow(dim, off, n) for off, n in shard.ranges]
    pad = shard.length - shard.real
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        pieces.append(x.new_zeros(shape))
    if len(pieces) == 1:
        return pieces[0].contiguous()
    return torch.cat(pieces, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        # The incoming gradient is usually a fresh buffer (the column-parallel
        # matmul's dX); when autograd hands the same tensor to another input
        # too (an add's backward), _reduce copies it.
        return _reduce(grad, ctx.comm), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, shard, group):
        ctx.dim, ctx.shard, ctx.group = dim, shard, group
        return split_along(x, dim, shard)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.dim, ctx.shard, ctx.group), None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, shard, group):
        ctx.dim, ctx.shard = dim, shard
        return gather_along(x, dim, shard, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.dim, ctx.shard), None, None, None


class _SyncReplicatedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dim, shard, group):
        ctx.dim, ctx.shard, ctx.group = dim, shard, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        # Every rank scatters its gradient into a zero full-size buffer at its
        # rows; the sum over the group is then, at each row, the sum over the
        # ranks that hold that row.
        shard, dim = ctx.shard, ctx.dim
        g = grad.movedim(dim, 0)
        full = g.new_zeros((shard.full,) + tuple(g.shape[1:]))
        pos = 0
        for off, n in shard.ranges:
            full[off:off + n] += g[pos:pos + n]
            pos += n
        C.all_reduce(full, ctx.group)
        out = torch.cat([full[off:off + n] for off, n in shard.ranges], 0)
        return out.movedim(0, dim), None, None, None


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a parallel region from a replicated one: identity forward,
    all-reduce of the gradient backward (each rank contributed a partial dX)."""
    if torch.compiler.is_compiling():
        return traceable.copy_to_tp_region(x, group)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x  # no gradient will flow back: nothing to do either way
    comm = parallel_communicator(x, group)
    if comm is None:
        return x
    return _CopyToTP.apply(x, comm)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a parallel region by summing partial results: all-reduce forward,
    identity backward.

    `x` is consumed, as in Megatron: it is reduced in place (and returned)
    when nothing else can read its memory -- no tensor saved for backward, no
    view, no other handle (see `_overwritable`), as for a fresh activation
    such as a matmul output -- and into one copy otherwise.  Gradients are
    those of a sum over ranks either way (see `_reduce`).  Under torch.compile:
    out of place (distributed/traceable.py)."""
    if torch.compiler.is_compiling():
        return traceable.reduce_from_tp_region(x, group)
    comm = parallel_communicator(x, group)
    if comm is None:
        return x
    return _reduce(x, comm)


def scatter_to_tp_region(x: torch.Tensor, dim: int, shard: DimShard, group=None) -> torch.Tensor:
    """Keep this rank's slice of `dim` forward; all-gather the gradient backward."""
    if shard.tp_size == 1:
        return x
    return _ScatterToTP.apply(x, dim, shard, group)


def gather_from_tp_region(x: torch.Tensor, dim: int, shard: DimShard, group=None) -> torch.Tensor:
    """All-gather the shards of `dim` into the full tensor forward (uneven and
    padded shards reassembled); keep this rank's slice of the gradient backward."""
    if shard.tp_size == 1 and shard.real == shard.full and shard.length == shard.full:
        return x
    return _GatherFromTP.apply(x, dim, shard, group)


def sync_replicated_grad(w: torch.Tensor, dim: int, shard: DimShard, group=None) -> torch.Tensor:
    """Identity forward; backward, sums the gradient of rows held by several
    ranks (KV heads replicated when there are fewer KV heads than ranks)."""
    if not shard.replicated:
        return w
    return _SyncReplicatedGrad.apply(w, dim, shard, group)
