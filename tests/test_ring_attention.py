"""Ring attention (shardformer.layer.ring_attention): on 2 and 4 ranks, the
zigzag-split forward and the q, k, v gradients equal full attention over the
whole sequence (causal and not, GQA, key padding with a left-padded batch
row, lengths that do not divide 2p, bf16 / fp16, the shm and torch
transports); the counters show one kernel call per ring step and the
skipped causal blocks.  Sliding windows (window=W in global positions, below
a chunk, between a chunk and the sequence, and >= the sequence; causal and
not; fp32 and bf16): the same comparisons, and the counters show the chunk
pairs out of the window's reach skipped and those it cuts masked.  Logit
soft-capping (Gemma 2): the same comparisons against the soft-capped
reference, alone and with windows, padding and half precision.  Attention
dropout: the blocks draw, in forward and backward, exactly the kernel's mask
for the whole padded sequence (ops.attention_dropout_mask), so forward and
gradients equal the float64 reference under that mask; keep rate ~ 1 - p."""
import pytest
import torch

from checks import ring_attention as checks
from shardformer import ops
from shardformer.layer import ring_attention as ra


def test_zigzag_rows_partition():
    assert ra.padded_length_for(7, 2) == 8 and ra.padded_length_for(13, 4) == 16
    assert ra.padded_length_for(16, 4) == 16 and ra.padded_length_for(0, 3) == 0
    assert ra.zigzag_rows(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert ra.zigzag_rows(8, 2, 1).tolist() == [2, 3, 4, 5]
    for p in (1, 2, 3, 4):
        n = 6 * p
        rows = torch.cat([ra.zigzag_rows(n, p, r) for r in range(p)])
        assert sorted(rows.tolist()) == list(range(n))
    with pytest.raises(ValueError, match="multiple of 2p"):
        ra.zigzag_rows(6, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        ra.zigzag_rows(8, 2, 2)


def test_one_rank_is_the_kernel():
    """Without a group of several ranks (torch.distributed not initialized)
    it is one causal kernel call, bit for bit ops.attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 10, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    kp = torch.ones(2, 10, dtype=torch.bool)
    kp[1, :3] = False
    for causal in (True, False):
        g = torch.randn(2, 4, 10, 8, generator=gen)
        o = ra.ring_attention(q, k, v, causal=causal, key_padding=kp)
        o2 = ops.attention(q, k, v, causal=causal, mask=kp)
        assert torch.equal(o, o2)
        for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(o2, (q, k, v), g)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_equals_full(pool, tp, causal):
    for result in pool.run(checks.ring_equals_full, tp, 16 * tp, causal):   # c = 8 rows per chunk
        assert result["backend"] == "shm"
        assert result["calls"]["messages"] == 3 * tp - 2 and result["calls"]["messages_torch"] == 0


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_multi_tile_mha(pool, tp, causal):
    """Chunks longer than the kernel's 64-row tiles; Hq = Hkv."""
    pool.run(checks.ring_equals_full, tp, 200 if tp == 2 else 360, causal, 1, 2, 2, 32)


@pytest.mark.parametrize("tp,S", [(2, 7), (4, 13), (4, 5)])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_lengths_not_dividing(pool, tp, S, causal):
    pool.run(checks.ring_equals_full, tp, S, causal)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_key_padding_left_padded_row(pool, tp, causal):
    pool.run(checks.ring_equals_full, tp, 8 * tp - 3, causal, left_pad=5)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_all_masked_batch_row(pool, causal):
    """A batch row whose every key is padding: output and gradients 0 there
    (every block's lse is +inf), the other row exact."""
    pool.run(checks.ring_equals_full, 4, 13, causal, left_pad=13)


@pytest.mark.parametrize("tp,S", [(2, 7), (4, 13)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bias_batch", [1, 2])
def test_ring_additive_bias(pool, tp, S, causal, bias_batch):
    # T5's relative position bias: the output, q/k/v gradients and the bias gradient (summed over the ranks)
    pool.run(checks.ring_equals_full, tp, S, causal, left_pad=3, bias_batch=bias_batch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_half_precision(pool, dtype, causal):
    pool.run(checks.ring_equals_full, 2, 61, causal, dtype=dtype, left_pad=4)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_ring_torch_transport(pool, tp):
    """SHARDFORMER_COMM=torch: the ring runs on gloo isend / irecv (3 ranks: odd ring)."""
    for causal in (True, False):
        for result in pool.run(checks.ring_equals_full, tp, 12 * tp - 1, causal, left_pad=3, backend="torch"):
            assert result["backend"] == "torch"
            assert result["calls"]["messages_torch"] == result["calls"]["messages"] == 3 * tp - 2


@pytest.mark.parametrize("tp", [2, 3])
def test_ring_torch_p2p_on_shm_group(pool, tp):
    """ring_attention.P2P = "torch": isend / irecv although the group's collectives use shm."""
    for result in pool.run(checks.ring_equals_full, tp, 10 * tp + 1, True, left_pad=3, p2p="torch"):
        assert result["backend"] == "shm"
        assert result["calls"]["messages_torch"] == result["calls"]["messages"] == 3 * tp - 2


def test_ring_odd_ring_shm(pool):
    pool.run(checks.ring_equals_full, 3, 29, True, dtype="bfloat16", left_pad=2)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_ring_on_a_subgroup(pool, backend):
    """Group ranks are not global ranks: the groups of global ranks [1, 3] and [0, 2, 3]."""
    for members in ([1, 3], [0, 2, 3]):
        results = pool.run(checks.ring_on_subgroup, 4, members, backend)
        assert all((res is None) == (r not in members) for r, res in enumerate(results))


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_counters(pool, tp):
    """Causal: per rank and pass, p kernel calls (one per ring step), 2p+1 of
    the 4p (query chunk, key chunk) pairs computed and 2p-1 skipped (b > a);
    over all ranks the 2p(2p+1)/2 pairs of the lower triangle.  Non-causal:
    all 4p, none skipped.  Messages: p-1 K/V hops forward, p-1 K/V and p
    dk/dv hops backward."""
    p = tp
    for causal in (True, False):
        calls = pool.run(checks.ring_counts, tp, causal)
        for c in calls:
            assert c["forward"] == 1 and c["backward"] == 1
            assert c["kernel_forward"] == p and c["kernel_backward"] == p
            blocks, skipped = (2 * p + 1, 2 * p - 1) if causal else (4 * p, 0)
            assert c["blocks"] == 2 * blocks and c["skipped"] == 2 * skipped   # forward + backward
            assert c["messages"] == (p - 1) + (p - 1) + p
        if causal:
            assert sum(c["blocks"] for c in calls) // 2 == (2 * p) * (2 * p + 1) // 2


def test_ring_refusals(pool):
    pool.run(checks.ring_shapes_refused, 2)


# ---- sliding windows ----------------------------------------------------------------

def _window_cases(tp: int, S: int):
    """W below a chunk, between a chunk and the sequence, and >= the sequence."""
    c = ra.padded_length_for(S, tp) // (2 * tp)
    return sorted({1, max(1, c - 1), c, c + 1, 2 * c + 3, S - 1, S, S + 5})


@pytest.mark.parametrize("tp,S", [(2, 16), (2, 7), (4, 32), (4, 13)])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_window_equals_full(pool, tp, S, causal):
    """window=W: the forward and the q, k, v gradients equal the float64
    reference with the sliding-window mask (GQA 4 / 2, key padding with a
    left-padded row, lengths that do not divide 2p)."""
    for W in _window_cases(tp, S):
        pool.run(checks.ring_equals_full, tp, S, causal, window=W, left_pad=3)


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_window_multi_tile(pool, tp):
    """Chunks longer than the kernel's 64-row tiles (c = 50 / 45): windows cut
    inside a chunk and across chunks."""
    S = 200 if tp == 2 else 360
    for W in (37, 70, 130):
        pool.run(checks.ring_equals_full, tp, S, True, 2, 2, 2, 32, window=W, left_pad=9)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_window_bf16(pool, tp, causal):
    S = 16 * tp - 3
    for W in (3, 11, S):
        pool.run(checks.ring_equals_full, tp, S, causal, dtype="bfloat16", window=W, left_pad=4)


def test_ring_window_torch_transport(pool):
    pool.run(checks.ring_equals_full, 3, 29, True, window=6, left_pad=2, backend="torch")


def _expected_pairs(p: int, c: int, W: int, causal: bool):
    """Over all ranks, one pass: (chunk pairs with some visible (query, key)
    row pair, pairs with none, pairs cut by the window off the diagonal)."""
    n = 2 * p
    seen = hidden = cut = 0
    d = torch.arange(c)[:, None] - torch.arange(c)[None, :]
    for a in range(n):
        for b in range(n):
            dist = (a - b) * c + d
            vis = ((dist >= 0) & (dist < W)) if causal else (dist.abs() < W)
            if not bool(vis.any()):
                hidden += 1
            else:
                seen += 1
                cut += int(a != b and not bool(vis.all()))
    return seen, hidden, cut


def _expected_hops(p: int, c: int, W: int, causal: bool):
    """(forward-chain hops kf, backward-chain hops kb) from the global chunk
    grid: the ring offsets s = (r - j) mod p at which some rank r has a
    (query chunk, key chunk) pair with a visible row pair against rank j's
    chunks, covered by the fewest hops (s <= kf or s >= p - kb); the plain
    ring (p - 1, 0) unless that saves hops."""
    d = torch.arange(c)[:, None] - torch.arange(c)[None, :]

    def sees(a, b):
        dist = (a - b) * c + d
        return bool((((dist >= 0) & (dist < W)) if causal else (dist.abs() < W)).any())

    needed = {(r - j) % p for r in range(p) for j in range(p) if j != r
              for a in (r, 2 * p - 1 - r) for b in (j, 2 * p - 1 - j) if sees(a, b)}
    covers = [(kf, kb) for kf in range(p) for kb in range(p - kf)
              if all(s <= kf or s >= p - kb for s in needed)]
    best = min(covers, key=sum)
    return best if sum(best) < p - 1 else (p - 1, 0)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_window_counters(pool, tp, causal):
    """The chunk pairs the window cannot reach are skipped (no kernel call),
    those it cuts off the diagonal get a mask; the totals over all ranks
    (forward + backward) are those of the global chunk grid.  A window of S'
    or more is no window: the plain plan, one kernel call per step.  The
    K/V of ranks out of every local query's reach never travel: messages
    3 (kf + kb) instead of the plain ring's 3p - 2 (_expected_hops)."""
    p, c = tp, 4
    S = 2 * p * c
    for W in (1, 3, 4, 6, 9, S - 1, S):
        calls = pool.run(checks.ring_window_counts, tp, S, W, causal)
        seen, hidden, cut = _expected_pairs(p, c, W, causal)
        assert sum(x["blocks"] for x in calls) == 2 * seen, (W, calls)
        assert sum(x["skipped"] for x in calls) == 2 * hidden, (W, calls)
        assert sum(x["masked"] for x in calls) == 2 * cut, (W, calls)
        if W >= S:
            assert all(x["kernel_forward"] == p == x["kernel_backward"] for x in calls)
        if W < c and causal:         # only the two diagonal pairs and their neighbours below
            assert hidden > 0 and sum(x["kernel_forward"] for x in calls) < 4 * p * p
        kf, kb = _expected_hops(p, c, W, causal)
        messages = 3 * p - 2 if (kf, kb) == (p - 1, 0) else 3 * (kf + kb)
        for x in calls:
            assert x["kernel_forward"] == x["kernel_backward"] and x["messages"] == messages, (W, kf, kb, x)
            assert x["unvisited"] == 2 * (p - 1 - kf - kb), (W, x)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_window_skips_hops(pool, causal):
    """4 ranks, chunks of c = 6: a window below the chunk (and W = 1: each
    query sees itself) needs only the neighbours' K/V (W = 1: none), so the
    K/V go one hop each way (none), against 3 without a window; results equal
    the full reference (checked on every rank inside ring_equals_full)."""
    p, c = 4, 6
    S = 2 * p * c
    plain = pool.run(checks.ring_window_counts, p, S, None, causal)
    assert all(x["messages"] == 3 * p - 2 and x["unvisited"] == 0 for x in plain)
    for W, hops in ((1, 0), (2, 2), (5, 2), (6, 2)):
        assert sum(_expected_hops(p, c, W, causal)) == hops
        for x in pool.run(checks.ring_window_counts, p, S, W, causal):
            # forward: hops K/V messages; backward: hops K/V + hops dk/dv messages
            assert x["messages"] == 3 * hops and x["unvisited"] == 2 * (p - 1 - hops), (W, x)
            assert x["kernel_forward"] == x["kernel_backward"] > 0
    # odd lengths and a padded row over the chains (window < chunk), bf16 too
    pool.run(checks.ring_equals_full, p, S - 5, causal, window=3, left_pad=4)
    pool.run(checks.ring_equals_full, p, S - 1, causal, dtype="bfloat16", window=4, left_pad=2)
    pool.run(checks.ring_equals_full, p, S - 3, causal, window=2, left_pad=3, backend="torch")


def test_ring_window_one_rank_is_the_kernel():
    """One rank: a causal window is one kernel call with window=W, bit for bit ops.attention."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 10, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    kp = torch.ones(2, 10, dtype=torch.bool)
    kp[1, :3] = False
    for W in (1, 3, 9):
        g = torch.randn(2, 4, 10, 8, generator=gen)
        o = ra.ring_attention(q, k, v, key_padding=kp, window=W)
        o2 = ops.attention(q, k, v, causal=True, mask=kp, window=W)
        assert torch.equal(o, o2)
        for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(o2, (q, k, v), g)):
            assert torch.equal(a, b)


# ---- logit soft-capping ---------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_softcap_equals_full(pool, tp, causal):
    """softcap=0.7 (below the logits' range: the cap binds) and 20: forward and
    q, k, v gradients equal the soft-capped float64 reference (GQA, a
    left-padded row, a length that does not divide 2p, one window case)."""
    S = 12 * tp - 3
    for cap, window in ((0.7, None), (20.0, None), (0.7, 5)):
        for result in pool.run(checks.ring_equals_full, tp, S, causal, D=16, left_pad=3, window=window,
                               softcap=cap):
            assert result["calls"]["kernel_forward"] > 0 and result["calls"]["kernel_backward"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ring_softcap_half_precision(pool, dtype):
    pool.run(checks.ring_equals_full, 2, 61, True, dtype=dtype, left_pad=4, softcap=1.0)


def test_ring_softcap_multi_tile(pool):
    """Chunks longer than the kernel's tiles (c = 50)."""
    pool.run(checks.ring_equals_full, 2, 200, True, 2, 2, 2, 32, softcap=0.5, left_pad=7)


def test_ring_softcap_one_rank_is_the_kernel():
    """One rank: bit for bit ops.attention(softcap=...); and the cap changes the result."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 10, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    g = torch.randn(2, 4, 10, 8, generator=gen)
    o = ra.ring_attention(q, k, v, softcap=0.3)
    o2 = ops.attention(q, k, v, causal=True, softcap=0.3)
    assert torch.equal(o, o2) and not torch.allclose(o, ops.attention(q, k, v, causal=True))
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(o2, (q, k, v), g)):
        assert torch.equal(a, b)


# ---- attention dropout --------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_dropout_equals_reference(pool, tp, causal):
    """dropout 0.3: forward and q, k, v gradients equal the float64 reference
    with the kernel's draws for the whole padded sequence (a length that does
    not divide 2p, a left-padded row, GQA); with a window (chains of hops) and
    soft-capping too; seed None: group rank 0's seed, the same on every rank."""
    S = 12 * tp - 3
    for window, cap, seed in ((None, None, 11), (5, None, 12), (None, 0.8, None)):
        results = pool.run(checks.ring_equals_full, tp, S, causal, left_pad=3, window=window, softcap=cap,
                           dropout=0.3, drop_seed=seed)
        assert len({r["seed"] for r in results}) == 1
        for r in results:
            assert abs(r["keep_rate"] - 0.7) < 0.03, r
            assert r["calls"]["kernel_forward"] > 0 and r["calls"]["kernel_backward"] > 0


def test_ring_dropout_multi_tile_bf16(pool):
    pool.run(checks.ring_equals_full, 2, 200, True, 2, 2, 2, 32, dropout=0.2, drop_seed=5, left_pad=7)
    pool.run(checks.ring_equals_full, 2, 61, True, dtype="bfloat16", dropout=0.1, drop_seed=3)


def test_ring_dropout_is_the_kernel_on_one_rank():
    """One rank: ring_attention(dropout_p, seed) is ops.attention(dropout_p, seed) bit for bit (the
    positions passed are the identity), and the draws are in force."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 10, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, generator=gen, requires_grad=True)
    g = torch.randn(2, 4, 10, 8, generator=gen)
    o = ra.ring_attention(q, k, v, dropout_p=0.4, seed=9)
    o2 = ops.attention(q, k, v, causal=True, dropout_p=0.4, seed=9)
    assert torch.equal(o, o2) and not torch.allclose(o, ops.attention(q, k, v, causal=True))
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(o2, (q, k, v), g)):
        assert torch.equal(a, b)
    # seed None: one draw from torch's generator, as ops.attention makes it
    torch.manual_seed(5)
    o = ra.ring_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(5)
    assert torch.equal(o, ops.attention(q, k, v, causal=True, dropout_p=0.4))


def test_dropout_positions_draw_the_global_mask():
    """The kernel's draws at positions (qpos, kpos) of a sequence of `seq` rows are
    those rows and columns of that sequence's mask; positions are checked."""
    from shardformer import _C

    full = ops.attention_dropout_mask((2, 3, 16, 16), 0.5, 21)
    qpos, kpos = torch.tensor([2, 3, 12, 13]), torch.tensor([0, 1, 14, 15, 6])
    part = ops.attention_dropout_mask((2, 3, 4, 5), 0.5, 21, qpos, kpos, 16)
    assert torch.equal(part, full[:, :, qpos][:, :, :, kpos])
    assert abs(full.float().mean().item() - 0.5) < 0.05
    keep = torch.empty(1, 1, 4, 5, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qpos"):
        _C.attention_dropout_keep(keep, 0.5, 1, torch.tensor([0, 1, 2, 16]), None, 16)
    with pytest.raises(ValueError, match="kpos"):
        _C.attention_dropout_keep(keep, 0.5, 1, None, torch.tensor([0, -1, 2, 3, 4]), 16)
    with pytest.raises(ValueError, match="qpos"):
        _C.attention_dropout_keep(keep, 0.5, 1, torch.tensor([0, 1]), None, 16)
    with pytest.raises(ValueError, match="drop_seq"):
        _C.attention_dropout_keep(keep, 0.5, 1, None, None, -3)
    with pytest.raises(ValueError, match="exceed drop_seq"):
        _C.attention_dropout_keep(keep, 0.5, 1, None, None, 3)


# ---- packed documents -----------------------------------------------------------------

@pytest.mark.parametrize("tp,S", [(2, 16), (2, 7), (4, 13)])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_documents_equal_full(pool, tp, S, causal):
    """documents: the block-diagonal mask of packed sequences (row 0 cut at 3, row 1 at S - 2), alone, with
    key padding and with a sliding window: the forward and the q, k, v gradients equal the float64 reference."""
    cuts = (3, S - 2)
    pool.run(checks.ring_equals_full, tp, S, causal, documents=cuts)
    pool.run(checks.ring_equals_full, tp, S, causal, documents=cuts, left_pad=2, window=4)
