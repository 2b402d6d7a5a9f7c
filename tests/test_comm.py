"""The shared-memory collectives and the NCCL wrapper (csrc/comm/,
shardformer.distributed.shm / nccl) against torch.distributed's results."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shardformer import _C
from shardformer.distributed import collectives as coll
from shardformer.distributed import communicator as cm
from shardformer.distributed import nccl, shm
from shardformer.launch import free_port, init_rank

from checks import parity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int32": torch.int32, "int64": torch.int64}


def _ours(pids) -> list[str]:
    """Segments of ours in /dev/shm made by any of `pids` (the name carries rank 0's pid)."""
    return [p for p in glob.glob("/dev/shm/shardformer-*")
            if any(f"shardformer-{pid}-" in p for pid in pids)]


# ---- the reduction kernels (no ranks needed) -----------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int64", "float64"])
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4])
def test_reduce_kernels_match_reference(dtype, nsrc):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(nsrc)
    n = 1037  # odd: exercises the SIMD body and the scalar tail
    if dt.is_floating_point:
        srcs = [(torch.randn(n, generator=g) * 100).to(dt) for _ in range(nsrc)]
        srcs[0][5] = float("nan")
        srcs[-1][9] = float("inf")
        if dt is torch.float16:
            srcs[0][11] = 6e-6  # a subnormal half
    else:
        srcs = [torch.randint(-2**30, 2**30, (n,), generator=g, dtype=dt) for _ in range(nsrc)]
    # The contract: accumulate in fp32 (fp64 / exact ints otherwise) in
    # source order, round once.
    acc_t = torch.float32 if dt in (torch.bfloat16, torch.float16) else dt
    want_sum = srcs[0].to(acc_t)
    want_max = srcs[0].to(acc_t)
    for s in srcs[1:]:
        want_sum = want_sum + s.to(acc_t)
        want_max = torch.maximum(want_max, s.to(acc_t))
    for op, want in (("sum", want_sum.to(dt)), ("max", want_max.to(dt))):
        for simd in (True, False):
            out = torch.empty(n, dtype=dt)
            _C.reduce_buffers(out, srcs, op, simd)
            same = (out == want) | (out.isnan() & want.isnan()) if dt.is_floating_point else out == want
            assert bool(same.all()), (dtype, op, simd, (out.float() - want.float()).abs().max())


def test_reduce_kernel_bad_arguments():
    a = torch.zeros(8)
    with pytest.raises(TypeError, match="bool"):
        _C.reduce_buffers(torch.zeros(8, dtype=torch.bool), [torch.zeros(8, dtype=torch.bool)])
    with pytest.raises(ValueError, match="inputs\\[1\\] has 7 elements"):
        _C.reduce_buffers(a, [torch.zeros(8), torch.zeros(7)])
    with pytest.raises(ValueError, match="'prod'"):
        _C.reduce_buffers(a, [a], "prod")
    with pytest.raises(TypeError):
        _C.shm_all_reduce(object(), a)


def test_no_reference_leaks_in_glue():
    """Success and error paths of the glue, many times: live blocks stay flat."""
    import gc
    import sys

    a, b = torch.ones(64), torch.ones(64)
    out = torch.empty(64)

    def cases():
        _C.reduce_buffers(out, [a, b], "max")
        for bad in ((out, [a, torch.ones(3)]), (out, [a], "prod"), (out, [])):
            try:
                _C.reduce_buffers(*bad)
            except (ValueError, TypeError):
                pass
        try:
            _C.shm_all_reduce(a, a)
        except TypeError:
            pass
        try:
            _C.shm_attach("/shardformer-test-does-not-exist", 2, 1, 7)
        except OSError:
            pass

    def blocks():
        gc.collect()
        sys._clear_type_cache()
        return sys.getallocatedblocks()

    for _ in range(200):
        cases()
    before = blocks()
    for _ in range(2000):
        cases()
    assert blocks() - before < 200


# ---- rank functions (run on the pool) -----------------------------------------------

