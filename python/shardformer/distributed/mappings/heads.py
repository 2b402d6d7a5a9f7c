"""Head regions (Ulysses sequence parallelism): the sequence split <-> the heads split.

    operator            forward                        backward
    all_to_all_along    all-to-all: scatter one dim,   the same all-to-all with the
                        gather another                 two dims swapped
    gather_heads        all-gather along the heads,    this rank's heads of the
                        appended heads and padded      (replicated) gradient, zeros
                        rows / keys dropped            on the padding
"""
from __future__ import annotations

import torch

from .. import collectives as C
from .. import traceable
from ..communicator import parallel_communicator
from .sequence import all_gather_even


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


class _GatherHeads(torch.autograd.Function):
    """Each rank's attention weights [B, H'/p, S', S'] (its heads over the
    whole padded sequence) -> [B, H, S, S]: all-gathered along the heads
    (dim 1), the appended heads beyond `heads` and the padded rows / keys
    beyond `length` dropped.  Backward: this rank's heads of the gradient
    (the same on every rank), zeros on the padding."""

    @staticmethod
    def forward(ctx, w, group, heads, length):
        ctx.group, ctx.local, ctx.shape = group, w.shape[1], tuple(w.shape)
        full = all_gather_even(w.contiguous(), 1, group)
        return full[:, :heads, :length, :length].contiguous()

    @staticmethod
    def backward(ctx, grad):
        b, h, s, _ = grad.shape
        rank = C.rank(ctx.group)
        padded = grad.new_zeros((b, ctx.local * C.world_size(ctx.group), ctx.shape[2], ctx.shape[3]))
        padded[:, :h, :s, :s] = grad
        return padded[:, rank * ctx.local:(rank + 1) * ctx.local].contiguous(), None, None, None


def gather_heads(w: torch.Tensor, group, heads: int, length: int) -> torch.Tensor:
    """all_to_all's per-rank attention weights -> the full [B, heads, length, length] (see the table)."""
    return _GatherHeads.apply(w, group, heads, length)
