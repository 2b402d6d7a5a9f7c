"""Unit tests of shardformer's C core, `shardformer._C`, one entry point at a time.

No process group is needed: everything here runs in this process on CPU.

* split_units / heads_layout / vocab_layout are checked exhaustively on small
  numbers against pure-Python references written here (formulated
  differently from the C code: the splits are dealt out rank by rank).
* copy_shard / place_shard are checked against torch (narrow + cat, zero
  padding) for several dtypes, 1-D to 4-D, every dim, strided sources and
  destinations, and their error paths.
* gather_index reassembles full tensors from padded per-rank shards of the
  layouts in shardformer.layout.
* tensor_info, including DLPack capsules crafted with ctypes to reach the
  checks that torch and NumPy never trigger (legacy capsules, NULL strides,
  byte_offset, foreign devices, bad versions and dtypes).
* sharder_plan / sharder_apply argument validation.

The last section holds regression tests for crashes found while writing
these tests (integer overflow in range checks, use-after-free in the sharder);
each of them used to kill the interpreter.
"""
from __future__ import annotations

import ctypes
import itertools
import re

import numpy as np
import pytest
import torch
from torch import nn

from shardformer import _C
from shardformer.layout import Fused, Heads, PerRank, Split, Vocab

INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------
# Pure-Python references
# ---------------------------------------------------------------------------