def _inputs(rank: int, n: int, dt: torch.dtype, integral: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if integral or not dt.is_floating_point:
        return torch.randint(-16, 17, (n,), generator=g).to(dt)
    return torch.randn(n, generator=g).to(dt)


# Unit roundoff of each float type: gloo rounds after every pairwise add, we
# round once, so for p ranks the two differ by at most ~p units of the result.
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _check(what, got, want, exact, p=2):
    if exact:
        ok = torch.equal(got, want)
    else:
        scale = want.double().abs().max().item()
        tol = 2 * p * EPS[got.dtype] * scale
        ok = (got.double() - want.double()).abs().max().item() <= tol
    if not ok:
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{what}: differs from torch.distributed (max abs diff {diff:.3g})")


def rank_collectives(ctx, dtype_name: str, n: int, workspace: int | None) -> str:
    """Every shm collective vs torch.distributed (gloo) on the same inputs.
    Returns a digest of the all-reduce result, which must agree across ranks."""
    dt = DTYPES[dtype_name]
    p, r, group = ctx.tp_size, ctx.rank, ctx.group
    comm = shm.ShmCommunicator(group, workspace=workspace)

    def ref(seed, m, integral, op="sum"):
        """Our contract: reduce in rank order in fp32 (16-bit types), round once."""
        xs = [_inputs(q, m, dt, integral, seed) for q in range(p)]
        acc = xs[0].to(torch.float32) if dt in (torch.bfloat16, torch.float16) else xs[0].clone()
        for xq in xs[1:]:
            xq = xq.to(acc.dtype)
            acc = acc + xq if op == "sum" else torch.maximum(acc, xq)
        return acc.to(dt)

    try:
        for integral in (True, False):
            if not dt.is_floating_point and not integral:
                continue
            exact = integral or dt in (torch.bfloat16, torch.float16) and p == 2
            x = _inputs(r, n, dt, integral)
            ops = ["sum", "max"]
            for op in ops:
                want = x.clone()
                dist.all_reduce(want, op=getattr(dist.ReduceOp, op.upper()), group=group)
                for algo in (0, 1, 2):
                    got = x.clone()
                    comm.all_reduce(got, op, algo)
                    what = f"all_reduce {op} algo {algo} {dtype_name} n={n}"
                    _check(what, got, want, exact or op == "max", p)
                    _check(what + " (vs rank-order reference)", got, ref(0, n, integral, op),
                           True)
            # reduce-scatter: n elements per rank out of p*n
            big = _inputs(r, p * n, dt, integral, seed=1)
            want = torch.empty(n, dtype=dt)
            coll.reduce_scatter_flat(want, big, group=group)
            got = torch.empty(n, dtype=dt)
            comm.reduce_scatter(got, big)
            what = f"reduce_scatter {dtype_name} n={n}"
            _check(what, got, want, exact, p)
            _check(what + " (vs rank-order reference)", got, ref(1, p * n, integral)[r * n:(r + 1) * n],
                   True)
        # The bytes-moving collectives.
        x = _inputs(r, n, dt, True, seed=2)
        want = torch.empty(p * n, dtype=dt)
        coll.all_gather_flat(want, x, group=group)
        got = torch.empty(p * n, dtype=dt)
        comm.all_gather(got, x)
        _check(f"all_gather {dtype_name} n={n}", got, want, True)
        for root in range(p):
            want = x.clone()
            dist.broadcast(want, dist.get_global_rank(group, root), group=group)
            got = x.clone()
            comm.broadcast(got, root)
            _check(f"broadcast root {root} {dtype_name} n={n}", got, want, True)
        # send/recv over every ordered pair in turn.
        for src in range(p):
            for dst in range(p):
                if src == dst:
                    continue
                if r == src:
                    comm.send(x, dst)
                elif r == dst:
                    got = torch.empty(n, dtype=dt)
                    comm.recv(got, src)
                    _check(f"recv from {src}", got, _inputs(src, n, dt, True, seed=2), True)
        final = _inputs(r, n, dt, False)
        comm.all_reduce(final)
        return final.view(torch.uint8).numpy().tobytes().hex()[:4096] + str(final.numel())
    finally:
        comm.close()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_collectives_vs_torch(pool, tp, dtype):
    # small sizes, and sizes above a 4 KiB workspace (chunked, several rounds)
    for n, ws in ((1, None), (7, None), (1001, None), (3001, 4096), (2 * 4096 + 13, 4096 * 3)):
        digests = pool.run(rank_collectives, tp, dtype, n, ws)
        assert len(set(digests)) == 1, "ranks disagree on the all-reduce result"


def test_collectives_large_default_workspace(pool):
    """Above the default 2 MiB workspace: 3 MiB of fp32 (several chunks)."""
    digests = pool.run(rank_collectives, 2, "float32", (3 << 20) // 4 + 3, None)
    assert len(set(digests)) == 1


def rank_dispatch(ctx) -> dict:
    """backend_for and the collectives module routing through shm."""
    group, r, p = ctx.group, ctx.rank, ctx.tp_size
    saved = os.environ.pop("SHARDFORMER_COMM", None)
    cm.reset_communicators()
    try:
        t = torch.full((5,), float(r + 1))
        answers = {"auto": coll.backend_for(t, group)}
        coll.all_reduce(t, group)
        assert torch.equal(t, torch.full((5,), float(sum(range(1, p + 1)))))
        m = torch.tensor([float(r), -float(r)])
        coll.all_reduce(m, group, op="max")
        assert m.tolist() == [p - 1.0, 0.0], m
        # bool cannot be reduced by shm: auto dispatch falls back to torch.
        b = torch.tensor([r == 0, False])
        coll.all_reduce(b.to(torch.int64), group)
        bools = torch.tensor([r == 0, False])
        coll.all_reduce(bools, group, op="max")  # bool: auto-picked shm hands it to torch
        assert bools.tolist() == [True, False]
        # The choice is made once: changing the variable now changes nothing
        # (the group keeps shm), and backend_for says so loudly.
        os.environ["SHARDFORMER_COMM"] = "torch"
        assert cm.get_communicator(group, t).backend == "shm"
        try:
            coll.backend_for(t, group)
            answers["changed"] = "no error"
        except RuntimeError as e:
            answers["changed"] = str(e)
        cm.reset_communicators()
        answers["forced_torch"] = coll.backend_for(t, group)
        os.environ["SHARDFORMER_COMM"] = "nccl"
        cm.reset_communicators()
        try:
            coll.backend_for(t, group)
            answers["forced_nccl"] = "no error"
        except RuntimeError as e:
            answers["forced_nccl"] = str(e)
        os.environ["SHARDFORMER_COMM"] = "bogus"
        cm.reset_communicators()
        try:
            coll.backend_for(t, group)
        except ValueError as e:
            answers["bogus"] = str(e)
        # A group whose segment cannot be made: backend_for says torch, and why.
        os.environ.pop("SHARDFORMER_COMM")
        cm.reset_communicators()
        os.environ["SHARDFORMER_SHM_WORKSPACE"] = str(1 << 50)
        try:
            g2 = dist.new_group(list(range(p))) if p == ctx.world_size else None
            if g2 is not None:
                answers["unmappable"] = coll.backend_for(t, g2)
                answers["unmappable_reason"] = shm.reason(g2)
                x = torch.ones(3)
                coll.all_reduce(x, g2)  # through torch.distributed
                assert x.tolist() == [float(p)] * 3
        finally:
            os.environ.pop("SHARDFORMER_SHM_WORKSPACE")
        answers["leftover"] = glob.glob(f"/dev/shm/shardformer-{os.getpid()}-*")
        return answers
    finally:
        os.environ.pop("SHARDFORMER_COMM", None)
        if saved is not None:
            os.environ["SHARDFORMER_COMM"] = saved
        cm.reset_communicators()


@pytest.mark.parametrize("tp", [2, 4])
def test_backend_for(pool, tp):
    answers = pool.run(rank_dispatch, tp)
    for a in answers:
        assert a["auto"] == "shm"
        assert a["forced_torch"] == "torch"
        assert "read once per group" in a["changed"] and "reset_communicators" in a["changed"], a["changed"]
        assert "no CUDA device" in a["forced_nccl"], a["forced_nccl"]
        assert "bogus" in a["bogus"]
        assert a["leftover"] == []
        if tp == 4:
            assert a["unmappable"] == "torch"
            assert "cannot reserve" in a["unmappable_reason"], a["unmappable_reason"]
    assert _ours([pr.pid for pr in pool.procs]) == []


def rank_two_groups(ctx) -> list:
    """Two groups over the same four ranks and two disjoint pairs, with async
    calls of one in flight while another runs."""
    r = ctx.rank
    g_b = dist.new_group([0, 1, 2, 3])
    g_lo, g_hi = dist.new_group([0, 1]), dist.new_group([2, 3])
    pair = g_lo if r < 2 else g_hi
    a = shm.ShmCommunicator(ctx.group)
    b = shm.ShmCommunicator(g_b)
    c = shm.ShmCommunicator(pair, workspace=4096)
    try:
        out = []
        for step in range(20):
            xa = torch.full((3000,), float(r + step))
            xb = torch.full((70,), float(10 * r))
            xc = torch.full((1500,), float(r * r))
            ha = a.all_reduce(xa, async_op=True)
            hc = c.all_reduce(xc, async_op=True)
            b.all_reduce(xb)
            ha.wait()
            hc.wait()
            assert torch.all(xa == float(6 + 4 * step)), (step, xa[:3])
            assert torch.all(xb == 60.0)
            want_c = 1.0 if r < 2 else 13.0
            assert torch.all(xc == want_c), (step, xc[:3])
            g = torch.empty(4 * 5)
            hb = b.all_gather(g, torch.full((5,), float(r)), async_op=True)
            assert hb.wait() is g
            assert g.view(4, 5)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        out.append(a.info()["nranks"])
        return out
    finally:
        for comm in (a, b, c):
            comm.close()


def test_two_groups_interleaved(pool):
    assert pool.run(rank_two_groups, 4) == [[4]] * 4
    assert _ours([pr.pid for pr in pool.procs]) == []


def rank_errors(ctx) -> list:
    """Errors in a collective's arguments leave the communicator usable; a
    failed setup leaves nothing in /dev/shm."""
    comm = shm.ShmCommunicator(ctx.group)
    msgs = []
    try:
        with pytest.raises(ValueError, match="out has 5 elements"):
            comm.all_gather(torch.empty(5), torch.ones(3))
        with pytest.raises(TypeError, match="bool"):
            comm.all_reduce(torch.ones(3, dtype=torch.bool))
        with pytest.raises(ValueError, match="CPU-only"):
            comm.all_reduce(torch.ones(3, device="meta"))
        with pytest.raises(ValueError, match="root 9"):
            comm.broadcast(torch.ones(3), 9)
        x = torch.ones(4)
        comm.all_reduce(x)
        assert x.tolist() == [float(ctx.tp_size)] * 4
    finally:
        comm.close()
    try:
        shm.ShmCommunicator(ctx.group, workspace=1 << 50)
    except shm.ShmUnavailable as e:
        msgs.append(str(e))
    msgs.append(glob.glob("/dev/shm/shardformer-*"))
    return msgs


def test_errors_and_no_leak_after_exception(pool):
    res = pool.run(rank_errors, 2)
    for msgs in res:
        assert "rank 0" in msgs[0] and "cannot reserve" in msgs[0], msgs[0]
    assert _ours([pr.pid for pr in pool.procs]) == []


# ---- the Communicator interface (communicator.py) ------------------------------------

def _with_comm_env(value):
    """Set SHARDFORMER_COMM (None: unset) and forget the cached choices; returns the old value."""
    saved = os.environ.pop("SHARDFORMER_COMM", None)
    if value is not None:
        os.environ["SHARDFORMER_COMM"] = value
    cm.reset_communicators()
    return saved


def rank_communicator_interface(ctx, backend: str) -> dict:
    """Every method of each backend's communicator, on the same inputs, against
    the plain torch.distributed result; the choice is made once and cached."""
    group, r, p = ctx.group, ctx.rank, ctx.tp_size
    saved = _with_comm_env(None if backend == "auto" else backend)
    try:
        t = torch.arange(6, dtype=torch.float32) + 10 * r
        comm = cm.get_communicator(group, "cpu")
        assert comm is cm.get_communicator(group, t) is cm.get_communicator(group, torch.device("cpu"))
        assert isinstance(comm, cm.Communicator)
        assert (comm.size, comm.rank) == (p, r) and comm.group is group
        # the env var is not read again once the communicator exists
        reads = []
        real = cm._forced
        cm._forced = lambda: reads.append(1) or real()
        try:
            x = t.clone()
            assert comm.all_reduce(x) is x
            assert torch.equal(x, torch.arange(6, dtype=torch.float32) * p + 10 * sum(range(p)))
            m = torch.tensor([float(r), -float(r)])
            comm.all_reduce(m, "max")
            assert m.tolist() == [p - 1.0, 0.0]
            with pytest.raises(ValueError, match="'prod'"):
                comm.all_reduce(m, "prod")
            out = torch.empty(p * 6)
            assert comm.all_gather_into_tensor(out, t) is out
            assert torch.equal(out, torch.cat([torch.arange(6.0) + 10 * q for q in range(p)]))
            with pytest.raises(ValueError, match="expected"):
                comm.all_gather_into_tensor(torch.empty(5), t)
            rs = torch.empty(2)
            comm.reduce_scatter_tensor(rs, torch.arange(2 * p, dtype=torch.float32))
            assert torch.equal(rs, torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) * p)
            b = torch.full((3,), float(r))
            assert comm.broadcast(b, p - 1) is b and b.tolist() == [p - 1.0] * 3
            if r == 0:
                comm.send(torch.arange(4.0), 1)
            elif r == 1:
                got = comm.recv(torch.empty(4), 0)
                assert torch.equal(got, torch.arange(4.0))
            # non-contiguous in-place operands
            nc = (torch.arange(8, dtype=torch.float32).view(2, 4) + r).t()
            comm.all_reduce(nc)
            assert torch.equal(nc, (torch.arange(8, dtype=torch.float32).view(2, 4) * p
                                    + sum(range(p))).t())
            # the collectives module: one lookup, the same communicator
            y = t.clone()
            coll.all_reduce(y, group)
            assert torch.equal(y, x)
            assert coll.world_size(group) == p and coll.rank(group) == r
        finally:
            cm._forced = real
        return {"backend": comm.backend, "reads": len(reads),
                "bool": _bool_reduce(comm, r)}
    finally:
        _with_comm_env(saved)


def _bool_reduce(comm, r):
    b = torch.tensor([r == 0, False])
    try:
        comm.all_reduce(b, "max")
    except TypeError as e:
        return f"TypeError: {e}"
    return b.tolist()


@pytest.mark.parametrize("backend", ["auto", "shm", "torch"])
def test_communicator_interface(pool, backend):
    for tp in (2, 4):
        res = pool.run(rank_communicator_interface, tp, backend)
        for a in res:
            assert a["backend"] == ("shm" if backend == "auto" else backend)
            assert a["reads"] == 0, "SHARDFORMER_COMM read after the communicator was made"
            if backend == "shm":  # forced shm never falls back: bool cannot be reduced
                assert a["bool"].startswith("TypeError") and "bool" in a["bool"], a["bool"]
            else:
                assert a["bool"] == [True, False]


def rank_send_recv_existing(ctx) -> dict:
    """send/recv use the communicator that exists and never set one up."""
    r = ctx.rank
    saved = _with_comm_env(None)
    g = dist.new_group(list(range(ctx.world_size)))  # a group no collective has touched
    try:
        out = {}
        # before any collective: torch.distributed, and nothing is cached
        out["before"] = cm.existing_communicator(torch.ones(1), g).backend
        if r == 0:
            coll.send(torch.arange(3.0), 1, g)
        elif r == 1:
            assert coll.recv(torch.empty(3), 0, g).tolist() == [0.0, 1.0, 2.0]
        out["cached_after_send"] = [c.backend for c in cm.communicators() if c.group is g]
        coll.all_reduce(torch.ones(2), g)  # sets up the shm communicator
        out["after"] = cm.existing_communicator(torch.ones(1), g).backend
        if r == 1:
            coll.send(torch.arange(3.0) + 1, 0, g)
        elif r == 0:
            assert coll.recv(torch.empty(3), 1, g).tolist() == [1.0, 2.0, 3.0]
        # forced shm on a group without a segment: send/recv raise, with the way out
        g2 = dist.new_group(list(range(ctx.world_size)))
        _with_comm_env("shm")
        try:
            coll.send(torch.ones(1), (r + 1) % ctx.world_size, g2)
        except RuntimeError as e:
            out["forced"] = str(e)
        return out
    finally:
        _with_comm_env(saved)
        shm.forget(g)


def test_send_recv_use_existing_communicator(pool):
    for a in pool.run(rank_send_recv_existing, 4):
        assert a["before"] == "torch"
        assert a["cached_after_send"] == []
        assert a["after"] == "shm"
        assert "SHARDFORMER_COMM=shm: send/recv need the shm communicator" in a["forced"], a["forced"]
        assert "get_communicator" in a["forced"]


def test_communicator_single_process():
    """No process group: a world of one, chosen once per device type; a forced
    backend that cannot run still raises."""
    saved = _with_comm_env(None)
    try:
        comm = cm.get_communicator(None, "cpu")
        assert (comm.size, comm.rank, comm.backend) == (1, 0, "torch")
        x = torch.ones(3)
        assert coll.all_reduce(x) is x and x.tolist() == [1.0] * 3
        out = torch.empty(3)
        coll.all_gather_into_tensor(out, torch.arange(3.0))
        assert out.tolist() == [0.0, 1.0, 2.0]
        assert coll.world_size() == 1 and coll.rank() == 0
        _with_comm_env("shm")
        assert coll.backend_for(x) == "shm"
        with pytest.raises(RuntimeError, match="shm is CPU-only"):
            cm.get_communicator(None, "meta")
        # the region operators skip a group of one without choosing anything
        from shardformer.distributed import copy_to_tp_region, reduce_from_tp_region
        m = torch.ones(2, device="meta")
        assert reduce_from_tp_region(m) is m and copy_to_tp_region(m) is m
    finally:
        _with_comm_env(saved)


# ---- the region operators reduce in place only when nothing else reads the tensor ----

def rank_inplace_safety(ctx) -> dict:
    """reduce_from_tp_region / copy_to_tp_region: in place for a fresh activation,
    a copy when autograd (or a view) holds the tensor; gradients equal the
    unsharded computation's either way."""
    import copy

    import torch.nn.functional as F

    from shardformer.distributed import copy_to_tp_region, reduce_from_tp_region
    from shardformer.layer import Linear1D_Row
    from shardformer.layer.parallel_module import shard_of

    group, r, p = ctx.group, ctx.rank, ctx.tp_size
    g = torch.Generator().manual_seed(0)
    k = 4  # input columns per rank
    W = torch.randn(5, k * p, generator=g, dtype=torch.float64)
    X = torch.randn(3, k * p, generator=g, dtype=torch.float64)
    probe = torch.randn(3, 5, generator=g, dtype=torch.float64)
    cols = slice(r * k, (r + 1) * k)
    out = {}

    def local():
        w = W[:, cols].clone().requires_grad_()
        x = X[:, cols].clone().requires_grad_()
        return w, x

    # 1. a fresh matmul output: reduced in place, autograd told (version bump)
    w, x = local()
    y = F.linear(x, w)
    ptr, ver = y.data_ptr(), y._version
    s = reduce_from_tp_region(y, group)
    out["fresh_inplace"] = s.data_ptr() == ptr and s._version > ver
    (s * probe).sum().backward()
    Wf, Xf = W.clone().requires_grad_(), X.clone().requires_grad_()
    ref = F.linear(Xf, Wf)
    (ref * probe).sum().backward()
    torch.testing.assert_close(s, ref.detach())
    torch.testing.assert_close(w.grad, Wf.grad[:, cols])
    torch.testing.assert_close(x.grad, Xf.grad[:, cols])

    # 2. saved as an input by another op (y * c saves y for dc): a copy; y and dc intact
    w, x = local()
    y = F.linear(x, w)
    partial = y.detach().clone()
    c = torch.randn(3, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64,
                    requires_grad=True)
    z = y * c
    s = reduce_from_tp_region(y, group)
    out["saved_input_copied"] = s.data_ptr() != y.data_ptr()
    assert torch.equal(y.detach(), partial), "the saved partial sum was overwritten"
    ((s * probe).sum() + z.sum()).backward()
    torch.testing.assert_close(c.grad, partial)  # dz/dc = y: the partial, not the sum
    torch.testing.assert_close(s, ref.detach())

    # 3. saved as an output (sigmoid keeps its result): a copy; dx still right
    w, x = local()
    y = F.linear(x, w).sigmoid()
    s = reduce_from_tp_region(y, group)
    out["saved_output_copied"] = s.data_ptr() != y.data_ptr()
    (s * probe).sum().backward()
    w2, x2 = local()
    (F.linear(x2, w2).sigmoid() * probe).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)

    # 4. a view of y alive: a copy, the view unchanged
    w, x = local()
    y = F.linear(x, w)
    row = y[0]
    before = row.detach().clone()
    s = reduce_from_tp_region(y, group)
    out["view_copied"] = s.data_ptr() != y.data_ptr() and torch.equal(row.detach(), before)

    # 5. inference: no autograd node, still in place, the version bumped
    with torch.no_grad():
        w, x = local()
        y = F.linear(x, w)
        ver = y._version
        s = reduce_from_tp_region(y, group)
        out["nograd_inplace"] = s is y and y._version > ver
        torch.testing.assert_close(s, ref.detach())

    # 6. backward of copy_to_tp_region when autograd hands the same gradient to
    #    another input too (an add): the other input's gradient is not all-reduced
    xr = X[:, :5].clone().requires_grad_()
    o = torch.zeros(3, 5, dtype=torch.float64, requires_grad=True)
    q = copy_to_tp_region(xr, group)
    ((q + o) * probe).sum().backward()
    torch.testing.assert_close(o.grad, probe)
    torch.testing.assert_close(xr.grad, probe * p)

    # 7. a row-parallel layer: output and every gradient equal nn.Linear's
    torch.manual_seed(0)  # the same layer on every rank
    lin = torch.nn.Linear(k * p, 5, dtype=torch.float64)
    row_layer = Linear1D_Row.from_native_module(copy.deepcopy(lin), group, input_is_parallel=False)
    xin, xref = X.clone().requires_grad_(), X.clone().requires_grad_()
    yl = row_layer(xin)
    yr = lin(xref)
    torch.testing.assert_close(yl, yr)
    (yl * probe).sum().backward()
    (yr * probe).sum().backward()
    torch.testing.assert_close(xin.grad, xref.grad)
    torch.testing.assert_close(row_layer.bias.grad, lin.bias.grad)
    torch.testing.assert_close(row_layer.weight.grad,
                               shard_of(lin.weight.grad, row_layer._split_dim(), row_layer.shard))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_region_operators_inplace_safety(pool, tp):
    for a in pool.run(rank_inplace_safety, tp):
        assert a == {"fresh_inplace": True, "saved_input_copied": True, "saved_output_copied": True,
                     "view_copied": True, "nograd_inplace": True}, a


