"""Sequence regions: a sequence split over the ranks of a group <-> the full sequence.

Notation: a tensor with the sequence along `dim` (S rows), p ranks, rank r.
A split sequence is padded with zero rows to S' (a multiple of p, of 2p for
ring attention's zigzag) and rank r holds `rows_r` of the padded sequence
(SequenceRows: the contiguous block [r S'/p, (r+1) S'/p) unless given).

    operator                            forward                      backward
    split_sequence_rows                 pad, keep rows_r             all-gather, rows put in place,
                                                                     padding dropped
    gather_sequence_rows                all-gather, rows put in      pad, keep rows_r of the
                                        place, padding dropped       (replicated) gradient
    keep_sequence_rows                  pad, keep rows_r (of a       rows_r of the gradient, zeros
                                        tensor that may differ       elsewhere (a partial gradient:
                                        per rank)                    the sum comes upstream)
    gather_from_sequence_region         all-gather along dim         reduce-scatter along dim
    reduce_scatter_to_sequence_region   reduce-scatter along dim     all-gather along dim
    reduce_scatter_rows                 pad, reduce-scatter along    all-gather along the tokens,
                                        the tokens (dim 1 of         padding dropped
                                        [B, S, H], 0 of [B*S, H])

The first two carry values that are the same on every rank on their full
side (their gradient too); the last three carry partial sums: the gradient
reaching gather_from_sequence_region's output, the value entering
reduce_scatter_*.  layer/sequence.py names each pair of layouts a module's
input or output moves between (SequenceLayout) and picks the operator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import collectives as C

SEQ_DIM = 1


def _even_chunks(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence dimension {dim} of length {x.shape[dim]} is not divisible by "
            f"the tensor-parallel size {n}"
        )


def all_gather_even(x, dim, group):
    """The n equal parts of every rank's `x` concatenated along `dim` in
    rank order ([.., s, ..] -> [.., n s, ..]; no padding dropped)."""
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
        return all_gather_even(x, dim, group)

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
        return all_gather_even(grad, ctx.dim, ctx.group), None, None



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


def pad_to(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """x padded with zero rows along `dim` to `length` rows (x itself when it has as many)."""
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra])


def padded_length(length: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that holds `length` rows."""
    return -(-length // multiple) * multiple


@dataclass(frozen=True, eq=False)
class SequenceRows:
    """Which rows of a split sequence this rank holds: the `length` real
    rows along `dim`, padded to `padded`; `rows`, this rank's rows of the
    padded sequence (None: the contiguous block r * padded/p ...), and
    `order`, every rank's rows in all-gather order (None: the all-gather is
    the sequence in order).  Frozen: an autograd function keeps the layout
    of its own forward (the model's state moves on with the next one)."""

    group: object
    length: int
    padded: int
    dim: int = SEQ_DIM
    rows: torch.Tensor | None = None
    order: torch.Tensor | None = None

    @classmethod
    def even(cls, group, length: int, dim: int = SEQ_DIM) -> "SequenceRows":
        """Contiguous blocks of the sequence padded to a multiple of the group's size."""
        return cls(group, length, padded_length(length, C.world_size(group)), dim)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor (padding rows zero-filled)."""
        x = pad_to(x, self.padded, self.dim)
        if self.rows is not None:
            return x.index_select(self.dim, self.rows)
        chunk = self.padded // C.world_size(self.group)
        return x.narrow(self.dim, C.rank(self.group) * chunk, chunk).contiguous()

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows all-gathered and put in sequence order: the
        padded sequence (padded rows along dim)."""
        gathered = all_gather_even(x.contiguous(), self.dim, self.group)
        if self.order is None:
            return gathered
        return torch.empty_like(gathered).index_copy_(self.dim, self.order, gathered)

    def in_sequence(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's rows in all-gather order (padded) -> the `length`
        real rows in sequence order; differentiable (index_select: the
        gradient goes back to the gathered positions, zeros to the padding)."""
        if self.order is None:
            return gathered.narrow(self.dim, 0, self.length)
        where = torch.argsort(self.order.to(gathered.device))[:self.length]
        return gathered.index_select(self.dim, where)

    def in_gather_order(self, full: torch.Tensor) -> torch.Tensor:
        """The inverse of in_sequence: the `length` rows in sequence order ->
        padded with zero rows and put in all-gather order, so a reduce-scatter
        along `dim` leaves each rank its own rows; differentiable."""
        full = pad_to(full, self.padded, self.dim)
        return full if self.order is None else full.index_select(self.dim, self.order.to(full.device))


def segment_rows(group, lengths: tuple[int, ...], dim: int = SEQ_DIM) -> SequenceRows:
    """A sequence made of consecutive segments (BLIP-2's Q-Former: [queries;
    text]) with each segment split over the group on its own: segment k of
    length L_k is padded to p * c_k rows (c_k = ceil(L_k / p)) and rank r
    holds rows [r c_k, (r+1) c_k) of each, the segments one after the other.
    The padded sequence is the real rows in order, then every padding row,
    so its first sum(L_k) rows are the sequence.  With one segment (or all
    others empty) this is SequenceRows.even."""
    p, r = C.world_size(group), C.rank(group)
    total = sum(lengths)
    nonempty = [n for n in lengths if n]
    if len(nonempty) <= 1:
        return SequenceRows.even(group, total, dim)
    start, pad_at = 0, total                        # padding rows take the positions after the sequence
    chunks = [padded_length(n, p) // p for n in lengths]
    positions = [[] for _ in range(p)]
    for n, c in zip(lengths, chunks):
        for q in range(p):
            for i in range(q * c, (q + 1) * c):
                if i < n:
                    positions[q].append(start + i)
                else:
                    positions[q].append(pad_at)
                    pad_at += 1
        start += n
    order = torch.tensor([i for rows in positions for i in rows], dtype=torch.long)
    return SequenceRows(group, total, pad_at, dim, rows=torch.tensor(positions[r], dtype=torch.long), order=order)


class _SplitRows(torch.autograd.Function):
    """Forward: pad, keep this rank's rows.  Backward: all-gather the rows'
    gradients into place, drop the padding."""

    @staticmethod
    def forward(ctx, x, rows: SequenceRows):
        ctx.rows = rows
        return rows.local(x)

    @staticmethod
    def backward(ctx, grad):
        rows = ctx.rows
        return rows.full(grad).narrow(rows.dim, 0, rows.length), None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather the rows into place, drop the padding.  Backward:
    this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, rows: SequenceRows):
        ctx.rows = rows
        return rows.full(x).narrow(rows.dim, 0, rows.length)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rows.local(grad), None


def split_sequence_rows(x: torch.Tensor, rows: SequenceRows) -> torch.Tensor:
    """Full sequence, the same on every rank -> this rank's rows (see the table)."""
    return _SplitRows.apply(x, rows)


def gather_sequence_rows(x: torch.Tensor, rows: SequenceRows) -> torch.Tensor:
    """This rank's rows -> the full sequence, the same on every rank (see the table)."""
    return _GatherRows.apply(x, rows)


class _KeepRows(torch.autograd.Function):
    """Forward: a full-sequence tensor (every rank's copy may differ, e.g. a
    dropout mask per rank) -> this rank's rows, padded as SequenceRows.even.
    Backward: the rows' gradient in place, zeros elsewhere (no collective:
    the all-reduce that sums the ranks' rows sits upstream, copy_to_tp_region)."""

    @staticmethod
    def forward(ctx, x, group):
        rows = SequenceRows.even(group, x.shape[SEQ_DIM])
        ctx.length, ctx.padded = rows.length, rows.padded
        ctx.start = C.rank(group) * (rows.padded // C.world_size(group))
        return rows.local(x)

    @staticmethod
    def backward(ctx, grad):
        shape = list(grad.shape)
        shape[SEQ_DIM] = ctx.padded
        full = grad.new_zeros(shape)
        full.narrow(SEQ_DIM, ctx.start, grad.shape[SEQ_DIM]).copy_(grad)
        return full.narrow(SEQ_DIM, 0, ctx.length), None


def keep_sequence_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Full sequence (may differ per rank) -> this rank's rows along dim 1
    (backward: zeros outside them)."""
    return _KeepRows.apply(x, group)


def token_dim(x: torch.Tensor) -> int:
    """The dimension of the tokens: SEQ_DIM of [batch, S, hidden], 0 of rows
    flattened to [batch * S, hidden] (OPT's MLP)."""
    return SEQ_DIM if x.dim() > 2 else 0


class _ReduceScatterDim0(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0 into a fresh tensor (not a view:
    the caller may add to it in place, e.g. Falcon's mlp_output +=).
    Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = C.world_size(group)
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        C.reduce_scatter_tensor(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = C.world_size(ctx.group)
        grad = grad.contiguous()
        full = grad.new_empty((grad.shape[0] * n,) + tuple(grad.shape[1:]))
        C.all_gather_into_tensor(full, grad, ctx.group)
        return full, None


def reduce_scatter_rows(y: torch.Tensor, group) -> torch.Tensor:
    """Partial sums over all tokens -> this rank's rows of their sum, for a
    row-parallel layer that leaves the region itself: padded with zero rows
    to a multiple of p along token_dim(y), reduce-scatter (backward:
    all-gather, padding dropped).  Flattened rows [B * S, hidden] come from
    a [B, S', hidden] tensor already padded (S' = p * rows per rank), so they
    divide p as they are, and reduce-scattering them along dim 0 gives each
    rank back the rows it had (the all-gather before stacked them rank by
    rank): only row-wise layers may run on such flattened rows."""
    n = C.world_size(group)
    if n == 1:
        return y
    dim = token_dim(y)
    rows = y.movedim(dim, 0)                      # a view autograd tracks: the result may be changed in place
    extra = -rows.shape[0] % n
    if extra:
        rows = F.pad(rows, [0, 0] * (rows.dim() - 1) + [0, extra])
    return _ReduceScatterDim0.apply(rows, group).movedim(0, dim)