def ref_split(units: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) of every rank: deal the units out rank by rank, each
    rank taking its fair share of what is left, rounded up."""
    out, start, left = [], 0, units
    for r in range(parts):
        take = -(-left // (parts - r))  # ceil(left / ranks left)
        out.append((start, take))
        start += take
        left -= take
    assert left == 0
    return out


def ref_heads(h: int, kv: int, parts: int):
    """Per rank (q_start, q_count, kv_start, kv_count), or the kind of error."""
    if h % kv:
        return "multiple"
    group = h // kv
    if kv >= parts:
        return [(s * group, c * group, s, c) for s, c in ref_split(kv, parts)]
    if parts % kv:
        return "replicas"
    replicas = parts // kv
    if group < replicas:
        return "too_few"
    out = []
    for k in range(kv):  # each KV head on `replicas` consecutive ranks
        for s, c in ref_split(group, replicas):
            out.append((k * group + s, c, k, 1))
    return out


def ref_vocab(vocab: int, parts: int, multiple: int):
    step = parts * multiple
    padded = -(-vocab // step) * step
    per = padded // parts
    out = []
    for r in range(parts):
        start = r * per
        real = max(0, min(vocab, start + per) - start)
        out.append((padded, start, per, real))
    return out


def ref_copy(full: torch.Tensor, dim: int, ranges, length: int) -> torch.Tensor:
    pieces = [full.narrow(dim, o, n) for o, n in ranges]
    shape = list(full.shape)
    shape[dim] = length - sum(n for _, n in ranges)
    pieces.append(torch.zeros(shape, dtype=full.dtype))
    return torch.cat(pieces, dim)


def has_value(msg: str, name: str, value: int) -> bool:
    return re.search(rf"{name}={value}(?!\d)", msg) is not None


# ---------------------------------------------------------------------------
# split_units
# ---------------------------------------------------------------------------

def test_split_units_exhaustive():
    for units in range(0, 25):
        for parts in range(1, 9):
            expected = ref_split(units, parts)
            got = [_C.split_units(units, parts, r) for r in range(parts)]
            assert got == expected, (units, parts)
            # Every unit exactly once, first ranks hold one more when uneven.
            owners = [r for r, (s, c) in enumerate(got) for _ in range(c)]
            assert owners == sorted(owners) and len(owners) == units
            counts = [c for _, c in got]
            assert max(counts) - min(counts) <= 1
            assert counts == sorted(counts, reverse=True)


def test_split_units_large_numbers():
    assert _C.split_units(INT64_MAX, INT64_MAX, INT64_MAX - 1) == (INT64_MAX - 1, 1)
    assert _C.split_units(INT64_MAX, 2, 1) == (2**62, 2**62 - 1)


@pytest.mark.parametrize("args, words", [
    ((5, 0, 0), ["tensor_parallel_size=0"]),
    ((5, -3, 0), ["tensor_parallel_size=-3"]),
    ((5, 2, 2), ["rank=2", "[0, 2)"]),
    ((5, 2, -1), ["rank=-1", "[0, 2)"]),
    ((-1, 2, 0), ["-1 units"]),
])
def test_split_units_errors(args, words):
    with pytest.raises(ValueError) as info:
        _C.split_units(*args)
    for w in words:
        assert w in str(info.value)


def test_split_units_argument_types():
    with pytest.raises(TypeError):
        _C.split_units("4", 2, 0)
    with pytest.raises(TypeError):
        _C.split_units(4.0, 2, 0)
    with pytest.raises(TypeError):
        _C.split_units(4, 2)
    with pytest.raises(OverflowError):
        _C.split_units(2**64, 2, 0)


# ---------------------------------------------------------------------------
# heads_layout
# ---------------------------------------------------------------------------

def test_heads_layout_exhaustive():
    ok = 0
    for h in range(1, 17):
        for kv in range(1, 17):
            for parts in range(1, 9):
                expected = ref_heads(h, kv, parts)
                if isinstance(expected, str):
                    for r in range(parts):
                        with pytest.raises(ValueError) as info:
                            _C.heads_layout(h, kv, parts, r)
                        msg = str(info.value)
                        if expected == "multiple":
                            assert has_value(msg, "num_attention_heads", h), msg
                            assert has_value(msg, "num_key_value_heads", kv), msg
                        else:
                            assert has_value(msg, "tensor_parallel_size", parts), msg
                            assert (has_value(msg, "num_attention_heads", h)
                                    or has_value(msg, "num_key_value_heads", kv)), msg
                    continue
                got = [_C.heads_layout(h, kv, parts, r) for r in range(parts)]
                assert got == expected, (h, kv, parts)
                check_heads_properties(h, kv, parts, got)
                ok += 1
    assert ok > 250  # the loop really covered valid layouts (293 of 2048)


def check_heads_properties(h, kv, parts, got):
    group = h // kv
    q_owner = [[] for _ in range(h)]
    kv_owner = [[] for _ in range(kv)]
    for r, (qs, qc, ks, kc) in enumerate(got):
        assert qc >= 1 and kc >= 1, "every rank needs a head"
        for q in range(qs, qs + qc):
            q_owner[q].append(r)
            # A query head stays with its KV head.
            assert ks <= q // group < ks + kc
        for k in range(ks, ks + kc):
            kv_owner[k].append(r)
    assert all(len(o) == 1 for o in q_owner), "every query head exactly once"
    if kv >= parts:
        assert all(len(o) == 1 for o in kv_owner), "every KV head exactly once"
        counts = [c for *_, c in got]
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    else:
        replicas = parts // kv
        for k, owners in enumerate(kv_owner):
            assert owners == list(range(k * replicas, (k + 1) * replicas))


@pytest.mark.parametrize("args", [(4, 2, 0, 0), (4, 2, 2, 2), (4, 2, 2, -1)])
def test_heads_layout_bad_group(args):
    with pytest.raises(ValueError) as info:
        _C.heads_layout(*args)
    assert f"tensor_parallel_size={args[2]}" in str(info.value) or "rank=" in str(info.value)


@pytest.mark.parametrize("h, kv", [(0, 1), (4, 0), (-4, 2)])
def test_heads_layout_nonpositive_heads(h, kv):
    with pytest.raises(ValueError) as info:
        _C.heads_layout(h, kv, 1, 0)
    assert has_value(str(info.value), "num_attention_heads", h)
    assert has_value(str(info.value), "num_key_value_heads", kv)


def test_heads_layout_examples():
    # Llama-style GQA: 32 query heads, 8 KV heads, 4 ranks.
    assert _C.heads_layout(32, 8, 4, 1) == (8, 8, 2, 2)
    # 2 KV heads over 4 ranks: each replicated on two ranks splitting 3 queries 2/1.
    assert [_C.heads_layout(6, 2, 4, r) for r in range(4)] == [
        (0, 2, 0, 1), (2, 1, 0, 1), (3, 2, 1, 1), (5, 1, 1, 1)]
    # MQA over 3 ranks, uneven query split.
    assert [_C.heads_layout(7, 1, 3, r) for r in range(3)] == [
        (0, 3, 0, 1), (3, 2, 0, 1), (5, 2, 0, 1)]


# ---------------------------------------------------------------------------
# vocab_layout
# ---------------------------------------------------------------------------

def test_vocab_layout_exhaustive():
    for vocab in range(1, 40):
        for parts in range(1, 6):
            for multiple in (1, 2, 3, 8, 64):
                expected = ref_vocab(vocab, parts, multiple)
                got = [_C.vocab_layout(vocab, parts, r, multiple) for r in range(parts)]
                assert got == expected, (vocab, parts, multiple)
                padded, _, per, _ = got[0]
                assert padded >= vocab and padded - vocab < parts * multiple
                assert per % multiple == 0 and per * parts == padded
                rows = [i for _, s, _, real in got for i in range(s, s + real)]
                assert rows == list(range(vocab)), "every real row exactly once"


@pytest.mark.parametrize("args, words", [
    ((0, 2, 0, 1), ["vocab_size=0"]),
    ((-5, 2, 0, 1), ["vocab_size=-5"]),
    ((10, 2, 0, 0), ["make_vocab_size_divisible_by=0"]),
    ((10, 2, 0, -8), ["make_vocab_size_divisible_by=-8"]),
    ((10, 0, 0, 1), ["tensor_parallel_size=0"]),
    ((10, 2, 2, 1), ["rank=2"]),
    ((10, 2, -1, 1), ["rank=-1"]),
])
def test_vocab_layout_errors(args, words):
    with pytest.raises(ValueError) as info:
        _C.vocab_layout(*args)
    for w in words:
        assert w in str(info.value)


# ---------------------------------------------------------------------------
# copy_shard / place_shard
# ---------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]
SHAPES = {1: (7,), 2: (5, 6), 3: (3, 4, 5), 4: (2, 3, 4, 5)}


def range_sets(size: int):
    """Range lists along a dimension of `size` (>= 2), disjoint ones flagged."""
    sets = [
        ([], True),
        ([(0, 0)], True),
        ([(size, 0)], True),
        ([(0, size)], True),
        ([(0, 1)], True),
        ([(size - 1, 1)], True),
        ([(1, size - 2), (0, 1)], True),
        ([(size - 1, 1), (0, 1), (1, 0)], True),
        ([(0, size), (0, 1)], False),  # repeats index 0
    ]
    if size >= 3:
        sets.append(([(2, 1), (0, 2)], True))
    return sets


def make_source(shape, dtype, variant, gen):
    """A tensor of `shape`, laid out as `variant` says."""
    def values(s):
        return torch.randint(-100, 100, s, generator=gen).to(dtype)

    if variant == "contiguous":
        return values(shape)
    if variant == "transposed":  # reversed memory order
        return values(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    if variant == "stepped":  # every dim sliced with a step, plus an offset
        big = values(tuple(2 * s + 1 for s in shape))
        return big[tuple(slice(1, None, 2) for _ in shape)]
    if variant == "expanded":  # stride 0 in dim 0
        return values((1,) + tuple(shape[1:])).expand(*shape)
    raise AssertionError(variant)


def make_dest(shape, dtype, variant, fill):
    if variant == "contiguous":
        return torch.full(shape, fill, dtype=dtype)
    # Transposed destination: written through strides.
    return torch.full(tuple(reversed(shape)), fill, dtype=dtype).permute(
        *reversed(range(len(shape))))


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_and_place_match_torch(dtype, ndim):
    gen = torch.Generator().manual_seed(ndim)
    shape = SHAPES[ndim]
    for dim, src_variant, dst_variant in itertools.product(
            range(ndim), ["contiguous", "transposed", "stepped", "expanded"],
            ["contiguous", "transposed"]):
        full = make_source(shape, dtype, src_variant, gen)
        size = shape[dim]
        for ranges, disjoint in range_sets(size):
            real = sum(n for _, n in ranges)
            for pad in (0, 2):
                sshape = list(shape)
                sshape[dim] = real + pad
                shard = make_dest(sshape, dtype, dst_variant, 99)
                _C.copy_shard(full, shard, dim, ranges)
                expected = ref_copy(full, dim, ranges, real + pad)
                assert torch.equal(shard, expected), (dim, src_variant, dst_variant, ranges, pad)

                if not disjoint:
                    continue
                # place_shard writes exactly the ranges (not the padding tail).
                target = make_dest(shape, dtype, dst_variant, -7)
                tail = shard.narrow(dim, real, pad)
                tail.fill_(55)
                _C.place_shard(target, shard, dim, ranges)
                expected_full = torch.full(shape, -7, dtype=dtype)
                for o, n in ranges:
                    expected_full.narrow(dim, o, n).copy_(full.narrow(dim, o, n))
                assert torch.equal(target, expected_full), (dim, ranges, pad)
                # Round trip: place(copy(x)) == x on the ranges.
                for o, n in ranges:
                    assert torch.equal(target.narrow(dim, o, n), full.narrow(dim, o, n))


def test_copy_shard_negative_dim_and_keywords():
    x = torch.arange(24.0).reshape(2, 3, 4)
    out = torch.empty(2, 3, 3)
    _C.copy_shard(full=x, shard=out, dim=-1, ranges=((3, 1), (0, 2)))
    assert torch.equal(out, torch.cat([x[..., 3:], x[..., :2]], -1))
    back = torch.zeros_like(x)
    _C.place_shard(shard=out, full=back, ranges=[(3, 1), (0, 2)], dim=-1)
    assert torch.equal(back[..., [0, 1, 3]], x[..., [0, 1, 3]])
    assert torch.equal(back[..., 2], torch.zeros(2, 3))


def test_copy_shard_ranges_any_sequences():
    x = torch.arange(10.0)
    for ranges in ([[2, 3]], ([2, 3],), ((2, 3),), [np.array([2, 3])],
                   [(np.int64(2), np.int32(3))], [range(2, 4)], np.array([[2, 3]])):
        out = torch.zeros(3)
        _C.copy_shard(x, out, 0, ranges)
        assert torch.equal(out, x[2:5]), ranges


def test_copy_shard_zero_size_tensors():
    x = torch.empty(0, 4)
    out = torch.empty(0, 2)
    _C.copy_shard(x, out, 1, [(1, 2)])
    _C.place_shard(x, out, 1, [(1, 2)])
    y = torch.arange(6.0).reshape(3, 2)
    empty = torch.empty(0, 2)
    _C.copy_shard(y, empty, 0, [])
    _C.copy_shard(y, empty, 0, [(3, 0), (1, 0)])


def test_copy_shard_other_dtypes():
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                  torch.complex64):
        x = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
        out = torch.ones(3, 3, dtype=dtype)
        _C.copy_shard(x, out, 1, [(1, 2)])
        assert torch.equal(out, torch.cat([x[:, 1:3], torch.zeros(3, 1, dtype=dtype)], 1))


def test_numpy_inputs():
    x = np.arange(30, dtype=np.float32).reshape(5, 6)
    out = np.full((5, 4), 7, dtype=np.float32)
    _C.copy_shard(x, out, 1, [(4, 2), (0, 1)])
    assert np.array_equal(out, np.concatenate([x[:, 4:], x[:, :1], np.zeros((5, 1), np.float32)], 1))
    # Non-contiguous NumPy source (Fortran order, negative step).
    xf = np.asfortranarray(x)
    out2 = np.empty((3, 6), dtype=np.float32)
    _C.copy_shard(xf, out2, 0, [(1, 3)])
    assert np.array_equal(out2, x[1:4])
    rev = x[::-1]
    _C.copy_shard(rev, out2, 0, [(0, 3)])
    assert np.array_equal(out2, x[4:1:-1])
    # Mixed torch / NumPy.
    t = torch.zeros(5, 6)
    _C.place_shard(t, out, 1, [(4, 2), (0, 1)])
    assert torch.equal(t[:, [0, 4, 5]], torch.from_numpy(x[:, [0, 4, 5]]))
    # A read-only NumPy array is a fine source.
    ro = x.copy()
    ro.flags.writeable = False
    _C.copy_shard(ro, out2, 0, [(0, 3)])
    assert np.array_equal(out2, x[:3])


def test_storage_offset_source():
    x = torch.arange(10.0)
    out = torch.empty(8)
    _C.copy_shard(x[2:], out, 0, [(0, 8)])
    assert torch.equal(out, x[2:])
    y = torch.arange(60.0).reshape(6, 10)
    view = y[2:, 3:]
    out = torch.empty(4, 2)
    _C.copy_shard(view, out, 1, [(5, 2)])
    assert torch.equal(out, y[2:, 8:10])
    # ...and as a destination.
    z = torch.zeros(10)
    _C.place_shard(z[3:], torch.ones(2), 0, [(1, 2)])
    assert torch.equal(z.nonzero().flatten(), torch.tensor([4, 5]))


# --- bad input ---------------------------------------------------------------

def test_dtype_mismatch():
    pairs = [(torch.float32, torch.float64), (torch.bfloat16, torch.float16),
             (torch.float32, torch.int32), (torch.int64, torch.float64)]
    for a, b in pairs:
        for fn in (_C.copy_shard, _C.place_shard):
            with pytest.raises(TypeError) as info:
                fn(torch.zeros(4, dtype=a), torch.zeros(2, dtype=b), 0, [(0, 2)])
            msg = str(info.value)
            assert str(a).split(".")[1] in msg and str(b).split(".")[1] in msg, msg


@pytest.mark.parametrize("bad", [[1.0, 2.0], None, 3, "tensor", object()])
def test_not_a_tensor(bad):
    t = torch.zeros(4)
    with pytest.raises(TypeError, match=r"^full: expected a tensor supporting __dlpack__"):
        _C.copy_shard(bad, t, 0, [])
    with pytest.raises(TypeError, match=r"^shard: expected a tensor supporting __dlpack__"):
        _C.place_shard(t, bad, 0, [])
    with pytest.raises(TypeError, match=r"^t: expected a tensor supporting __dlpack__"):
        _C.tensor_info(bad)


def test_numpy_dlpack_read_only_flag():
    ro = np.zeros(4, dtype=np.float32)
    ro.flags.writeable = False
    assert _C.tensor_info(ro)["readonly"] is True
    assert _C.tensor_info(np.zeros(4))["readonly"] is False
    with pytest.raises(ValueError, match="shard: tensor is read-only"):
        _C.copy_shard(np.arange(4, dtype=np.float32), ro, 0, [(0, 2)])
    with pytest.raises(ValueError, match="full: tensor is read-only"):
        _C.place_shard(ro, np.ones(2, dtype=np.float32), 0, [(0, 2)])
    assert not ro.any()


def test_requires_grad_is_refused_cleanly():
    w = torch.ones(4, requires_grad=True)
    with pytest.raises(TypeError, match=r"full: cannot export through DLPack.*gradient"):
        _C.copy_shard(w, torch.zeros(2), 0, [(0, 2)])
    with pytest.raises(TypeError, match=r"shard: cannot export through DLPack"):
        _C.copy_shard(torch.ones(4), w, 0, [(0, 2)])
    with pytest.raises(TypeError, match=r"t: cannot export through DLPack"):
        _C.tensor_info(w)
    # detach() is the documented way out.
    out = torch.zeros(2)
    _C.copy_shard(w.detach(), out, 0, [(0, 2)])
    assert torch.equal(out, torch.ones(2))


def test_ndim_and_shape_mismatch():
    with pytest.raises(ValueError, match="full has 2 dimensions but shard has 1"):
        _C.copy_shard(torch.zeros(2, 3), torch.zeros(3), 0, [])
    with pytest.raises(ValueError, match=r"dimension 1 \(3 vs 4\)"):
        _C.copy_shard(torch.zeros(2, 3), torch.zeros(2, 4), 0, [])
    with pytest.raises(ValueError, match=r"dimension 0 \(2 vs 5\)"):
        _C.place_shard(torch.zeros(2, 3), torch.zeros(5, 3), 1, [])


@pytest.mark.parametrize("ranges", [
    [(0, 5)], [(4, 2)], [(-1, 1)], [(0, -1)], [(5, 1)], [(6, 0)], [(1, 2), (3, 3)],
    [(INT64_MAX, 1)], [(1, INT64_MAX)], [(1, INT64_MAX), (0, 2)],
])
def test_ranges_out_of_bounds(ranges):
    full = torch.arange(5.0)
    shard = torch.full((4,), 3.0)
    for fn in (_C.copy_shard, _C.place_shard):
        with pytest.raises(IndexError, match="range"):
            fn(full, shard, 0, ranges)
    # Checks run before any memory is touched.
    assert torch.equal(full, torch.arange(5.0)) and torch.equal(shard, torch.full((4,), 3.0))


@pytest.mark.parametrize("ranges", [[(0, 3), (3, 2)], [(0, 5)], [(0, 2), (1, 2), (2, 1)]])
def test_ranges_longer_than_shard(ranges):
    with pytest.raises(IndexError, match="shard holds"):
        _C.copy_shard(torch.arange(5.0), torch.zeros(4), 0, ranges)


@pytest.mark.parametrize("ranges, exc", [
    (3, TypeError), (None, TypeError), ("ab", TypeError), (b"ab", TypeError),
    ({0: 1}, TypeError), ([3], TypeError), ([None], TypeError), ([(0,)], TypeError),
    ([(0, 1, 2)], TypeError), ([("a", 1)], TypeError), ([(0.5, 1)], TypeError),
    ([(0, 1.0)], TypeError), (["01"], TypeError), ([(2**64, 1)], OverflowError),
    ([(0, -(2**64))], OverflowError),
])
def test_bad_ranges_types(ranges, exc):
    with pytest.raises(exc):
        _C.copy_shard(torch.arange(5.0), torch.zeros(4), 0, ranges)


def test_bad_dim():
    x, s = torch.zeros(2, 3), torch.zeros(2, 3)
    for dim in (2, -3, 100):
        with pytest.raises(IndexError, match="dim out of range"):
            _C.copy_shard(x, s, dim, [])
    with pytest.raises(TypeError):
        _C.copy_shard(x, s, 0.0, [])
    with pytest.raises(TypeError):
        _C.copy_shard(x, s, "0", [])
    with pytest.raises(OverflowError):
        _C.copy_shard(x, s, 2**40, [])
    with pytest.raises(IndexError):  # 0-d tensors have no dim to split
        _C.copy_shard(torch.tensor(1.0), torch.tensor(2.0), 0, [])


def test_bad_call_signature():
    with pytest.raises(TypeError):
        _C.copy_shard(torch.zeros(2), torch.zeros(2), 0)
    with pytest.raises(TypeError):
        _C.copy_shard(torch.zeros(2), torch.zeros(2), 0, [], 5)
    with pytest.raises(TypeError):
        _C.place_shard(full=torch.zeros(2), shard=torch.zeros(2), dim=0, rangez=[])


def test_foreign_device_is_refused():
    fake = FakeTensor(np.zeros(4, np.float32), device_type=2, device_id=1)
    info = _C.tensor_info(fake)
    assert (info["device_type"], info["device_id"]) == (2, 1)
    with pytest.raises(ValueError, match="full: expected a CPU tensor.*device type 2"):
        _C.copy_shard(fake, torch.zeros(2), 0, [(0, 2)])
    with pytest.raises(ValueError, match="shard: expected a CPU tensor"):
        _C.copy_shard(torch.zeros(4), fake, 0, [(0, 2)])


# ---------------------------------------------------------------------------
# gather_index
# ---------------------------------------------------------------------------

def layout_cases():
    for full in range(1, 12):
        yield Split(), full
    yield Split(unit=2), 12
    yield Split(unit=3), 9
    for h, kv in [(4, 4), (8, 2), (6, 2), (4, 1), (12, 4), (6, 3), (8, 8), (5, 5), (3, 1)]:
        for hd in (1, 2, 3):
            heads = Heads(h, kv)
            yield heads.q, h * hd
            yield heads.kv, kv * hd
            yield heads.qkv, (h + 2 * kv) * hd
            yield Heads(h, kv, head_dim=hd).qkv, (h + 2 * kv) * hd
    yield Fused.equal(2), 8
    yield Fused.equal(2), 10
    yield Fused.equal(3, unit=2), 18
    yield Fused((Split(), Heads(4, 2, head_dim=2).kv)), 7
    for vocab in (1, 5, 10, 17):
        for multiple in (1, 4, 8):
            yield Vocab(multiple), vocab


def test_gather_index_reassembles_layouts():
    checked = 0
    gen = torch.Generator().manual_seed(0)
    for (spec, full_len), tp in itertools.product(list(layout_cases()), range(1, 5)):
        try:
            shards = [spec.resolve(full_len, tp, r) for r in range(tp)]
        except ValueError:
            continue  # layout impossible at this tp (heads_layout's own tests cover that)
        full = torch.randint(-1000, 1000, (full_len, 3), generator=gen).float()
        chunk = shards[0].chunk
        buffers = []
        for ds in shards:
            shard = torch.full((ds.length, 3), 123.0)
            _C.copy_shard(full, shard, 0, ds.ranges)
            assert torch.equal(shard[ds.real:], torch.zeros(ds.length - ds.real, 3))
            padded = torch.full((chunk, 3), float("nan"))
            padded[:ds.length] = shard
            buffers.append(padded)
        gathered = torch.cat(buffers)
        idx = _C.gather_index(shards[0].all_ranges, full_len, chunk)
        assert isinstance(idx, np.ndarray) and idx.dtype == np.int64 and idx.shape == (full_len,)
        assert torch.equal(gathered[torch.from_numpy(idx)], full), (spec, full_len, tp)
        assert torch.equal(shards[tp - 1].gather_index, torch.from_numpy(idx))
        # Also along a non-leading dimension of the gathered tensor.
        assert torch.equal(gathered.t()[:, torch.from_numpy(idx)], full.t())
        checked += 1
    assert checked > 250


def test_gather_index_first_holder_wins():
    # Replicated KV heads: index i comes from the first rank holding it.
    idx = _C.gather_index([[(0, 2)], [(0, 2)], [(2, 2)], [(2, 2)]], 4, 2)
    assert idx.tolist() == [0, 1, 4, 5]
    idx = _C.gather_index([[(2, 1), (0, 2)], [(3, 1)]], 4, 4)
    assert idx.tolist() == [1, 2, 0, 4]


def test_gather_index_edge_cases():
    assert _C.gather_index([], 0, 0).tolist() == []
    assert _C.gather_index([[]], 0, 5).tolist() == []
    assert _C.gather_index(([(0, 1)], [(1, 0)]), 1, 1).tolist() == [0]
    assert _C.gather_index([[[0, 3]]], 3, 3).tolist() == [0, 1, 2]


def test_gather_index_errors():
    with pytest.raises(ValueError, match="full index 2 is held by no rank"):
        _C.gather_index([[(0, 2)], [(3, 1)]], 4, 2)
    with pytest.raises(ValueError, match="full index 0 is held by no rank"):
        _C.gather_index([], 1, 1)
    with pytest.raises(ValueError, match=r"rank 1 range \(3, 2\) does not fit full length 4"):
        _C.gather_index([[(0, 2)], [(3, 2)]], 4, 2)
    with pytest.raises(ValueError, match="chunk 2"):  # longer than the chunk
        _C.gather_index([[(0, 3)]], 4, 2)
    with pytest.raises(ValueError, match="does not fit"):
        _C.gather_index([[(-1, 1)]], 4, 2)
    with pytest.raises(ValueError, match="does not fit"):
        _C.gather_index([[(0, 1), (1, INT64_MAX)]], 4, 2)
    with pytest.raises(ValueError, match="does not fit"):
        _C.gather_index([[(INT64_MAX, 1)]], 4, 2)
    with pytest.raises(ValueError, match="overflow"):
        _C.gather_index([[(0, 1)], [(1, 1)]], 2, INT64_MAX)
    with pytest.raises(ValueError, match=">= 0"):
        _C.gather_index([], -1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        _C.gather_index([], 0, -1)
    with pytest.raises((ValueError, MemoryError)):
        _C.gather_index([], 2**62, 1)
    for bad in (None, 3, "ab", [3], [[3]], [[(0, 1, 2)]], [[(0.0, 1)]]):
        with pytest.raises(TypeError):
            _C.gather_index(bad, 1, 1)
    with pytest.raises(TypeError):
        _C.gather_index([[(0, 1)]], 1.0, 1)


# ---------------------------------------------------------------------------
# tensor_info
# ---------------------------------------------------------------------------

def test_tensor_info_torch():
    info = _C.tensor_info(torch.zeros(2, 3, 4))
    assert info == {"dtype": "float32", "device_type": 1, "device_id": 0, "shape": (2, 3, 4),
                    "strides": (12, 4, 1), "contiguous": True, "readonly": False,
                    "itemsize": 4}
    info = _C.tensor_info(torch.zeros(5, 6, dtype=torch.bfloat16).t())
    assert (info["dtype"], info["itemsize"], info["shape"], info["strides"],
            info["contiguous"]) == ("bfloat16", 2, (6, 5), (1, 6), False)
    info = _C.tensor_info(torch.zeros(4, 6)[:, ::2])
    assert (info["shape"], info["strides"], info["contiguous"]) == ((4, 3), (6, 2), False)
    info = _C.tensor_info(torch.tensor(3.0))
    assert (info["shape"], info["strides"], info["contiguous"]) == ((), (), True)
    # Size-1 dimensions do not break contiguity whatever their stride.
    odd = torch.zeros(12).as_strided((4, 1, 3), (3, 100, 1))
    info = _C.tensor_info(odd)
    assert info["contiguous"] and info["shape"] == (4, 1, 3)
    assert _C.tensor_info(torch.zeros(3, 4)[:1])["contiguous"]
    names = {torch.float16: "float16", torch.float64: "float64", torch.int64: "int64",
             torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
             torch.uint8: "uint8", torch.bool: "bool"}
    for dtype, name in names.items():
        info = _C.tensor_info(torch.zeros(2, dtype=dtype))
        assert info["dtype"] == name and info["itemsize"] == torch.zeros(0, dtype=dtype).element_size()


def test_tensor_info_storage_offset():
    x = torch.arange(10, dtype=torch.int64)
    tail = x[2:]
    assert tail.storage_offset() == 2
    info = _C.tensor_info(tail)
    assert info["shape"] == (8,) and info["strides"] == (1,) and info["contiguous"]
    out = torch.empty(8, dtype=torch.int64)
    _C.copy_shard(tail, out, 0, [(0, 8)])
    assert out.tolist() == list(range(2, 10))
    # NumPy views too.
    a = np.arange(10.0)[3:]
    assert _C.tensor_info(a)["shape"] == (7,)
    o = np.empty(7)
    _C.copy_shard(a, o, 0, [(0, 7)])
    assert o.tolist() == list(np.arange(3.0, 10.0))


def test_tensor_info_numpy():
    a = np.zeros((3, 4), dtype=np.float16, order="F")
    info = _C.tensor_info(a)
    assert (info["dtype"], info["shape"], info["strides"], info["contiguous"]) == (
        "float16", (3, 4), (1, 3), False)
    info = _C.tensor_info(np.arange(6.0)[::-1])
    assert info["strides"] == (-1,) and not info["contiguous"]


def test_tensor_info_bad_arguments():
    with pytest.raises(TypeError):
        _C.tensor_info()
    with pytest.raises(TypeError):
        _C.tensor_info(torch.zeros(1), torch.zeros(1))


# --- Hand-made DLPack capsules -------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _DLTensor)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAMES = {True: b"dltensor_versioned", False: b"dltensor", "bogus": b"not_a_tensor"}
_DL_CODES = {"f": 2, "i": 0, "u": 1, "b": 6}


class FakeTensor:
    """A DLPack producer over a NumPy array's memory with every field under the
    test's control.  The capsules have no destructor; the memory and the
    structs live as long as this object."""

    def __init__(self, array, *, versioned=True, major=1, flags=0, device_type=1, device_id=0,
                 code=None, bits=None, lanes=1, ndim=None, shape=None, strides="auto",
                 byte_offset=0, capsule="ok"):
        self.array = array
        shape = tuple(array.shape if shape is None else shape)
        if strides == "auto":
            strides = tuple(s // array.itemsize for s in array.strides)
        n = max(len(shape), 1)
        self._shape = (ctypes.c_int64 * n)(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * n)(*strides)
        t = _DLTensor()
        t.data = array.ctypes.data - byte_offset
        t.device = _DLDevice(device_type, device_id)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = _DLDataType(_DL_CODES[array.dtype.kind] if code is None else code,
                              array.itemsize * 8 if bits is None else bits, lanes)
        t.shape = self._shape
        t.strides = self._strides
        t.byte_offset = byte_offset
        if versioned:
            self._managed = _DLManagedTensorVersioned(_DLPackVersion(major, 0), None, None,
                                                      flags, t)
        else:
            self._managed = _DLManagedTensor(t, None, None)
        self.versioned = versioned
        self.capsule = capsule

    def __dlpack__(self, *, max_version=None, **kwargs):
        if not self.versioned and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if self.capsule == "not_a_capsule":
            return 42
        name = _CAPSULE_NAMES["bogus" if self.capsule == "bogus" else self.versioned]
        return _PyCapsule_New(ctypes.addressof(self._managed), name, None)


def test_fake_capsules_valid_paths():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    # Legacy (pre-1.0) producer: the first call with max_version fails with
    # TypeError and _C falls back to the plain call.
    legacy = FakeTensor(base, versioned=False)
    assert _C.tensor_info(legacy)["shape"] == (3, 4)
    out = np.zeros((3, 2), np.float32)
    _C.copy_shard(legacy, out, 1, [(2, 2)])
    assert np.array_equal(out, base[:, 2:])
    # NULL strides mean row-major.
    compact = FakeTensor(base, strides=None)
    info = _C.tensor_info(compact)
    assert info["strides"] == (4, 1) and info["contiguous"]
    _C.copy_shard(compact, out, 1, [(0, 2)])
    assert np.array_equal(out, base[:, :2])
    # byte_offset: data points before the tensor, byte_offset moves to it.
    flat = np.arange(10, dtype=np.int64)
    tail = FakeTensor(flat[3:], byte_offset=3 * 8)
    got = np.zeros(7, np.int64)
    _C.copy_shard(tail, got, 0, [(0, 7)])
    assert got.tolist() == list(range(3, 10))
    # The read-only flag of DLPack 1.0.
    ro = FakeTensor(base, flags=1)
    assert _C.tensor_info(ro)["readonly"] is True
    with pytest.raises(ValueError, match="full: tensor is read-only"):
        _C.place_shard(ro, np.zeros((3, 1), np.float32), 1, [(0, 1)])
    _C.copy_shard(ro, out, 1, [(1, 2)])
    assert np.array_equal(out, base[:, 1:3])
    # 16 dimensions is the limit, and works.
    many = np.zeros((1,) * 15 + (3,), np.float32)
    assert len(_C.tensor_info(FakeTensor(many))["shape"]) == 16


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(major=2), TypeError, "unsupported DLPack major version 2"),
    (dict(major=0), TypeError, "unsupported DLPack major version 0"),
    (dict(ndim=17, shape=(1,) * 17, strides=(1,) * 17), ValueError, "17 dimensions"),
    (dict(ndim=-1), ValueError, "-1 dimensions"),
    (dict(shape=(3, -4)), ValueError, "negative size in dimension 1"),
    (dict(bits=0), TypeError, "unsupported DLPack dtype"),
    (dict(bits=12), TypeError, "unsupported DLPack dtype"),
    (dict(lanes=2), TypeError, "unsupported DLPack dtype"),
    (dict(capsule="bogus"), TypeError, "__dlpack__ did not return a DLPack capsule"),
    (dict(capsule="not_a_capsule"), TypeError, "__dlpack__ did not return a DLPack capsule"),
])
def test_fake_capsules_rejected(kwargs, exc, pattern):
    fake = FakeTensor(np.zeros((3, 4), np.float32), **kwargs)
    with pytest.raises(exc, match="t: " + pattern):
        _C.tensor_info(fake)
    with pytest.raises(exc, match="shard: " + pattern):
        _C.copy_shard(np.zeros((3, 4), np.float32), fake, 0, [])


def test_dlpack_method_failures():
    class Raises:
        def __dlpack__(self, **kw):
            raise RuntimeError("no export today")

    class NotCallable:
        __dlpack__ = 42

    class Explodes:
        @property
        def __dlpack__(self):
            raise KeyError("boom")

    with pytest.raises(TypeError, match="full: cannot export through DLPack: no export today"):
        _C.copy_shard(Raises(), torch.zeros(1), 0, [])
    with pytest.raises(TypeError, match="t: cannot export through DLPack"):
        _C.tensor_info(NotCallable())
    with pytest.raises(TypeError, match="t: expected a tensor supporting __dlpack__"):
        _C.tensor_info(Explodes())


# ---------------------------------------------------------------------------
# sharder_plan / sharder_apply
# ---------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.num_heads = 8


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])


class Target:
    calls: list = []

    @staticmethod
    def plan_shard(module, tp_size, rank, **kwargs):
        return ("plan", tp_size, rank, tuple(sorted(kwargs)))

    @staticmethod
    def from_native_module(module, process_group, **kwargs):
        Target.calls.append((module, process_group, kwargs))
        return nn.Identity()


def new_forward(self, x):
    return x * 2


def entries_for_block():
    return {Block: (
        (("num_heads", PerRank(lambda tp, r: 8 // tp)),),
        (lambda m: setattr(m, "touched", True),),
        (("proj", Target, {"k": 1}, False),),
        (("forward", new_forward),),
    )}


def test_sharder_plan_and_apply_roundtrip():
    root = Root()
    ops, matched = _C.sharder_plan(root, "Root", entries_for_block(), 2, 1)
    assert matched == 2
    assert [op.kind for op in ops] == ["attr", "param", "sub", "method"] * 2
    assert ops[2].path == "blocks.0.proj" and ops[2].plan == ("plan", 2, 1, ("k",))
    assert not hasattr(root.blocks[0], "touched") and root.blocks[0].num_heads == 8
    Target.calls.clear()
    assert _C.sharder_apply(ops, "pg") == 8
    assert ops == [None] * 8  # consumed
    for block in root.blocks:
        assert block.num_heads == 4 and block.touched and isinstance(block.proj, nn.Identity)
        assert block(torch.ones(1)).item() == 2.0
    assert [(pg, kw) for _, pg, kw in Target.calls] == [("pg", {"k": 1, "plan": ("plan", 2, 1, ("k",))})] * 2


def test_sharder_plan_keys_by_name_and_star():
    entry = ((), (), (("*.proj", Target, {}, True),), ())  # ModuleList has no 'proj'; ignored
    root = Root()
    for key in ("Root", f"{Root.__module__}.Root"):
        ops, matched = _C.sharder_plan(root, "M", {key: entry}, 1, 0)
        assert matched == 1 and [op.path for op in ops] == []
    entry = ((), (), (("blocks.*.proj", Target, {}, False),), ())
    for key in ("Root", f"{Root.__module__}.Root"):
        ops, matched = _C.sharder_plan(root, "M", {key: entry}, 1, 0)
        assert matched == 1 and [op.path for op in ops] == ["blocks.0.proj", "blocks.1.proj"]
    ops, _ = _C.sharder_plan(root, "M", {Root: ((), (), (("missing", Target, {}, True),), ())},
                             1, 0)
    assert ops == []


@pytest.mark.parametrize("args", [
    (42, "M", {}, 1, 0),
    ("not a module", "M", {}, 1, 0),
])
def test_sharder_plan_root_not_a_module(args):
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        _C.sharder_plan(*args)


@pytest.mark.parametrize("args", [
    (Root(), 5, {}, 1, 0),          # model_name not str
    (Root(), "M", [], 1, 0),        # entries not a dict
    (Root(), "M", None, 1, 0),
    (Root(), "M", {}, 1.0, 0),      # tp_size not int
    (Root(), "M", {}, 1, "0"),      # rank not int
    (Root(), "M", {}),              # missing arguments
])
def test_sharder_plan_argument_types(args):
    with pytest.raises(TypeError):
        _C.sharder_plan(*args)


@pytest.mark.parametrize("entry, pattern", [
    ([(), (), (), ()], "policy entry"),
    ("abcd", "policy entry"),
    (((), (), ()), "policy entry"),
    (((), (), (), (), ()), "policy entry"),
    (([], (), (), ()), "policy entry"),
    (((1,), (), (), ()), "attribute_replacement item"),
    (((("a",),), (), (), ()), "attribute_replacement item"),
    ((((1, 2),), (), (), ()), "attribute_replacement item"),
    ((([("num_heads", 1)]), (), (), ()), "policy entry"),
    (((), (), (("proj", Target, {}),), ()), "sub_module_replacement item"),
    (((), (), (("proj", Target, [], False),), ()), "sub_module_replacement item"),
    (((), (), (["proj", Target, {}, False],), ()), "sub_module_replacement item"),
    (((), (), (), (("forward",),)), "method_replacement item"),
    (((), (), (), (("forward", 3),)), "not callable"),
    (((), (), (), ("forward",)), "method_replacement item"),
])
def test_sharder_plan_malformed_entries(entry, pattern):
    with pytest.raises(TypeError, match=pattern):
        _C.sharder_plan(Root(), "M", {Block: entry}, 1, 0)


def test_sharder_plan_errors_carry_context():
    class Failing:
        @staticmethod
        def plan_shard(module, tp, rank):
            raise ValueError("cannot split 4 over 3")

    with pytest.raises(ValueError, match=r"^M: blocks.0.proj: cannot split 4 over 3") as info:
        _C.sharder_plan(Root(), "M", {Block: ((), (), (("proj", Failing, {}, False),), ())}, 3, 0)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="no sub-module 'nope'"):
        _C.sharder_plan(Root(), "M", {Block: ((), (), (("nope", Target, {}, False),), ())}, 1, 0)
    with pytest.raises(ValueError, match="does not have"):
        _C.sharder_plan(Root(), "M", {Block: ((("nope", 1),), (), (), ())}, 1, 0)
    with pytest.raises(ValueError, match="replaced by two policy entries"):
        _C.sharder_plan(Root(), "M", {Block: ((), (), (("proj", Target, {}, False),) * 2, ())},
                        1, 0)
    with pytest.raises(TypeError, match=r"^M: blocks.0.num_heads: .*boom"):
        _C.sharder_plan(Root(), "M", {Block: ((("num_heads", PerRank(
            lambda tp, r: (_ for _ in ()).throw(TypeError("boom")))),), (), (), ())}, 1, 0)


def test_sharder_apply_argument_types():
    with pytest.raises(TypeError):
        _C.sharder_apply((), None)  # ops must be a list
    with pytest.raises(TypeError):
        _C.sharder_apply("ops", None)
    with pytest.raises(TypeError):
        _C.sharder_apply([])  # process_group missing
    assert _C.sharder_apply([], None) == 0


def record(kind, path, owner=None, name=None, value=None, target=None, native=None, kwargs=None,
           plan=None, change=None):
    """A plan record (_C.PlanOp) made by hand."""
    return _C.PlanOp((kind, path, owner, name, value, target, native, kwargs, plan, change))


def test_plan_records_are_named():
    """sharder_plan returns _C.PlanOp records read by field name; apply's
    builds are records too (a sub's replacement in `value`)."""
    root = Root()
    ops, _ = _C.sharder_plan(root, "Root", entries_for_block(), 2, 1)
    attr, param, sub, method = ops[:4]
    assert all(isinstance(op, _C.PlanOp) for op in ops)
    assert (attr.kind, attr.path, attr.owner, attr.name, attr.value) == (
        "attr", "blocks.0.num_heads", root.blocks[0], "num_heads", 4)
    assert (param.kind, param.owner, param.name, callable(param.value)) == ("param", root.blocks[0], None, True)
    assert (sub.kind, sub.owner, sub.name, sub.target, sub.native, sub.kwargs, sub.value) == (
        "sub", root.blocks[0], "proj", Target, root.blocks[0].proj, {"k": 1}, None)
    assert (method.kind, method.name, method.value) == ("method", "forward", new_forward)
    seen = []
    _C.sharder_apply(ops, "pg", None, None, lambda o, builds: seen.extend(builds))
    subs = [b for b in seen if b.kind == "sub"]
    assert [type(b.value) for b in subs] == [nn.Identity] * 2 and all(b.change is None for b in subs)
    assert all(b.value.__self__ is b.owner for b in seen if b.kind == "method")


@pytest.mark.parametrize("op, pattern", [
    (42, "malformed plan op: expected a shardformer._C.PlanOp, got int"),
    (("attr", "p", 3, "real", 1), "expected a shardformer._C.PlanOp, got tuple"),
    (record("attr", "p"), "'attr' op needs owner"),
    (record("param", "p", nn.Linear(1, 1)), "'param' op needs value"),
    (record("sub", "p", Root(), "x", native=nn.Linear(1, 1)), "'sub' op needs target"),
    (record("method", "p", Root(), 3, len), "name must be a str"),
    (record("bogus", "p"), "unknown plan op kind 'bogus'"),
    (record("sub", "p", Root(), "x", target=Target, native=nn.Linear(1, 1), kwargs=[]),
     "kwargs is not a dict"),
    (record("param", "p", nn.Linear(1, 1), value=3), "not callable"),
    (record("attr", "p", 3, "real", 1), "attribute"),
])
def test_sharder_apply_malformed_ops(op, pattern):
    with pytest.raises(RuntimeError, match=f"applying the shard plan failed.*{pattern}"):
        _C.sharder_apply([op], None)


# ---------------------------------------------------------------------------
# Regressions: each of these used to crash the interpreter
# ---------------------------------------------------------------------------

def test_regression_vocab_layout_overflow():
    # parts * multiple wrapped to 0: division by zero (SIGFPE).
    with pytest.raises(ValueError, match="overflows int64"):
        _C.vocab_layout(10, 2**62, 0, 4)
    # vocab rounded up past INT64_MAX: negative sizes came back.
    with pytest.raises(ValueError, match="overflows int64"):
        _C.vocab_layout(INT64_MAX, 2, 0, 1)
    assert _C.vocab_layout(INT64_MAX, 1, 0, 1) == (INT64_MAX, 0, INT64_MAX, INT64_MAX)


def test_regression_range_overflow():
    # offset + length wrapped negative and passed the bounds check (abort in memcpy).
    with pytest.raises(IndexError):
        _C.copy_shard(torch.arange(4.0), torch.zeros(4), 0, [(1, INT64_MAX), (0, 2)])
    # Same in gather_index (segfault writing past the index array).
    with pytest.raises(ValueError):
        _C.gather_index([[(0, 1), (1, INT64_MAX)]], 4, 2)


def test_regression_plan_entry_dropped_while_planning():
    # plan_shard runs Python code; dropping the policy entry from the dict
    # used to free the entry tuple that the planner was iterating over.
    entries = {}

    class Clears:
        @staticmethod
        def plan_shard(module, tp, rank):
            entries.clear()
            return None

    entries[Root] = ((), (), tuple(("blocks.%d.proj" % i, Clears, {}, False) for i in range(2)), ())
    ops, matched = _C.sharder_plan(Root(), "M", entries, 1, 0)
    assert matched == 1 and len(ops) == 2


def test_regression_apply_list_shrinks():
    ops = []

    def clear(module):
        ops.clear()

    ops.extend([record("param", "a", nn.Linear(1, 1), value=clear),
                record("param", "b", nn.Linear(1, 1), value=clear)])
    assert _C.sharder_apply(ops, None) == 1


def test_aliased_full_and_shard():
    # One tensor as both source and destination: rows overlap (memmove).
    x = torch.arange(8.0)
    _C.copy_shard(x, x, 0, [(1, 6)])
    assert x.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    y = torch.arange(8.0)
    _C.place_shard(y, y, 0, [(2, 5)])
    assert y.tolist() == [0, 1, 0, 1, 2, 3, 4, 7]
    z = torch.arange(12.0).reshape(3, 4)
    _C.copy_shard(z, z[:, 1:], 1, [(0, 3)])  # shifts each row right by one
    assert z.tolist() == [[0, 0, 1, 2], [4, 4, 5, 6], [8, 8, 9, 10]]


def test_regression_ranges_mutated_by_index():
    # __index__ may run arbitrary code; the ranges are snapshotted first.
    ranges = []

    class Sneaky:
        def __index__(self):
            ranges.clear()
            return 1

    ranges.extend([(0, Sneaky()), (1, 1), (2, 1)])
    out = torch.zeros(3)
    _C.copy_shard(torch.arange(4.0), out, 0, ranges)
    assert out.tolist() == [0.0, 1.0, 2.0]
    per_rank = []

    class SneakyOuter:
        def __index__(self):
            per_rank.clear()
            return 1

    per_rank.extend([[(0, SneakyOuter())], [(1, 1)]])
    assert _C.gather_index(per_rank, 2, 1).tolist() == [0, 1]


def test_sharder_apply_adopt_callback():
    """adopt(path, native, replacement) runs for every sub-module swap, before
    the swap; its exception aborts the apply; a non-callable is refused."""
    root = Root()
    ops, _ = _C.sharder_plan(root, "Root", entries_for_block(), 2, 1)
    natives = [root.blocks[0].proj, root.blocks[1].proj]
    seen = []

    def adopt(path, native, replacement):
        seen.append((path, native, replacement, getattr(root.blocks[len(seen)], "proj") is native))

    assert _C.sharder_apply(ops, "pg", adopt) == 8
    assert [s[0] for s in seen] == ["blocks.0.proj", "blocks.1.proj"]
    assert [s[1] for s in seen] == natives and all(s[3] for s in seen)   # called before the swap
    assert [s[2] for s in seen] == [root.blocks[0].proj, root.blocks[1].proj]
    with pytest.raises(TypeError, match="adopt must be callable"):
        _C.sharder_apply([], None, 3)

    def refuse(path, native, replacement):
        raise ValueError("no")

    ops, _ = _C.sharder_plan(Root(), "Root", entries_for_block(), 2, 1)
    with pytest.raises(RuntimeError, match="blocks.0.proj.*no"):
        _C.sharder_apply(ops, "pg", adopt=refuse)


def test_fingerprint_kernel():
    """One ulp anywhere changes it; equal bytes give equal values; every tail
    length of 0..40 bytes is covered; the seed chains; bad input raises."""
    t = torch.randn(1000, 37)
    h = _C.fingerprint(t)
    assert _C.fingerprint(t.clone()) == h
    for index in [(0, 0), (500, 17), (999, 36)]:
        u = t.clone()
        u[index] = torch.nextafter(u[index], torch.tensor(1e9))
        assert _C.fingerprint(u) != h, index
    assert _C.fingerprint(t, seed=5) != h
    assert _C.fingerprint(t, seed=2**64 - 1) != h
    base = torch.arange(40, dtype=torch.uint8)
    assert len({_C.fingerprint(base[:n]) for n in range(41)}) == 41
    assert _C.fingerprint(np.arange(10, dtype=np.int64)) == _C.fingerprint(torch.arange(10))
    with pytest.raises(ValueError, match="contiguous"):
        _C.fingerprint(t.t())
    with pytest.raises(TypeError):
        _C.fingerprint([1, 2])
    with pytest.raises(OverflowError):
        _C.fingerprint(t, seed=-1)


# ---------------------------------------------------------------------------
# The one C status convention (csrc/status.h): every plain-C layer returns an
# sf_status with a message; one mapper turns it into the exception; one DLPack
# gate (sf_take) checks every tensor argument, NCCL's included; one half
# conversion (csrc/half.h); one CPU probe; one dimension limit.
# ---------------------------------------------------------------------------

def _xent_args():
    return torch.randn(6, 20), torch.randint(0, 20, (6,))


@pytest.mark.parametrize("call, exc, message", [
    (lambda zz, y: _C.xent_forward(zz, y, 0, 21, -100, *(torch.empty(6) for _ in range(3)), None),
     ValueError, "xent_forward: vocab_real=21 outside [0, 20] (the logits have 20 columns)"),
    (lambda zz, y: _C.xent_forward(zz, y, 0, -2, -100, *(torch.empty(6) for _ in range(3)), None),
     ValueError, "xent_forward: vocab_real=-2 outside [0, 20]"),
    (lambda zz, y: _C.xent_backward(zz, y, 0, 20, -100, torch.empty(6), torch.empty(6), 0.0, -1,
                                    torch.empty(6, 20)),
     ValueError, "xent_backward: vocab=-1 must be >= 0"),
    (lambda zz, y: _C.bias_dropout_add_forward(zz, None, zz, 1.5, 0, torch.empty(6, 20)),
     ValueError, "bias_dropout_add_forward: p=1.5 outside [0, 1]"),
    (lambda zz, y: _C.bias_dropout_add_backward(zz, -0.25, 0, torch.empty(6, 20), None),
     ValueError, "bias_dropout_add_backward: p=-0.25 outside [0, 1]"),
    (lambda zz, y: _C.attention_forward(torch.zeros(1, 4, 3, 8), torch.zeros(1, 3, 5, 8),
                                        torch.zeros(1, 3, 5, 8), torch.zeros(1, 4, 3, 8),
                                        torch.zeros(1, 4, 3), 1.0, False, 0, None, None, None,
                                        0.0, 0),
     ValueError, "attention_forward: 4 query heads are not a multiple of 3 key-value heads"),
    (lambda zz, y: _C.attention_forward(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 5, 8),
                                        torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 3, 8),
                                        torch.zeros(1, 2, 3), 1.0, True, -3, None, None, None,
                                        0.0, 0),
     ValueError, "attention_forward: window=-3 must be >= 0"),
    (lambda zz, y: _C.attention_backward(*(torch.zeros(1, 2, 3, 8) for _ in range(2)),
                                         torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8),
                                         torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3),
                                         *(torch.zeros(1, 2, 3, 8) for _ in range(3)), None,
                                         1.0, False, 0, None, None, None, 1.5, 0),
     ValueError, "attention_backward: dropout=1.5 outside [0, 1]"),
    (lambda zz, y: _C.attention_dropout_keep(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), 2.0, 0),
     ValueError, "attention_dropout_keep: dropout=2 outside [0, 1]"),
])
def test_kernel_errors_say_why(call, exc, message):
    """Kernels that used to fail with a bare negative code ("kernel returned
    -1") now name the kernel, the argument and the numbers."""
    zz, y = _xent_args()
    with pytest.raises(exc) as info:
        call(zz, y)
    assert message in str(info.value)
    assert "kernel returned" not in str(info.value)