# ---- a rank killed mid-collective (own process group, not the pool) -------------------

def _killed_worker(rank, size, port, q, timeout):
    init_rank(rank, size, port, "gloo", timeout_s=60, threads=1)
    comm = shm.ShmCommunicator(None, timeout=timeout)
    x = torch.ones(50_000)
    q.put(("started", rank, time.time()))
    try:
        for _ in range(10**7):
            comm.all_reduce(x)
            x.fill_(1.0)
    except TimeoutError as e:
        q.put(("timeout", rank, time.time(), str(e)))
    except RuntimeError as e:       # PeerFailed: the waiting ranks' pid check found the process gone
        q.put((type(e).__name__, rank, time.time(), f"{getattr(e, 'ranks', None)} {e}"))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", rank, time.time(), repr(e)))
    q.close()
    q.join_thread()  # flush the message before leaving without cleanup
    os._exit(0)


def test_killed_rank_is_named_by_the_waiting_ranks():
    """A rank killed mid-collective: the others' waits find its process gone (the pid check of
    csrc/comm/shm_wait.c) and raise PeerFailed naming it within a second, not at the timeout."""
    size, timeout = 3, 30.0
    # Not shardformer.launch.spawn: this test kills one rank by its pid while the others run.
    ctx = mp.get_context("spawn")
    port = free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_killed_worker, args=(r, size, port, q, timeout), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        started = [q.get(timeout=240) for _ in range(size)]
        assert all(m[0] == "started" for m in started), started
        time.sleep(0.5)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        reports = [q.get(timeout=60) for _ in range(size - 1)]
        for kind, rank, when, msg in reports:
            assert kind == "PeerFailed", msg
            assert rank in (0, 2)
            assert msg.startswith("[1] ") and "global rank 1 exited" in msg and "global ranks [0, 1, 2]" in msg, msg
            assert when - killed_at < 5.0, when - killed_at
        for p in procs:
            p.join(30)
        assert _ours([p.pid for p in procs]) == []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


