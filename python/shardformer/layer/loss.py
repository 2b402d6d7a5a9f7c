"""cross_entropy_1d: cross-entropy over vocabulary-sharded logits.

Logits z [N, V] are split by columns: rank i holds z[:, V_i] for its
vocabulary rows V_i (plus padding columns, which are ignored).  Without
gathering z:

    m     = max over ranks of max_j z_j              (all-reduce max)
    S     = sum over ranks of sum_j exp(z_j - m)     (all-reduce sum)
    z_y   = the target logit, from the rank that holds y (all-reduce sum)
    loss  = log S - (z_y - m)

Label smoothing eps mixes in the mean log-probability over the *global*
vocabulary V (all-reduce of the local sums of z), not the local shard:

    loss = (1 - eps) * nll + eps * (log S + m - mean_j z_j)

Backward writes softmax - target into the local shard: d z_j =
g * (p_j - (1 - eps) [j == y] - eps / V) for real columns, 0 for padding.
"""
from __future__ import annotations

import torch

from ..distributed import collectives as C


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_real, vocab_size, ignore_index,
                label_smoothing, reduction, group):
        z = logits.float()
        local_v = z.shape[-1]
        real = z[..., :vocab_real]
        m = real.max(dim=-1).values if vocab_real > 0 else z.new_full(z.shape[:-1], float("-inf"))
        C.all_reduce(m, group, op="max")
        shifted = real - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group)

        ignored = labels == ignore_index
        local_label = labels - vocab_start
        mine = (local_label >= 0) & (local_label < vocab_real) & ~ignored
        safe = local_label.clamp(0, max(vocab_real - 1, 0))
        target = torch.where(mine, shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) if vocab_real
                             else torch.zeros_like(m), torch.zeros_like(m))
        C.all_reduce(target, group)
        log_s = sum_exp.log()
        loss = log_s - target
        if label_smoothing > 0:
            sum_shifted = shifted.sum(dim=-1)
            C.all_reduce(sum_shifted, group)
            smooth = log_s - sum_shifted / vocab_size
            loss = (1 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss.masked_fill(ignored, 0.0)
        count = (~ignored).sum()

        softmax = torch.zeros_like(z)
        softmax[..., :vocab_real] = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe, mine, ignored, count)
        ctx.vocab_real, ctx.vocab_size, ctx.eps = vocab_real, vocab_size, label_smoothing
        ctx.reduction, ctx.dtype, ctx.local_v = reduction, logits.dtype, local_v
        if reduction == "mean":
            return loss.sum() / count.clamp(min=1)
        if reduction == "sum":
            return loss.sum()
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, safe, mine, ignored, count = ctx.saved_tensors
        eps = ctx.eps
        g = softmax
        if ctx.vocab_real:
            onehot = torch.zeros_like(g)
            onehot.scatter_(-1, safe.unsqueeze(-1), mine.unsqueeze(-1).to(g.dtype))
            g[..., :ctx.vocab_real] -= (1 - eps) * onehot[..., :ctx.vocab_real] + eps / ctx.vocab_size
        g = g.masked_fill(ignored.unsqueeze(-1), 0.0)
        if ctx.reduction == "mean":
            g = g * (grad / count.clamp(min=1))
        elif ctx.reduction == "sum":
            g = g * grad
        else:
            g = g * grad.unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None, None, None, None


def cross_entropy_1d(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, *,
                     vocab_size: int, vocab_start: int | None = None, ignore_index: int = -100,
                     label_smoothing: float = 0.0, reduction: str = "mean",
                     process_group=None) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary (see the module doc).

    `vocab_parallel_logits` [..., V_local] is this rank's shard as produced by
    VocabParallelLMHead1D(gather_output=False): rows [vocab_start,
    vocab_start + V_local) of the padded vocabulary, of which those below
    `vocab_size` are real.  `vocab_start` defaults to rank * V_local.
    Equals F.cross_entropy on the gathered, unpadded logits.
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
                                            process_group)
