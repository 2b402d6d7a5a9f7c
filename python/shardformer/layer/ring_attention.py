"""Ring attention: exact attention over a sequence split across the ranks of a group.

Layout ("zigzag", for load balance under causal masking).  The sequence of
length S is padded to S' = padded_length_for(S, p), the smallest multiple of
2p >= S (p = group size), and cut into 2p chunks of c = S' / (2p) rows.
Rank r holds chunks r and 2p-1-r, in that order, as its 2c local rows
(`zigzag_rows(S', p, r)` lists their global indices).  Every rank then has
one early and one late chunk, so under causal masking each does the same
work.

What ring_attention computes.  With q, k, v the rows of the full (padded)
sequence, for each local query row i (global position P(i)) and every key
position j of the whole sequence:

    s_ij = scale q_i . k_j, or with soft-capping (cap > 0) cap tanh(scale q_i . k_j / cap),
    s_ij = -inf where key_padding[b, j] is False,
           or (causal) j > P(i), or (window W, causal) P(i) - j >= W,
           or (window W, not causal) |P(i) - j| >= W,
           or (documents) documents[b, P(i)] != documents[b, j]
    lse_i = log sum_j exp(s_ij)              (+inf when every s_ij is -inf)
    o_i   = sum_j exp(s_ij - lse_i) v_j      (0 for such an all-masked row)

GQA: query head h reads key-value head h // (Hq / Hkv), as the C kernel does.

Forward.  The packed K/V of each rank travel around the ring (rank r sends
to r+1 and receives from r-1): at step s (0 <= s < p) rank r holds the K/V of
rank j = (r - s) mod p, i.e. key chunks j and 2p-1-j, and runs one call of
the C kernel (csrc/kernels/attention.h) on the query / key chunk pairs that
causal masking leaves visible.  With query chunk a and key chunk b: b < a is
unmasked, b == a is causal with Sq == Sk (the kernel's causal flag), b > a is
skipped without a kernel call.  With the zigzag layout the visible pairs of
one step always form one rectangle:

    j == r (s = 0)  all 2c queries x all 2c keys, causal: row t of chunk
                    2p-1-r sees all of chunk r and rows <= t of its own chunk,
                    which is exactly the kernel's causal mask on the local
                    concatenation (1 of the 4 pairs skipped);
    j <  r          all 2c queries x key chunk j (c keys), unmasked
                    (pairs with key chunk 2p-1-j skipped: 2 of 4);
    j >  r          query chunk 2p-1-r (c queries) x all 2c keys, unmasked
                    (pairs with query chunk r skipped: 2 of 4);

so every step costs about 2c^2 logits (2c x c, c x 2c, or the lower half of
the causal 2c x 2c) and every rank does the same work: 2c^2 p in all, half
of the unmasked 4c^2 p.
Without causal masking every step is the full 2c x 2c block.  Each block
returns (o_b, lse_b) for the rows it covers, merged exactly into the running
(o, lse) in float32:

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

where a block's lse_b = +inf (the kernel's "every key masked") counts as -inf
(no contribution), and a row with no visible key anywhere ends with o = 0 and
lse = +inf, as the kernel gives it.  The next step's K/V travel while the
current block computes (asynchronous send/recv, see "Transport").

Sliding windows (window=W, global positions: with causal masking key j is
visible to query i iff j <= i and i - j < W, HF's sliding_window_overlay
kv_idx > q_idx - W on top of causal; without it iff |i - j| < W, the kernel's
symmetric window).  A window of S' or more hides nothing and is dropped.
Each (query chunk a, key chunk b) pair spans the global distances
d = (a - b) c + t - u, t, u in [0, c), and is

    skipped   when no d in it is visible (no kernel call; e.g. b > a, or a - b
              large enough that the window cannot reach);
    full      when every d is visible: no mask beyond key padding;
    diagonal  a == b: the kernel's own causal / window math on the c x c
              block is exact (off = Sk - Sq = 0 and local = global distances);
    cut       a != b and the window line crosses it: the kernel's window is
              aligned bottom-right within one call (off = Sk - Sq), and no
              views of the held rows give off = (a - b) c, so these pairs get
              an explicit uint8 mask [1 or B, 1, c, c] (the band, and-ed with
              the key padding): at most two such pairs per query chunk.

The visible pairs of a step go into as few kernel calls as possible: one
rectangle when they are all full (so a step with no cut or diagonal pair
stays one call), the local 2c x 2c block under the kernel's causal / window
flags at step 0 when that is exact (no window, or r = p-1, whose chunks
p-1, p are adjacent), else one call per query chunk whose visible pairs are
all full, else one call per pair.  Backward replays the same calls with the
same masks and windows.

Which K/V travel (chains()).  Rank r needs the K/V of rank j = (r - s) mod p
only when some pair of its chunks {r, 2p-1-r} x {j, 2p-1-j} has a visible
row pair.  A window W reaches k = ceil((W - 1) / c) chunks: query chunk a
sees key chunks a-k..a (a-k..a+k without causal masking),
so through the zigzag the needed offsets s lie near 0 (s <= k: lower
chunks of lower ranks) and near p (s >= p - k: the mirrored upper chunks of
higher ranks).  Instead of p - 1 hops one way, the K/V then go kf hops to
rank+1 (offsets 1..kf, the forward chain) and kb hops to rank-1 (offsets
p-1..p-kb, the backward chain), the fewest hops covering every offset some
rank needs; the ranks in between never see each other's K/V.  E.g. W <= c
on 4 ranks: one hop each way (2, not 3), W = 1: none.  When that saves
nothing the plain ring runs.  Backward with chains: the K/V travel the same
way and each step's dk / dv partial (float32) for its owner is kept (kf + kb
of them, few: the chains are used only when they are shorter than the
ring); then each chain's partials go home against its direction in kf
(kb) neighbour hops, summed on the way (at hop h rank r sends the sum for
owner r - kf + h - 1 and adds its own partial for the next owner to what
it receives).  Messages per rank: kf + kb forward, 2 (kf + kb) backward.

Backward.  Saved for it: q, the local k and v, the final o and the final lse
(nothing [S, S], no per-step outputs).  K/V go around the ring again; for
each block the kernel's backward runs with the FINAL o and lse, so inside it
p_ij = exp(s_ij - lse_i) are the global probabilities and
delta_i = dout_i . o_i is the global one, and each block's

    dq_i += scale sum_j ds_ij k_j,   dk_j += scale sum_i ds_ij q_i,
    dv_j += sum_i p_ij dout_i,       ds_ij = p_ij (dout_i . v_j - delta_i)

are exact partial sums.  dq accumulates locally (float32).  The dk / dv
accumulators (float32, for the 2c key rows of one owner) travel with their
K/V: at the end of step s rank r adds its block's dk / dv into the
accumulator of owner j = (r - s) mod p and sends it on to r+1, which holds
owner j's K/V at step s+1.  After the last step one more hop brings every
accumulator home, so p hops in all (the first p-1 while the next step's K/V
are already on their way; the accumulator's receive overlaps the next
block's compute).

Transport.  The K/V of a step go as one packed message ([2, B, Hkv, 2c, D]
of the input dtype), the dk / dv accumulators as one float32 message.  Each
step is one `exchange` of the group's communicator (send to one neighbour,
receive from the other, asynchronous on every backend, a tag per stream;
communicator.py orders the pair so that a ring of any size cannot
deadlock); module-level P2P = "torch" asks the communicator for its
torch.distributed transport (gloo isend / irecv) even on an shm group.
Either way the computation of a block overlaps the transfer of the next
step's K/V.
Devices.  CPU tensors run each block on the C kernel; tensors on any other
device (CUDA) run it in torch's ops on that device (ring_blocks.py: the same
block contract, forward and the final-lse backward), the K/V and dk / dv
messages on the group's communicator for that device; only the [B, S'] key
padding / documents and the blocks' uint8 masks are built on the CPU and
moved.  BLOCKS = "torch" forces the torch-ops blocks on CPU (tests).
Inputs are checked before any
communication; a rank failing in the middle of the ring (say, out of memory)
leaves its peers waiting until the transport's timeout, as with any
collective.

Counters (module-level CALLS, for tests; reset_counters() zeroes them):
    forward / backward      calls of the autograd function's two passes
    kernel_forward / _backward  C kernel calls (one per ring step without a
                            window; with one, up to one per computed pair)
    blocks / skipped        chunk pairs (query chunk, key chunk) computed /
                            skipped (b > a, or out of the window's reach,
                            with the 4 pairs of each unvisited owner),
                            counted in forward and backward
    masked                  computed pairs cut by the window off the diagonal
                            (an explicit band mask)
    messages                point-to-point messages sent by this rank
    messages_torch          those of them sent by torch.distributed isend
    unvisited               K/V owners that never reach this rank (window), per pass

Soft-capping is elementwise on each logit, so every block applies it in
the kernel (forward and backward, csrc/kernels/attention.h) and the merge
and the backward's final-lse identities above hold unchanged.

Attention dropout (dropout_p > 0): o_i = sum_j p_ij z_ij / (1 - dropout_p) v_j
with z_ij drawn by the kernel's counter-based hash from (seed, b, h, global
query position, global key position), i.e. what one kernel call over the
whole padded sequence of S' rows draws (ops.attention_dropout_mask of
[B, Hq, S', S'] shows them).  Each block passes the global positions of
its rows (qpos, kpos, drop_seq = S'), so the blocks of every rank draw
exactly their part of that mask, in forward and again in backward.  The
block's lse stays the undropped log-sum-exp, so the merge above is
unchanged (o_b carries the dropped, rescaled weights), and backward with
the final o (dropped) gives delta_i = sum_j p_ij dp_ij as the kernel needs.
The seed is one number for the whole group: drawn by group rank 0 from
torch's generator and broadcast when not given.

An additive bias over the whole padded sequence (T5's relative position
bias; `bias`) is added block by block, each block taking its rows and
columns; its gradient is this rank's query rows of the blocks' softmax
gradients.  Not supported: ALiBi slopes.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.autograd.function import once_differentiable

from .. import _C
from .. import distributed as D
from .. import ops
from ..distributed.communicator import get_communicator
from . import ring_blocks

__all__ = ["ring_attention", "zigzag_rows", "padded_length_for", "CALLS", "reset_counters"]

# The ring's point-to-point transport: "auto" = the group's communicator backend
# (shm async calls on an shm group, else torch.distributed isend / irecv);
# "torch" = isend / irecv even on an shm group (gloo's sockets buffer in the
# kernel, so a transfer progresses without both peers' threads on a core,
# which can matter when the ranks oversubscribe the cores).
P2P = "auto"

# How a block is computed: "auto" = the C kernel for CPU tensors, torch's ops
# (ring_blocks.py, the same block contract) for tensors on any other device;
# "torch" = torch's ops on CPU too (for tests of the torch-ops path on CPU).
BLOCKS = "auto"


def _torch_blocks(t: torch.Tensor) -> bool:
    """Whether the blocks of a ring over `t` run in torch's ops (BLOCKS)."""
    if BLOCKS not in ("auto", "torch"):
        raise ValueError(f"ring_attention.BLOCKS must be 'auto' or 'torch', got {BLOCKS!r}")
    return BLOCKS == "torch" or t.device.type != "cpu"

