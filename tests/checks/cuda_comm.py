"""Rank-side checks of the collectives' CUDA routes (tests/test_cuda_streams.py on
CPU ranks, tests/test_gpu.py on a GPU).

`staged_collectives` runs every operation of a communicator against values
each rank computes for itself from the seeds (every rank knows every rank's
input), blocking and async_op.  On CPU it checks the staging route of
StagedTorchCommunicator (host copies, the gloo call, the copy back, the
copy deferred to wait()); on CUDA the same function checks the real thing.
"""
from __future__ import annotations

import os

import torch

from shardformer.distributed import communicator as cm


def _finish(result):
    if hasattr(result, "wait"):
        result.wait()
    return result


def _inputs(n: int, rows: int, seed: int, device) -> list[torch.Tensor]:
    """Rank q's input, for every q: [rows, 3] from seed + q."""
    return [torch.randn(rows, 3, generator=torch.Generator().manual_seed(seed + q)).to(device) for q in range(n)]


def exercise(comm, n: int, r: int, device) -> dict:
    """Every collective of `comm` (group of n ranks, this is rank r) against
    the values it must give; returns the operations checked."""
    xs = _inputs(n, 4, 10, device)
    blocks = _inputs(n, 2 * n, 20, device)                  # reduce_scatter / all_to_all inputs: n blocks of 2 rows
    checked = []
    for async_op in (False, True):
        for op, expect in (("sum", sum(xs)), ("max", torch.stack(xs).amax(0))):
            t = xs[r].clone()
            _finish(comm.all_reduce(t, op, async_op=async_op))
            assert torch.allclose(t, expect, rtol=1e-6, atol=1e-6), f"all_reduce({op}, async_op={async_op})"
        out = torch.full((4 * n, 3), float("nan"), device=device)
        _finish(comm.all_gather_into_tensor(out, xs[r], async_op=async_op))
        assert torch.equal(out, torch.cat(xs)), f"all_gather_into_tensor(async_op={async_op})"
        out = torch.full((2, 3), float("nan"), device=device)
        _finish(comm.reduce_scatter_tensor(out, blocks[r], async_op=async_op))
        assert torch.allclose(out, sum(blocks)[2 * r:2 * r + 2], rtol=1e-6, atol=1e-6), \
            f"reduce_scatter_tensor(async_op={async_op})"
        checked += ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
    out = torch.full((2 * n, 3), float("nan"), device=device)
    comm.all_to_all_single(out, blocks[r])
    assert torch.equal(out, torch.cat([b[2 * r:2 * r + 2] for b in blocks])), "all_to_all_single"
    t = xs[r].clone()
    comm.broadcast(t, n - 1)
    assert torch.equal(t, xs[n - 1]), "broadcast"
    # a ring step: send to r+1, receive from r-1 (async send / recv), then a blocking pair 0 -> 1
    got = torch.full((4, 3), float("nan"), device=device)
    comm.exchange(xs[r], (r + 1) % n, got, (r - 1) % n, tag=5).wait()
    assert torch.equal(got, xs[(r - 1) % n]), "exchange (async send / recv)"
    if r == 0:
        comm.send(xs[0], 1)
    elif r == 1:
        got = torch.full((4, 3), float("nan"), device=device)
        comm.recv(got, 0)
        assert torch.equal(got, xs[0]), "recv"
    return {"checked": sorted(set(checked + ["all_to_all_single", "broadcast", "send", "recv"]))}


def staged_collectives(ctx) -> dict:
    """On CPU ranks: a StagedTorchCommunicator staging EVERY operation (host
    buffers, the copy back at wait()) gives the exact values; a gloo group's
    communicator for CUDA tensors (device type "cuda", made without touching
    a GPU) is staged for exactly the operations gloo cannot run on CUDA."""
    info = cm.group_info(ctx.group)
    staged = cm.StagedTorchCommunicator(info, "cpu", None, cm._ALL_OPS)
    report = exercise(staged, ctx.tp_size, ctx.rank, "cpu")
    cuda = cm.get_communicator(ctx.group, "cuda")
    assert isinstance(cuda, cm.StagedTorchCommunicator), f"gloo group's CUDA communicator: {cuda!r}"
    assert cuda.backend == "torch" and cuda.overlaps
    report["cuda_staged"] = sorted(cuda.staged)
    report["cpu_staged"] = sorted(cm.staged_ops(ctx.group, "cpu"))
    return report


def direct_nccl(ctx) -> dict:
    """SHARDFORMER_COMM=nccl on a GPU per rank: the direct NCCL path's
    collectives give the exact values (blocking and async_op on its side
    stream)."""
    from shardformer.distributed import reset_communicators

    device = torch.device("cuda", ctx.rank)
    torch.cuda.set_device(device)
    old = os.environ.get(cm.ENV)
    os.environ[cm.ENV] = "nccl"
    reset_communicators()
    try:
        comm = cm.get_communicator(ctx.group, "cuda")
        assert comm.backend == "nccl", f"SHARDFORMER_COMM=nccl gave {comm!r}"
        report = exercise(comm, ctx.tp_size, ctx.rank, device)
        torch.cuda.synchronize(device)
    finally:
        if old is None:
            os.environ.pop(cm.ENV, None)
        else:
            os.environ[cm.ENV] = old
        reset_communicators()
    return report