def test_take_names_entry_point_argument_and_dtypes():
    """The one DLPack gate: messages name the entry point, the argument, the
    accepted dtypes and what came instead."""
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match=r"^norm_forward: rstd: expected float32, got float16$"):
        _C.norm_forward(False, x, None, None, 1e-5, torch.empty(3, 4), None,
                        torch.empty(3, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"^swiglu_forward: gate: expected float32, float16 or "
                                        r"bfloat16, got int32$"):
        _C.swiglu_forward(*(torch.ones(3, dtype=torch.int32) for _ in range(3)))
    with pytest.raises(TypeError, match=r"mask: expected uint8 or bool, got float32"):
        _C.attention_forward(*(torch.zeros(1, 1, 2, 4) for _ in range(4)), torch.zeros(1, 1, 2),
                             1.0, False, 0, None, None, torch.zeros(1, 1, 2, 2), 0.0, 0)
    with pytest.raises(ValueError, match=r"^xent_forward: max: tensor is read-only$"):
        ro = np.zeros(6, np.float32)
        ro.flags.writeable = False
        _C.xent_forward(torch.randn(6, 4), torch.zeros(6, dtype=torch.int64), 0, 4, -100, ro,
                        torch.empty(6), torch.empty(6), None)
    with pytest.raises(ValueError, match=r"^reduce_buffers: out: expected a CPU tensor"):
        _C.reduce_buffers(FakeTensor(np.zeros(4, np.float32), device_type=2),
                          [torch.zeros(4)])
    with pytest.raises(TypeError, match=r"^reduce_buffers: out: expected float32, float16, "
                                        r"bfloat16, float64, int32 or int64, got bool$"):
        _C.reduce_buffers(torch.zeros(4, dtype=torch.bool), [torch.zeros(4, dtype=torch.bool)])


def test_status_exception_types():
    """One mapper, one exception type per status."""
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):       # SF_EINVAL
        _C.split_units(4, 0, 0)
    with pytest.raises(IndexError, match=r"range 0 \(offset 2, length 5\)"):  # SF_ERANGE
        _C.copy_shard(torch.zeros(3), torch.zeros(3), 0, [(2, 5)])
    with pytest.raises(TypeError, match="unsupported DLPack dtype"):       # SF_ETYPE
        _C.tensor_info(FakeTensor(np.zeros(3, np.float32), bits=12))
    big = FakeTensor(np.zeros(1, np.float32), shape=(2**40, 2**40), strides=(1, 1))
    with pytest.raises(OverflowError, match="t: the element count overflows int64"):  # SF_EOVERFLOW
        _C.tensor_info(big)
    with pytest.raises(OSError, match="shm_open"):                         # SF_EIO
        _C.shm_attach("/shardformer-test-no-such-segment", 2, 1, 7)
    try:                                                                   # SF_EIO
        _C.nccl_load("/nonexistent/libnccl-does-not-exist.so.2")
    except OSError as e:
        assert "libnccl-does-not-exist" in str(e)
    # (else: NCCL was already loaded in this process, and load is idempotent)


