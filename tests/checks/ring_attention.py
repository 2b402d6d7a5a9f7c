"""Rank-side checks of ring attention (tests/test_ring_attention.py).

Every rank builds the same full q, k, v (seeded), the reference is a plain
float64 softmax attention over the whole sequence with torch autograd, and
ring_attention runs on this rank's zigzag rows; the outputs and the q, k, v
gradients are all-gathered back to full sequences and compared on the real
rows (the padding of a length that does not divide 2p is added here the way
a model integration adds it)."""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist

from shardformer import ops
from shardformer.distributed import communicator as comm_mod
from shardformer.layer import ring_attention as ra

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |ring - reference| / max |reference|, per tensor
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


def reference(q, k, v, scale, causal, mask, window=None, softcap=None, keep=None, p=0.0, bias=None, docs=None):
    """softmax(scale q k^T (+ bias), masked) v in float64 (GQA by repeating K/V heads);
    mask [B, S] bool (True = attend) or None; window W: query i sees key j only
    when i - j < W (causal, HF's sliding_window_overlay: j > i - W) or
    |i - j| < W (not causal); softcap: logits softcap tanh(s / softcap) before
    the masks; keep [B, Hq, S, S] (dropout draws): probabilities * keep / (1 - p);
    docs [B, S]: query i sees key j only within its document;
    a row with no visible key gives 0."""
    S = q.shape[2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    allowed = torch.ones(q.shape[0], 1, S, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    if window:
        d = torch.arange(S)[:, None] - torch.arange(S)[None, :]
        allowed = allowed & ((d < window) if causal else (d.abs() < window))
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    s = s.masked_fill(~allowed, -1e300)
    probs = torch.softmax(s, dim=-1) * allowed.any(-1, keepdim=True)
    if keep is not None:
        probs = probs * keep.to(probs.dtype) / (1 - p)
    return probs @ v


@contextlib.contextmanager
def _backend(name: str | None):
    """SHARDFORMER_COMM=name for the group's communicator (every rank, same point)."""
    if name is None:
        yield
        return
    old = os.environ.get(comm_mod.ENV)
    os.environ[comm_mod.ENV] = name
    comm_mod.reset_communicators()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(comm_mod.ENV, None)
        else:
            os.environ[comm_mod.ENV] = old
        comm_mod.reset_communicators()


def _gather_rows(t: torch.Tensor, ctx, S_pad: int) -> torch.Tensor:
    """The full [B, H, S', D] tensor from every rank's zigzag rows."""
    p = ctx.tp_size
    parts = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    full = torch.empty(t.shape[0], t.shape[1], S_pad, t.shape[3], dtype=t.dtype)
    for r, part in enumerate(parts):
        full[:, :, ra.zigzag_rows(S_pad, p, r)] = part
    return full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def ring_equals_full(ctx, S: int, causal: bool = True, B: int = 2, Hq: int = 4, Hkv: int = 2, D: int = 16,
                     dtype: str = "float32", left_pad: int = 0, backend: str | None = None,
                     seed: int = 0, p2p: str = "auto", window: int | None = None,
                     softcap: float | None = None, dropout: float = 0.0, drop_seed: int | None = None,
                     bias_batch: int | None = None, documents: tuple | None = None) -> dict:
    """ring_attention on this rank's zigzag rows equals full attention: the
    forward rows and the q, k, v gradients (gathered to full sequences), on
    the S real rows.  left_pad: batch row 1 starts with that many padding
    tokens (key_padding False there).  The padding to S' = padded_length_for(S, p)
    is at the end: masked by key_padding when not causal (or when a padding
    mask is given anyway), unmasked when causal (real queries never see it).
    backend: SHARDFORMER_COMM for the group; p2p: ring_attention.P2P;
    window: the sliding window (global positions); softcap: logit soft-capping;
    dropout (drop_seed, None: the ring draws one on group rank 0): the
    reference applies the kernel's draws for the whole padded sequence,
    ops.attention_dropout_mask([B, Hq, S', S']), restricted to the S real rows.
    bias_batch (1 or B): an additive bias [bias_batch, Hq, S, S] (zero-padded
    to S'), its gradient summed over the group compared too.  documents: the
    first document's length in each batch row (packed sequences: the rest of
    the row is a second document), padded rows a document of their own."""
    p, r = ctx.tp_size, ctx.rank
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=gen).to(dt)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dt)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dt)
    dout = torch.randn(B, Hq, S, D, generator=gen).to(dt)
    bias = None if bias_batch is None else torch.randn(bias_batch, Hq, S, S, generator=gen)
    real = torch.ones(B, S, dtype=torch.bool)
    if left_pad:
        real[1, :left_pad] = False
    scale = 1.0 / math.sqrt(D)

    # the model integration's padding: zero rows at the end, key_padding over S'
    S_pad = ra.padded_length_for(S, p)
    extra = S_pad - S

    def pad(t):
        return torch.nn.functional.pad(t, (0, 0, 0, extra))

    docs = docs_pad = None
    if documents is not None:
        docs = torch.stack([(torch.arange(S) >= cut).long() for cut in documents])
        docs_pad = torch.nn.functional.pad(docs, (0, extra), value=-1)
    key_padding = None
    if left_pad or (extra and not causal):
        key_padding = torch.cat([real, torch.zeros(B, extra, dtype=torch.bool)], dim=1)
    rows = ra.zigzag_rows(S_pad, p, r)
    ql, kl, vl = (pad(t)[:, :, rows].clone().requires_grad_() for t in (q, k, v))
    gl = pad(dout)[:, :, rows]          # padded query rows get no upstream gradient
    bl = None if bias is None else \
        torch.nn.functional.pad(bias, (0, extra, 0, extra)).requires_grad_()   # whole sequence, every rank

    before = dict(ra.CALLS)
    old_p2p, ra.P2P = ra.P2P, p2p
    try:
        with _backend(backend):
            from shardformer.distributed import get_communicator

            used = get_communicator(ctx.group, "cpu").backend
            seeds, group_seed = [], ra._group_seed
            ra._group_seed = lambda *a: seeds.append(group_seed(*a)) or seeds[-1]
            try:
                out = ra.ring_attention(ql, kl, vl, ctx.group, scale=scale, causal=causal, key_padding=key_padding,
                                        window=window, softcap=softcap, dropout_p=dropout, seed=drop_seed,
                                        bias=bl, documents=docs_pad)
            finally:
                ra._group_seed = group_seed
            out.backward(gl)
            calls = {key: ra.CALLS[key] - before[key] for key in before}

            full_o = _gather_rows(out.detach(), ctx, S_pad)[:, :, :S]
            full_dq = _gather_rows(ql.grad, ctx, S_pad)[:, :, :S]
            full_dk = _gather_rows(kl.grad, ctx, S_pad)[:, :, :S]
            full_dv = _gather_rows(vl.grad, ctx, S_pad)[:, :, :S]
            if bl is not None:                     # each rank's query rows: summed over the group
                dbias = bl.grad.clone()
                dist.all_reduce(dbias, group=ctx.group)
    finally:
        ra.P2P = old_p2p
    assert out.dtype == dt and out.shape == ql.shape
    keep = None
    if dropout:
        if drop_seed is None:                  # drawn on group rank 0: every rank got the same
            assert len(seeds) == 1, seeds
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(p)]
            dist.all_gather(every, torch.tensor(seeds, dtype=torch.int64), group=ctx.group)
            assert all(int(e) == seeds[0] for e in every), every
            drop_seed = seeds[0]
        keep = ops.attention_dropout_mask((B, Hq, S_pad, S_pad), dropout, drop_seed)[:, :, :S, :S]

    # reference: float64 autograd on the same (rounded) values
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    br = None if bias is None else bias.double().requires_grad_()
    ref = reference(qr, kr, vr, scale, causal, real if left_pad else None, window, softcap, keep, dropout, br, docs)
    ref.backward(dout.double())
    errors = {"o": _rel(full_o, ref), "dq": _rel(full_dq, qr.grad), "dk": _rel(full_dk, kr.grad),
              "dv": _rel(full_dv, vr.grad)}
    if bl is not None:
        errors["dbias"] = _rel(dbias[:, :, :S, :S], br.grad)
    if window == 1:               # each query sees itself only: dq = dk = 0 exactly, compare absolutely
        errors["dq"] = (full_dq.double() - qr.grad).abs().max().item()
        errors["dk"] = (full_dk.double() - kr.grad).abs().max().item()
    bad = {name: e for name, e in errors.items() if not e <= TOL[dtype]}
    assert not bad, (f"rank {r}/{p} S={S} causal={causal} window={window} softcap={softcap} {dtype} "
                     f"left_pad={left_pad} "
                     f"backend={used}: "
                     f"relative errors {bad} over {TOL[dtype]}")
    if left_pad and (causal or left_pad >= S):   # queries that see only padding keys: output and gradients 0
        assert full_o[1, :, :left_pad].abs().max() == 0 and full_dq[1, :, :left_pad].abs().max() == 0
    if left_pad >= S:                            # keys nobody may see: no gradient
        assert full_dk[1].abs().max() == 0 and full_dv[1].abs().max() == 0
    return {"errors": errors, "calls": calls, "backend": used, "seed": drop_seed,
            "keep_rate": None if keep is None else keep.float().mean().item()}