CALLS = {"forward": 0, "backward": 0, "kernel_forward": 0, "kernel_backward": 0,
         "blocks": 0, "skipped": 0, "masked": 0, "messages": 0, "messages_torch": 0, "unvisited": 0,
         "torch_forward": 0, "torch_backward": 0}   # blocks computed in torch's ops (ring_blocks)


def reset_counters() -> None:
    for key in CALLS:
        CALLS[key] = 0


# ---- layout -------------------------------------------------------------------------

def padded_length_for(S: int, p: int) -> int:
    """The smallest multiple of 2p that is >= S: the padded sequence length S'."""
    S, p = int(S), int(p)
    if S < 0 or p < 1:
        raise ValueError(f"padded_length_for: need S >= 0 and p >= 1, got S={S}, p={p}")
    return -(-S // (2 * p)) * (2 * p)


def zigzag_rows(padded_length: int, p: int, rank: int) -> torch.LongTensor:
    """Global row indices rank holds, in its local order: chunk `rank` then
    chunk 2p-1-rank of the 2p chunks of c = padded_length / (2p) rows, i.e.
    [rank c, (rank+1) c) followed by [(2p-1-rank) c, (2p-rank) c)."""
    n, p, rank = int(padded_length), int(p), int(rank)
    if p < 1 or not 0 <= rank < p:
        raise ValueError(f"zigzag_rows: need p >= 1 and 0 <= rank < p, got p={p}, rank={rank}")
    if n < 0 or n % (2 * p):
        raise ValueError(f"zigzag_rows: padded_length={n} is not a multiple of 2p={2 * p} "
                         f"(use padded_length_for(S, p))")
    c = n // (2 * p)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * p - 1 - rank) * c, (2 * p - rank) * c)])


def _kind(a: int, b: int, c: int, causal: bool, W: float) -> str:
    """How query chunk a sees key chunk b (c rows each, global distances
    d = (a - b) c + t - u for rows t, u): "skip" (no pair visible), "full"
    (every pair visible), "diag" (a == b: the kernel's own causal / window
    math on the c x c block, off = 0, is exact) or "band" (a != b, cut by the
    window: needs an explicit mask)."""
    delta = (a - b) * c
    dmin, dmax = delta - (c - 1), delta + (c - 1)
    if causal:
        if dmax < 0 or dmin >= W:
            return "skip"
        if dmin >= 0 and dmax < W:
            return "full"
    else:
        if dmin >= W or dmax <= -W:
            return "skip"
        if dmin > -W and dmax < W:
            return "full"
    return "diag" if a == b else "band"


_NAMES = ("lo", "hi")


def _plan(r: int, j: int, p: int, c: int, causal: bool, W: float):
    """The kernel calls rank r makes against the K/V of rank j: (calls, chunk
    pairs computed, chunk pairs skipped, pairs computed with a window mask).
    Each call is (query rows, key rows, kernel causal flag, kernel window,
    band offset): rows "all" (2c), "lo" (the first chunk's c) or "hi" (the
    second's); band offset None, or delta = (a - b) c for a single pair that
    needs the mask of _band_mask.  W: the window (math.inf for none).

    The visible pairs go into as few calls as possible: one rectangle when
    they are all fully visible (every step without a window but step 0),
    the local 2c x 2c block under the kernel's causal / window flags at step
    0 without a window or on rank p-1 (see the module docstring), else one call per query chunk whose visible pairs are all
    full, else one call per pair."""
    qch, kch = (r, 2 * p - 1 - r), (j, 2 * p - 1 - j)
    kinds = {(qi, ki): _kind(qch[qi], kch[ki], c, causal, W) for qi in (0, 1) for ki in (0, 1)}
    nblk = sum(kd != "skip" for kd in kinds.values())
    nskip, nband = 4 - nblk, sum(kd == "band" for kd in kinds.values())
    kwin = 0 if W == math.inf else int(W)
    if j == r and ((causal and W == math.inf) or r == p - 1):
        # the local 2c x 2c block under the kernel's own causal / window math:
        # exact without a window (see the module docstring), and with one when
        # the two chunks are adjacent (r = p-1: chunks p-1, p; local = global distances)
        return [("all", "all", causal, kwin, None)], nblk, nskip, nband

    def sel(idx):
        return "all" if len(idx) == 2 else _NAMES[idx[0]]

    vis = [pair for pair, kd in kinds.items() if kd != "skip"]
    rows = sorted({qi for qi, _ in vis})
    cols = sorted({ki for _, ki in vis})
    if vis and all(kinds[(qi, ki)] == "full" for qi in rows for ki in cols):
        return [(sel(rows), sel(cols), False, 0, None)], nblk, nskip, nband
    calls = []
    for qi in rows:
        ks = [ki for ki in (0, 1) if kinds[(qi, ki)] != "skip"]
        if all(kinds[(qi, ki)] == "full" for ki in ks):
            calls.append((_NAMES[qi], sel(ks), False, 0, None))
            continue
        for ki in ks:
            kd = kinds[(qi, ki)]
            if kd == "full":
                calls.append((_NAMES[qi], _NAMES[ki], False, 0, None))
            elif kd == "diag":
                calls.append((_NAMES[qi], _NAMES[ki], causal, kwin, None))
            else:
                calls.append((_NAMES[qi], _NAMES[ki], False, 0, (qch[qi] - kch[ki]) * c))
    return calls, nblk, nskip, nband


def _rows(t: torch.Tensor, which: str, c: int, dim: int = 2) -> torch.Tensor:
    """t's rows `which` ("all", "lo" = first c, "hi" = last c) along dim, as a view."""
    if which == "all":
        return t
    return t.narrow(dim, 0 if which == "lo" else c, c)


# ---- transport ----------------------------------------------------------------------

class _Ring:
    """Asynchronous sends to rank+1 and receives from rank-1 of a group
    (and back): the group's communicator's exchange(), or that of its
    torch.distributed transport when P2P = "torch"."""

    def __init__(self, group, size: int, rank: int, device="cpu"):
        self.size, self.rank = size, rank
        self.nxt, self.prv = (rank + 1) % size, (rank - 1) % size
        comm = get_communicator(group, device)   # collective on a group's first use: every rank is here
        if P2P not in ("auto", "torch"):
            raise ValueError(f"ring_attention.P2P must be 'auto' or 'torch', got {P2P!r}")
        self.comm = comm.torch_transport() if P2P == "torch" else comm
        self.backend = self.comm.backend          # for the counters only

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int, direction: int = 1):
        """Start sending `send` to rank+direction and receiving rank-direction's
        into `recv` (direction +1 or -1); returns the handle to wait on
        (neither buffer may be touched before)."""
        CALLS["messages"] += 1
        CALLS["messages_torch"] += self.backend == "torch"
        to, frm = (self.nxt, self.prv) if direction == 1 else (self.prv, self.nxt)
        return self.comm.exchange(send, to, recv, frm, tag=tag)

    @staticmethod
    def wait(handle) -> None:
        if handle is not None:
            handle.wait()