# ---- NCCL ----------------------------------------------------------------------------

def test_nccl_reports_unavailable_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    ok, why = nccl.available()
    assert not ok
    assert "no CUDA device" in why
    t = torch.ones(3)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        nccl.NcclCommunicator()
    old = os.environ.get("SHARDFORMER_COMM")
    os.environ["SHARDFORMER_COMM"] = "nccl"
    cm.reset_communicators()
    try:
        with pytest.raises(RuntimeError, match="SHARDFORMER_COMM=nccl: no CUDA device"):
            coll.backend_for(t)
    finally:
        if old is None:
            os.environ.pop("SHARDFORMER_COMM")
        else:
            os.environ["SHARDFORMER_COMM"] = old
        cm.reset_communicators()


def test_nccl_load_reports_missing_library(tmp_path):
    missing = str(tmp_path / "libnccl-missing.so.2")
    try:
        _C.nccl_load(missing)
    except OSError as e:
        assert "libnccl-missing" in str(e)
    else:  # NCCL already loaded in this process: load is idempotent
        assert nccl.version() is not None


@pytest.mark.skipif(not torch.cuda.is_available() or not nccl.available()[0],
                    reason="needs a GPU and libnccl.so.2")
def test_nccl_world_size_one_and_graph_capture():
    comm = nccl.NcclCommunicator()
    try:
        x = torch.arange(10, dtype=torch.float32, device="cuda")
        comm.all_reduce(x)
        out = torch.empty(10, device="cuda")
        comm.all_gather(out, x)
        comm.reduce_scatter(out, x)
        comm.broadcast(x, 0)
        torch.cuda.synchronize()
        assert x.tolist() == list(map(float, range(10)))
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(graph, stream=s):
                comm.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        assert x.tolist() == list(map(float, range(10)))
    finally:
        comm.destroy()