def copy_of(t):
    """A tensor like t over memory of its own (all_to_all refuses out
    overlapping tensor): the same kind of object, fakes on CUDA."""
    if isinstance(t, FakeTensor):
        return FakeTensor(t.array.copy(), device_type=2)
    if isinstance(t, torch.Tensor):
        return t.clone()
    if isinstance(t, np.ndarray):
        return t.copy()
    return list(t)


NCCL_ENTRY_POINTS = [
    ("nccl_all_reduce", lambda t: (None, t, "sum", 0)),
    ("nccl_all_gather", lambda t: (None, t, t, 0)),
    ("nccl_reduce_scatter", lambda t: (None, t, t, "sum", 0)),
    ("nccl_broadcast", lambda t: (None, t, 0, 0)),
    ("nccl_send", lambda t: (None, t, 1, 0)),
    ("nccl_recv", lambda t: (None, t, 1, 0)),
    ("nccl_all_to_all", lambda t: (None, t, copy_of(t), 0)),
]


def _nccl_mapped() -> bool:
    with open("/proc/self/maps") as f:
        return "libnccl" in f.read()


@pytest.mark.parametrize("name, args", NCCL_ENTRY_POINTS, ids=[n for n, _ in NCCL_ENTRY_POINTS])
def test_nccl_entry_points_check_tensors_on_cpu(name, args):
    """The NCCL entry points take tensors through the same DLPack gate as the
    others and refuse what NCCL cannot take before anything loads NCCL."""
    fn = getattr(_C, name)
    mapped = _nccl_mapped()
    with pytest.raises(ValueError, match=rf"^{name}: (out|tensor): expected a CUDA tensor, got a "
                                         r"CPU tensor"):
        fn(*args(torch.ones(6)))
    with pytest.raises(ValueError, match="expected a CUDA tensor, got a CPU tensor"):
        fn(*args(np.ones(6, np.float32)))
    cuda_bool = FakeTensor(np.zeros(6, np.bool_), device_type=2)
    with pytest.raises(TypeError, match=r"expected float32, float16, bfloat16, float64, int8, "
                                        r"uint8, int32 or int64, got bool"):
        fn(*args(cuda_bool))
    strided = FakeTensor(np.zeros((3, 4), np.float32)[:, ::2], device_type=2)
    with pytest.raises(ValueError, match="expected a contiguous tensor"):
        fn(*args(strided))
    # A well-formed (fake) CUDA tensor gets as far as the communicator.
    with pytest.raises(TypeError, match=rf"^{name}: expected an NCCL communicator"):
        fn(*args(FakeTensor(np.zeros(6, np.float32), device_type=2)))
    with pytest.raises(TypeError, match="__dlpack__"):
        fn(*args([1.0, 2.0]))
    assert _nccl_mapped() == mapped, "an argument check loaded NCCL"


