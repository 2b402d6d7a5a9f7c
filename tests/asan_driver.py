"""The driver of tests/test_asan.py: every C entry point of shardformer._C,
success and error paths, under AddressSanitizer or a reference-leak check.

    python tests/asan_driver.py MODE SO ITERATIONS TESTS_DIR

MODE  "asan": run every scenario ITERATIONS times
      "leaks": warm up, then check allocations do not grow per call
SO    path of the _C build to load as shardformer._C ("-" = the installed one)
TESTS_DIR  tests/, for test_c_core's helpers

See tests/test_asan.py's docstring for how the two modes are judged.  Prints
"DRIVER OK" at the end when every scenario / case passed.
"""
import gc
import importlib.machinery
import importlib.util
import os
import sys
import time

MODE, SO, ITERATIONS = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, sys.argv[4])  # tests/, for test_c_core's helpers

if SO != "-":
    loader = importlib.machinery.ExtensionFileLoader("shardformer._C", SO)
    spec = importlib.util.spec_from_file_location("shardformer._C", SO, loader=loader)
    _C = importlib.util.module_from_spec(spec)
    sys.modules["shardformer._C"] = _C
    loader.exec_module(_C)

import numpy as np
import torch
from torch import nn

import shardformer
import shardformer.layout
from shardformer import _C as C_in_package

if SO != "-":
    assert C_in_package is _C and shardformer.layout._C is _C, "ASan build not in use"
    assert os.path.samefile(_C.__file__, SO)
    shardformer._C = _C
else:
    _C = C_in_package

from test_c_core import FakeTensor, copy_of, layout_cases  # noqa: E402
from shardformer.layout import PerRank  # noqa: E402

INT64_MAX = 2**63 - 1


def expect(exc, fn, *args, match=None, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        if match is not None and match not in str(e):
            raise AssertionError(f"{fn.__name__}: {e!r} does not mention {match!r}")
        return
    raise AssertionError(f"{fn.__name__}{args!r} did not raise {exc.__name__}")


def record(kind, path, owner=None, name=None, value=None, target=None, native=None, kwargs=None,
           plan=None, change=None):
    """A plan record (_C.PlanOp) made by hand."""
    return _C.PlanOp((kind, path, owner, name, value, target, native, kwargs, plan, change))


# --- layout arithmetic --------------------------------------------------------

def scenario_layout_math(i):
    for units in range(0, 9):
        for parts in range(1, 5):
            total = sum(_C.split_units(units, parts, r)[1] for r in range(parts))
            assert total == units
    for h, kv, p in [(8, 2, 4), (6, 2, 4), (7, 1, 3), (32, 8, 4), (5, 5, 2)]:
        q = sum(_C.heads_layout(h, kv, p, r)[1] for r in range(p))
        assert q == h
    for v, p, m in [(10, 3, 4), (1, 4, 1), (50257, 4, 64)]:
        assert sum(_C.vocab_layout(v, p, r, m)[3] for r in range(p)) == v
    expect(ValueError, _C.split_units, 5, 0, 0, match="tensor_parallel_size=0")
    expect(ValueError, _C.split_units, 5, 2, 2, match="rank=2")
    expect(ValueError, _C.split_units, -1, 2, 0)
    expect(TypeError, _C.split_units, "5", 2, 0)
    expect(OverflowError, _C.split_units, 2**64, 2, 0)
    expect(ValueError, _C.heads_layout, 6, 4, 2, 0, match="num_key_value_heads=4")
    expect(ValueError, _C.heads_layout, 4, 3, 4, 0)
    expect(ValueError, _C.heads_layout, 2, 1, 4, 0, match="tensor_parallel_size=4")
    expect(ValueError, _C.heads_layout, 0, 1, 1, 0)
    expect(ValueError, _C.heads_layout, 4, 4, 0, 0)
    expect(ValueError, _C.heads_layout, 4, 4, 2, 5)
    expect(TypeError, _C.heads_layout, 4, 4, 2)
    expect(ValueError, _C.vocab_layout, 0, 2, 0, 1, match="vocab_size=0")
    expect(ValueError, _C.vocab_layout, 10, 2, 0, 0)
    expect(ValueError, _C.vocab_layout, 10, 2, 3, 1)
    expect(ValueError, _C.vocab_layout, 10, 2**62, 0, 4, match="overflows")
    expect(ValueError, _C.vocab_layout, INT64_MAX, 2, 0, 1, match="overflows")
    expect(TypeError, _C.vocab_layout, 10, 2, 0, None)


class Sneaky:
    """An int-like whose __index__ empties a list (the one being parsed)."""

    def __init__(self, victim):
        self.victim = victim

    def __index__(self):
        self.victim.clear()
        return 1


# --- copy_shard / place_shard ---------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]
SHAPES = [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 5)]
GEN = torch.Generator().manual_seed(0)


def variants(shape, dtype):
    base = torch.randint(-50, 50, shape, generator=GEN).to(dtype)
    yield base
    rev = torch.randint(-50, 50, tuple(reversed(shape)), generator=GEN).to(dtype)
    yield rev.permute(*reversed(range(len(shape))))
    big = torch.randint(-50, 50, tuple(2 * s + 1 for s in shape), generator=GEN).to(dtype)
    yield big[tuple(slice(1, None, 2) for _ in shape)]


