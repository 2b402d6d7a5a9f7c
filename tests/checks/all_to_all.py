"""Rank-side checks of the all-to-all collective (tests/test_all_to_all.py):
`all_to_all_single` on every CPU backend against a reference built from every
rank's input, chunked shm messages, mismatched and bad calls, and the
`all_to_all_along` region operator's forward and backward."""
from __future__ import annotations

import contextlib
import os

import torch

from shardformer import _C
from shardformer.distributed import all_to_all_along, mappings
from shardformer.distributed import collectives as coll
from shardformer.distributed import communicator as cm
from shardformer.distributed import shm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def _set_env(name: str, value: str | None) -> str | None:
    old = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    return old


@contextlib.contextmanager
def backend(name: str | None, checked: bool = False):
    """SHARDFORMER_COMM forced to `name` (None: auto) and, when `checked`,
    SHARDFORMER_CHECK_COLLECTIVES=1, for the communicators made inside; the
    choices are forgotten on the way in and out (every rank, same point)."""
    saved = (_set_env(cm.ENV, name), _set_env(cm.CHECK_ENV, "1" if checked else None))
    cm.reset_communicators()
    try:
        yield
    finally:
        _set_env(cm.ENV, saved[0])
        _set_env(cm.CHECK_ENV, saved[1])
        cm.reset_communicators()


@contextlib.contextmanager
def counting_c_calls():
    """Count the calls of the C entry point the shm backend uses for all-to-all."""
    real = _C.shm_all_to_all
    calls = []

    def counted(*args):
        calls.append(1)
        return real(*args)

    _C.shm_all_to_all = counted
    try:
        yield calls
    finally:
        _C.shm_all_to_all = real