def test_nccl_pairs_and_ops_checked_in_c():
    f32 = FakeTensor(np.zeros(12, np.float32), device_type=2)
    i64 = FakeTensor(np.zeros(6, np.int64), device_type=2)
    other_gpu = FakeTensor(np.zeros(6, np.float32), device_type=2, device_id=1)
    with pytest.raises(TypeError, match="out has dtype float32 but tensor has dtype int64"):
        _C.nccl_all_gather(None, f32, i64, 0)
    with pytest.raises(ValueError, match="out is on CUDA device 0 but tensor on device 1"):
        _C.nccl_reduce_scatter(None, f32, other_gpu, "sum", 0)
    with pytest.raises(ValueError, match="reduction op 'avg'"):
        _C.nccl_all_reduce(None, f32, "avg", 0)
    # all_to_all: the pair checks, and no shared byte between out and tensor
    # (grouped send / recv race), all before the communicator is looked at
    with pytest.raises(TypeError, match="out has dtype float32 but tensor has dtype int64"):
        _C.nccl_all_to_all(None, f32, i64, 0)
    with pytest.raises(ValueError, match="out is on CUDA device 0 but tensor on device 1"):
        _C.nccl_all_to_all(None, FakeTensor(np.zeros(6, np.float32), device_type=2), other_gpu, 0)
    with pytest.raises(ValueError, match=r"^nccl_all_to_all: out overlaps tensor in memory"):
        _C.nccl_all_to_all(None, f32, f32, 0)
    buf = np.zeros(12, np.float32)
    with pytest.raises(ValueError, match=r"^nccl_all_to_all: out overlaps tensor in memory"):
        _C.nccl_all_to_all(None, FakeTensor(buf[2:8], device_type=2),
                           FakeTensor(buf[:6], device_type=2), 0)
    with pytest.raises(TypeError, match=r"^nccl_all_to_all: expected an NCCL communicator"):
        _C.nccl_all_to_all(None, FakeTensor(buf[6:], device_type=2),
                           FakeTensor(buf[:6], device_type=2), 0)
    with pytest.raises(TypeError, match=r"^nccl_all_to_all: expected an NCCL communicator"):
        _C.nccl_all_to_all(None, FakeTensor(np.zeros(0, np.float32), device_type=2),
                           FakeTensor(np.zeros(0, np.float32), device_type=2), 0)
    with pytest.raises(TypeError, match="expected an NCCL communicator"):
        _C.nccl_comm_destroy(object())
    with pytest.raises(ValueError, match="unique id has 3 bytes"):
        _C.nccl_comm_init(2, b"abc", 0)