def scenario_copy_place_torch(i):
    dtype = DTYPES[i % len(DTYPES)]
    shape = SHAPES[(i // len(DTYPES)) % len(SHAPES)]
    for dim in range(len(shape)):
        size = shape[dim]
        range_lists = [[], [(0, size)], [(size - 1, 1), (0, 1)], [(1, size - 2)], [(size, 0)]]
        for full in variants(shape, dtype):
            for ranges in range_lists:
                real = sum(n for _, n in ranges)
                for pad in (0, 3):
                    sshape = list(shape)
                    sshape[dim] = real + pad
                    shard = torch.full(sshape, 9, dtype=dtype)
                    _C.copy_shard(full, shard, dim, ranges)
                    parts = [full.narrow(dim, o, n) for o, n in ranges]
                    zshape = list(shape)
                    zshape[dim] = pad
                    parts.append(torch.zeros(zshape, dtype=dtype))
                    assert torch.equal(shard, torch.cat(parts, dim))
                    back = torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(
                        *reversed(range(len(shape))))
                    _C.place_shard(back, shard, dim, ranges)
                    for o, n in ranges:
                        assert torch.equal(back.narrow(dim, o, n), full.narrow(dim, o, n))
    # Many ranges (a heap-allocated range buffer past pymalloc's small sizes).
    x = torch.arange(200.0)
    many = [(k, 1) for k in range(0, 200, 2)]
    out = torch.empty(100)
    _C.copy_shard(x, out, 0, many)
    assert torch.equal(out, x[::2])
    # Storage offsets and stride-0 sources.
    _C.copy_shard(x[150:], out[:50], 0, [(0, 50)])
    assert torch.equal(out[:50], x[150:])
    e = torch.ones(1, 4).expand(3, 4)
    o = torch.empty(3, 2)
    _C.copy_shard(e, o, 1, [(1, 2)])
    assert torch.equal(o, torch.ones(3, 2))
    # Source and destination in the same memory.
    a = torch.arange(8.0)
    _C.copy_shard(a, a, 0, [(1, 6)])
    assert a.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    z = torch.arange(12.0).reshape(3, 4)
    _C.place_shard(z, z[:, 1:], 1, [(0, 3)])
    # Zero-size tensors.
    _C.copy_shard(torch.empty(0, 4), torch.empty(0, 2), 1, [(1, 2)])
    _C.place_shard(torch.empty(3, 0), torch.empty(3, 0), 0, [(0, 3)])


def scenario_copy_place_numpy(i):
    x = np.arange(30, dtype=np.float32).reshape(5, 6)
    refs = [sys.getrefcount(x)]
    out = np.full((5, 4), 7, dtype=np.float32)
    _C.copy_shard(x, out, 1, [(4, 2), (0, 1)])
    assert np.array_equal(out[:, :3], x[:, [4, 5, 0]]) and not out[:, 3].any()
    _C.copy_shard(np.asfortranarray(x), out, 1, [(0, 4)])
    assert np.array_equal(out, x[:, :4])
    rev = x[::-1, ::-1]
    o2 = np.empty((2, 6), np.float32)
    _C.copy_shard(rev, o2, 0, [(3, 2)])
    assert np.array_equal(o2, rev[3:5])
    t = torch.zeros(5, 6)
    _C.place_shard(t, out, 1, [(1, 4)])
    assert torch.equal(t[:, 1:5], torch.from_numpy(x[:, :4]))
    ro = x.copy()
    ro.flags.writeable = False
    _C.copy_shard(ro, o2, 0, [(0, 2)])
    expect(ValueError, _C.copy_shard, x, ro, 0, [(0, 5)], match="shard: tensor is read-only")
    expect(ValueError, _C.place_shard, ro, out, 1, [], match="full: tensor is read-only")
    assert sys.getrefcount(x) == refs[0], "a DLPack capsule of x was not released"


def scenario_copy_errors(i):
    f = torch.arange(5.0)
    s = torch.zeros(4)
    for fn in (_C.copy_shard, _C.place_shard):
        expect(TypeError, fn, f, s.double(), 0, [], match="dtype")
        expect(TypeError, fn, f.bfloat16(), s.half(), 0, [], match="bfloat16")
        expect(TypeError, fn, [1.0], s, 0, [], match="full:")
        expect(TypeError, fn, f, None, 0, [], match="shard:")
        expect(TypeError, fn, f.requires_grad_(), s, 0, [], match="full: cannot export")
        f.requires_grad_(False)
        expect(ValueError, fn, torch.zeros(2, 5), s, 0, [], match="dimensions")
        expect(ValueError, fn, torch.zeros(2, 5), torch.zeros(3, 4), 1, [], match="differ")
        for ranges in ([(0, 6)], [(-1, 1)], [(0, -1)], [(6, 0)], [(1, INT64_MAX)],
                       [(INT64_MAX, 1)], [(1, INT64_MAX), (0, 2)], [(0, 3), (0, 3)]):
            expect(IndexError, fn, f, s, 0, ranges)
        for ranges in (3, None, "ab", [3], [None], [(0,)], [(0, 1, 2)], [("a", 1)],
                       [(0.5, 1)], {0: 1}):
            expect(TypeError, fn, f, s, 0, ranges)
        expect(OverflowError, fn, f, s, 0, [(2**64, 0)])
        expect(IndexError, fn, f, s, 1, [], match="dim out of range")
        expect(IndexError, fn, f, s, -2, [])
        expect(OverflowError, fn, f, s, 2**40, [])
        expect(TypeError, fn, f, s, "0", [])
        expect(IndexError, fn, torch.tensor(1.0), torch.tensor(1.0), 0, [])
        expect(TypeError, fn, f, s, 0)
        expect(TypeError, fn, f, s, 0, [], bogus=1)
    # __index__ that mutates the caller's ranges list while it is parsed.
    ranges = [(0, Sneaky(ranges)), (1, 1), (2, 1)]
    ranges[0][1].victim = ranges
    out = torch.zeros(3)
    _C.copy_shard(f, out, 0, ranges)
    assert out.tolist() == [0.0, 1.0, 2.0]


# --- gather_index ----------------------------------------------------------------

CASES = list(layout_cases())


def scenario_gather_index(i):
    for spec, full_len in CASES[i % 7::7]:
        for tp in range(1, 5):
            try:
                shards = [spec.resolve(full_len, tp, r) for r in range(tp)]
            except ValueError:
                continue
            full = torch.arange(full_len * 2, dtype=torch.float32).reshape(full_len, 2)
            chunk = shards[0].chunk
            buf = torch.full((tp * chunk, 2), -1.0)
            for r, ds in enumerate(shards):
                _C.copy_shard(full, buf[r * chunk: r * chunk + ds.length], 0, ds.ranges)
            idx = _C.gather_index(shards[0].all_ranges, full_len, chunk)
            assert torch.equal(buf[torch.from_numpy(idx)], full)
    expect(ValueError, _C.gather_index, [[(0, 2)], [(3, 1)]], 4, 2, match="held by no rank")
    expect(ValueError, _C.gather_index, [[(0, 3)]], 4, 2, match="does not fit")
    expect(ValueError, _C.gather_index, [[(0, 1), (1, INT64_MAX)]], 4, 2)
    expect(ValueError, _C.gather_index, [[(INT64_MAX, 2)]], 4, 2)
    expect(ValueError, _C.gather_index, [[(0, 1)], [(1, 1)]], 2, INT64_MAX, match="overflow")
    expect(ValueError, _C.gather_index, [], -1, 0)
    for bad in (None, 3, "ab", [3], [[3]], [[(0, 1, 2)]], [[(0.0, 1)]]):
        expect(TypeError, _C.gather_index, bad, 1, 1)
    assert _C.gather_index([], 0, 0).shape == (0,)
    per_rank = []
    per_rank.extend([[(0, Sneaky(per_rank))], [(1, 1)]])
    assert _C.gather_index(per_rank, 2, 1).tolist() == [0, 1]


# --- tensor_info and hand-made capsules ---------------------------------------------

# Made once: building ctypes structures has allocation noise of its own.
BASE = np.arange(12, dtype=np.float32).reshape(3, 4)
FLAT = np.arange(10, dtype=np.int64)
FAKE_OK = [FakeTensor(BASE, versioned=False), FakeTensor(BASE, strides=None)]
FAKE_OFFSET = FakeTensor(FLAT[3:], byte_offset=24)
FAKE_RO = FakeTensor(BASE, flags=1)
FAKE_GPU = FakeTensor(BASE, device_type=2)
FAKE_BAD = [(FakeTensor(BASE, **kwargs), exc) for kwargs, exc in [
    (dict(major=2), TypeError), (dict(ndim=17, shape=(1,) * 17, strides=(1,) * 17), ValueError),
    (dict(ndim=-1), ValueError), (dict(shape=(3, -4)), ValueError), (dict(bits=0), TypeError),
    (dict(bits=12), TypeError), (dict(lanes=4), TypeError), (dict(capsule="bogus"), TypeError),
    (dict(capsule="not_a_capsule"), TypeError)]]


class Raises:
    def __dlpack__(self, **kw):
        raise RuntimeError("no")


def scenario_tensor_info(i):
    assert _C.tensor_info(torch.zeros(2, 3))["strides"] == (3, 1)
    assert _C.tensor_info(torch.zeros(2, 3, dtype=torch.bfloat16).t())["dtype"] == "bfloat16"
    assert _C.tensor_info(torch.arange(10)[2:])["shape"] == (8,)
    assert _C.tensor_info(torch.tensor(1.0))["shape"] == ()
    assert _C.tensor_info(np.arange(6.0)[::-1])["strides"] == (-1,)
    ro = np.zeros(3)
    ro.flags.writeable = False
    assert _C.tensor_info(ro)["readonly"] is True
    expect(TypeError, _C.tensor_info, [1, 2], match="t: expected a tensor")
    expect(TypeError, _C.tensor_info, torch.ones(2, requires_grad=True))
    out = np.zeros((3, 2), np.float32)
    for fake in FAKE_OK:
        _C.copy_shard(fake, out, 1, [(2, 2)])
        assert np.array_equal(out, BASE[:, 2:])
    got = np.zeros(7, np.int64)
    _C.copy_shard(FAKE_OFFSET, got, 0, [(0, 7)])
    assert got.tolist() == list(range(3, 10))
    expect(ValueError, _C.place_shard, FAKE_RO, out, 1, [], match="read-only")
    expect(ValueError, _C.copy_shard, FAKE_GPU, out, 1, [], match="CPU")
    for fake, exc in FAKE_BAD:
        expect(exc, _C.tensor_info, fake)
        expect(exc, _C.copy_shard, BASE, fake, 0, [])
    expect(TypeError, _C.tensor_info, Raises(), match="cannot export")


# --- sharder ----------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.num_heads = 8


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.shared = self.blocks[0]  # reachable twice: planned once


class Target:
    @staticmethod
    def plan_shard(module, tp, rank, **kw):
        return (tp, rank)

    @staticmethod
    def from_native_module(module, pg, **kw):
        assert kw["plan"] == (2, 1)
        return nn.Identity()


def fwd(self, x):
    return x


class Failing:
    @staticmethod
    def plan_shard(module, tp, rank):
        raise ValueError("cannot")


DROPPING = {}


class Clears:
    """plan_shard drops the policy entry being planned from its dict."""

    @staticmethod
    def plan_shard(module, tp, rank):
        DROPPING.clear()
        return None


def scenario_sharder(i):
    root = Root()
    entries = {Block: ((("num_heads", PerRank(lambda tp, r: 8 // tp)),),
                       (lambda m: None,),
                       (("proj", Target, {"k": i}, False),),
                       (("forward", fwd),))}
    ops, matched = _C.sharder_plan(root, "Root", entries, 2, 1)
    assert matched == 2 and len(ops) == 8
    assert _C.sharder_apply(ops, None) == 8
    assert root.blocks[1].num_heads == 4 and isinstance(root.blocks[0].proj, nn.Identity)
    by_name = {"Root": ((), (), (("blocks.*.proj", Target, {}, False),), ())}
    ops, _ = _C.sharder_plan(Root(), "M", by_name, 1, 0)
    assert len(ops) == 2
    # Argument validation.
    expect(TypeError, _C.sharder_plan, 42, "M", {}, 1, 0, match="torch.nn.Module")
    expect(TypeError, _C.sharder_plan, Root(), 5, {}, 1, 0)
    expect(TypeError, _C.sharder_plan, Root(), "M", [], 1, 0)
    expect(TypeError, _C.sharder_plan, Root(), "M", {}, 1.0, 0)
    expect(TypeError, _C.sharder_plan, Root(), "M", {}, 1, None)
    for entry in ([(), (), (), ()], "abcd", ((), ()), ([], (), (), ()), ((1,), (), (), ()),
                  ((("a",),), (), (), ()), (((1, 2),), (), (), ()),
                  ((), (), (("proj", Target, {}),), ()), ((), (), (("proj", Target, [], 0),), ()),
                  ((), (), (["proj", Target, {}, 0],), ()), ((), (), (), (("f",),)),
                  ((), (), (), (("f", 3),)), ((), (), (), ("forward",))):
        expect(TypeError, _C.sharder_plan, Root(), "M", {Block: entry}, 1, 0)
    for entry, match in [(((), (), (("proj", Failing, {}, False),), ()), "M: blocks.0.proj"),
                         (((), (), (("nope", Target, {}, False),), ()), "no sub-module"),
                         (((("nope", 1),), (), (), ()), "does not have"),
                         (((), (), (("proj", Target, {}, False),) * 2, ()), "two policy")]:
        expect(ValueError, _C.sharder_plan, Root(), "M", {Block: entry}, 1, 0, match=match)
    expect(TypeError, _C.sharder_apply, (), None)
    expect(TypeError, _C.sharder_apply, [])
    for op in (42, (), ("attr", "p", 1, "x", 2), record("attr", "p"), record("bogus", "p"),
               record("method", "p", Root(), 3, fwd),
               record("sub", "p", Root(), "x", target=Target, native=nn.Linear(1, 1), kwargs=[]),
               record("sub", "p", Root(), "x", target=object, native=nn.Linear(1, 1), kwargs={}),
               record("param", "p", nn.Linear(1, 1), value=3), record("attr", "p", 3, "real", 1),
               record("method", "p", 3, "f", fwd)):
        expect(RuntimeError, _C.sharder_apply, [op], None, match="applying the shard plan")
    # Regression: the policy entry dropped from the dict while planning.
    dropping = DROPPING
    dropping[Root] = ((), (), (("blocks.0.proj", Clears, {}, False),
                               ("blocks.1.proj", Clears, {}, False)), ())
    ops, _ = _C.sharder_plan(Root(), "M", dropping, 1, 0)
    assert len(ops) == 2
    # Regression: the op list shrinking while it is applied.
    shrinking = []
    shrinking.extend([record("param", "a", nn.Linear(1, 1), value=lambda m: shrinking.clear()),
                      record("param", "b", nn.Linear(1, 1), value=lambda m: None)])
    assert _C.sharder_apply(shrinking, None) == 1
    _sharder_built_callback()


class SharedParent(nn.Module):
    """Two blocks holding one `inner` module: its slot reached by two paths."""

    def __init__(self):
        super().__init__()
        inner = Block()
        self.blocks = nn.ModuleList([nn.Module(), nn.Module()])
        self.blocks[0].inner = self.blocks[1].inner = inner


def _sharder_built_callback():
    """sharder_apply's `built` callback (the tie binding): it sees and may
    edit the builds; what it raises comes out unchanged, the model as it
    was; a slot under a parent shared by two paths is planned once."""
    entries = {nn.Module: ((), (), (("inner.proj", Target, {}, True),), ())}
    root = SharedParent()
    ops, _ = _C.sharder_plan(root, "M", entries, 2, 1)
    assert len(ops) == 1
    seen = []

    def edit(ops_seen, builds):
        seen.append(len(builds))
        fields = dict(zip(_C.PlanOp.__match_args__, builds[0]), value=nn.Linear(3, 3))
        builds[0] = _C.PlanOp(tuple(fields.values()))

    assert _C.sharder_apply(ops, None, None, None, edit) == 1 and seen == [1]
    assert isinstance(root.blocks[1].inner.proj, nn.Linear) and root.blocks[1].inner.proj.in_features == 3
    root = SharedParent()
    ops, _ = _C.sharder_plan(root, "M", entries, 2, 1)

    def refuse(ops_seen, builds):
        raise ValueError("tied two ways")

    expect(ValueError, _C.sharder_apply, ops, None, None, [], refuse, match="tied two ways")
    assert root.blocks[0].inner.proj.in_features == 2
    ops, _ = _C.sharder_plan(SharedParent(), "M", entries, 2, 1)
    expect(TypeError, _C.sharder_apply, ops, None, None, None, 3, match="built must be callable")
    ops, _ = _C.sharder_plan(SharedParent(), "M", entries, 2, 1)
    expect(RuntimeError, _C.sharder_apply, ops, None, None, None, lambda o, b: b.clear(), match="number of builds")


def _attention_args(dtype, B=2, Hq=4, Hkv=2, Sq=37, Sk=70, D=13):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def scenario_attention(i):
    """Every option of the attention kernel, forward and backward, 1 and 2
    threads, fp32 / bf16 / fp16, and the argument errors."""
    from shardformer import ops

    dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
    ops.set_num_threads(1 + i % 2)
    try:
        q, k, v = (t.requires_grad_() for t in _attention_args(dtype))
        pad = torch.ones(2, 70, dtype=torch.bool)
        pad[1, :20] = False
        bias = torch.randn(4, 37, 70, requires_grad=True)
        opts = [dict(causal=True), dict(window=9, mask=pad), dict(causal=True, window=5, bias=bias),
                dict(alibi_slopes=torch.rand(4), mask=torch.rand(2, 1, 37, 70) > 0.5),
                dict(causal=True, dropout_p=0.2, seed=i), dict(causal=True, softcap=0.7, bias=bias),
                dict(window=9, mask=pad, softcap=3.0, dropout_p=0.3, seed=i)]
        out = ops.attention(q, k, v, **opts[i % len(opts)])
        out.float().sum().backward()
        # the other alignment: more queries than keys (rows with no key at all)
        q2, k2, v2 = _attention_args(dtype, 1, 2, 1, 70, 9, 64)
        ops.attention(q2, k2, v2, causal=True)
        # one (batch, kv head) pair: at 2 threads the backward splits its key tiles
        q3, k3, v3 = (t.requires_grad_() for t in _attention_args(dtype, 1, 2, 1, 70, 200, 13))
        ops.attention(q3, k3, v3, causal=True, window=(0, 40)[i % 2]).float().sum().backward()
        ops.attention_dropout_mask((1, 2, 3, 5), 0.5, i)
        # the ring's dropout coordinates: global positions of a longer sequence
        ops.attention_dropout_mask((1, 2, 3, 5), 0.5, i, [4, 0, 9], [1, 2, 3, 4, 11], 12)
        qpos, kpos = torch.arange(37) * 2, torch.arange(70) + 30
        o4, l4 = torch.empty_like(q.detach()), torch.empty(2, 4, 37)
        _C.attention_forward(q.detach(), k.detach(), v.detach(), o4, l4, 0.3, False, 0, None, None, None,
                             0.25, i, 2.0, qpos, kpos, 100)
        _C.attention_backward(q.detach(), k.detach(), v.detach(), o4, o4, l4, torch.empty_like(o4),
                              torch.empty_like(k.detach()), torch.empty_like(v.detach()), None, 0.3, False, 0,
                              None, None, None, 0.25, i, 2.0, qpos, kpos, 100)
    finally:
        ops.set_num_threads(1)
    q, k, v = _attention_args(torch.float32)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 37)
    args = (1.0, False, 0, None, None, None, 0.0, 0)
    expect(ValueError, _C.attention_forward, q, k[:, :1, :, :5].contiguous(), v, out, lse, *args)
    expect(ValueError, _C.attention_forward, q, torch.randn(2, 3, 70, 13), torch.randn(2, 3, 70, 13),
           out, lse, *args, match="multiple")
    expect(ValueError, _C.attention_forward, q, k, v, out, torch.empty(5), *args, match="lse")
    expect(TypeError, _C.attention_forward, q, k, v, out, lse, 1.0, False, 0, None, None,
           torch.ones(1, 1, 1, 70), 0.0, 0, match="mask")
    expect(ValueError, _C.attention_forward, q, k, v, out, lse, 1.0, False, 0, None,
           torch.zeros(2, 3, 37, 70), None, 0.0, 0, match="broadcast")
    expect(ValueError, _C.attention_forward, q, k, v, out, lse, 1.0, False, -1, None, None, None,
           0.0, 0, match="window")
    expect(ValueError, _C.attention_backward, q, k, v, out, out, lse, q, k, v,
           torch.empty(3), 1.0, False, 0, None, None, None, 0.0, 0, match="dbias")
    expect(ValueError, _C.attention_dropout_keep, torch.empty(2, 2), 0.5, 0)
    for bad in (-1.0, float("nan"), float("inf"), 1e300):
        expect(ValueError, _C.attention_forward, q, k, v, out, lse, *args, bad, match="softcap")
    expect(TypeError, _C.attention_forward, q, k, v, out, lse, *args, "1", match="softcap")
    expect(ValueError, _C.attention_forward, q, k, v, out, lse, *args, None, torch.arange(5), None, 0,
           match="qpos")
    expect(ValueError, _C.attention_forward, q, k, v, out, lse, *args, None, None, torch.arange(70) + 1, 70,
           match="kpos")
    expect(ValueError, _C.attention_forward, q, k, v, out, lse, *args, None, None, None, -1, match="drop_seq")
    expect(TypeError, _C.attention_forward, q, k, v, out, lse, *args, None, torch.arange(37.0), None, 0,
           match="qpos")


# --- the status convention: kernel messages, the NCCL gate, conversions ------------

F32_CUDA = FakeTensor(np.zeros(6, np.float32), device_type=2)
F32_CUDA_12 = FakeTensor(np.zeros(12, np.float32), device_type=2)
I64_CUDA = FakeTensor(np.zeros(6, np.int64), device_type=2)
BOOL_CUDA = FakeTensor(np.zeros(6, np.bool_), device_type=2)
STRIDED_CUDA = FakeTensor(np.zeros((3, 4), np.float32)[:, ::2], device_type=2)
NCCL_CALLS = [
    (_C.nccl_all_reduce, lambda t: (None, t, "sum", 0)),
    (_C.nccl_all_gather, lambda t: (None, t, t, 0)),
    (_C.nccl_reduce_scatter, lambda t: (None, t, t, "sum", 0)),
    (_C.nccl_broadcast, lambda t: (None, t, 0, 0)),
    (_C.nccl_send, lambda t: (None, t, 1, 0)),
    (_C.nccl_recv, lambda t: (None, t, 1, 0)),
    (_C.nccl_all_to_all, lambda t: (None, t, copy_of(t), 0)),
]


A2A_BUF = np.zeros(16, np.float32)
A2A_CUDA_LO = FakeTensor(A2A_BUF[:8], device_type=2)
A2A_CUDA_HI = FakeTensor(A2A_BUF[4:12], device_type=2)


def scenario_kernel_pool(i):
    """The kernels' worker pool: reuse over calls at 2 threads, a resize, the
    erf GeLU over its tails, three Python threads at once (calls that find the
    pool busy run inline), shutdown and remake, and a fork whose child makes
    its own pool."""
    import os
    import threading

    from shardformer import ops

    x = torch.randn(600, 300)
    w = torch.randn(300)
    try:
        ops.set_num_threads(2 + i % 2)
        for _ in range(3):
            ops.layer_norm(x, (300,), w)
        xg = torch.linspace(-20, 20, 600 * 301).view(600, 301).requires_grad_()
        ops.bias_gelu(xg, torch.randn(301)).sum().backward()
        ts = [threading.Thread(target=lambda: [ops.layer_norm(x, (300,), w) for _ in range(5)])
              for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        _C.kernel_pool_shutdown()
        ops.layer_norm(x, (300,), w)
        if i == 0:
            pid = os.fork()
            if pid == 0:
                try:
                    ops.layer_norm(x, (300,), w)
                    _C.kernel_pool_shutdown()
                finally:
                    os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        ops.set_num_threads(1)


def scenario_status(i):
    # NCCL's gate refuses on CPU, before anything loads NCCL
    for fn, args in NCCL_CALLS:
        expect(ValueError, fn, *args(torch.ones(6)), match="expected a CUDA tensor, got a CPU")
        expect(TypeError, fn, *args(BOOL_CUDA), match="got bool")
        expect(ValueError, fn, *args(STRIDED_CUDA), match="contiguous")
        expect(TypeError, fn, *args(F32_CUDA), match="expected an NCCL communicator")
        expect(TypeError, fn, *args([1, 2]), match="__dlpack__")
    expect(TypeError, _C.nccl_all_gather, None, F32_CUDA_12, I64_CUDA, 0, match="dtype")
    expect(TypeError, _C.nccl_all_to_all, None, F32_CUDA_12, I64_CUDA, 0, match="dtype")
    expect(ValueError, _C.nccl_all_to_all, None, F32_CUDA_12, F32_CUDA_12, 0, match="overlaps")
    expect(ValueError, _C.nccl_all_to_all, None, A2A_CUDA_HI, A2A_CUDA_LO, 0, match="overlaps")
    expect(ValueError, _C.nccl_all_reduce, None, F32_CUDA, "avg", 0, match="'avg'")
    expect(TypeError, _C.nccl_comm_destroy, None)
    # kernels say why, naming the argument and the numbers
    zz, y = torch.randn(6, 20), torch.randint(0, 20, (6,))
    expect(ValueError, _C.xent_forward, zz, y, 0, 21, -100, *(torch.empty(6) for _ in range(3)),
           None, match="xent_forward: vocab_real=21 outside [0, 20]")
    expect(ValueError, _C.xent_backward, zz, y, 0, 20, -100, torch.empty(6), torch.empty(6), 0.0,
           -1, torch.empty(6, 20), match="xent_backward: vocab=-1 must be >= 0")
    expect(ValueError, _C.bias_dropout_add_forward, zz, None, zz, 1.5, 0, torch.empty(6, 20),
           match="bias_dropout_add_forward: p=1.5 outside [0, 1]")
    # the one half conversion, both ways, through the kernels' and the reductions' paths
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dt in (torch.float16, torch.bfloat16):
        h = bits.view(dt)
        f = torch.empty(h.numel())
        _C.kernel_convert(h, f)
        back = torch.empty_like(h)
        _C.kernel_convert(f, back)
        red = torch.empty_like(h)
        _C.reduce_buffers(red, [h], "sum", bool(i % 2))
        assert torch.equal(back.view(torch.int16), red.view(torch.int16))


# --- issue 11: sizes, aliasing, strides, out-of-range indices -------------------

HUGE = 2**62
# strides whose reach overflows int64 bytes (refused before any read)
OVERREACH = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(5,), strides=(2**61,))
D0_Q, D0_K, D0_LSE = torch.empty(1, 1, 2**20, 0), torch.empty(1, 1, 2**31, 0), torch.zeros(1, 1, 2**20)


def scenario_faults(i):
    """The error paths of issue 11: empty tensors with huge other dimensions
    (done at once or refused), outputs overlapping inputs, destinations that
    overlap themselves, sources sharing memory with the destination (read
    from a copy), token ids and labels out of range."""
    from shardformer import ops

    dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
    # sizes: rows of nothing, nothing of huge rows
    x = torch.empty(2**50, 0, dtype=dtype, requires_grad=True)
    ops.bias_gelu(x).sum().backward()
    ops.bias_dropout_add(x, None, x, 0.5, seed=i).sum().backward()
    ops.swiglu(x, x).sum().backward()
    x = torch.empty(0, 2**40, dtype=dtype, requires_grad=True)
    ops.layer_norm(x, [2**40]).sum().backward()
    ops.rms_norm(x, [2**40]).sum().backward()
    _C.norm_backward(True, torch.empty(0, HUGE), torch.empty(0, HUGE), None, None, torch.empty(0),
                     torch.empty(0, HUGE), None, None)
    ops.vocab_embedding(torch.tensor([5, 2**40 + 3]), torch.empty(2**40 + 10, 0, dtype=dtype),
                        vocab_size=2**40 + 10)
    _C.embedding_backward(torch.empty(0, HUGE, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64),
                          0, 0, -1, torch.empty(0, HUGE))
    _C.embedding_grad(torch.empty(0, HUGE, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64),
                      0, 0, -1, torch.empty(0, HUGE, dtype=torch.bfloat16))
    dw = torch.full((10, 5), float("nan"), dtype=dtype)   # every row written: ids repeat, miss, hit padding
    _C.embedding_grad(torch.randn(6, 5).to(dtype), torch.tensor([3, 1, 3, 12, 0, 3]), 1, 8, 2, dw)
    assert not torch.isnan(dw).any()
    ops.xent_stats(torch.empty(0, 2**60), torch.zeros(0, dtype=torch.int64), 0, 2**60, -100, True, 2**60)
    ops.xent_grad(torch.empty(0, 2**60), torch.zeros(0, dtype=torch.int64), 0, 2**60, -100,
                  torch.empty(0), torch.empty(0), 0.1, 2**60)
    assert ops.attention(torch.empty(1, 1, 2**40, 0), torch.empty(1, 1, 2**40, 0),
                         torch.empty(1, 1, 2**40, 0)).shape == (1, 1, 2**40, 0)
    expect(ValueError, _C.attention_forward, D0_Q, D0_K, D0_K, torch.empty_like(D0_Q), D0_LSE,
           1.0, False, 0, None, None, None, 0.0, 0, match="head size D=0")
    _C.attention_backward(D0_Q, D0_K, D0_K, D0_Q, D0_Q, D0_LSE, torch.empty_like(D0_Q),
                          torch.empty_like(D0_K), torch.empty_like(D0_K), None, 1.0, True, 0, None,
                          None, None, 0.0, 0)
    ops.attention_dropout_mask((2**40, 1, 1, 0), 0.5, i)
    q, k, v = _attention_args(dtype, 1, 2, 2, 5, 9, 8)
    assert torch.equal(ops.attention(q, k, v, window=2**63 - 1), ops.attention(q, k, v))
    _C.copy_shard(torch.empty(0, 2**60), torch.empty(0, 2**40), 1, [(0, 2**40)])
    expect(OverflowError, _C.copy_shard, OVERREACH, np.zeros(5, np.float32), 0, [(0, 5)],
           match="full: the memory its strides reach overflows")
    expect(ValueError, _C.embedding_forward, torch.randn(4, 3), torch.tensor([2**63 - 1]), -1, 4,
           torch.empty(1, 3), match="vocab_start=-1")
    # aliasing: outputs over inputs are refused; the declared in-place use stays
    lse = torch.empty(1, 2, 5)
    expect(ValueError, _C.attention_forward, q, k, v, q, lse, 0.5, False, 0, None, None, None, 0.0,
           0, match="out overlaps q in memory")
    qf, kf, vf = _attention_args(torch.float32, 1, 2, 2, 5, 9, 8)
    outf = torch.empty_like(qf)
    expect(ValueError, _C.attention_forward, qf, kf, vf, outf, outf.reshape(-1)[:10].view(1, 2, 5),
           0.5, False, 0, None, None, None, 0.0, 0, match="out overlaps the output lse")
    xf = torch.randn(3, 8)
    expect(ValueError, _C.norm_forward, False, xf, None, None, 1e-5, xf, None, torch.empty(3),
           match="norm_forward: y overlaps x in memory")
    expect(ValueError, _C.swiglu_backward, xf, xf, xf, torch.empty(3, 8), xf, match="overlaps")
    zbuf = torch.randn(40)
    yl = torch.tensor([1, 2, 3, 0])
    expect(ValueError, _C.xent_backward, zbuf[:32].view(4, 8), yl, 0, 8, -100, torch.zeros(4),
           torch.ones(4), 0.0, 8, zbuf[8:].view(4, 8), match="grad overlaps logits")
    z = torch.randn(4, 8)
    _C.xent_backward(z, yl, 0, 8, -100, torch.zeros(4), torch.ones(4), 0.0, 8, z)
    # destinations that overlap themselves; sources sharing memory, read first
    expect(ValueError, _C.copy_shard, torch.arange(8.0).view(2, 4), torch.zeros(1, 2).expand(2, 2), 1,
           [(0, 2)], match="stride 0")
    expect(ValueError, _C.place_shard, torch.zeros(4).expand(2, 4), torch.ones(2, 2), 1, [(0, 2)],
           match="stride 0")
    expect(ValueError, _C.copy_shard, torch.ones(3, 2), torch.zeros(4).as_strided((3, 2), (1, 1)), 1,
           [(0, 2)], match="steps into the span")
    a = torch.arange(8.0)
    _C.copy_shard(a, a, 0, [(4, 2), (0, 2)])
    assert a.tolist() == [4, 5, 0, 1, 0, 0, 0, 0]
    w = torch.arange(24.0).view(4, 6)
    _C.place_shard(w.t(), w[:, :4].t(), 0, [(3, 1), (0, 2), (5, 1)])
    # token ids and labels outside [0, V)
    expect(IndexError, _C.embedding_forward, torch.randn(10, 4), torch.tensor([1, 10]), 0, 10,
           torch.empty(2, 4), 10, match="index 10 is out of range for the vocabulary of 10")
    expect(IndexError, _C.xent_forward, torch.randn(4, 12), torch.tensor([1, -100, 10, 0]), 0, 10, -100,
           torch.empty(4), torch.empty(4), torch.empty(4), None, 10, match="label 10 (row 2)")


# --- shm all_to_all: ranks are threads over one segment -----------------------------

_SHM_GROUPS = {}


def shm_group(nranks, workspace):
    """Communicators of ranks 0..nranks-1 over one segment, made once per shape."""
    key = (nranks, workspace)
    if key not in _SHM_GROUPS:
        import secrets

        name = f"/shardformer-{os.getpid()}-asan-{secrets.token_hex(6)}"
        comms = [_C.shm_create(name, nranks, workspace, 256, 7)]
        try:
            comms += [_C.shm_attach(name, nranks, r, 7) for r in range(1, nranks)]
        finally:
            _C.shm_unlink(name)
        for c in comms:
            _C.shm_configure(c, f"asan group of {nranks}", 10.0, 1 << 20)
        _SHM_GROUPS[key] = comms
    return _SHM_GROUPS[key]


def on_threads(fns):
    import threading

    out = [None] * len(fns)

    def run(r):
        try:
            out[r] = ("ok", fns[r]())
        except Exception as e:  # noqa: BLE001 - compared by the caller
            out[r] = (type(e).__name__, str(e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    return out


def _a2a_in(rank, nranks, n, dtype):
    return torch.arange(nranks * n, dtype=torch.float64).add(1000 * rank).to(dtype)


def scenario_shm_all_to_all(i):
    """shm_all_to_all through the CPython entry point: values over one and
    several rounds of a small workspace, in place, zero bytes, partial
    overlaps and bad arguments refused, mismatched calls on every rank."""
    nranks, workspace = ((2, 4096), (3, 256), (4, 256))[i % 3]
    comms = shm_group(nranks, workspace)
    dtype = (torch.float32, torch.bfloat16, torch.uint8, torch.int64)[i % 4]
    n = (0, 1, 7, 100, 1001)[i % 5]

    def rank(r):
        t = _a2a_in(r, nranks, n, dtype)
        want = torch.cat([_a2a_in(q, nranks, n, dtype)[r * n:(r + 1) * n] for q in range(nranks)])
        out = torch.full_like(t, 7)
        _C.shm_all_to_all(comms[r], out, t)
        assert torch.equal(out, want) and torch.equal(t, _a2a_in(r, nranks, n, dtype))
        _C.shm_all_to_all(comms[r], t, t)  # in place
        assert torch.equal(t, want)
        return True

    assert on_threads([lambda r=r: rank(r) for r in range(nranks)]) == [("ok", True)] * nranks
    # refused on one rank before it meets the others
    c = comms[0]
    buf = torch.zeros(8 * nranks + 4)
    expect(ValueError, _C.shm_all_to_all, c, buf[1:1 + 4 * nranks], buf[:4 * nranks],
           match="input and output overlap")
    expect(ValueError, _C.shm_all_to_all, c, buf[:4 * nranks], buf[3:3 + 4 * nranks],
           match="input and output overlap")
    expect(ValueError, _C.shm_all_to_all, c, torch.zeros(nranks + 1), torch.zeros(nranks + 1),
           match="not divisible")
    expect(ValueError, _C.shm_all_to_all, c, torch.zeros(nranks), torch.zeros(2 * nranks),
           match="the same number")
    expect(TypeError, _C.shm_all_to_all, c, torch.zeros(nranks, dtype=torch.int32),
           torch.zeros(nranks), match="dtype")
    expect(ValueError, _C.shm_all_to_all, c, torch.zeros(2 * nranks)[::2], torch.zeros(nranks),
           match="contiguous")
    expect(TypeError, _C.shm_all_to_all, None, torch.zeros(nranks), torch.zeros(nranks),
           match="shm communicator")
    expect(TypeError, _C.shm_all_to_all, c, [1.0] * nranks, torch.zeros(nranks), match="__dlpack__")
    expect(TypeError, _C.shm_all_to_all, c, torch.zeros(nranks))
    # mismatched calls: another size, or another collective, on the last rank
    sizes = [4] * (nranks - 1) + [8 if i % 2 else 4]

    def mismatched(r):
        x = torch.zeros(nranks * sizes[r], dtype=torch.uint8)
        if i % 2 == 0 and r == nranks - 1:
            return _C.shm_all_gather(comms[r], torch.empty(nranks * 4 * nranks, dtype=torch.uint8),
                                     torch.zeros(4 * nranks, dtype=torch.uint8))
        return _C.shm_all_to_all(comms[r], torch.empty_like(x), x)

    got = on_threads([lambda r=r: mismatched(r) for r in range(nranks)])
    assert all(k == "RuntimeError" and "collective mismatch" in m for k, m in got), got


def scenario_skinny_linear(i):
    """ops.skinny_linear over every dtype, ragged sizes (rows of W past the
    last block of 4, in_features past the last vector of 8 / 16 / 32), 1 to 9
    rows, with and without bias, on every path this CPU has, with contiguous
    and row-strided weights, empty sizes with huge others, and its refusals:
    mismatched sizes, an output over an input, a layout or path it cannot take."""
    from shardformer import ops

    dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
    m, n, k = 1 + i % 9, 1 + (i * 7) % 23, 1 + (i * 5) % 41
    x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n)
    feats = _C.cpu_features()
    paths = ["auto", "portable"] + (["avx2"] if feats["simd"] else []) + \
        (["avx512_bf16"] if feats["avx512_bf16"] and dtype == torch.bfloat16 else [])
    # a column slice that ends where its allocation ends: a read past a row's k weights is caught
    wide = torch.randn(n, k + 3).to(dtype)
    with torch.no_grad():
        y = ops.skinny_linear(x, w, b if i % 2 else None)
        assert y.shape == (m, n) and bool(torch.isfinite(y).all())
        for path in paths:
            for weight in (w, wide[:, 3:]):
                y = ops.skinny_linear(x, weight, b if i % 2 else None, path=path)
                assert y.shape == (m, n) and bool(torch.isfinite(y).all()), path
        assert ops.skinny_linear(torch.empty(0, 2**40, dtype=dtype), torch.empty(0, 2**40, dtype=dtype)).shape == (0, 0)
        ops.skinny_linear(torch.empty(3, 0, dtype=dtype), torch.empty(2**20, 0, dtype=dtype))
    expect(ValueError, _C.skinny_linear, x, w, None, torch.empty(m, n + 1, dtype=dtype), match="y has")
    expect(ValueError, _C.skinny_linear, torch.randn(m, k + 1).to(dtype), w, None, torch.empty(m, n, dtype=dtype),
           match="takes")
    xw = torch.randn(4, 4)
    expect(ValueError, _C.skinny_linear, xw[:1], torch.randn(4, 4), None, xw[:1], match="overlaps")
    expect(ValueError, _C.skinny_linear, x, torch.randn(k, n).to(dtype).T if k > 1 and n > 1 else w[:, :0], None,
           torch.empty(m, n, dtype=dtype), match="strides" if k > 1 and n > 1 else "takes")
    expect(ValueError, _C.skinny_linear, x, w, None, torch.empty(m, n, dtype=dtype), 7, match="path=7")
    if dtype != torch.bfloat16:
        expect(ValueError, _C.skinny_linear, x, w, None, torch.empty(m, n, dtype=dtype), 3, match="bfloat16 only")


def _decode_case(i):
    """One layer's decode_plan arguments (B 2, h 16, 4 query / 2 KV heads of
    8, F 24, 3 cached positions, room for 6): with biases and q/k norms on
    odd i, weights and cache in bf16 for i % 4 >= 2 (biases fp32); and x,
    cos, sin, mask (fp32 values of the weights' type)."""
    g = torch.Generator().manual_seed(i)
    t = torch.bfloat16 if i % 4 >= 2 else torch.float32
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(t)  # noqa: E731
    b = lambda *s: torch.randn(*s, generator=g) * 0.3 if odd else None  # noqa: E731
    B, h, H, K, d, F, cap, past = 2, 16, 4, 2, 8, 24, 6, 3
    odd = i % 2 == 1
    kc, vc = r(B, K, cap, d), r(B, K, cap, d)
    row = (1 + r(h), 1e-6, 1 + r(h), 1e-5, r(H * d, h), r(K * d, h), r(K * d, h), b(H * d), b(K * d), b(K * d),
           1 + r(d) if odd else None, 1 + r(d) if odd else None, 1e-6, r(h, H * d), b(h),
           r(F, h), r(F, h), b(F), b(F), r(h, F), b(h), kc, vc, d ** -0.5)
    mask = torch.ones(B, past + 1, dtype=torch.int64)
    mask[0, 0] = 0
    f = lambda *s: r(*s).float()  # noqa: E731
    return (B, h, H, K, d, F, cap), row, f(B, h), f(1, d), f(1, d), mask, past


def _decode_reference(row, x, cos, sin, mask, past, H, K, d, F):
    """decode.h's math in fp32 torch, one layer, one rank (the reduce is the identity)."""
    row = [v.float() if isinstance(v, torch.Tensor) else v for v in row]
    ln1, e1, ln2, e2, wq, wk, wv, bq, bk, bv, qn, kn, qe, wo, bo, wg, wu, bg, bu, wd, bd, kc, vc, scale = row
    rms = lambda v, w, e: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + e) * w  # noqa: E731
    rot = lambda u: torch.cat((-u[..., d // 2:], u[..., :d // 2]), -1)  # noqa: E731
    lin = torch.nn.functional.linear
    B = x.shape[0]
    a = rms(x, ln1, e1)
    q, k, v = lin(a, wq, bq).view(B, H, d), lin(a, wk, bk).view(B, K, d), lin(a, wv, bv).view(B, K, d)
    if qn is not None:
        q, k = rms(q, qn, qe), rms(k, kn, qe)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    kc, vc = kc.clone(), vc.clone()
    kc[:, :, past], vc[:, :, past] = k, v
    keys, vals = kc[:, :, :past + 1].repeat_interleave(H // K, 1), vc[:, :, :past + 1].repeat_interleave(H // K, 1)
    s = torch.einsum("bhd,bhtd->bht", q, keys) * scale + (mask[:, None, :] == 0) * torch.finfo(torch.float32).min
    o = torch.einsum("bht,bhtd->bhd", s.softmax(-1), vals).reshape(B, H * d)
    x = x + (o @ wo.T + (bo if bo is not None else 0))
    m = rms(x, ln2, e2)
    x = x + (torch.nn.functional.silu(lin(m, wg, bg)) * lin(m, wu, bu)) @ wd.T + (bd if bd is not None else 0)
    return x, kc, vc


def _decode_ends(i, t, h, B):
    """decode_plan's ends for a group of one rank (vocabulary 5, this rank's
    shard holding [3, 5) then [0, 3), 6 head rows (one padding) in a gather
    block of 7, a head bias on odd i), ids [B] and the fp32 torch logits
    function of the last hidden states."""
    g = torch.Generator().manual_seed(100 + i)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(t)  # noqa: E731
    emb, norm, head = r(6, h), 1 + r(h), r(6, h)
    bias = torch.randn(6, generator=g) * 0.3 if i % 2 else None
    ends = (emb, 0, 5, 5, norm, 1e-6, head, bias, 7, 1, ((0, 3, 2), (0, 0, 3)))
    ids = torch.tensor([4, 0, 2][:B], dtype=torch.int64)
    order = [3, 4, 0, 1, 2]                  # vocabulary index of each real shard row

    def logits(x):
        a = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
        z = torch.nn.functional.linear(a, head.float(), bias)[:, :5]
        out = torch.empty_like(z)
        out[:, order] = z
        return out

    return ends, ids, emb.float()[ids], logits


def scenario_decode_step(i):
    """decode_plan / decode_step on a group of one rank: one layer equals
    the fp32 torch reference (x and the cache's new position; bf16: within
    bf16's roundings); sizes and types that do not fit are refused by name."""
    comm = shm_group(1, 4096)[0]
    sizes, row, x, cos, sin, mask, past = _decode_case(i)
    B, h, H, K, d, F, cap = sizes
    want, kc, vc = _decode_reference(row, x, cos, sin, mask, past, H, K, d, F)
    plan = _C.decode_plan(sizes, [row], [row])
    got = x.clone()
    assert len(_C.decode_step(comm, plan, got, cos, sin, mask, past)) == 2   # seconds: all-reduces, gather
    tol = (1e-5, 1e-4) if row[4].dtype == torch.float32 else (6e-2, 3e-2)
    assert torch.allclose(got, want, atol=tol[0], rtol=tol[1]), (got - want).abs().max()
    assert torch.allclose(row[21].float(), kc, atol=tol[0] / 5, rtol=tol[1]), (row[21].float() - kc).abs().max()
    assert torch.allclose(row[22].float(), vc, atol=tol[0] / 5, rtol=tol[1])
    expect(ValueError, _C.decode_step, comm, plan, got, cos, sin, mask, cap, match="outside the plan's cache")
    expect(ValueError, _C.decode_step, comm, plan, got[:1], cos, sin, mask, past, match="x has")
    expect(ValueError, _C.decode_plan, (B, h + 1, H, K, d, F, cap), [row], [row], match="layer 0 ln1")
    expect(ValueError, _C.decode_plan, (B, h, H, K, d, F, 0), [row], [row], match="outside")
    other = row[:5] + (row[5].to(torch.float16),) + row[6:]
    expect(TypeError, _C.decode_plan, sizes, [other], [other], match="layer 0 wk")
    # the ends: the embedding of ids, the final norm, the head and the (one-rank) gather in the same call
    ends, ids, x0, logits_of = _decode_ends(i, row[4].dtype, h, B)
    row = row[:21] + (row[21].clone(), row[22].clone()) + row[23:]
    want, _, _ = _decode_reference(row, x0, cos, sin, mask, past, H, K, d, F)
    plan = _C.decode_plan(sizes, [row], [row, ends], ends)
    got, logits = torch.empty(B, h), torch.empty(B, 5, dtype=row[4].dtype)
    assert len(_C.decode_step(comm, plan, got, cos, sin, mask, past, ids, logits)) == 2
    assert torch.allclose(got, want, atol=tol[0], rtol=tol[1]), (got - want).abs().max()
    exp = logits_of(got)
    assert torch.allclose(logits.float(), exp, atol=tol[0] * 5, rtol=tol[1]), (logits.float() - exp).abs().max()
    expect(IndexError, _C.decode_step, comm, plan, got, cos, sin, mask, past, ids + 5, logits, match="index 9")
    expect(ValueError, _C.decode_step, comm, plan, got, cos, sin, mask, past, ids[:1], None, match="ids has")
    expect(ValueError, _C.decode_step, comm, plan, got, cos, sin, mask, past, None, logits[:1], match="logits has")
    plain = _C.decode_plan(sizes, [row], [row])
    expect(ValueError, _C.decode_step, comm, plain, got, cos, sin, mask, past, ids, None, match="without an embedding")
    expect(ValueError, _C.decode_step, comm, plain, got, cos, sin, mask, past, None, logits, match="without a head")
    bad = {"two ranges": ends[:10] + (((0, 0, 3), (0, 2, 3)),), "cover": ends[:10] + (((0, 0, 3),),),
           "in order": ends[:10] + (((0, 3, 2), (1, 0, 3)),), "block": ends[:8] + (5,) + ends[9:],
           "cannot hold": (ends[0], 3) + ends[2:], "without a norm": ends[:4] + (None,) + ends[5:]}
    for match, e in bad.items():
        expect(ValueError, _C.decode_plan, sizes, [row], [row, e], e, match=match)


SCENARIOS = [scenario_layout_math, scenario_copy_place_torch, scenario_copy_place_numpy,
             scenario_copy_errors, scenario_gather_index, scenario_tensor_info,
             scenario_sharder, scenario_attention, scenario_kernel_pool, scenario_status,
             scenario_faults, scenario_shm_all_to_all, scenario_skinny_linear, scenario_decode_step]

if MODE == "asan":
    for scenario in SCENARIOS:
        t0 = time.perf_counter()
        for i in range(ITERATIONS):
            scenario(i)
        print(f"{scenario.__name__}: {ITERATIONS} runs in {time.perf_counter() - t0:.1f}s",
              flush=True)
elif MODE == "leaks":
    import tracemalloc

    def checkpoint():
        # The type attribute cache keeps a reference to the name of every
        # attribute looked up (up to 4096), e.g. the strings the sharder
        # makes with PyObject_GetAttrString: bounded, but not a leak of ours.
        sys._clear_type_cache()
        gc.collect()
        return sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]

    # Each case is one _C call (success or error path) on inputs built once,
    # so that a leak of one object per call shows as ITERATIONS blocks while
    # the loop itself allocates nothing that survives an iteration.
    T2 = torch.arange(30.0).reshape(5, 6)
    T2_STRIDED = torch.arange(120.0).reshape(10, 12)[::2, ::2]
    S2 = torch.zeros(5, 4)
    N2 = np.asfortranarray(np.arange(30.0).reshape(5, 6))
    NS2 = np.zeros((5, 4))
    RO = np.zeros((5, 4))
    RO.flags.writeable = False
    GRAD = torch.ones(5, 6, requires_grad=True)
    X200 = torch.arange(200.0)
    O100 = torch.zeros(100)
    MANY = [(k, 1) for k in range(0, 200, 2)]
    ROOT = Root()
    PLAN_ENTRIES = {Block: ((("num_heads", PerRank(lambda tp, r: 8 // tp)),),
                            (lambda m: None,),
                            (("proj", Target, {"k": 1}, False),),
                            (("forward", fwd),))}
    IDENTITY = nn.Identity()

    class Reuse:
        @staticmethod
        def from_native_module(module, pg, **kw):
            return IDENTITY

    HOST = Block()
    OPS = [record("attr", "a", HOST, "num_heads", 4), record("param", "p", HOST, value=lambda m: None),
           record("sub", "s", HOST, "proj", target=Reuse, native=IDENTITY, kwargs={"k": 1}, plan=(1, 2)),
           record("method", "m", HOST, "forward", fwd)]
    GATHER_OK = [[(0, 2)], [(2, 2)], [(4, 1)]]

    def raises_type_error(tp, r):
        raise TypeError("boom")

    ATT_Q, ATT_K, ATT_V = _attention_args(torch.float32)
    ATT_OUT, ATT_LSE = torch.empty_like(ATT_Q), torch.empty(2, 4, 37)
    ATT_DQ, ATT_DK, ATT_DV = torch.empty_like(ATT_Q), torch.empty_like(ATT_K), torch.empty_like(ATT_V)
    ATT_MASK = torch.ones(2, 1, 1, 70, dtype=torch.bool)
    ATT_BIAS = torch.zeros(1, 4, 37, 70)
    ATT_DB = torch.empty(2, 4, 37, 70)
    ATT_SLOPES = torch.ones(4)
    ATT_QPOS, ATT_KPOS = torch.arange(37) * 3, torch.arange(70) + 100
    XZ, XY = torch.randn(6, 20), torch.randint(0, 20, (6,))
    XO = [torch.empty(6) for _ in range(3)]
    XO16 = torch.empty(6, dtype=torch.float16)
    XG = torch.empty(6, 20)
    XZ16 = torch.empty(6, 20, dtype=torch.bfloat16)
    # issue 11's error paths
    EMPTY_HUGE, EMPTY0 = torch.empty(0, HUGE), torch.empty(0)
    OVER_DST = np.zeros(5, np.float32)
    ROWS_OF_NOTHING = torch.empty(2**50, 0)
    XF = torch.randn(3, 8)
    XF_OUT, XF_RSTD = torch.empty(3, 8), torch.empty(3)
    EXPANDED_DST = torch.zeros(1, 2).expand(2, 2)
    SELF_OVERLAP = torch.zeros(4).as_strided((3, 2), (1, 1))
    ALIASED = torch.arange(8.0)
    EMB_W, EMB_OUT = torch.randn(10, 4), torch.empty(2, 4)
    OOB_IDS, OOB_LABELS = torch.tensor([1, 10]), torch.tensor([1, -100, 10, 0, 2, 3])
    A2A_COMM = shm_group(1, 4096)[0]
    A2A_T, A2A_OUT, A2A_BIG = torch.arange(12.0), torch.empty(12), torch.arange(3000.0)
    A2A_BIG_OUT, A2A_SHORT = torch.empty(3000), torch.empty(6)
    A2A_ROBUF = torch.zeros(20)
    A2A_COPY = copy_of(F32_CUDA_12)
    SK_X, SK_WIDE, SK_Y = torch.randn(2, 20).bfloat16(), torch.randn(9, 27).bfloat16(), torch.empty(2, 9).bfloat16()
    SK_T = torch.randn(20, 9).bfloat16().T
    DEC_SIZES, DEC_ROW, DEC_X, DEC_COS, DEC_SIN, DEC_MASK, DEC_PAST = _decode_case(1)
    DEC_PLAN = _C.decode_plan(DEC_SIZES, [DEC_ROW], [DEC_ROW])
    DEC_ENDS, DEC_IDS, _, _ = _decode_ends(1, DEC_ROW[4].dtype, DEC_SIZES[1], DEC_SIZES[0])
    DEC_FULL = _C.decode_plan(DEC_SIZES, [DEC_ROW], [DEC_ROW, DEC_ENDS], DEC_ENDS)
    DEC_LOGITS = torch.empty(DEC_SIZES[0], 5)
    DEC_BAD = DEC_ENDS[:10] + (((0, 0, 3), (0, 2, 3)),)
    cases = {
        "decode_plan/ok": lambda: _C.decode_plan(DEC_SIZES, [DEC_ROW], [DEC_ROW]),
        "decode_plan/size": lambda: expect(ValueError, _C.decode_plan, DEC_SIZES[:6] + (0,), [DEC_ROW], [DEC_ROW]),
        "decode_plan/layer": lambda: expect(ValueError, _C.decode_plan, (2, 17) + DEC_SIZES[2:], [DEC_ROW], []),
        "decode_step/ok": lambda: _C.decode_step(A2A_COMM, DEC_PLAN, DEC_X.clone(), DEC_COS, DEC_SIN, DEC_MASK,
                                                 DEC_PAST),
        "decode_plan/ends": lambda: _C.decode_plan(DEC_SIZES, [DEC_ROW], [DEC_ROW], DEC_ENDS),
        "decode_plan/ranges": lambda: expect(ValueError, _C.decode_plan, DEC_SIZES, [DEC_ROW], [], DEC_BAD),
        "decode_step/ends": lambda: _C.decode_step(A2A_COMM, DEC_FULL, DEC_X.clone(), DEC_COS, DEC_SIN, DEC_MASK,
                                                   DEC_PAST, DEC_IDS, DEC_LOGITS),
        "decode_step/ids": lambda: expect(IndexError, _C.decode_step, A2A_COMM, DEC_FULL, DEC_X.clone(), DEC_COS,
                                          DEC_SIN, DEC_MASK, DEC_PAST, DEC_IDS - 1, DEC_LOGITS),
        "decode_step/past": lambda: expect(ValueError, _C.decode_step, A2A_COMM, DEC_PLAN, DEC_X, DEC_COS, DEC_SIN,
                                           DEC_MASK, 6),
        "decode_step/mask": lambda: expect(ValueError, _C.decode_step, A2A_COMM, DEC_PLAN, DEC_X, DEC_COS, DEC_SIN,
                                           DEC_MASK[:1], DEC_PAST),
        "skinny_linear/strided": lambda: _C.skinny_linear(SK_X, SK_WIDE[:, 7:], None, SK_Y),
        "skinny_linear/strided_portable": lambda: _C.skinny_linear(SK_X, SK_WIDE[:, 7:], None, SK_Y, 1),
        "skinny_linear/transposed": lambda: expect(ValueError, _C.skinny_linear, SK_X, SK_T, None, SK_Y),
        "skinny_linear/path": lambda: expect(ValueError, _C.skinny_linear, SK_X, SK_WIDE[:, 7:], None, SK_Y, 9),
        "shm_all_to_all": lambda: _C.shm_all_to_all(A2A_COMM, A2A_OUT, A2A_T),
        "shm_all_to_all/in_place": lambda: _C.shm_all_to_all(A2A_COMM, A2A_T, A2A_T),
        "shm_all_to_all/rounds": lambda: _C.shm_all_to_all(A2A_COMM, A2A_BIG_OUT, A2A_BIG),
        "shm_all_to_all/overlap": lambda: expect(ValueError, _C.shm_all_to_all, A2A_COMM,
                                                 A2A_ROBUF[2:14], A2A_ROBUF[:12]),
        "shm_all_to_all/numel": lambda: expect(ValueError, _C.shm_all_to_all, A2A_COMM,
                                               A2A_SHORT, A2A_T),
        "shm_all_to_all/dtype": lambda: expect(TypeError, _C.shm_all_to_all, A2A_COMM, XO16,
                                               A2A_SHORT),
        "shm_all_to_all/comm": lambda: expect(TypeError, _C.shm_all_to_all, None, A2A_OUT, A2A_T),
        "nccl/all_to_all_overlap": lambda: expect(ValueError, _C.nccl_all_to_all, None,
                                                  A2A_CUDA_HI, A2A_CUDA_LO, 0),
        "nccl/all_to_all_comm": lambda: expect(TypeError, _C.nccl_all_to_all, None, F32_CUDA_12,
                                               A2A_COPY, 0),
        "nccl/all_to_all_pair": lambda: expect(TypeError, _C.nccl_all_to_all, None, F32_CUDA_12,
                                               I64_CUDA, 0),
        "faults/norm_backward_empty_huge": lambda: _C.norm_backward(
            True, EMPTY_HUGE, EMPTY_HUGE, None, None, EMPTY0, EMPTY_HUGE, None, None),
        "faults/gelu_rows_of_nothing": lambda: _C.bias_gelu_forward(
            ROWS_OF_NOTHING, None, False, ROWS_OF_NOTHING),
        "faults/attention_d0": lambda: expect(
            ValueError, _C.attention_forward, D0_Q, D0_K, D0_K, D0_Q, D0_LSE, 1.0, False, 0, None,
            None, None, 0.0, 0),
        "faults/extent_overflow": lambda: expect(OverflowError, _C.copy_shard, OVERREACH, OVER_DST,
                                                 0, [(0, 5)]),
        "faults/output_overlaps_input": lambda: expect(
            ValueError, _C.norm_forward, False, XF, None, None, 1e-5, XF, None, XF_RSTD),
        "faults/output_overlaps_output": lambda: expect(
            ValueError, _C.norm_forward, False, XF, None, None, 1e-5, XF_OUT, None,
            XF_OUT.view(-1)[:3]),
        "faults/zero_stride_destination": lambda: expect(ValueError, _C.copy_shard, T2[:2, :2],
                                                         EXPANDED_DST, 1, [(0, 2)]),
        "faults/self_overlapping_destination": lambda: expect(
            ValueError, _C.copy_shard, T2[:3, :2], SELF_OVERLAP, 1, [(0, 2)]),
        "faults/staged_source": lambda: _C.copy_shard(ALIASED, ALIASED, 0, [(4, 2), (0, 2)]),
        "faults/oob_ids": lambda: expect(IndexError, _C.embedding_forward, EMB_W, OOB_IDS, 0, 10,
                                         EMB_OUT, 10),
        "faults/oob_labels": lambda: expect(IndexError, _C.xent_forward, XZ, OOB_LABELS, 0, 20,
                                            -100, XO[0], XO[1], XO[2], None, 10),
        "attention_forward": lambda: _C.attention_forward(
            ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_LSE, 0.5, True, 4, ATT_SLOPES, ATT_BIAS, ATT_MASK, 0.1, 3),
        "attention_backward": lambda: _C.attention_backward(
            ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_OUT, ATT_LSE, ATT_DQ, ATT_DK, ATT_DV, ATT_DB, 0.5, True, 4,
            ATT_SLOPES, ATT_BIAS, ATT_MASK, 0.1, 3),
        "attention_forward/error": lambda: expect(
            ValueError, _C.attention_forward, ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_DB, 0.5, False, 0, None,
            None, None, 0.0, 0),
        "attention_dropout_keep": lambda: _C.attention_dropout_keep(
            torch.empty(1, 2, 3, 4, dtype=torch.uint8), 0.5, 7),
        "attention_forward/softcap_positions": lambda: _C.attention_forward(
            ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_LSE, 0.5, True, 4, None, None, ATT_MASK, 0.1, 3, 2.0, ATT_QPOS,
            ATT_KPOS, 200),
        "attention_backward/softcap_positions": lambda: _C.attention_backward(
            ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_OUT, ATT_LSE, ATT_DQ, ATT_DK, ATT_DV, None, 0.5, True, 4,
            None, None, ATT_MASK, 0.1, 3, 2.0, ATT_QPOS, ATT_KPOS, 200),
        "attention_forward/bad_softcap": lambda: expect(
            ValueError, _C.attention_forward, ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_LSE, 0.5, False, 0, None,
            None, None, 0.0, 0, -2.0),
        "attention_forward/bad_position": lambda: expect(
            ValueError, _C.attention_forward, ATT_Q, ATT_K, ATT_V, ATT_OUT, ATT_LSE, 0.5, False, 0, None,
            None, None, 0.1, 0, None, ATT_QPOS, ATT_KPOS, 50),
        "split_units": lambda: _C.split_units(10, 3, 1),
        "split_units/error": lambda: expect(ValueError, _C.split_units, 5, 2, 7),
        "split_units/type": lambda: expect(TypeError, _C.split_units, "5", 2, 0),
        "heads_layout": lambda: _C.heads_layout(6, 2, 4, 3),
        "heads_layout/multiple": lambda: expect(ValueError, _C.heads_layout, 6, 4, 2, 0),
        "heads_layout/too_few": lambda: expect(ValueError, _C.heads_layout, 2, 1, 4, 0),
        "vocab_layout": lambda: _C.vocab_layout(50257, 4, 3, 64),
        "vocab_layout/error": lambda: expect(ValueError, _C.vocab_layout, 0, 2, 0, 1),
        "vocab_layout/overflow": lambda: expect(ValueError, _C.vocab_layout, 10, 2**62, 0, 4),
        "copy_shard": lambda: _C.copy_shard(T2_STRIDED, S2, 1, [(4, 2), (0, 1)]),
        "copy_shard/numpy": lambda: _C.copy_shard(N2, NS2, 1, ((1, 4),)),
        "copy_shard/many_ranges": lambda: _C.copy_shard(X200, O100, 0, MANY),
        "place_shard": lambda: _C.place_shard(T2.clone(), S2, 1, [[0, 3]]),
        "copy_shard/read_only": lambda: expect(ValueError, _C.copy_shard, N2, RO, 1, []),
        "copy_shard/dtype": lambda: expect(TypeError, _C.copy_shard, T2, NS2, 1, []),
        "copy_shard/full_not_tensor": lambda: expect(TypeError, _C.copy_shard, [1], S2, 1, []),
        "copy_shard/shard_not_tensor": lambda: expect(TypeError, _C.copy_shard, T2, [1], 1, []),
        "copy_shard/full_grad": lambda: expect(TypeError, _C.copy_shard, GRAD, S2, 1, []),
        "copy_shard/shard_grad": lambda: expect(TypeError, _C.place_shard, T2, GRAD, 1, []),
        "copy_shard/ndim": lambda: expect(ValueError, _C.copy_shard, T2, O100, 0, []),
        "copy_shard/shape": lambda: expect(ValueError, _C.copy_shard, T2, S2, 0, []),
        "copy_shard/range": lambda: expect(IndexError, _C.copy_shard, T2, S2, 1, [(5, 2)]),
        "copy_shard/overflow": lambda: expect(IndexError, _C.copy_shard, T2, S2, 1,
                                              [(1, INT64_MAX), (0, 2)]),
        "copy_shard/too_long": lambda: expect(IndexError, _C.copy_shard, T2, S2, 1, [(0, 5)]),
        "copy_shard/ranges_int": lambda: expect(TypeError, _C.copy_shard, T2, S2, 1, 3),
        "copy_shard/second_item": lambda: expect(TypeError, _C.copy_shard, T2, S2, 1,
                                                 [(0, 1), (0, "a")]),
        "copy_shard/item_size": lambda: expect(TypeError, _C.copy_shard, T2, S2, 1,
                                               [(0, 1), (0, 1, 2)]),
        "copy_shard/item_overflow": lambda: expect(OverflowError, _C.copy_shard, T2, S2, 1,
                                                   [(0, 2**70)]),
        "copy_shard/dim": lambda: expect(IndexError, _C.copy_shard, T2, S2, 2, []),
        "copy_shard/args": lambda: expect(TypeError, _C.copy_shard, T2, S2, 1),
        "copy_shard/cpu": lambda: expect(ValueError, _C.copy_shard, BASE, FAKE_GPU, 1, []),
        "copy_shard/fake_legacy": lambda: _C.copy_shard(FAKE_OK[0], BASE.copy(), 1, [(0, 4)]),
        "copy_shard/fake_offset": lambda: _C.copy_shard(FAKE_OFFSET, FLAT[:7].copy(), 0,
                                                        [(0, 7)]),
        "place_shard/fake_read_only": lambda: expect(ValueError, _C.place_shard, FAKE_RO,
                                                     BASE, 1, []),
        "gather_index": lambda: _C.gather_index(GATHER_OK, 5, 2),
        "gather_index/uncovered": lambda: expect(ValueError, _C.gather_index, GATHER_OK, 6, 2),
        "gather_index/range": lambda: expect(ValueError, _C.gather_index, [[(0, 1)], [(3, 3)]],
                                             5, 2),
        "gather_index/type": lambda: expect(TypeError, _C.gather_index, [[(0, 1)], [3]], 5, 2),
        "gather_index/overflow": lambda: expect(ValueError, _C.gather_index, GATHER_OK, 5,
                                                INT64_MAX),
        "gather_index/negative": lambda: expect(ValueError, _C.gather_index, [], -1, 0),
        "tensor_info": lambda: _C.tensor_info(T2_STRIDED),
        "tensor_info/numpy": lambda: _C.tensor_info(RO),
        "tensor_info/not_tensor": lambda: expect(TypeError, _C.tensor_info, 3),
        "tensor_info/raises": lambda: expect(TypeError, _C.tensor_info, Raises()),
        "tensor_info/legacy": lambda: _C.tensor_info(FAKE_OK[0]),
        "tensor_info/null_strides": lambda: _C.tensor_info(FAKE_OK[1]),
        "sharder_plan": lambda: _C.sharder_plan(ROOT, "Root", PLAN_ENTRIES, 2, 1),
        "sharder_plan/by_name": lambda: _C.sharder_plan(
            ROOT, "M", {"Root": ((), (), (("blocks.*.proj", Target, {}, False),), ())}, 1, 0),
        "sharder_plan/plan_shard_raises": lambda: expect(
            ValueError, _C.sharder_plan, ROOT, "M",
            {Block: ((), (), (("proj", Failing, {}, False),), ())}, 1, 0),
        "sharder_plan/missing": lambda: expect(
            ValueError, _C.sharder_plan, ROOT, "M",
            {Block: ((), (), (("nope", Target, {}, False),), ())}, 1, 0),
        "sharder_plan/attr_missing": lambda: expect(
            ValueError, _C.sharder_plan, ROOT, "M", {Block: ((("nope", 1),), (), (), ())}, 1, 0),
        "sharder_plan/per_rank_raises": lambda: expect(
            TypeError, _C.sharder_plan, ROOT, "M",
            {Block: ((("num_heads", PerRank(raises_type_error)),), (), (), ())}, 1, 0),
        "sharder_plan/twice": lambda: expect(
            ValueError, _C.sharder_plan, ROOT, "M",
            {Block: ((), (), (("proj", Target, {}, False),) * 2, ())}, 1, 0),
        "sharder_plan/root": lambda: expect(TypeError, _C.sharder_plan, 42, "M", {}, 1, 0),
        "sharder_plan/entry": lambda: expect(TypeError, _C.sharder_plan, ROOT, "M",
                                             {Block: [(), (), (), ()]}, 1, 0),
        "sharder_plan/sub_item": lambda: expect(TypeError, _C.sharder_plan, ROOT, "M",
                                                {Block: ((), (), (("proj", Target),), ())}, 1, 0),
        "sharder_plan/method": lambda: expect(TypeError, _C.sharder_plan, ROOT, "M",
                                              {Block: ((), (), (), (("f", 3),))}, 1, 0),
        "sharder_apply": lambda: _C.sharder_apply(list(OPS), None),
        "sharder_apply/malformed": lambda: expect(RuntimeError, _C.sharder_apply,
                                                  [OPS[0], record("sub", "p")], None),
        "sharder_apply/factory_missing": lambda: expect(
            RuntimeError, _C.sharder_apply, [record("sub", "s", HOST, "proj", target=object,
                                                    native=IDENTITY, kwargs={})], None),
        "sharder_apply/type": lambda: expect(TypeError, _C.sharder_apply, (), None),
        "sharder_apply/adopt": lambda: _C.sharder_apply(list(OPS), None, lambda *a: None),
        "sharder_apply/adopt_type": lambda: expect(TypeError, _C.sharder_apply, [], None, 3),
        "fingerprint": lambda: _C.fingerprint(BASE),
        "fingerprint/seed": lambda: _C.fingerprint(BASE, seed=2**64 - 1),
        "fingerprint/strided": lambda: expect(ValueError, _C.fingerprint, T2_STRIDED),
        "fingerprint/not_tensor": lambda: expect(TypeError, _C.fingerprint, 3),
        "nccl/cpu": lambda: expect(ValueError, _C.nccl_all_reduce, None, S2, "sum", 0),
        "nccl/numpy": lambda: expect(ValueError, _C.nccl_all_gather, None, NS2, NS2, 0),
        "nccl/dtype": lambda: expect(TypeError, _C.nccl_broadcast, None, BOOL_CUDA, 0, 0),
        "nccl/comm": lambda: expect(TypeError, _C.nccl_reduce_scatter, None, F32_CUDA_12,
                                    F32_CUDA, "sum", 0),
        "nccl/pair": lambda: expect(TypeError, _C.nccl_all_gather, None, F32_CUDA_12, I64_CUDA,
                                    0),
        "kernel/vocab_real": lambda: expect(ValueError, _C.xent_forward, XZ, XY, 0, 21, -100,
                                            XO[0], XO[1], XO[2], None),
        "kernel/p": lambda: expect(ValueError, _C.bias_dropout_add_forward, XZ, None, XZ, 1.5, 0,
                                   XG),
        "kernel/dtype": lambda: expect(TypeError, _C.norm_forward, False, XZ, None, None, 1e-5,
                                       XG, None, XO16),
        "kernel_convert": lambda: _C.kernel_convert(XZ, XZ16),
        "reduce_buffers": lambda: _C.reduce_buffers(XZ16, [XZ16, XZ16]),
        "cpu_features": lambda: _C.cpu_features(),
    }
    for fake, exc in FAKE_BAD:
        cases[f"tensor_info/{fake.__dict__.get('capsule')}/{len(cases)}"] = (
            lambda fake=fake, exc=exc: expect(exc, _C.tensor_info, fake))
        cases[f"copy_shard/bad_capsule/{len(cases)}"] = (
            lambda fake=fake, exc=exc: expect(exc, _C.copy_shard, BASE, fake, 0, []))

    gc.collect()
    gc.freeze()  # torch's many objects out of the way: gc.collect() stays cheap
    tracemalloc.start()
    failures = []
    t_start = time.perf_counter()
    for name, case in cases.items():
        for _ in range(100):  # warm-up: caches, free lists, lazy imports
            case()
        # Two windows: a leak grows both by >= ITERATIONS blocks; caches and
        # free lists still settling show in one at most.
        marks = [checkpoint()]
        for window in range(2):
            for _ in range(ITERATIONS):
                case()
            marks.append(checkpoint())
        blocks = [b1 - b0 for (b0, _), (b1, _) in zip(marks, marks[1:])]
        traced = [t1 - t0 for (_, t0), (_, t1) in zip(marks, marks[1:])]
        print(f"{name}: 2 x {ITERATIONS} calls, blocks {blocks[0]:+d} {blocks[1]:+d}, "
              f"traced bytes {traced[0]:+d} {traced[1]:+d}", flush=True)
        if min(blocks) > ITERATIONS // 10 or min(traced) > 16 * ITERATIONS:
            failures.append(name)
    print(f"leak check: {len(cases)} cases in {time.perf_counter() - t_start:.1f}s")
    tracemalloc.stop()
    if failures:
        sys.exit("allocations grow per call in: " + ", ".join(failures))
else:
    sys.exit(f"unknown mode {MODE}")
print("DRIVER OK")