# ---- whole models with each backend forced ---------------------------------------------------

def rank_model_with_backend(ctx, name: str, backend: str) -> dict:
    saved = os.environ.get("SHARDFORMER_COMM")
    os.environ["SHARDFORMER_COMM"] = backend
    cm.reset_communicators()  # SHARDFORMER_COMM is read once per group
    try:
        assert coll.backend_for(torch.ones(1), ctx.group) == backend
        return parity.check_model(ctx, name)
    finally:
        if saved is None:
            os.environ.pop("SHARDFORMER_COMM", None)
        else:
            os.environ["SHARDFORMER_COMM"] = saved
        cm.reset_communicators()


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_models_with_backend_forced(pool, name, tp, backend):
    reports = pool.run(rank_model_with_backend, tp, name, backend)
    assert all(r["tp"] == tp for r in reports)


def rank_bf16_model_with_shm(ctx, name: str) -> dict:
    saved = os.environ.get("SHARDFORMER_COMM")
    os.environ["SHARDFORMER_COMM"] = "shm"
    cm.reset_communicators()  # SHARDFORMER_COMM is read once per group
    try:
        return parity.check_model(ctx, name, "bfloat16")
    finally:
        if saved is None:
            os.environ.pop("SHARDFORMER_COMM", None)
        else:
            os.environ["SHARDFORMER_COMM"] = saved
        cm.reset_communicators()


@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_model_with_shm(pool, tp):
    pool.run(rank_bf16_model_with_shm, tp, "LlamaForCausalLM")
