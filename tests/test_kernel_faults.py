"""Bad sizes, aliasing and out-of-range indices against the C kernels, the
shard copies and the layers (issue 11, classes 1, 5, 6 and 10).

Class 1 (sizes): a tensor with a zero dimension may have others near 2**62
(torch.empty(0, 2**62) is legal and costs nothing), so a kernel must neither
trust the products of its dimensions nor loop over rows of nothing.  Each
entry point family gets such inputs and must give the correct empty result
or a clear ValueError / OverflowError, at once.  The cases run in a child
process (test_sizes_* share one; a case that crashes it or outlives its
watchdog fails alone and the child is restarted for the rest), so a
segfault or a kernel looping with the GIL released fails the test instead
of killing or hanging pytest.

Class 5 (aliasing): no C entry point writes into memory that another of its
tensors uses (an output overlapping an input or another output), nor into a
destination whose elements share memory (expand(), as_strided); the one
declared in-place use (the cross-entropy gradient into its logits) stays.
copy_shard / place_shard read a source that shares memory with their
destination from a copy, so their result is that of separate tensors.

Class 6 (indices): token ids and labels outside [0, V) (V the real,
unpadded vocabulary) raise IndexError as the unsharded model does, on one
process and on every rank of TP = 2 and 4 (checked locally: ids and labels
are the same on every rank).

Class 10: head size 0 gives torch's empty attention result, and no
PyErr_Format in csrc/ is handed a float conversion it does not know.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardformer import _C, ops

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
HUGE = 2**62
WATCHDOG_S = 30       # one case; the legitimate ones take milliseconds


def _empty_or_refused(fn, shape=None):
    """fn() gives an empty result (of `shape`) or a ValueError / OverflowError."""
    try:
        out = fn()
    except (ValueError, OverflowError):
        return None
    if shape is not None:
        assert tuple(out.shape) == tuple(shape), (tuple(out.shape), shape)
    return out


# ---- class 1: sizes (each function is one case, run in the child) -----------

def sizes_norms():
    x = torch.empty(0, HUGE)
    assert ops.layer_norm(x, [HUGE]).shape == (0, HUGE)
    for rms in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(0, 2**40, dtype=dtype, requires_grad=True)
            y = ops.rms_norm(x, [2**40]) if rms else ops.layer_norm(x, [2**40])
            y.sum().backward()       # used to ask calloc for terabytes of partial sums
            assert x.grad.shape == x.shape
    dy = torch.empty(0, HUGE)
    _C.norm_backward(True, dy, dy, None, None, torch.empty(0), torch.empty(0, HUGE), None, None)
    x = torch.empty(3, 0, requires_grad=True)
    ops.layer_norm(x, [0]).sum().backward()
    assert x.grad.shape == (3, 0)


def sizes_gelu_swiglu():
    for approximate in ("none", "tanh"):
        x = torch.empty(2**50, 0, requires_grad=True)     # 2**50 rows of nothing: no loop
        b = torch.empty(0, requires_grad=True)
        y = ops.bias_gelu(x, b, approximate)
        assert y.shape == (2**50, 0)
        y.sum().backward()
        assert x.grad.shape == x.shape and b.grad.shape == (0,)
    g = torch.empty(2**50, 0, requires_grad=True)
    ops.swiglu(g, g).sum().backward()
    assert ops.swiglu(torch.empty(0, HUGE), torch.empty(0, HUGE)).shape == (0, HUGE)
    _C.bias_gelu_backward(torch.empty(0, HUGE), torch.empty(0, HUGE), None, False,
                          torch.empty(0, HUGE), None)


def sizes_bias_dropout_add():
    x = torch.empty(2**50, 0, requires_grad=True)
    b = torch.empty(0, requires_grad=True)
    y = ops.bias_dropout_add(x, b, x, 0.5, seed=3)
    assert y.shape == (2**50, 0)
    y.sum().backward()
    assert b.grad.shape == (0,)
    _C.bias_dropout_add_backward(torch.empty(0, HUGE), 0.1, 0, torch.empty(0, HUGE), None)


def sizes_vocab_embedding():
    w = torch.empty(2**40 + 10, 0, requires_grad=True)     # a huge vocabulary of empty rows
    out = ops.vocab_embedding(torch.tensor([5, 2**40 + 3]), w, vocab_size=2**40 + 10)
    assert out.shape == (2, 0)
    out.sum().backward()
    assert ops.vocab_embedding(torch.zeros(0, dtype=torch.int64), torch.empty(0, HUGE), 0, 0).shape \
        == (0, HUGE)
    # the zero-size weight of huge width: the output size is checked, not wrapped
    _empty_or_refused(lambda: _C.embedding_forward(torch.empty(0, 2**40), torch.zeros(4, dtype=torch.int64),
                                                   0, 0, torch.empty(0)))
    _C.embedding_backward(torch.empty(0, HUGE, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64), 0,
                          0, -1, torch.empty(0, HUGE))
    # id - vocab_start must not overflow: a negative shard start is refused
    with pytest.raises(ValueError, match="vocab_start=-1 must be >= 0"):
        _C.embedding_forward(torch.randn(4, 3), torch.tensor([2**63 - 1]), -1, 4, torch.empty(1, 3))


def sizes_cross_entropy():
    z = torch.empty(0, 2**60)
    y = torch.zeros(0, dtype=torch.int64)
    stats = ops.xent_stats(z, y, 0, 2**60, -100, True, vocab_size=2**60)
    assert all(s.shape == (0,) for s in stats)
    assert ops.xent_grad(z, y, 0, 2**60, -100, torch.empty(0), torch.empty(0), 0.1, 2**60).shape == z.shape
    from shardformer.layer import cross_entropy_1d

    zz = torch.empty(0, 2**40, requires_grad=True)
    loss = cross_entropy_1d(zz, y, vocab_size=2**40, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and zz.grad.shape == zz.shape
    with pytest.raises(ValueError, match="vocab_start=-1 must be >= 0"):
        ops.xent_stats(torch.randn(2, 4), torch.tensor([2**63 - 1, 0]), -1, 4, -100, False)


def sizes_attention():
    q = torch.empty(1, 1, 2**40, 0)           # head size 0 and Sq = Sk = 2**40: empty result
    assert ops.attention(q, q, q, scale=1.0).shape == q.shape
    # the kernels themselves (Sq x Sk = 2**51 pairs of nothing): refused / done at once
    q, k = torch.empty(1, 1, 2**20, 0), torch.empty(1, 1, 2**31, 0)
    lse = torch.zeros(1, 1, 2**20)
    with pytest.raises(ValueError, match="head size D=0"):
        _C.attention_forward(q, k, k, torch.empty_like(q), lse, 1.0, False, 0, None, None, None, 0.0, 0)
    _C.attention_backward(q, k, k, q, q, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(k),
                          None, 1.0, True, 0, None, None, None, 0.0, 0)
    assert ops.attention_dropout_mask((2**40, 1, 1, 0), 0.5, 1).shape == (2**40, 1, 1, 0)
    # a window no distance reaches is no window (a huge one used to overflow the index math)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    for causal in (False, True):
        torch.testing.assert_close(ops.attention(q, k, k, causal=causal, window=2**63 - 1),
                                   ops.attention(q, k, k, causal=causal), rtol=0, atol=0)


def sizes_copy_shard():
    _C.copy_shard(torch.empty(0, 2**60), torch.empty(0, 2**40), 1, [(0, 2**40)])
    _C.place_shard(torch.empty(2**40, 0), torch.empty(2**20, 0), 0, [(5, 2**20)])
    _C.copy_shard(torch.ones(1).expand(2**40)[:0], torch.empty(0), 0, [])
    # strides whose reach overflows int64 bytes (a NumPy as_strided view): refused before any read
    src = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(5,), strides=(2**61,))
    with pytest.raises(OverflowError, match="full: the memory its strides reach overflows"):
        _C.copy_shard(src, np.zeros(5, np.float32), 0, [(0, 5)])
    with pytest.raises(OverflowError, match="shard: the memory its strides reach overflows"):
        _C.place_shard(np.zeros(5, np.float32), src, 0, [(0, 5)])


SIZE_CASES = [sizes_norms, sizes_gelu_swiglu, sizes_bias_dropout_add, sizes_vocab_embedding,
              sizes_cross_entropy, sizes_attention, sizes_copy_shard]

_CHILD = r"""
import faulthandler, sys, traceback
sys.path.insert(0, sys.argv[1])
import test_kernel_faults as m
for name in sys.argv[3:]:
    print("START", name, flush=True)
    faulthandler.dump_traceback_later(int(sys.argv[2]), exit=True)
    try:
        getattr(m, name)()
        print("OK", name, flush=True)
    except BaseException:
        print("FAIL", name, repr(traceback.format_exc()), flush=True)
    faulthandler.cancel_dump_traceback_later()