# per stream: K/V and dk/dv accumulators of the forward chain (+1) and the backward chain (-1)
_TAG_KV = {1: 7301, -1: 7303}
_TAG_DKV = {1: 7302, -1: 7304}


# ---- which hops travel --------------------------------------------------------------

def _needed_offsets(p: int, c: int, causal: bool, W: float) -> list:
    """The ring offsets s in [1, p) at which some rank r has a chunk pair to
    compute against the K/V of rank (r - s) mod p (_plan)."""
    return [s for s in range(1, p) if any(_plan(r, (r - s) % p, p, c, causal, W)[0] for r in range(p))]


@functools.lru_cache(maxsize=256)
def chains(p: int, c: int, causal: bool, W: float) -> tuple:
    """(kf, kb): how far the K/V travel.  Rank r computes against the K/V
    of the ranks r - 1, ..., r - kf (the forward chain: K/V passed on to
    rank+1, kf hops) and r + 1, ..., r + kb (the backward chain: passed to
    rank-1, kb hops); kf + kb <= p - 1 and every needed offset is covered
    (offset s <= kf, or s >= p - kb).  Without a window that is the plain ring
    (p - 1, 0); a window shorter than the sequence leaves the offsets near 0
    and near p (the zigzag pairs chunk a with 2p-1-a), and the K/V of the
    ranks in between, whose chunks are out of every local query's reach,
    never travel."""
    if p == 1:
        return 0, 0
    best = (p - 1, 0)
    if W == math.inf:
        return best
    needed = _needed_offsets(p, c, causal, W)
    for kf in range(p):
        rest = [s for s in needed if s > kf]
        kb = p - min(rest) if rest else 0
        if kf + kb < sum(best):
            best = (kf, kb)
    return best


