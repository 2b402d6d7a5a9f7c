"""Rank-side checks of the parallel layers, region operators and collectives
(tests/test_layers.py, test_kernels.py): each function runs on every rank of
the pool."""
from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

from checks import parity


def dropout_masks(ctx):
    from shardformer.layer import DropoutForParallelInput, DropoutForReplicatedInput

    rep = DropoutForReplicatedInput.from_native_module(torch.nn.Dropout(0.5), ctx.group)
    par = DropoutForParallelInput.from_native_module(torch.nn.Dropout(0.5), ctx.group)
    x = torch.ones(4096)
    torch.manual_seed(ctx.rank)  # global RNG differs per rank and must not matter to the masks
    state = torch.get_rng_state()
    r1, r2, p1 = rep(x), rep(x), par(x)
    # each call takes one draw of torch's generator (the key a checkpoint's recomputation finds its
    # step by), and only one: the masks come from the module's own generator
    probe = torch.get_rng_state()
    torch.set_rng_state(state)
    for _ in range(3):
        torch.randint(0, 2**62, (1,))
    assert torch.equal(torch.get_rng_state(), probe), "dropout drew more than one number per call"
    rep.eval()
    assert torch.equal(rep(x), x)
    gathered_r = [torch.empty_like(r1) for _ in range(ctx.tp_size)]
    gathered_p = [torch.empty_like(p1) for _ in range(ctx.tp_size)]
    torch.distributed.all_gather(gathered_r, r1, group=ctx.group)
    torch.distributed.all_gather(gathered_p, p1, group=ctx.group)
    assert all(torch.equal(g, gathered_r[0]) for g in gathered_r), "replicated masks differ across ranks"
    assert not any(torch.equal(gathered_p[0], g) for g in gathered_p[1:]), "parallel masks equal across ranks"
    assert not torch.equal(r1, r2), "mask did not advance between calls"
    kept = (r1 != 0).float().mean().item()
    assert 0.45 < kept < 0.55, kept
    assert set(r1.unique().tolist()) <= {0.0, 2.0}
    return kept


def cross_entropy_matches(ctx, vocab: int, smoothing: float, reduction: str, dtype_name: str = "float32"):
    from shardformer.layer import VocabParallelLMHead1D, cross_entropy_1d

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, vocab, bias=False).to(dtype)
    head = VocabParallelLMHead1D.from_native_module(copy.deepcopy(lin), ctx.group, gather_output=False,
                                                    make_vocab_size_divisible_by=4)
    x = torch.randn(3, 5, 16, dtype=dtype)
    labels = torch.randint(0, vocab, (3, 5))
    labels[0, :2] = -100
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = cross_entropy_1d(head(x1), labels, vocab_size=vocab, label_smoothing=smoothing, reduction=reduction,
                            process_group=ctx.group)
    ref = F.cross_entropy(lin(x2).flatten(0, 1).float(), labels.flatten(), label_smoothing=smoothing,
                          reduction=reduction)
    if reduction == "none":
        ref = ref.view(3, 5)
    tol = parity.TOL[dtype]
    parity.assert_close("loss", loss, ref, tol)
    (loss.sum() if reduction == "none" else loss).backward()
    (ref.sum() if reduction == "none" else ref).backward()
    parity.assert_close("dx", x1.grad, x2.grad, tol)
    from shardformer.layer.parallel_module import shard_of

    parity.assert_close("dW", head.weight.grad, shard_of(lin.weight.grad, 0, head.shard), tol)
    return float(loss.detach().sum())


def mappings_round_trip(ctx):
    """gather/scatter over uneven, fused and padded layouts invert each other,
    forward and backward."""
    from shardformer.distributed import gather_from_tp_region, scatter_to_tp_region
    from shardformer.layout import Fused, Heads, Split, Vocab

    kv = 3 if ctx.tp_size == 3 else 2
    specs = [(Split(), 11), (Split(3), 15), (Heads(6, kv, 4).qkv, 24 + 8 * kv), (Vocab(4), 37), (Fused.equal(2), 14)]
    for spec, n in specs:
        shard = spec.resolve(n, ctx.tp_size, ctx.rank)
        full = torch.arange(2 * n, dtype=torch.float32).view(2, n).requires_grad_()
        local = scatter_to_tp_region(full, -1, shard, ctx.group)
        assert local.shape[-1] == shard.length
        back = gather_from_tp_region(local, -1, shard, ctx.group)
        assert torch.equal(back, full.detach()), (spec, back, full)
        (back * torch.arange(2 * n, dtype=torch.float32).view(2, n)).sum().backward()
        # d/dfull = weights, gathered from every rank's slice
        assert torch.equal(full.grad, torch.arange(2 * n, dtype=torch.float32).view(2, n)), spec
    return True


def collectives_match(ctx):
    from shardformer import distributed as D

    r, n = ctx.rank, ctx.tp_size
    t = torch.full((5,), float(r + 1))
    D.all_reduce(t, ctx.group)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) / 2)))
    m = torch.tensor([float(r)])
    D.all_reduce(m, ctx.group, op="max")
    assert m.item() == n - 1
    out = torch.empty(3 * n)
    D.all_gather_into_tensor(out, torch.full((3,), float(r)), ctx.group)
    assert torch.equal(out, torch.arange(n).float().repeat_interleave(3))
    rs = torch.empty(2)
    D.reduce_scatter_tensor(rs, torch.arange(2 * n, dtype=torch.float32), ctx.group)
    assert torch.equal(rs, torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) * n)
    b = torch.full((4,), float(r))
    D.broadcast(b, 1, ctx.group)
    assert torch.equal(b, torch.ones(4))
    if r == 0:
        D.send(torch.arange(4.0), 1, ctx.group)
    elif r == 1:
        got = D.recv(torch.empty(4), 0, ctx.group)
        assert torch.equal(got, torch.arange(4.0))
    # CPU ranks of one host share a segment: the C shared-memory backend serves them
    assert D.backend_for(t, ctx.group) == ("torch" if os.environ.get("SHARDFORMER_COMM") == "torch" else "shm")
    return True


def sequence_region_pair(ctx):
    from shardformer.distributed import gather_from_sequence_region, reduce_scatter_to_sequence_region

    n = ctx.tp_size
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(ctx.rank)).requires_grad_()
    full = gather_from_sequence_region(x, 1, ctx.group)
    assert full.shape == (2, 3 * n, 4)
    assert torch.equal(full[:, 3 * ctx.rank:3 * ctx.rank + 3], x.detach())
    back = reduce_scatter_to_sequence_region(full, 1, ctx.group)
    assert torch.allclose(back, x.detach() * n)
    back.sum().backward()
    # Backward: reduce-scatter's backward all-gathers the ones of every rank,
    # all-gather's backward reduce-scatters them: n on every element of x.
    assert torch.equal(x.grad, torch.full_like(x, float(n))), x.grad
    return True
