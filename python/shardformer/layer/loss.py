"""cross_entropy_1d: cross-entropy over vocabulary-sharded logits.

Logits z [N, V] are split by columns: rank i holds z[:, V_i] for its
vocabulary rows V_i (plus padding columns, which are ignored).  Without
gathering z, each rank reads its shard once for, per row,

    m_i   = max_{j in V_i} z_j
    s_i   = sum_{j in V_i} exp(z_j - m_i)      (the sum-exp at its own max)
    t_i   = z_y if y is in V_i, else 0
    u_i   = sum_{j in V_i} z_j                 (only with label smoothing)

and ONE all-gather per step brings every rank's (m_i, s_i, t_i[, u_i]) to
every rank, which combines them locally, in rank order:

    m     = max_i m_i
    S     = sum_i s_i exp(m_i - m)             (= sum_j exp(z_j - m); a rank
                                                with no real column has
                                                m_i = -inf, s_i = 0: adds 0)
    z_y   = sum_i t_i                          (one rank holds y)
    loss  = log S - (z_y - m)

Every rank combines the same gathered numbers in the same order, so every
rank gets bit-identical statistics.  (Two all-reduces would do it too: the
max first, then the sums rescaled to it; the gather needs one round trip
for the same bytes sent per rank.)

Label smoothing eps mixes in the mean log-probability over the *global*
vocabulary V (sum_i u_i), not the local shard:

    loss = (1 - eps) * nll + eps * (log S + m - mean_j z_j)

Backward writes softmax - target into the local shard: d z_j =
g * (p_j - (1 - eps) [j == y] - eps / V) for real columns, 0 for padding.
"""
from __future__ import annotations

import torch