def _schedule(r: int, p: int, kf: int, kb: int) -> list:
    """Rank r's steps as (chain, t, owner): (0, 0, r) its own K/V, then in
    turn the forward chain's t-th (owner r - t, from rank r-1) and the
    backward chain's t-th (owner r + t, from rank r+1).  Every rank has the
    same chain sequence, so the i-th exchange of every rank pairs with its
    neighbours' i-th."""
    steps = [(0, 0, r)]
    for t in range(1, max(kf, kb) + 1):
        if t <= kf:
            steps.append((1, t, (r - t) % p))
        if t <= kb:
            steps.append((-1, t, (r + t) % p))
    return steps


# ---- block math ---------------------------------------------------------------------

def _merge(o_acc: torch.Tensor, lse_acc: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (o_acc, lse_acc) <- the softmax merge with a block (o_b, lse_b).

        lse = logaddexp(lse_a, lse_b),  o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

    lse_acc holds -inf for "nothing seen yet"; a block's +inf (all masked)
    counts as -inf.  Rows still at -inf after the merge keep o = 0."""
    lse_b = lse_b.masked_fill(lse_b == math.inf, -math.inf)
    lse = torch.logaddexp(lse_acc, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_acc - ref).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).unsqueeze(-1)
    o_acc.mul_(wa).add_(o_b.float() * wb)
    lse_acc.copy_(lse)


def _mask_for(kp, rows: torch.Tensor | None, which: str, c: int):
    """The key padding columns of the key rows `rows` (global), as the kernel's
    uint8 [B, 1, 1, Sk] mask (strides {Sk, 0, 0, 1}), or None."""
    if kp is None:
        return None
    cols = kp.index_select(1, _rows(rows, which, c, dim=0))
    return cols.contiguous().view(cols.shape[0], 1, 1, cols.shape[1])


def _band_mask(delta: int, c: int, causal: bool, W: float, kpm):
    """The mask of one chunk pair cut by the window: query row t, key row u at
    global distance d = delta + t - u, visible iff 0 <= d < W (causal) or
    |d| < W, and-ed with the pair's key padding kpm ([B, 1, 1, c] or None):
    uint8 [1 or B, 1, c, c]."""
    d = delta + torch.arange(c).unsqueeze(1) - torch.arange(c).unsqueeze(0)
    vis = ((d >= 0) & (d < W)) if causal else (d.abs() < W)
    m = vis.view(1, 1, c, c).to(torch.uint8)
    return m if kpm is None else (m & kpm).contiguous()


def _document_mask(docs: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor) -> torch.Tensor:
    """Query rows qg x key rows kg (global) of the same document: uint8
    [B, 1, Sq, Sk], docs [B, S'] the document of every row."""
    dq, dk = docs.index_select(1, qg), docs.index_select(1, kg)
    return (dq[:, None, :, None] == dk[:, None, None, :]).to(torch.uint8)


class _Step:
    """The blocks of one ring step: for each call of the plan, the query-row /
    key-row selectors, the kernel's causal flag and window, and its mask."""

    def __init__(self, r, j, p, c, S_pad, causal, W, kp, docs=None):
        self.calls, nblk, nskip, nband = _plan(r, j, p, c, causal, W)
        CALLS["blocks"] += nblk
        CALLS["skipped"] += nskip
        CALLS["masked"] += nband
        self.c, self.causal, self.W, self.kp, self.docs = c, causal, W, kp, docs
        self.owner_rows = None if kp is None and docs is None else zigzag_rows(S_pad, p, j)
        self.query_rows = None if docs is None else zigzag_rows(S_pad, p, r)

    def mask(self, qrows: str, krows: str, band):
        """The block's mask: key padding, the window's band, and (packed
        documents) query and key of the same document; None: none."""
        kpm = _mask_for(self.kp, self.owner_rows, krows, self.c)
        m = kpm if band is None else _band_mask(band, self.c, self.causal, self.W, kpm)
        if self.docs is None:
            return m
        same = _document_mask(self.docs, _rows(self.query_rows, qrows, self.c, dim=0),
                              _rows(self.owner_rows, krows, self.c, dim=0))
        return same if m is None else (same & m).contiguous()


class _Halves:
    """Contiguous copies of a [B, H, 2c, ...] tensor's "lo" / "hi" rows, made once."""

    def __init__(self, c: int):
        self.c, self.cache = c, {}

    def __call__(self, name: str, t: torch.Tensor, which: str) -> torch.Tensor:
        if which == "all":
            return t
        key = (name, which)
        if key not in self.cache:
            self.cache[key] = _rows(t, which, self.c).contiguous()
        return self.cache[key]


def _positions(drop, r, j, p, c, qrows, krows) -> tuple:
    """(qpos, kpos, drop_seq) of a block for the kernel's dropout draws: the
    global positions of rank r's query rows `qrows` and owner j's key rows
    `krows` in the padded sequence of S' = 2cp rows, and S'.  (None, None, 0)
    without dropout."""
    if drop is None:
        return None, None, 0
    S_pad = 2 * c * p
    return (_rows(zigzag_rows(S_pad, p, r), qrows, c, dim=0).contiguous(),
            _rows(zigzag_rows(S_pad, p, j), krows, c, dim=0).contiguous(), S_pad)


def _bias_block(bias, qg: torch.Tensor, kg: torch.Tensor) -> torch.Tensor | None:
    """The additive bias of one block: rows qg, columns kg (global positions)
    of the whole-sequence bias [1 | B, H, S', S'], as contiguous float32."""
    if bias is None:
        return None
    return bias.index_select(2, qg.to(bias.device)).index_select(3, kg.to(bias.device)).float().contiguous()


def _add_bias_grad(dbias: torch.Tensor, ds: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor) -> None:
    """In place: dbias[:, :, qg, kg] += ds (summed over the batch where the
    bias broadcasts it); dbias [1 | B, H, S', S'] float32."""
    if dbias.shape[0] == 1 and ds.shape[0] != 1:
        ds = ds.sum(dim=0, keepdim=True)
    S = dbias.shape[-1]
    flat = (qg[:, None] * S + kg[None, :]).reshape(-1).to(dbias.device)
    dbias.view(*dbias.shape[:2], S * S).index_add_(2, flat, ds.reshape(*ds.shape[:2], -1))


class _Bias:
    """The whole-sequence bias of one ring call: its blocks (global rows of
    the chunks, cached) and, in backward, its gradient's accumulator."""

    def __init__(self, bias: torch.Tensor, S_pad: int, p: int, c: int, want_grad: bool = False):
        self.bias, self.S_pad, self.p, self.c, self.cache = bias, S_pad, p, c, {}
        self.grad = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_grad else None

    def rows(self, rank: int, which: str) -> torch.Tensor:
        key = (rank, which)
        if key not in self.cache:
            self.cache[key] = _rows(zigzag_rows(self.S_pad, self.p, rank), which, self.c, dim=0)
        return self.cache[key]

    def block(self, r: int, j: int, qrows: str, krows: str) -> torch.Tensor:
        return _bias_block(self.bias, self.rows(r, qrows), self.rows(j, krows))

    def add_grad(self, ds: torch.Tensor, r: int, j: int, qrows: str, krows: str) -> None:
        _add_bias_grad(self.grad, ds, self.rows(r, qrows), self.rows(j, krows))


def _group_seed(group, p: int) -> int:
    """One dropout seed for the whole group: group rank 0 draws it from
    torch's generator and broadcasts it (every rank calls this at the same
    point, as the ring itself)."""
    t = torch.randint(0, 2**62, (1,), dtype=torch.int64) if D.rank(group) == 0 else torch.zeros(1, dtype=torch.int64)
    if p > 1:
        D.broadcast(t, 0, group)
    return int(t.item())


def _travel(ring, r: int, p: int, kf: int, kb: int, kd: torch.Tensor, vd: torch.Tensor):
    """Yield (owner, its K/V as [2, B, Hkv, 2c, D] or the (k, v) pair) for
    rank r's steps (_schedule), the K/V of each step travelling while the
    previous step computes: the exchange for step i+1 starts before step i
    is yielded and is waited on before step i+1.  One exchange in flight at
    a time; the K/V a chain sends on are the last it received (or our own)."""
    steps = _schedule(r, p, kf, kb)
    CALLS["unvisited"] += p - len(steps)
    CALLS["skipped"] += 4 * (p - len(steps))          # the chunk pairs of the K/V that never come
    if len(steps) == 1:
        yield r, (kd, vd)
        return
    own = torch.stack([kd, vd])
    held = {1: own, -1: own}
    handles = incoming = None
    for i, (chain, _t, owner) in enumerate(steps):
        if i > 0:
            _Ring.wait(handles)
            held[chain] = incoming
        cur = held[chain] if chain else own
        if i + 1 < len(steps):
            nxt = steps[i + 1][0]
            incoming = torch.empty_like(own)
            handles = ring.exchange(held[nxt], incoming, _TAG_KV[nxt], nxt)
        yield owner, cur


def _backward_blocks(r, j, p, c, S_pad, cur, qd, o, dout, lse, dq, half, args) -> list:
    """The kernel's backward of rank r's blocks against owner j's K/V `cur`:
    dq accumulated in place, [(key rows, dk, dv)] returned."""
    _group, scale, causal, kp, W, softcap, drop, docs, bias = args
    step = _Step(r, j, p, c, S_pad, causal, W, kp, docs)
    grads = []
    for qrows, krows, blk_causal, blk_window, band in step.calls:
        qb, ob, db, lb = (half(name, t, qrows) for name, t in
                          (("q", qd), ("o", o), ("dout", dout), ("lse", lse)))
        kb = _rows(cur[0], krows, c).contiguous()
        vb = _rows(cur[1], krows, c).contiguous()
        want_db = bias is not None and bias.grad is not None
        bblk = None if bias is None else bias.block(r, j, qrows, krows)
        mask, pos = step.mask(qrows, krows, band), _positions(drop, r, j, p, c, qrows, krows)
        if _torch_blocks(qb):
            dqb, dkb, dvb, ds = ring_blocks.block_backward(qb, kb, vb, ob, db, lb, scale, blk_causal, blk_window,
                                                           bblk, mask, drop, softcap, pos, want_db)
            CALLS["torch_backward"] += 1
        else:
            dqb, dkb, dvb = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
            ds = torch.empty(*qb.shape[:3], kb.shape[2], dtype=torch.float32) if want_db else None
            _C.attention_backward(qb, kb, vb, ob, db, lb, dqb, dkb, dvb, ds, scale, blk_causal,
                                  blk_window, None, bblk, mask, *(drop or (0.0, 0)), softcap, *pos)
            CALLS["kernel_backward"] += 1
        if want_db:
            bias.add_grad(ds, r, j, qrows, krows)
        _rows(dq, qrows, c).add_(dqb)
        grads.append((krows, dkb, dvb))
    return grads


def _chain_backward(ring, r, p, c, S_pad, kf, kb, qd, kd, vd, o, dout, lse, dq, half, args):
    """Backward when the K/V travel kf hops forward and kb backward
    (chains() < the plain ring): the K/V travel as in forward and each
    step's dk / dv partials for its owner are kept (float32, at most
    kf + kb of them); then each chain's partials go home against its
    direction in k hops, summed on the way: at hop h rank r sends the sum
    for owner r - k + h - 1 (forward chain) received at hop h-1 plus its own
    partial, so that after hop k every owner holds the sum over the ranks
    its K/V visited.  Returns (dk, dv) of our own K/V, float32."""
    own = torch.zeros((2, *kd.shape), dtype=torch.float32, device=kd.device)
    partial = {1: {}, -1: {}}
    steps = _schedule(r, p, kf, kb)
    for (chain, t, owner), (_j, cur) in zip(steps, _travel(ring, r, p, kf, kb, kd, vd)):
        acc = own if chain == 0 else torch.zeros_like(own)
        for krows, dkb, dvb in _backward_blocks(r, owner, p, c, S_pad, cur, qd, o, dout, lse, dq, half, args):
            _rows(acc[0], krows, c).add_(dkb)
            _rows(acc[1], krows, c).add_(dvb)
        if chain:
            partial[chain][t] = acc
    for chain, k in ((1, kf), (-1, kb)):
        if k == 0:
            continue
        send = partial[chain][k]
        for h in range(1, k + 1):
            got = torch.empty_like(send)
            _Ring.wait(ring.exchange(send, got, _TAG_DKV[chain], -chain))
            send = got.add_(partial[chain][k - h]) if h < k else own.add_(got)
    return own[0], own[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal, kp, W, softcap, drop, docs, bias):
        qd, kd, vd = ops._data(q, "ring_attention q"), ops._data(k, "ring_attention k"), \
            ops._data(v, "ring_attention v")
        p, r = D.world_size(group), D.rank(group)
        B, Hq, n, Dh = qd.shape
        c = n // 2
        S_pad = n * p
        ring = _Ring(group, p, r, qd.device) if p > 1 else None
        CALLS["forward"] += 1

        dev = qd.device
        o_acc = torch.zeros(qd.shape, dtype=torch.float32, device=dev)      # running (o, lse), float32;
        lse_acc = torch.full(qd.shape[:3], -math.inf, dtype=torch.float32, device=dev)  # -inf: none yet
        in_torch = _torch_blocks(qd)
        half = _Halves(c)
        bd = None if bias is None else bias.detach()
        blocks = None if bd is None else _Bias(bd, S_pad, p, c)
        for j, cur in _travel(ring, r, p, *chains(p, c, causal, W), kd, vd):
            step = _Step(r, j, p, c, S_pad, causal, W, kp, docs)
            for qrows, krows, blk_causal, blk_window, band in step.calls:
                qb = half("q", qd, qrows)
                kb = _rows(cur[0], krows, c).contiguous()
                vb = _rows(cur[1], krows, c).contiguous()
                bblk = None if blocks is None else blocks.block(r, j, qrows, krows)
                mask, pos = step.mask(qrows, krows, band), _positions(drop, r, j, p, c, qrows, krows)
                if in_torch:
                    ob, lb = ring_blocks.block_forward(qb, kb, vb, scale, blk_causal, blk_window, bblk,
                                                       mask, drop, softcap, pos)
                    CALLS["torch_forward"] += 1
                else:
                    ob = torch.empty_like(qb)
                    lb = torch.empty(qb.shape[:3], dtype=torch.float32)
                    _C.attention_forward(qb, kb, vb, ob, lb, scale, blk_causal, blk_window, None, bblk,
                                         mask, *(drop or (0.0, 0)), softcap, *pos)
                    CALLS["kernel_forward"] += 1
                _merge(_rows(o_acc, qrows, c), _rows(lse_acc, qrows, c), ob, lb)
        lse = lse_acc.masked_fill_(lse_acc == -math.inf, math.inf)   # kernel convention: all masked = +inf
        o = o_acc.to(qd.dtype)
        ctx.save_for_backward(qd, kd, vd, o, lse, bd)
        ctx.args = (group, scale, causal, kp, W, softcap, drop, docs)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qd, kd, vd, o, lse, bd = ctx.saved_tensors
        o = o.detach()
        group, scale, causal, kp, W, softcap, drop, _docs = ctx.args
        p, r = D.world_size(group), D.rank(group)
        dout = ops._data(dout, "ring_attention grad").to(qd.dtype).contiguous()
        B, Hq, n, Dh = qd.shape
        c = n // 2
        S_pad = n * p
        ring = _Ring(group, p, r, qd.device) if p > 1 else None
        CALLS["backward"] += 1

        half = _Halves(c)
        dq = torch.zeros(qd.shape, dtype=torch.float32, device=qd.device)
        bias = None if bd is None else _Bias(bd, S_pad, p, c, want_grad=ctx.needs_input_grad[11])
        args = ctx.args + (bias,)
        dt = qd.dtype

        def bias_grad():
            return None if bias is None or bias.grad is None else bias.grad.to(bd.dtype)

        hops = chains(p, c, causal, W)
        if hops != (p - 1, 0):
            dk, dv = _chain_backward(ring, r, p, c, S_pad, *hops, qd, kd, vd, o, dout, lse, dq, half, args)
            return dq.to(dt), dk.to(dt), dv.to(dt), None, None, None, None, None, None, None, None, bias_grad()
        cur = torch.stack([kd, vd]) if p > 1 else (kd, vd)
        spare = torch.empty_like(cur) if p > 1 else None
        acc = torch.zeros((2, *kd.shape), dtype=torch.float32, device=kd.device)  # dk, dv of owner j
        acc_next = torch.empty_like(acc) if p > 1 else None
        acc_handles = None
        for s in range(p):
            j = (r - s) % p
            kv_handles = ring.exchange(cur, spare, _TAG_KV[1]) if s < p - 1 else None
            grads = _backward_blocks(r, j, p, c, S_pad, cur, qd, o, dout, lse, dq, half, args)
            if acc_handles is not None:                # owner j's accumulator, from rank r-1
                _Ring.wait(acc_handles)
                acc, acc_next = acc_next, acc
            for krows, dkb, dvb in grads:
                _rows(acc[0], krows, c).add_(dkb)
                _rows(acc[1], krows, c).add_(dvb)
            if p > 1:                                  # on to r+1, which holds owner j's K/V next
                acc_handles = ring.exchange(acc, acc_next, _TAG_DKV[1])
            if kv_handles is not None:
                _Ring.wait(kv_handles)
                cur, spare = spare, cur
        if acc_handles is not None:                    # the last hop: our own dk, dv come home
            _Ring.wait(acc_handles)
            acc = acc_next
        return dq.to(dt), acc[0].to(dt), acc[1].to(dt), None, None, None, None, None, None, None, None, bias_grad()


# ---- the entry point ------------------------------------------------------------------

def ring_attention(q, k, v, group=None, *, scale: float | None = None, causal: bool = True,
                   key_padding: torch.Tensor | None = None, softcap: float | None = None,
                   dropout_p: float = 0.0, window: int | None = None, seed: int | None = None,
                   bias: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over a sequence split in zigzag order over `group`.

    q [B, Hq, 2c, D], k / v [B, Hkv, 2c, D] (Hq a multiple of Hkv): this
    rank's local rows, chunks r and 2p-1-r of the padded sequence of
    S' = 2cp rows (zigzag_rows(S', p, r)); CPU or CUDA float32 / float16 / bfloat16,
    the same shapes on every rank.  Returns o [B, Hq, 2c, D] (the input's
    dtype): full attention over the whole sequence, restricted to this rank's
    rows (see the module docstring for the math):

        o_i = sum_j softmax_j(scale q_i . k_j  + -inf where masked) v_j

    scale: default 1 / sqrt(D).  causal: key j visible to query i only when
    j <= i in GLOBAL positions (False: every key, for encoders).
    key_padding: None or bool [B, S'] over the FULL padded sequence, the same
    on every rank, True = attend; padded key rows must be False there unless
    (causal) they lie after every real query.  A query row with no visible
    key returns 0 (and gets zero gradients).  Differentiable in q, k, v;
    gradients equal those of full attention.  A collective over `group`:
    every rank calls it at the same point.

    window: None / 0 (none) or W > 0, a sliding window in GLOBAL positions:
    causal, key j visible to query i iff j <= i and i - j < W (HF's
    sliding_window_causal); not causal, iff |i - j| < W.  Composes with
    key_padding; gradients stay exact.

    softcap: None / 0 (none) or a finite cap > 0: each logit becomes
    softcap tanh(scale q_i . k_j / softcap) before the masks (Gemma 2).

    dropout_p: attention dropout in [0, 1] (the caller passes 0 outside
    training); seed: the draws' seed, the same on every rank (None: group
    rank 0 draws one and broadcasts it).  The draws are those of one kernel
    call over the whole padded sequence: ops.attention_dropout_mask(
    [B, Hq, S', S'], dropout_p, seed) (see the module docstring).

    bias: None or an additive floating-point bias [1 or B, Hq, S', S'] over
    the WHOLE padded sequence in global positions, the same on every rank
    (T5's relative position bias): s_ij = scale q_i . k_j + bias_ij.  No
    bias travels: each block adds the rows of this rank's query chunk and
    the columns of the key chunk it holds.  Differentiable: its gradient
    holds this rank's query rows (the softmax gradient of each computed
    block, summed over a broadcast batch) and 0 elsewhere, so summing it
    over the group gives the whole bias's gradient.

    documents: None or an integer tensor [B, S'] over the WHOLE padded
    sequence, the same on every rank: the document of each row (packed
    sequences).  Key j is then visible to query i only when documents[b, i]
    == documents[b, j], on top of the other masks: each block and-s the
    equality of its rows' and columns' documents into its mask (the
    block-diagonal mask of packed sequences, never built whole).
    """
    cap = ops.check_softcap(softcap, "ring_attention")
    dropout_p = float(dropout_p or 0.0)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"ring_attention: dropout_p must be in [0, 1], got {dropout_p}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"ring_attention: seed must be an int or None, got {type(seed).__name__}")
    ops.check_qkv(q, k, v, "ring_attention", cuda=True)
    B, Hq, n, Dh = q.shape
    if k.shape[2] != n:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in local rows")
    if n % 2:
        raise ValueError(f"ring_attention: {n} local rows; the zigzag layout gives each rank two chunks "
                         f"of c rows (2c, even)")
    if Dh == 0:
        raise ValueError("ring_attention: head size 0")
    p = D.world_size(group)
    S_pad = n * p
    kp = None
    if key_padding is not None:
        if key_padding.dtype != torch.bool:
            raise TypeError(f"ring_attention: key_padding must be bool (True = attend), got {key_padding.dtype}")
        if tuple(key_padding.shape) != (B, S_pad):
            raise ValueError(f"ring_attention: key_padding of shape {tuple(key_padding.shape)}, expected "
                             f"[B, S'] = [{B}, {S_pad}] (the full padded sequence: {p} ranks x {n} rows)")
        # [B, S'] of bytes: the blocks' masks are cut from it on the CPU (ring_blocks moves them)
        kp = key_padding.cpu().contiguous().view(torch.uint8)
    W = math.inf
    if window is not None:
        if isinstance(window, bool) or int(window) != window or window < 0:
            raise ValueError(f"ring_attention: window must be a non-negative integer (0 / None: none), "
                             f"got {window!r}")
        if 0 < window < S_pad:      # a window of S' or more never hides a pair
            W = int(window)
    if bias is not None:
        if not (isinstance(bias, torch.Tensor) and bias.dtype.is_floating_point):
            raise TypeError(f"ring_attention: bias must be a floating-point tensor, got {type(bias).__name__}"
                            + (f" {bias.dtype}" if isinstance(bias, torch.Tensor) else ""))
        if bias.dim() != 4 or bias.shape[0] not in (1, B) or tuple(bias.shape[1:]) != (Hq, S_pad, S_pad):
            raise ValueError(f"ring_attention: bias of shape {tuple(bias.shape)}, expected [1 or {B}, {Hq}, "
                             f"{S_pad}, {S_pad}] (the whole padded sequence)")
        if bias.device != q.device:
            raise ValueError(f"ring_attention: bias is on {bias.device}, expected q's device {q.device}")
    docs = None
    if documents is not None:
        if not isinstance(documents, torch.Tensor) or documents.dtype.is_floating_point or \
                documents.dtype == torch.bool:
            raise TypeError(f"ring_attention: documents must be an integer tensor, got "
                            f"{getattr(documents, 'dtype', type(documents).__name__)}")
        if tuple(documents.shape) != (B, S_pad):
            raise ValueError(f"ring_attention: documents of shape {tuple(documents.shape)}, expected [B, S'] = "
                             f"[{B}, {S_pad}] (the full padded sequence: {p} ranks x {n} rows)")
        docs = documents.cpu().to(torch.int64).contiguous()   # [B, S']: masks are cut from it on the CPU
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    drop = None
    if dropout_p > 0:
        drop = (dropout_p, _group_seed(group, p) if seed is None else int(seed))
    return _RingAttention.apply(q, k, v, group, scale, bool(causal), kp, W, cap, drop, docs, bias)
