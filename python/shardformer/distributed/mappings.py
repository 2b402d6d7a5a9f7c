"""The region operators: every collective that autograd sees, as a conjugate pair.

Tensor-parallel layers move activations between three kinds of region:
replicated (every rank holds the whole tensor), parallel (each rank holds a
slice of the last dimension) and, with sequence parallelism, sequence-split.
Each operator below is named after the transition it makes and does one
collective forward and its conjugate backward:

    operator                            forward            backward
    copy_to_tp_region                   identity           all-reduce
    reduce_from_tp_region               all-reduce         identity
    scatter_to_tp_region                keep own slice     all-gather
    gather_from_tp_region               all-gather         keep own slice
    gather_from_sequence_region         all-gather (seq)   reduce-scatter (seq)
    reduce_scatter_to_sequence_region   reduce-scatter     all-gather (seq)
    sync_replicated_grad                identity           sum grads over ranks
                                                           that hold the same rows
    all_to_all_along                    all-to-all         all-to-all, the two
                                        (scatter one dim,  dims swapped
                                        gather another)

Slices follow a `DimShard`, so uneven splits, padding and fused layouts
gather back to exactly the full tensor.
"""
from __future__ import annotations

import functools

import torch

from ..layout import DimShard
from . import collectives as C
from . import traceable
from .communicator import parallel_communicator

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


def _gather_dim(x: torch.Tensor, dim: int, shard: DimShard, group) -> torch.Tensor:
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


def _split_dim(x: torch.Tensor, dim: int, shard: DimShard) -> torch.Tensor:
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
        return _split_dim(x, dim, shard)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.dim, ctx.shard, ctx.group), None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, shard, group):
        ctx.dim, ctx.shard = dim, shard
        return _gather_dim(x, dim, shard, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, ctx.dim, ctx.shard), None, None, None


def _even_chunks(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence dimension {dim} of length {x.shape[dim]} is not divisible by "
            f"the tensor-parallel size {n}"
        )


def _all_gather_seq(x, dim, group):
    n = C.world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    buf = x0.new_empty((x0.shape[0] * n,) + tuple(x0.shape[1:]))
    C.all_gather_into_tensor(buf, x0, group)
    return buf.movedim(0, dim)


def _reduce_scatter_seq(x, dim, group):
    n = C.world_size(group)
    _even_chunks(x, dim, n)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // n,) + tuple(x0.shape[1:]))
    C.reduce_scatter_tensor(out, x0, group)
    return out.movedim(0, dim)


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.dim, ctx.group), None, None


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


def gather_from_sequence_region(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Sequence-split -> replicated: all-gather along `dim` forward,
    reduce-scatter of the gradient backward."""
    if C.world_size(group) == 1:
        return x
    return _GatherFromSeq.apply(x, dim, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Partial sums -> sequence-split: reduce-scatter along `dim` forward,
    all-gather of the gradient backward."""
    if C.world_size(group) == 1:
        return x
    return _ReduceScatterToSeq.apply(x, dim, group)


def sync_replicated_grad(w: torch.Tensor, dim: int, shard: DimShard, group=None) -> torch.Tensor:
    """Identity forward; backward, sums the gradient of rows held by several
    ranks (KV heads replicated when there are fewer KV heads than ranks)."""
    if not shard.replicated:
        return w
    return _SyncReplicatedGrad.apply(w, dim, shard, group)


# ---- all-to-all between two dimensions (Ulysses sequence parallelism) ----------------

def _a2a_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> tuple[int, int]:
    """The two dimensions, normalized against x's rank (ValueError when out of range)."""
    nd = x.dim()
    for name, d in (("scatter_dim", scatter_dim), ("gather_dim", gather_dim)):
        if not -nd <= d < nd:
            raise ValueError(f"all_to_all_along: {name}={d} is out of range for a tensor of shape "
                             f"{tuple(x.shape)} ({nd} dimensions)")
    return scatter_dim % nd, gather_dim % nd


def _a2a(x: torch.Tensor, scatter_dim: int, gather_dim: int, comm) -> torch.Tensor:
    """One all_to_all_single: cut `scatter_dim` into p chunks (chunk j to rank j),
    concatenate the p received chunks along `gather_dim` in rank order.

    The send buffer is x with `scatter_dim` unflattened into (p, chunk) and the
    p moved to the front (one copy); what comes back has the sender's rank in
    front, which is moved to just before `gather_dim` and flattened into it
    (one more copy, none when gather_dim is 0)."""
    p = comm.size
    chunk = x.shape[scatter_dim] // p
    send = x.unflatten(scatter_dim, (p, chunk)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, comm):
        ctx.dims, ctx.comm = (scatter_dim, gather_dim), comm
        return _a2a(x, scatter_dim, gather_dim, comm)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        # The forward is a permutation of elements across ranks; its adjoint
        # is the inverse permutation: the same exchange with the dims swapped.
        return _a2a(grad, gather_dim, scatter_dim, ctx.comm), None, None, None


def all_to_all_along(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Ulysses' exchange: cut `scatter_dim` of `x` into p equal chunks (p: the
    group's size), send chunk j to group rank j, and concatenate the p chunks
    received along `gather_dim`, in rank order.  Backward: the same exchange
    with the two dims swapped.

    E.g. q of shape [B, H, S/p, D] (sequence-split), scatter_dim=1 (heads),
    gather_dim=2 (sequence) -> [B, H/p, S, D] (head-split); and back with
    scatter_dim=2, gather_dim=1.  One all_to_all_single per call, on a
    contiguous [p, ...] copy of x.  A group of one rank: x itself.  ValueError,
    before anything is sent, when a dim is out of range or x.shape[scatter_dim]
    is not a multiple of p."""
    scatter_dim, gather_dim = _a2a_dims(x, scatter_dim, gather_dim)
    compiling = torch.compiler.is_compiling()
    comm = None if compiling else parallel_communicator(x, group)
    size = traceable.size_of(group) if compiling else 1 if comm is None else comm.size
    if size == 1:
        return x
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"all_to_all_along: scatter_dim={scatter_dim} of length {x.shape[scatter_dim]} "
            f"(shape {tuple(x.shape)}, gather_dim={gather_dim}) is not divisible by the group "
            f"size {size}")
    if compiling:
        return traceable.all_to_all_along(x, scatter_dim, gather_dim, group)
    return _AllToAll.apply(x, scatter_dim, gather_dim, comm)