def make_input(rank: int, shape, dt: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The same tensor for `rank` on every process (so each can build the reference)."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    if dt is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    lo, hi = (0, 250) if dt is torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dt)


def reference(rank: int, p: int, shape, dt: torch.dtype, seed: int = 0) -> torch.Tensor:
    """What rank `rank` must receive: chunk `rank` of every rank's input, in rank order."""
    c = shape[0] // p
    return torch.cat([make_input(q, shape, dt, seed)[rank * c:(rank + 1) * c] for q in range(p)])


# ---- all_to_all_single on a backend -----------------------------------------------------

def single_vs_reference(ctx, backend_name: str, dtype_names: list, shapes: list) -> dict:
    """all_to_all_single through the collectives module, for every dtype and
    shape, equals the reference exactly; non-contiguous out and input too."""
    r, p, group = ctx.rank, ctx.tp_size, ctx.group
    with backend(None if backend_name == "auto" else backend_name), counting_c_calls() as calls:
        used = coll.backend_for(torch.ones(1), group)
        done = 0
        for seed, name in enumerate(dtype_names):
            dt = DTYPES[name]
            for shape in shapes:
                shape = (shape[0] * p,) + tuple(shape[1:])
                x = make_input(r, shape, dt, seed)
                out = torch.empty_like(x)
                assert coll.all_to_all_single(out, x, group) is out
                want = reference(r, p, shape, dt, seed)
                assert torch.equal(out, want), (backend_name, name, shape)
                done += 1
        # a non-contiguous output and input (a transposed view)
        x = make_input(r, (3, 4 * p), torch.float32, 99)
        out_t = torch.empty(3, 4 * p).t()
        coll.all_to_all_single(out_t, x.t(), group)
        rows = [make_input(q, (3, 4 * p), torch.float32, 99).t()[r * 4:(r + 1) * 4] for q in range(p)]
        assert torch.equal(out_t, torch.cat(rows)), "non-contiguous operands"
        done += 1
    return {"backend": used, "c_calls": len(calls), "done": done}


def large_messages(ctx) -> dict:
    """Messages larger than the shm workspace: a 4 KiB workspace (blocks in
    rounds of 2048 / (p - 1) bytes, odd byte counts), and the default 2 MiB one with
    a 3 MiB tensor through the collectives module."""
    r, p, group = ctx.rank, ctx.tp_size, ctx.group
    comm = shm.ShmCommunicator(group, workspace=4096)
    rounds = []
    try:
        for seed, (name, rows, cols) in enumerate((("float32", 37, 13), ("bfloat16", 41, 25),
                                                    ("uint8", 1001, 3), ("int64", 5, 300),
                                                    ("float32", 1, 1))):
            dt = DTYPES[name]
            shape = (rows * p, cols)
            x = make_input(r, shape, dt, seed)
            out = torch.empty_like(x)
            assert comm.all_to_all(out, x) is out
            assert torch.equal(out, reference(r, p, shape, dt, seed)), (name, shape)
            per = (2048 // (p - 1)) & ~63  # a half holds p - 1 slots of whole lines
            rounds.append(-(-(rows * cols * x.element_size()) // per))
        # async, twice in flight, then a blocking call after them
        xs = [make_input(r, (8 * p, 100), torch.float32, 10 + k) for k in range(2)]
        outs = [torch.empty_like(x) for x in xs]
        handles = [comm.all_to_all(o, x, async_op=True) for o, x in zip(outs, xs)]
        assert [h.wait() for h in handles] == outs
        for k in range(2):
            assert torch.equal(outs[k], reference(r, p, (8 * p, 100), torch.float32, 10 + k))
        assert comm.info()["workspace"] == 4096
        # the C core: exactly the same buffer in and out is allowed (in place,
        # in rounds); a partial overlap is refused (here on every rank, so before
        # anyone waits)
        x = make_input(r, (50 * p, 7), torch.float32, 30)
        _C.shm_all_to_all(comm._comm, x, x)
        assert torch.equal(x, reference(r, p, (50 * p, 7), torch.float32, 30)), "in place"
        buf = torch.zeros(4 * p)
        try:
            _C.shm_all_to_all(comm._comm, buf[1:2 * p + 1], buf[:2 * p])
            overlap = "no error"
        except ValueError as e:
            overlap = str(e)
        assert "input and output overlap" in overlap, overlap
        y = make_input(r, (p, 3), torch.int32, 31)
        out = torch.empty_like(y)
        comm.all_to_all(out, y)  # still in step
        assert torch.equal(out, reference(r, p, (p, 3), torch.int32, 31))
    finally:
        comm.close()
    with backend("shm"), counting_c_calls() as calls:
        n = (3 << 20) // 4  # 3 MiB of float32 over the default 2 MiB workspace
        shape = (p * 4, n // (4 * p))
        x = make_input(r, shape, torch.float32, 20)
        out = torch.empty_like(x)
        coll.all_to_all_single(out, x, group)
        assert torch.equal(out, reference(r, p, shape, torch.float32, 20))
        workspace = cm.get_communicator(group, "cpu").shm.info()["workspace"]
    return {"rounds": rounds, "c_calls": len(calls), "workspace": workspace}


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def bad_arguments(ctx, backend_name: str) -> dict:
    """Arguments every rank rejects raise ValueError before anything is sent
    (no C call, and the next collective is in step)."""
    r, p, group = ctx.rank, ctx.tp_size, ctx.group
    out = {}
    with backend(backend_name), counting_c_calls() as calls:
        coll.backend_for(torch.ones(1), group)  # the communicator exists before the bad calls
        x = torch.ones(2 * p, 3)
        out["shape"] = _error(lambda: coll.all_to_all_single(torch.empty(2 * p, 4), x, group))
        out["dtype"] = _error(lambda: coll.all_to_all_single(torch.empty(2 * p, 3, dtype=torch.int32), x,
                                                             group))
        odd = torch.ones(2 * p + 1, 3)
        out["divisible"] = _error(lambda: coll.all_to_all_single(torch.empty_like(odd), odd, group))
        out["scalar"] = _error(lambda: coll.all_to_all_single(torch.empty(()), torch.ones(()), group))
        out["overlap"] = _error(lambda: coll.all_to_all_single(x, x, group))
        buf = torch.ones(4 * p)
        out["partial_overlap"] = _error(lambda: coll.all_to_all_single(buf[p:3 * p], buf[:2 * p], group))
        out["along_divisible"] = _error(lambda: all_to_all_along(torch.ones(2, 2 * p + 1, 4, 3), 1, 2,
                                                                 group))
        out["along_dim"] = _error(lambda: all_to_all_along(torch.ones(2, 2 * p, 4, 3), 4, 2, group))
        out["c_calls_bad"] = len(calls)
        # every rank still in step: a correct call
        y = make_input(r, (p, 5), torch.float32)
        res = torch.empty_like(y)
        coll.all_to_all_single(res, y, group)
        assert torch.equal(res, reference(r, p, (p, 5), torch.float32))
        out["c_calls"] = len(calls)
    if backend_name == "shm":  # the C entry point checks too (direct calls)
        capsule = shm.communicator(group)._comm
        out["c_numel"] = _error(lambda: _C.shm_all_to_all(capsule, torch.empty(2 * p), torch.ones(2 * p + 1)))
        out["c_blocks"] = _error(lambda: _C.shm_all_to_all(capsule, torch.empty(2 * p + 1),
                                                           torch.ones(2 * p + 1)))
        out["c_dtype"] = _error(lambda: _C.shm_all_to_all(capsule, torch.empty(2 * p, dtype=torch.int32),
                                                          torch.ones(2 * p)))
    return out


def mismatched_calls(ctx, backend_name: str, checked: bool) -> dict:
    """Ranks that disagree (element count, dtype, operation, an argument only
    rank 1 rejects) raise RuntimeError on every rank, and the group goes on."""
    r, p, group = ctx.rank, ctx.tp_size, ctx.group
    out = {}
    with backend(backend_name, checked):
        out["type"] = type(cm.get_communicator(group, "cpu")).__name__
        n = 2 * p if r == 0 else 4 * p
        out["count"] = _error(lambda: coll.all_to_all_single(torch.empty(n), torch.ones(n), group))
        dt = torch.float32 if r == 0 else torch.int32
        out["dtype"] = _error(lambda: coll.all_to_all_single(torch.empty(2 * p, dtype=dt),
                                                             torch.ones(2 * p, dtype=dt), group))
        if r == 0:
            out["kind"] = _error(lambda: coll.all_to_all_single(torch.empty(2 * p), torch.ones(2 * p), group))
        else:
            out["kind"] = _error(lambda: coll.all_gather_into_tensor(torch.empty(2 * p * p), torch.ones(2 * p),
                                                                     group))
        if checked:  # only the check can tell the others about an argument it rejects
            bad = torch.empty(2 * p + (1 if r == 1 else 0))
            out["bad_args"] = _error(lambda: coll.all_to_all_single(bad, torch.ones(2 * p), group))
        y = make_input(r, (3 * p, 2), torch.float32, 5)
        res = torch.empty_like(y)
        coll.all_to_all_single(res, y, group)
        out["after"] = torch.equal(res, reference(r, p, (3 * p, 2), torch.float32, 5))
    return out


# ---- the autograd operator ----------------------------------------------------------------

def _gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full tensor along `dim` from every rank's piece (an all-gather): the reference."""
    p = coll.world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    buf = x0.new_empty((x0.shape[0] * p,) + tuple(x0.shape[1:]))
    coll.all_gather_into_tensor(buf, x0, group)
    return buf.movedim(0, dim)


def along_forward_backward(ctx, backend_name: str, pairs: list) -> dict:
    """all_to_all_along for each (scatter_dim, gather_dim) on 4-D tensors:
    the output is the full tensor's slice (full tensor from an all-gather of
    every rank's input); the gradient of sum(out * probe) is the slice of the
    all-gathered probes; float64 and bfloat16 values exact (it moves bytes)."""
    r, p, group = ctx.rank, ctx.tp_size, ctx.group
    with backend(backend_name), counting_c_calls() as calls:
        for k, (sd, gd) in enumerate(pairs):
            for dt in (torch.float64, torch.bfloat16):
                shape = [2, 3, 5, 4]
                shape[sd % 4] = 2 * p  # divisible along the scattered dim
                g = torch.Generator().manual_seed(100 * k + r)
                x = torch.randn(shape, generator=g, dtype=torch.float64).to(dt).requires_grad_()
                y = all_to_all_along(x, sd, gd, group)
                full = _gather_along(x.detach(), gd, group)  # every rank's x, along gather_dim
                c = shape[sd % 4] // p
                want = full.narrow(sd, r * c, c)
                assert y.shape == want.shape, (sd, gd, tuple(y.shape), tuple(want.shape))
                assert torch.equal(y.detach(), want), (sd, gd, dt)
                assert y.requires_grad and y.grad_fn is not None
                probe = torch.randn(tuple(y.shape), generator=g, dtype=torch.float64).to(dt)
                (gx,) = torch.autograd.grad((y * probe).sum(), x)
                # d(sum over ranks of <y_q, probe_q>)/dx_r: the probes, all-gathered
                # along scatter_dim, at x_r's rows of gather_dim.
                full_probe = _gather_along(probe, sd, group)
                m = shape[gd % 4]
                assert torch.equal(gx, full_probe.narrow(gd, r * m, m)), (sd, gd, dt)
        # round trip: (1, 2) then (2, 1) is the identity
        x = torch.randn(2, 2 * p, 3, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        assert torch.equal(all_to_all_along(all_to_all_along(x, 1, 2, group), 2, 1, group), x)
    return {"c_calls": len(calls)}


def shm_path_counts(ctx) -> dict:
    """The C entry point runs once per all_to_all_single and once per direction
    of all_to_all_along; auto dispatch on CPU takes it."""
    p, group = ctx.tp_size, ctx.group
    with backend(None), counting_c_calls() as calls:
        comm = cm.get_communicator(group, "cpu")
        x = torch.ones(2 * p, 3)
        coll.all_to_all_single(torch.empty_like(x), x, group)
        single = len(calls)
        q = torch.randn(1, 2 * p, 3, 4, requires_grad=True)
        all_to_all_along(q, 1, 2, group).sum().backward()
        along = len(calls) - single
    return {"backend": comm.backend, "type": type(comm).__name__, "single": single, "along": along,
            "mappings_has": hasattr(mappings, "all_to_all_along")}