from .. import ops
from ..distributed import collectives as C


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: the C kernel reads each row of the shard once for its local
    max, sum-exp, target logit (and sum of logits when smoothing); one
    all-gather of those k = 3 (4) floats per row brings every rank's to all,
    and combine_stats reduces them locally (see the module doc).
    Backward: the C kernel writes g * (softmax - (1-eps) onehot - eps/V) for
    the real columns and 0 for padding into one new tensor, the gradient (or
    into the logits themselves with inplace_backward); only the logits and a
    float per row are kept in between."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_real, vocab_size, ignore_index,
                label_smoothing, reduction, group, inplace):
        # the kernels (C on CPU, CUDA on a GPU with shardformer._cuda built), else torch ops
        kernels = logits.device.type == "cpu" or ops.fused_input(logits)
        z = ops._data(logits, "cross_entropy_1d logits") if kernels else logits.detach().contiguous()
        local_v = z.shape[-1]
        z2 = z.reshape(-1, local_v)
        y = (ops._ids(labels, "cross_entropy_1d labels").to(z.device) if kernels
             else labels.detach().to(device=z.device, dtype=torch.int64).contiguous()).reshape(-1)
        eps = float(label_smoothing)
        # labels are the same on every rank: each checks them locally (IndexError), no collective
        stats = ops.xent_stats if kernels else torch_xent_stats
        mx, se, tg, sz = stats(z2, y, vocab_start, vocab_real, ignore_index, eps > 0, vocab_size=vocab_size)
        lse, z_y, sum_z = combine_stats(gather_stats(mx, se, tg, sz, group))
        loss = lse - z_y
        if eps > 0:
            loss = (1 - eps) * loss + eps * (lse - sum_z / vocab_size)
        ignored = y == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        count = (~ignored).sum()
        ctx.save_for_backward(z2, y, lse, ignored, count)
        ctx.args = (vocab_start, vocab_real, vocab_size, ignore_index, eps, reduction)
        ctx.shape = logits.shape
        # in place only into the caller's own memory (not a contiguous copy of it)
        ctx.inplace = inplace and z2.data_ptr() == logits.data_ptr() and logits.dtype == z2.dtype
        if reduction == "mean":
            return loss.sum() / count.clamp(min=1)
        if reduction == "sum":
            return loss.sum()
        return loss.reshape(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        z2, y, lse, ignored, count = ctx.saved_tensors
        vocab_start, vocab_real, vocab_size, ignore_index, eps, reduction = ctx.args
        grad = grad.detach().float()
        if reduction == "mean":
            scale = (grad / count.clamp(min=1)).expand(y.shape)
        elif reduction == "sum":
            scale = grad.expand(y.shape)
        else:
            scale = grad.reshape(-1)
        scale = scale.masked_fill(ignored, 0.0).contiguous()
        grad_fn = ops.xent_grad if z2.device.type == "cpu" or ops.fused_input(z2) else torch_xent_grad
        g = grad_fn(z2, y, vocab_start, vocab_real, ignore_index, lse, scale, eps, vocab_size,
                    out=z2 if ctx.inplace else None)
        return g.reshape(ctx.shape), None, None, None, None, None, None, None, None, None


def gather_stats(mx, se, tg, sz, group) -> torch.Tensor:
    """Every rank's per-row statistics, [p, k, rows] (k = 3, or 4 with the
    logit sums sz), in rank order: ONE all-gather of this rank's [k, rows]."""
    local = torch.stack([mx, se, tg] + ([sz] if sz is not None else []))
    p = C.world_size(group)
    if p == 1:
        return local.unsqueeze(0)
    out = local.new_empty((p * local.shape[0], local.shape[1]))
    C.all_gather_into_tensor(out, local, group)
    return out.view(p, *local.shape)


def combine_stats(stats: torch.Tensor):
    """(lse, z_y, sum_z or None) per row from gather_stats' [p, k, rows]:
    m = max_i m_i, lse = m + log sum_i s_i exp(m_i - m), z_y = sum_i t_i,
    sum_z = sum_i u_i (the module doc).  exp(m_i - m) is 0 for a rank whose
    shard has no real column (m_i = -inf, s_i = 0); m itself is finite
    whenever some rank holds a real column."""
    mx, se, tg = stats[:, 0], stats[:, 1], stats[:, 2]
    m = mx.amax(dim=0)
    lse = m + (se * torch.exp(mx - m)).sum(dim=0).log()
    return lse, tg.sum(dim=0), stats[:, 3].sum(dim=0) if stats.shape[1] > 3 else None


# The same halves in torch ops, for logits on a device no kernel runs on (CUDA
# in a build without shardformer._cuda): same arguments, same results as
# ops.xent_stats / xent_grad.

def torch_xent_stats(z2, y, vocab_start: int, vocab_real: int, ignore_index: int, need_sumz: bool,
                     vocab_size: int | None = None):
    if vocab_size is not None:
        bad = (y != ignore_index) & ((y < 0) | (y >= vocab_size))
        if bool(bad.any()):
            raise IndexError(f"cross_entropy_1d: label {int(y[bad][0])} is outside [0, {vocab_size}) "
                             f"and is not ignore_index ({ignore_index})")
    rows = z2.shape[0]
    real = z2[:, :vocab_real].float()
    if vocab_real == 0:
        mx = torch.full((rows,), float("-inf"), device=z2.device)
        se = torch.zeros(rows, device=z2.device)
    else:
        mx = real.max(dim=-1).values
        se = torch.exp(real - mx[:, None]).sum(dim=-1)
    local = y - vocab_start
    inside = (local >= 0) & (local < vocab_real) & (y != ignore_index)
    tg = torch.zeros(rows, device=z2.device)
    if vocab_real > 0:
        picked = real.gather(1, local.clamp(0, vocab_real - 1)[:, None]).squeeze(1)
        tg = torch.where(inside, picked, tg)
    sz = real.sum(dim=-1) if need_sumz else None
    return mx, se, tg, sz


def torch_xent_grad(z2, y, vocab_start: int, vocab_real: int, ignore_index: int, lse, scale, eps: float,
                    vocab: int, out=None):
    g = torch.zeros(z2.shape, dtype=torch.float32, device=z2.device)
    if vocab_real > 0:
        s = scale.float()[:, None]
        g[:, :vocab_real] = s * (torch.exp(z2[:, :vocab_real].float() - lse[:, None]) - eps / vocab)
        local = y - vocab_start
        inside = (local >= 0) & (local < vocab_real) & (y != ignore_index)
        rows = inside.nonzero().squeeze(1)
        g[rows, local[rows]] -= (1 - eps) * scale.float()[rows]
    if out is None:
        return g.to(z2.dtype)
    out.copy_(g)
    return out


def cross_entropy_1d(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, *,
                     vocab_size: int, vocab_start: int | None = None, ignore_index: int = -100,
                     label_smoothing: float = 0.0, reduction: str = "mean",
                     process_group=None, inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary (see the module doc).

    `vocab_parallel_logits` [..., V_local] is this rank's shard as produced by
    VocabParallelLMHead1D(gather_output=False): rows [vocab_start,
    vocab_start + V_local) of the padded vocabulary, of which those below
    `vocab_size` are real.  `vocab_start` defaults to rank * V_local.
    Equals F.cross_entropy on the gathered, unpadded logits, including its
    IndexError for a label outside [0, vocab_size) other than ignore_index.

    inplace_backward=True writes the gradient into the logits' own memory
    instead of a new tensor (saving one logits-sized buffer); the logits must
    not be read after backward (true for logits that only feed this loss).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if labels.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but logits have "
                         f"{tuple(vocab_parallel_logits.shape)}; expected labels of shape logits.shape[:-1]")
    local_v = vocab_parallel_logits.shape[-1]
    if vocab_start is None:
        vocab_start = C.rank(process_group) * local_v if C.world_size(process_group) > 1 else 0
    vocab_real = max(0, min(local_v, vocab_size - vocab_start))
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, labels, vocab_start, vocab_real,
                                            vocab_size, ignore_index, label_smoothing, reduction,
                                            process_group, bool(inplace_backward))
