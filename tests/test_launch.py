"""shardformer.launch.spawn: per-rank results, error propagation, cleanup."""
import multiprocessing
import os
import time

import numpy as np
import pytest

from shardformer.launch import RankError, spawn


def _children() -> set:
    """Live child processes (the suite's rank pool may be among them)."""
    return {p.pid for p in multiprocessing.active_children()}


def _report(rank, scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "dist_rank": dist.get_rank(), "world": dist.get_world_size(),
            "sum": t.item() * scale, "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}


def _fail_on(rank, bad_rank):
    import torch.distributed as dist

    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    dist.barrier()   # the healthy ranks wait for the failed one: spawn must not hang
    return rank


def _exit_hard(rank):
    if rank == 1:
        os._exit(3)
    return rank


def _tensor_result(rank):
    import torch

    return torch.arange(4, dtype=torch.float32) + rank


@pytest.mark.parametrize("nprocs", [1, 2])
def test_spawn_returns_values_by_rank(nprocs):
    before = _children()
    out = spawn(_report, nprocs, args=(10,), threads_per_rank=1)
    assert [o["rank"] for o in out] == list(range(nprocs))
    assert [o["dist_rank"] for o in out] == list(range(nprocs))
    total = sum(range(1, nprocs + 1)) * 10
    for r, o in enumerate(out):
        assert o["world"] == nprocs
        assert o["sum"] == total
        assert o["env"] == (str(r), str(nprocs))
        assert o["threads"] == 1 and o["omp"] == "1"
    assert _children() <= before, "spawn() left rank processes running"


def test_spawn_threads_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    out = spawn(_report, 1, args=(1,), threads_per_rank=2)
    assert out[0]["threads"] == 2 and out[0]["omp"] == "2"
    assert os.environ["OMP_NUM_THREADS"] == "7"   # the caller's environment is restored


@pytest.mark.parametrize("nprocs,bad", [(1, 0), (2, 1), (2, 0)])
def test_spawn_reraises_with_rank_and_traceback(nprocs, bad):
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_fail_on, nprocs, args=(bad,), grace_s=3)
    err = info.value
    assert err.rank == bad
    assert f"rank {bad} failed: ValueError: boom from rank {bad}" in str(err)
    assert err.message == f"ValueError: boom from rank {bad}"
    assert "Traceback (most recent call last)" in err.traceback and "_fail_on" in err.traceback
    assert time.monotonic() - t0 < 60
    assert _children() <= before, "spawn() left rank processes running"


def test_spawn_reports_a_rank_that_dies():
    with pytest.raises(RankError) as info:
        spawn(_exit_hard, 2, grace_s=3)
    assert info.value.rank == 1
    assert "exit code 3" in str(info.value)


def test_spawn_returns_tensors_by_value():
    out = spawn(_tensor_result, 2)
    np.testing.assert_array_equal(out[1].numpy(), np.arange(4, dtype=np.float32) + 1)


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        spawn(_report, 0)
    with pytest.raises(ValueError, match="cannot send"):
        spawn(lambda rank: rank, 1)


_EXIT_PROBE = r"""
import atexit, sys
import torch
# Registered before shardformer's exit teardown (registered on import), so (atexit runs
# last-in first-out) it runs after it.
atexit.register(lambda: print("initialized at exit:", torch.distributed.is_initialized(), flush=True))
from shardformer.launch import free_port, init_rank
dist = init_rank(0, 1, free_port(), "gloo", timeout_s=30)
g = dist.new_group([0])
t = torch.ones(4)
dist.all_reduce(t, group=g)
# the script ends without destroy_process_group
"""


def test_init_rank_destroys_groups_at_exit():
    """A rank that returns without destroy_process_group still gets its groups
    destroyed while the interpreter is whole (not by finalization, where gloo's
    threads can end the process with SIGABRT)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXIT_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "initialized at exit: False" in out.stdout, out.stdout + out.stderr
