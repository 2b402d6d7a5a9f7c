"""A column-parallel linear layer that gathers its input rows itself (the
overlapped all-gather of sequence parallelism), as one autograd function.

    operator                 forward                          backward
    GatherRowsLinear        all-gather the rows (async,      re-gather X (async, during dX),
                             during this rank's own rows'     reduce-scatter dX (async,
                             matmuls), Y_k = X A_k^T + b_k    during the dA_k matmuls)

Linear1D_Col(gather_input=True) and layer/sequence.py's gather_block_input
apply it; the asynchronous calls are the communicator's (async_op=True),
and whether they overlap the matmuls is its `overlaps`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from ..communicator import communicator_for


def start_all_gather(out: torch.Tensor, t: torch.Tensor, group):
    """Start out = the ranks' `t` stacked along dim 0 (both contiguous);
    returns (handle, overlapped): the communicator's async call, which runs
    while this thread computes until handle.wait() where the backend allows
    it (overlapped = the communicator's `overlaps`)."""
    comm = communicator_for(t, group)
    return comm.all_gather_into_tensor(out, t, async_op=True), comm.overlaps


def start_reduce_scatter(out: torch.Tensor, t: torch.Tensor, group):
    """Start out = this rank's dim-0 chunk of the sum over ranks of `t`;
    (handle, overlapped) as start_all_gather."""
    comm = communicator_for(t, group)
    return comm.reduce_scatter_tensor(out, t, async_op=True), comm.overlaps


class GatherRowsLinear(torch.autograd.Function):
    """Linear1D_Col(gather_input=True) on rows laid out along dim 0: X0 is
    this rank's s rows ([s, ..., in]); the output is the first `length` of
    the n * s gathered rows times A_i^T (+ b_i), [length, ..., out_i].  Only
    X0 is saved (see Linear1D_Col for the math).

    Several column layers reading the same input (a Llama block's q/k/v or
    gate/up, gather_block_input) share one gather: `params` is (A_1, b_1,
    A_2, b_2, ...) (b_k None without a bias), the outputs are Y_1, Y_2, ...,
    and backward re-gathers X once and reduce-scatters the one sum
    dX = sum_k dY_k A_k.  `keep_full`: the gathered rows X[:length] come
    first among the outputs (the block hands them to the module, which reads
    their shape; a gradient they receive joins dX).

    overlap=True (ShardConfig.enable_sequence_overlap), on a backend with
    asynchronous collectives (shared memory):
        forward:   the all-gather of the rows runs while this rank's own rows
                   are multiplied (by every A_k); then the other ranks' rows
        backward:  the re-gather of X runs while dX = sum_k dY_k A_k is
                   computed; the reduce-scatter of dX runs while the
                   dA_k = dY_k^T X are computed
    `regathers` counts backward re-gathers, `overlapped` the forward and
    backward passes that ran with collectives in flight (one per pass,
    however many layers share it), `unused` the outputs gather_block_input
    computed that their layer was not asked for (tests read all three)."""

    regathers = 0
    overlapped = 0
    unused = 0

    @staticmethod
    def forward(ctx, x0, conv1d: bool, group, length, overlap: bool, keep_full: bool, *params):
        ctx.set_materialize_grads(False)
        n, r = C.world_size(group), C.rank(group)
        x0 = x0.contiguous()
        s = x0.shape[0]
        length = n * s if length is None else length
        weights, biases = params[0::2], params[1::2]

        def mm(a, weight):
            return a @ weight if conv1d else F.linear(a, weight)

        full = x0.new_empty((n * s,) + tuple(x0.shape[1:]))
        if overlap:
            handle, overlapped = start_all_gather(full, x0, group)
            lo, hi = min(r * s, length), min((r + 1) * s, length)
            ys = []
            for weight in weights:
                out_features = weight.shape[1] if conv1d else weight.shape[0]
                y = x0.new_empty((length,) + tuple(x0.shape[1:-1]) + (out_features,))
                if hi > lo:
                    y[lo:hi] = mm(x0[:hi - lo], weight)      # this rank's rows, while the others' arrive
                ys.append(y)
            handle.wait()
            for y, weight in zip(ys, weights):
                if lo > 0:
                    y[:lo] = mm(full[:lo], weight)
                if hi < length:
                    y[hi:] = mm(full[hi:length], weight)
            GatherRowsLinear.overlapped += int(overlapped)
        else:
            C.all_gather_into_tensor(full, x0, group)
            ys = [mm(full[:length], weight) for weight in weights]
        for y, bias in zip(ys, biases):
            if bias is not None:
                y += bias
        ctx.save_for_backward(x0, *weights)
        ctx.conv1d, ctx.group, ctx.length, ctx.overlap, ctx.keep_full = conv1d, group, length, overlap, keep_full
        ctx.has_bias = [b is not None for b in biases]
        outs = ([full[:length]] if keep_full else []) + ys
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        x0, *weights = ctx.saved_tensors
        group, length, conv1d = ctx.group, ctx.length, ctx.conv1d
        n = C.world_size(group)
        s = x0.shape[0]
        gfull = grads[0] if ctx.keep_full else None
        gys = list(grads[1:] if ctx.keep_full else grads)
        gys = [None if g is None else g.contiguous() for g in gys]
        want_x = ctx.needs_input_grad[0]
        want_w = [ctx.needs_input_grad[6 + 2 * k] and g is not None for k, g in enumerate(gys)]
        overlapped = False
        full = handle_x = None
        if any(want_w):                              # X again, for dA (in flight during dX when overlapping)
            full = x0.new_empty((n * s,) + tuple(x0.shape[1:]))
            if ctx.overlap:
                handle_x, ov = start_all_gather(full, x0, group)
                overlapped |= ov
            else:
                C.all_gather_into_tensor(full, x0, group)
            GatherRowsLinear.regathers += 1
        gx = handle_dx = None
        if want_x:
            dx_full = x0.new_zeros((n * s,) + tuple(x0.shape[1:]))      # padding rows: no gradient
            dx = dx_full[:length]                                       # this rank's share of dX
            if gfull is not None:
                dx += gfull
            for g, weight in zip(gys, weights):
                if g is not None:
                    dx += g @ weight.t() if conv1d else g @ weight
            gx = x0.new_empty(x0.shape)
            if ctx.overlap:
                handle_dx, ov = start_reduce_scatter(gx, dx_full, group)
                overlapped |= ov
            else:
                C.reduce_scatter_tensor(gx, dx_full, group)
        if handle_x is not None:
            handle_x.wait()
        f2 = full[:length].reshape(-1, full.shape[-1]) if full is not None else None
        gparams = []
        for k, (g, weight) in enumerate(zip(gys, weights)):
            gw = gb = None
            if g is not None:
                g2 = g.reshape(-1, g.shape[-1])
                if want_w[k]:                        # dA while the reduce-scatter of dX runs
                    gw = f2.t() @ g2 if conv1d else g2.t() @ f2
                if ctx.has_bias[k] and ctx.needs_input_grad[7 + 2 * k]:
                    gb = g2.sum(0)
            gparams += [gw, gb]
        if handle_dx is not None:
            handle_dx.wait()
        GatherRowsLinear.overlapped += int(overlapped)
        return (gx, None, None, None, None, None, *gparams)
