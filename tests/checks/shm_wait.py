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