def ring_on_subgroup(ctx, members: list, backend: str | None = None) -> dict | None:
    """A group that is not [0, n): every rank makes it (new_group is collective
    over the world), its members run ring_equals_full on it with their rank in it
    (torch numbers a group's ranks in the order of their global ranks)."""
    sub = dist.new_group(members)
    try:
        if ctx.rank not in members:
            return None
        from dist_pool import RankContext

        sub_ctx = RankContext(dist.get_rank(sub), ctx.world_size, len(members), sub)
        return ring_equals_full(sub_ctx, 6 * len(members) + 1, True, left_pad=2, backend=backend)
    finally:
        dist.destroy_process_group(sub)


def ring_counts(ctx, causal: bool) -> dict:
    """The counters of one forward + backward: one kernel call per ring step
    each way, the chunk pairs computed and skipped (b > a) and the messages."""
    return ring_equals_full(ctx, 8 * ctx.tp_size, causal=causal, B=1, Hq=2, Hkv=1, D=8)["calls"]


def ring_shapes_refused(ctx) -> list:
    """Bad inputs raise before any communication, on every rank alike."""
    p = ctx.tp_size
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 1, 4, 8)
    seen = []
    cases = [
        (lambda: ra.ring_attention(q, k, k, ctx.group, key_padding=torch.ones(1, 4, dtype=torch.bool)),
         ValueError, "key_padding"),
        (lambda: ra.ring_attention(q, k, k, ctx.group, key_padding=torch.ones(1, 4 * p)),
         TypeError, "bool"),
        (lambda: ra.ring_attention(q[:, :, :3], k[:, :, :3], k[:, :, :3], ctx.group), ValueError, "2c"),
        (lambda: ra.ring_attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8),
                                   ctx.group), ValueError, "multiple"),
        (lambda: ra.ring_attention(q, k, k, ctx.group, softcap=-1.0), ValueError, "softcap"),
        (lambda: ra.ring_attention(q, k, k, ctx.group, softcap=float("nan")), ValueError, "softcap"),
        (lambda: ra.ring_attention(q, k, k, ctx.group, dropout_p=1.5), ValueError, "dropout_p"),
        (lambda: ra.ring_attention(q, k, k, ctx.group, dropout_p=0.1, seed="7"), TypeError, "seed"),
        (lambda: ra.ring_attention(q, k, k, ctx.group, window=-1), ValueError, "window"),
    ]
    for fn, exc, words in cases:
        try:
            fn()
        except exc as e:
            assert words in str(e), f"{exc.__name__} without {words!r}: {e}"
            seen.append(exc.__name__)
        else:
            raise AssertionError(f"no {exc.__name__} ({words})")
    return seen


def ring_window_counts(ctx, S: int, window: int, causal: bool = True) -> dict:
    """ring_equals_full with a sliding window (B=1, MQA); returns the counters."""
    return ring_equals_full(ctx, S, causal=causal, B=1, Hq=2, Hkv=1, D=8, window=window)["calls"]
