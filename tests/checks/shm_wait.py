"""Rank-side check of the shm backend's sleeping wait: a rank that waits long
sleeps on the segment's futex and is woken by the peer's store."""
from __future__ import annotations

import time

import torch

from shardformer.distributed import all_reduce, shm


def late_peer(ctx, delay: float = 0.3) -> dict:
    """Rank 1 joins an all-reduce `delay` s late: rank 0 has slept on the
    futex by then (its sleep count grew), rank 1's arrival woke it (its wake
    count grew), and the sum is right."""
    t = torch.full((1024,), float(ctx.rank + 1))
    all_reduce(t, ctx.group)                   # the communicator exists before we read its counters
    comm = shm.communicator(ctx.group)
    before = comm.info()
    t = torch.full((1024,), float(ctx.rank + 1))
    if ctx.rank == 1:
        time.sleep(delay)
    all_reduce(t, ctx.group)
    after = comm.info()
    assert torch.all(t == 3.0), t[:4]
    return {"sleeps": after["futex_sleeps"] - before["futex_sleeps"],
            "wakes": after["futex_wakes"] - before["futex_wakes"]}


def abort_after_arrival(ctx, delay: float = 0.3) -> dict:
    """A call every rank finished succeeds on each, even where a peer that
    left it raised (aborted the communicator) before this rank woke: rank 0
    sleeps in a barrier; rank 1 stops rank 0 (SIGSTOP), arrives, aborts, and
    lets rank 0 run again, so rank 0 wakes to both the arrival and the
    abort.  Its barrier returns (a spurious failure there, outside any
    step's guard, left rank 0 on a broken communicator while its peers set
    up a fresh one: the next collective hung); its next call is refused,
    naming rank 1; after every rank forgets the group, an all-reduce is right."""
    import os
    import signal

    from shardformer.distributed import communicator

    pids = torch.zeros(ctx.tp_size, dtype=torch.float64)
    pids[ctx.rank] = os.getpid()
    all_reduce(pids, ctx.group)
    comm = shm.communicator(ctx.group)
    out = {}
    if ctx.rank == 0:
        comm.barrier()
        out["barrier"] = "returned"
        try:
            comm.barrier()
            out["next"] = "returned"
        except RuntimeError as e:
            out["next"] = str(e)
    else:
        time.sleep(delay)                        # rank 0 sleeps on the futex by now
        os.kill(int(pids[0]), signal.SIGSTOP)
        try:
            comm.barrier()                       # rank 0 arrived: returns at once
            comm.abort(12345)
        finally:
            os.kill(int(pids[0]), signal.SIGCONT)
    communicator.forget_group(ctx.group)
    t = torch.full((256,), float(ctx.rank + 1))
    all_reduce(t, ctx.group)
    assert torch.all(t == 3.0), t[:4]
    return out