"""


def _run_cases(names):
    """{name: (passed, detail)}, each case in a child process with a watchdog;
    a case that kills the child (crash, watchdog) fails alone."""
    results, todo = {}, list(names)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    while todo:
        proc = subprocess.run([sys.executable, "-c", _CHILD, TESTS_DIR, str(WATCHDOG_S), *todo],
                              capture_output=True, text=True, env=env, timeout=60 + WATCHDOG_S * len(todo))
        current = None
        for line in proc.stdout.splitlines():
            word, _, rest = line.partition(" ")
            name, _, detail = rest.partition(" ")
            if word == "START":
                current = name
            elif word in ("OK", "FAIL") and name == current:
                results[name] = (word == "OK", detail)
                current = None
        done = [n for n in todo if n in results]
        if current is not None:           # the child died in this case
            results[current] = (False, f"child exited with {proc.returncode} in this case (crash or "
                                       f"longer than {WATCHDOG_S} s):\n{proc.stderr[-3000:]}")
        elif len(done) < len(todo) and not done:
            results.update({n: (False, f"child exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
                            for n in todo})
        todo = [n for n in todo if n not in results]
    return results


@pytest.fixture(scope="module")
def size_results():
    return _run_cases([f.__name__ for f in SIZE_CASES])


@pytest.mark.parametrize("case", [f.__name__ for f in SIZE_CASES])
def test_sizes(size_results, case):
    passed, detail = size_results[case]
    assert passed, detail


# ---- class 5: aliasing and strides --------------------------------------------

def _f(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _attn_tensors():
    q, k, v = _f(1, 2, 6, 4, seed=1), _f(1, 2, 7, 4, seed=2), _f(1, 2, 7, 4, seed=3)
    return q, k, v


ATT = (0.5, False, 0, None, None, None, 0.0, 0)


def _writers():
    """(entry point, builder) for every C entry point that writes: the builder
    takes `alias(name)`, which hands back the tensor the output should be, and
    returns the argument tuple."""
    x, w = _f(3, 8), torch.ones(8)
    zbuf, y = _f(40), torch.tensor([1, 2, 3, 0])
    z, z_shifted = zbuf[:32].view(4, 8), zbuf[8:].view(4, 8)      # one row apart in one buffer
    ids, table = torch.tensor([0, 3, 1]), _f(5, 8)
    dwbuf = torch.zeros(40)                    # dout inside dweight's memory
    q, k, v = _attn_tensors()
    lse = torch.empty(1, 2, 6)
    return [
        ("norm_forward", lambda a: (False, x, w, None, 1e-5, a(torch.empty(3, 8), x), None, torch.empty(3))),
        ("norm_backward", lambda a: (True, x, x.clone(), w, None, torch.ones(3), a(torch.empty(3, 8), x),
                                     None, None)),
        ("bias_gelu_forward", lambda a: (x, None, False, a(torch.empty(3, 8), x))),
        ("bias_gelu_backward", lambda a: (x, x.clone(), None, False, a(torch.empty(3, 8), x), None)),
        ("swiglu_forward", lambda a: (x, x.clone(), a(torch.empty(3, 8), x))),
        ("swiglu_backward", lambda a: (x, x.clone(), x.clone(), torch.empty(3, 8), a(torch.empty(3, 8), x))),
        ("bias_dropout_add_forward", lambda a: (x, None, x.clone(), 0.0, 0, a(torch.empty(3, 8), x))),
        ("bias_dropout_add_backward", lambda a: (x, 0.0, 0, a(torch.empty(3, 8), x), None)),
        ("embedding_forward", lambda a: (table, ids, 0, 5, a(torch.empty(3, 8), table[:3]))),
        ("embedding_backward", lambda a: (dwbuf[:24].view(3, 8), ids, 0, 5, -1,
                                          a(torch.zeros(5, 8), dwbuf.view(5, 8)))),
        ("xent_forward", lambda a: (z, y, 0, 8, -100, torch.empty(4), a(torch.empty(4), z[0, :4]),
                                    torch.empty(4), None)),
        ("xent_backward", lambda a: (z, y, 0, 8, -100, torch.zeros(4), torch.ones(4), 0.0, 8,
                                     a(torch.empty(4, 8), z_shifted))),
        ("attention_forward", lambda a: (q, k, v, a(torch.empty_like(q), q), lse) + ATT),
        ("attention_backward", lambda a: (q, k, v, q.clone(), q.clone(), torch.zeros(1, 2, 6), torch.empty_like(q),
                                          a(torch.empty_like(k), v), torch.empty_like(v), None) + ATT),
        ("attention_dropout_keep", None),
        ("kernel_convert", lambda a: (x, a(torch.empty(3, 8), x))),
    ]


@pytest.mark.parametrize("entry", [e for e, b in _writers() if b is not None])
def test_outputs_may_not_overlap_inputs(entry):
    """Every writing entry point refuses an output sharing memory with an
    input (before: a silently wrong result), and accepts a separate one."""
    build = dict(_writers())[entry]
    fn = getattr(_C, entry)
    fn(*build(lambda fresh, alias: fresh))                   # separate: fine
    with pytest.raises(ValueError, match=rf"^{entry}: .* overlaps .* in memory"):
        fn(*build(lambda fresh, alias: alias.view(fresh.shape) if alias.numel() == fresh.numel()
                  else alias))


def test_attention_output_aliasing_inputs_refused():
    """out = q, k or v, out overlapping part of v, lse inside out, and the
    backward's gradients over their inputs: refused (each gave wrong numbers);
    disjoint views of one buffer are fine and exact."""
    q, k, v = _attn_tensors()
    ref = ops.attention(q, k, v, scale=0.5)
    for name, t in (("q", q), ("k", k), ("v", v)):
        target = t.clone()
        args = [q, k, v]
        args[["q", "k", "v"].index(name)] = target
        out = target if target.shape == q.shape else None
        if out is None:      # k, v are [1, 2, 7, 4]: an out of q's shape inside them
            out = target.reshape(-1)[: q.numel()].view(q.shape)
        with pytest.raises(ValueError, match=f"out overlaps {name} in memory"):
            _C.attention_forward(*args, out, torch.empty(1, 2, 6), *ATT)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="out overlaps the output lse"):
        _C.attention_forward(q, k, v, out, out.reshape(-1)[:12].view(1, 2, 6), *ATT)
    buf = torch.empty(q.numel() * 2 + 12)
    out, lse = buf[: q.numel()].view(q.shape), buf[q.numel(): q.numel() + 12].view(1, 2, 6)
    _C.attention_forward(q, k, v, out, lse, *ATT)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with pytest.raises(ValueError, match="dk overlaps the output dv"):
        _C.attention_backward(q, k, v, out, q, lse, dq, dk, dk, None, *ATT)
    with pytest.raises(ValueError, match="dq overlaps dout"):
        dout = q.clone()
        _C.attention_backward(q, k, v, out, dout, lse, dout, dk, dv, None, *ATT)


def test_xent_backward_in_place_stays():
    """The declared in-place use: the gradient written over its own logits
    (cross_entropy_1d(inplace_backward=True)); a partial overlap is refused."""
    from shardformer.layer import cross_entropy_1d

    z = _f(4, 8, seed=5)
    y = torch.tensor([1, 2, 3, 0])
    ref = ops.xent_grad(z, y, 0, 8, -100, torch.zeros(4), torch.ones(4), 0.0, 8)
    z2 = z.clone()
    _C.xent_backward(z2, y, 0, 8, -100, torch.zeros(4), torch.ones(4), 0.0, 8, z2)
    torch.testing.assert_close(z2, ref, rtol=0, atol=0)
    zz = z.clone().requires_grad_()
    cross_entropy_1d(zz * 1, y, vocab_size=8, inplace_backward=True).backward()
    zr = z.clone().requires_grad_()
    F.cross_entropy(zr, y).backward()
    torch.testing.assert_close(zz.grad, zr.grad)
    zbuf = torch.cat([z.reshape(-1), torch.zeros(8)])
    with pytest.raises(ValueError, match="xent_backward: grad overlaps logits"):
        _C.xent_backward(zbuf[:32].view(4, 8), y, 0, 8, -100, torch.zeros(4), torch.ones(4), 0.0, 8,
                         zbuf[8:].view(4, 8))


def test_copy_destinations_may_not_overlap_themselves():
    """An expand()ed destination (stride 0) and an as_strided one whose
    elements share memory are refused, before anything is written."""
    full = torch.arange(8.0).view(2, 4)
    dst = torch.zeros(1, 2).expand(2, 2)
    with pytest.raises(ValueError, match="shard: dimension 0 has size 2 but stride 0"):
        _C.copy_shard(full, dst, 1, [(0, 2)])
    assert torch.equal(dst, torch.zeros(2, 2))
    target = torch.zeros(4).expand(2, 4)
    with pytest.raises(ValueError, match="full: dimension 0 has size 2 but stride 0"):
        _C.place_shard(target, torch.ones(2, 2), 1, [(0, 2)])
    assert torch.equal(target, torch.zeros(2, 4))
    base = torch.zeros(4)
    inter = base.as_strided((3, 2), (1, 1))
    with pytest.raises(ValueError, match=r"shard: dimension 1 \(size 2, stride 1\) steps into the span"):
        _C.copy_shard(full[:, :2].repeat(2, 1)[:3], inter, 1, [(0, 2)])
    assert torch.equal(base, torch.zeros(4))
    # reading through a stride 0 (a broadcast source) stays fine
    out = torch.empty(3, 2)
    _C.copy_shard(torch.ones(1, 4).expand(3, 4), out, 1, [(1, 2)])
    assert torch.equal(out, torch.ones(3, 2))


def test_copy_source_sharing_memory_is_read_first():
    """A source that shares memory with the destination reads as it was
    before the call, whatever the order of the ranges (several ranges used to
    read values the earlier ones had just written)."""
    x = torch.arange(8.0)
    _C.copy_shard(x, x, 0, [(4, 2), (0, 2)])
    assert x.tolist() == [4, 5, 0, 1, 0, 0, 0, 0]
    y = torch.arange(8.0)
    _C.place_shard(y, y[2:6], 0, [(4, 2), (0, 2)])
    assert y.tolist() == [4, 5, 2, 3, 2, 3, 6, 7]
    z = torch.arange(24.0).view(4, 6)
    ref = z.clone()
    _C.copy_shard(z.t(), z[:, :4].t(), 0, [(3, 2), (0, 2)])      # transposed, interleaved
    assert torch.equal(z[:, :4].t(), torch.cat([ref.t()[3:5], ref.t()[0:2]]))
    # disjoint column blocks of one buffer: extents interleave, results exact
    w = torch.arange(12.0).view(3, 4)
    _C.copy_shard(w[:, :2], w[:, 2:], 1, [(1, 1), (0, 1)])
    assert w.tolist() == [[0, 1, 1, 0], [4, 5, 5, 4], [8, 9, 9, 8]]


# ---- class 6: out-of-range token ids and labels -----------------------------

def _oob_message(i, vocab):
    return re.escape(f"index {i} is out of range for the vocabulary of {vocab} "
                     f"(token ids must be in [0, {vocab}))")


def test_kernel_refuses_out_of_range_ids_and_labels():
    w = _f(10, 4)
    for bad in (10, -1, 2**63 - 1, -(2**63)):
        with pytest.raises(IndexError, match=_oob_message(bad, 10)):
            _C.embedding_forward(w, torch.tensor([1, bad, 3]), 0, 10, torch.empty(3, 4), 10)
        with pytest.raises(IndexError, match=_oob_message(bad, 10)):
            ops.vocab_embedding(torch.tensor([[1, bad]]), w, vocab_size=10)
    # a shard's view: ids of other shards are zeros, ids past the real vocabulary raise
    out = ops.vocab_embedding(torch.tensor([0, 9, 5]), w[:6], vocab_start=4, vocab_real=6, vocab_size=10)
    assert torch.equal(out, torch.stack([torch.zeros(4), w[5], w[1]]))
    with pytest.raises(IndexError, match=_oob_message(10, 10)):       # a padding row of the shard
        ops.vocab_embedding(torch.tensor([10]), w[:8], vocab_start=4, vocab_real=6, vocab_size=10)
    z = _f(4, 12)
    for bad in (10, 11, -1, -101):
        with pytest.raises(IndexError, match=rf"xent_forward: label {bad} \(row 2\) is out of range for "
                                             r"the vocabulary of 10 \(labels must be in \[0, 10\) or "
                                             r"ignore_index=-100\)"):
            ops.xent_stats(z, torch.tensor([1, -100, bad, 0]), 0, 10, -100, False, vocab_size=10)
    ops.xent_stats(z, torch.tensor([1, -100, 9, 0]), 0, 10, -100, False, vocab_size=10)   # fine


def test_cross_entropy_1d_out_of_range_labels_single_process():
    from shardformer.layer import cross_entropy_1d

    z = _f(2, 3, 7, seed=4)
    with pytest.raises(IndexError):           # what the unsharded loss does
        F.cross_entropy(z.reshape(-1, 7), torch.tensor([0, 1, 7, 2, 3, 4]))
    for bad in (7, -1, 100):
        labels = torch.tensor([[0, 1, bad], [2, 3, -100]])
        with pytest.raises(IndexError, match=f"label {bad} .* out of range for the vocabulary of 7"):
            cross_entropy_1d(z, labels, vocab_size=7)
    # a custom ignore_index is still ignored, -100 then is not
    labels = torch.tensor([[0, 1, 5], [2, 3, -1]])
    loss = cross_entropy_1d(z, labels, vocab_size=7, ignore_index=-1)
    torch.testing.assert_close(loss, F.cross_entropy(z.reshape(-1, 7), labels.reshape(-1), ignore_index=-1))
    with pytest.raises(IndexError, match="label -100"):
        cross_entropy_1d(z, torch.tensor([[0, 1, -100], [2, 3, 4]]), vocab_size=7, ignore_index=-1)


def oob_on_ranks(ctx, vocab: int):
    """Run on every rank: sharded embedding (C path and torch path) and
    cross_entropy_1d with ids / labels outside [0, vocab) raise IndexError, in
    range they match the unsharded layers."""
    from shardformer.layer import VocabParallelEmbedding1D, VocabParallelLMHead1D, cross_entropy_1d

    torch.manual_seed(0)
    messages = []
    for dtype in (torch.float32, torch.float64):     # float64: not a kernel dtype, the torch path
        emb = torch.nn.Embedding(vocab, 6).to(dtype)
        par = VocabParallelEmbedding1D.from_native_module(emb, ctx.group, make_vocab_size_divisible_by=4)
        ids = torch.tensor([[0, vocab - 1, 3], [5, 1, 2]])
        torch.testing.assert_close(par(ids), emb(ids))
        padded_id = par.shard.chunk * ctx.tp_size - 1            # a padding row of the last rank
        assert padded_id >= vocab
        for bad in (vocab, padded_id, -1):
            with pytest.raises(IndexError):
                emb(torch.tensor([bad]))
            try:
                par(torch.tensor([[1, bad, 2]]))
            except IndexError as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"{dtype} id {bad} embedded on rank {ctx.rank}")
    lin = torch.nn.Linear(6, vocab, bias=False)
    head = VocabParallelLMHead1D.from_native_module(lin, ctx.group, gather_output=False,
                                                    make_vocab_size_divisible_by=4)
    x = torch.randn(2, 3, 6)
    good = torch.tensor([[0, vocab - 1, -100], [3, 2, 1]])
    loss = cross_entropy_1d(head(x), good, vocab_size=vocab, process_group=ctx.group)
    torch.testing.assert_close(loss, F.cross_entropy(lin(x).reshape(-1, vocab), good.reshape(-1)))
    for bad in (vocab, vocab + 2, -5):
        labels = torch.tensor([[0, bad, -100], [3, 2, 1]])
        try:
            cross_entropy_1d(head(x), labels, vocab_size=vocab, process_group=ctx.group)
        except IndexError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"label {bad} gave a loss on rank {ctx.rank}")
    return messages


@pytest.mark.parametrize("tp", [2, 4])
def test_out_of_range_on_ranks(pool, tp):
    vocab = 37      # padded to 40 (tp 2) or 48 (tp 4): ids 37.. hit padding rows
    per_rank = pool.run(oob_on_ranks, tp, vocab)
    for messages in per_rank:
        assert len(messages) == 9
        assert messages[0] == (f"embedding_forward: index {vocab} is out of range for the vocabulary of "
                               f"{vocab} (token ids must be in [0, {vocab}))")
        assert messages[2].startswith("embedding_forward: index -1 is out of range")
        assert messages[3] == (f"index {vocab} is out of range for the vocabulary of {vocab} "
                               f"(token ids must be in [0, {vocab}))")
        assert messages[6].startswith(f"xent_forward: label {vocab} (row 1) is out of range")
        assert messages[8].startswith("xent_forward: label -5 (row 1)")


# ---- class 10 -------------------------------------------------------------------

def test_attention_head_size_zero_matches_sdpa():
    """D = 0: torch's SDPA returns the empty result (and empty / zero
    gradients); so do we, default scale included (it used to divide by 0)."""
    q = torch.empty(2, 3, 4, 0, requires_grad=True)
    k = torch.empty(2, 3, 5, 0, requires_grad=True)
    bias = torch.randn(1, 3, 4, 5, requires_grad=True)
    out = ops.attention(q, k, k, bias=bias)
    ref = F.scaled_dot_product_attention(q, k, k)
    assert out.shape == ref.shape == (2, 3, 4, 0) and out.dtype == ref.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert torch.equal(bias.grad, torch.zeros_like(bias))
    assert ops.attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), causal=True).dtype == torch.bfloat16


def test_pyerr_format_gets_no_float_conversions():
    """PyErr_Format knows no %g / %f / %e: it printed them literally.  Every
    call in csrc/ formats floats another way (sf_fail's vsnprintf does know
    them)."""
    bad = []
    for path in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True)):
        src = open(path).read()
        for m in re.finditer(r"PyErr_Format\s*\((.*?)\);", src, re.S):
            fmt = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
            if re.search(r"%[-+ #0]*\d*(\.\d+)?[eEfFgGaA]", fmt.replace("%%", "")):
                bad.append(f"{os.path.relpath(path, ROOT)}:{src.count(chr(10), 0, m.start()) + 1}")
    assert not bad, f"PyErr_Format with a float conversion at {bad}"
    with pytest.raises(ValueError, match=r"p=1\.5 outside \[0, 1\]"):
        _C.bias_dropout_add_forward(torch.ones(2, 2), None, torch.ones(2, 2), 1.5, 0, torch.empty(2, 2))