def test_nccl_communicator_methods_refuse_cpu_tensors():
    """NcclCommunicator's call sites hand tensors to _C, which says what is
    wrong (no GPU here: a communicator object without NCCL behind it)."""
    from shardformer.distributed import nccl

    comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
    comm.group, comm.rank, comm.size, comm._comm = None, 0, 2, "not a communicator"
    t = torch.ones(4, requires_grad=True)   # detached on the way: DLPack refuses grad tensors
    for call in (lambda: comm.all_reduce(t), lambda: comm.all_reduce(t, "max"),
                 lambda: comm.all_gather(torch.empty(8), t),
                 lambda: comm.reduce_scatter(torch.empty(2), t),
                 lambda: comm.broadcast(t, 0), lambda: comm.send(t, 1),
                 lambda: comm.recv(torch.empty(4), 1),
                 lambda: comm.all_to_all(torch.empty(4), t)):
        with pytest.raises(ValueError, match="expected a CUDA tensor, got a CPU tensor"):
            call()
    comm._comm = None
    with pytest.raises(RuntimeError, match="destroyed"):
        comm.all_reduce(t)


def _bits16(dt):
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dt)


def _f32_sweep():
    """float32 bit patterns: every exponent with edge mantissas (ties and their
    neighbours for both 16-bit roundings), plus random ones."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-2**31, 2**31, (1 << 20,), generator=g, dtype=torch.int64)
    exp = torch.arange(256, dtype=torch.int64) << 23
    mant = torch.tensor([0, 1, 0x0fff, 0x1000, 0x1001, 0x2fff, 0x3000, 0x3001, 0x7fff, 0x8000,
                         0x8001, 0x17fff, 0x18000, 0x18001, 0x3fffff, 0x400000, 0x7fffff],
                        dtype=torch.int64)
    edge = (exp[:, None] | mant[None, :]).flatten()
    u = torch.cat([rand, edge, edge | (1 << 31)])
    return u.to(torch.int64).sub((u >= 2**31).to(torch.int64) << 32).to(torch.int32)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_half_widening_matches_torch(dt):
    """Every 16-bit pattern widens to float32 as torch does; NaNs keep their
    payload and come out quiet (float16, as F16C) or unchanged (bfloat16)."""
    h = _bits16(dt)
    f = torch.empty(h.numel())
    _C.kernel_convert(h, f)
    want = h.float()                       # torch's vectorized path (65536 elements)
    fb, wb = f.view(torch.int32), want.view(torch.int32)
    ok = h == h
    assert torch.equal(fb[ok], wb[ok])
    nan = ~ok
    hb = h.view(torch.int16).to(torch.int32) & 0xFFFF
    if dt is torch.float16:
        expect = ((hb & 0x8000) << 16) | 0x7F800000 | 0x00400000 | ((hb & 0x3FF) << 13)
    else:
        expect = hb << 16
    assert torch.equal(fb[nan], expect[nan].to(torch.int64).sub(
        (expect[nan] >= 2**31).to(torch.int64) << 32).to(torch.int32))


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_half_narrowing_matches_torch(dt):
    """float32 -> 16 bits rounds to nearest even exactly as torch does, over a
    sweep of patterns; NaNs keep sign and top payload bits, quieted."""
    u = _f32_sweep()
    f = u.view(torch.float32)
    h = torch.empty(f.numel(), dtype=dt)
    _C.kernel_convert(f, h)
    got = h.view(torch.int16).to(torch.int32) & 0xFFFF
    want = f.to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
    ok = f == f
    assert torch.equal(got[ok], want[ok])
    uu = u.to(torch.int64) & 0xFFFFFFFF
    nan = ~ok
    if dt is torch.float16:
        expect = ((uu >> 16) & 0x8000) | 0x7E00 | ((uu >> 13) & 0x3FF)
    else:
        expect = (uu | 0x00400000) >> 16
    assert torch.equal(got[nan].to(torch.int64), expect[nan])


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_half_round_trip_keeps_nan_payloads(dt):
    """16 bits -> float32 -> 16 bits gives every pattern back, NaNs with their
    payload (quieted), through the kernels' conversion and the reductions'
    (plain C and AVX2 alike: one conversion)."""
    h = _bits16(dt)
    f = torch.empty(h.numel())
    _C.kernel_convert(h, f)
    back = torch.empty_like(h)
    _C.kernel_convert(f, back)
    hb = h.view(torch.int16).to(torch.int32) & 0xFFFF
    quiet = 0x0200 if dt is torch.float16 else 0x0040
    want = torch.where(h != h, hb | quiet, hb)
    assert torch.equal(back.view(torch.int16).to(torch.int32) & 0xFFFF, want)
    for simd in (True, False):
        red = torch.empty_like(h)
        _C.reduce_buffers(red, [h], "sum", simd)
        assert torch.equal(red.view(torch.int16).to(torch.int32) & 0xFFFF, want), simd


def test_one_cpu_probe():
    feats = _C.cpu_features()
    assert set(feats) == {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512bf16", "simd", "avx512",
                          "avx512_bf16"}
    assert feats["simd"] == (feats["avx2"] and feats["fma"] and feats["f16c"])
    assert feats["avx512"] == (feats["simd"] and feats["avx512f"])
    assert feats["avx512_bf16"] == (feats["avx512"] and feats["avx512bw"] and feats["avx512bf16"])
    assert _C.cpu_has_avx2() is feats["simd"] and not hasattr(_C, "kernel_has_avx2")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return
    # the probe's names, /proc/cpuinfo's
    for name, flag in (("avx2", "avx2"), ("fma", "fma"), ("f16c", "f16c"), ("avx512f", "avx512f"),
                       ("avx512bw", "avx512bw"), ("avx512bf16", "avx512_bf16")):
        assert feats[name] == (flag in flags), name


def test_one_dimension_limit():
    """SF_MAX_DIMS (16) holds for the DLPack gate and the copy kernel alike."""
    x = torch.arange(3 * 2).reshape((1,) * 14 + (3, 2)).float()
    out = torch.zeros((1,) * 14 + (3, 1))
    _C.copy_shard(x, out, 15, [(1, 1)])
    assert torch.equal(out.flatten(), x[..., 1].flatten())
    with pytest.raises(ValueError, match=r"17 dimensions \(at most 16 supported\)"):
        _C.copy_shard(np.zeros((1,) * 17, np.float32), np.zeros((1,) * 17, np.float32), 0, [])
