"""The SIGABRT at exit (issue 30, class 7): "terminate called without an
active exception" is CPython stopping a daemon thread with pthread_exit when
it takes the GIL back during interpreter finalization, while that thread is
inside a torch operation (torch releases the GIL in every op): the forced
unwinding through torch's C++ frames calls std::terminate.  Our daemon
thread is the shm communicator's async worker (sequence overlap, ring
attention); shm._close_all now stops it before finalization.

Each case runs two real rank processes (a gloo group, one shm segment) that
leave the interpreter while the worker is inside torch operations (with the
group alive, or destroyed first), and checks both exit cleanly; before the
fix both abort every time.  (An async collective left unwaited at exit hits
the same window only sometimes: the worker must be in the copy back into a
non-contiguous tensor at that moment.)

The same SIGABRT (one torchrun run of examples/sentence_embeddings.py in
about thirty under load) came from a group that outlived
`dist.destroy_process_group()`: a torch.distributed module imported after
init_process_group (torch.distributed.nn.functional, imported by
torch._dynamo and so by transformers) captures the world group in its
functions' default arguments, and shardformer.mesh() cached its groups, so
the gloo backend's threads lived into interpreter finalization.  The exit
teardown (shardformer.distributed.teardown) destroys and releases the groups
before it; the threads-at-exit cases check that no backend thread is left
when the program's last exit handler runs (on the code before, all are).
"""
import os
import subprocess
import sys

import pytest

RANK = r'''
import sys, time, faulthandler
faulthandler.enable()
import torch, torch.distributed as dist
rank, port, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from shardformer.distributed import shm
comm = shm.communicator(None)

def torch_work(seconds):
    x, end = torch.ones(4096), time.monotonic() + seconds
    while time.monotonic() < end:
        x.add_(1.0)

if case == "running":           # the worker is inside torch ops when the program ends
    comm._call(True, torch_work, 1.5)
    time.sleep(0.3)
if case == "destroyed":         # the group destroyed first (its communicator closed), worker still busy
    comm._call(True, torch_work, 1.5)
    time.sleep(0.3)
    dist.destroy_process_group()
print(f"rank {rank} leaving", flush=True)
'''


# The program's first exit handler runs last: after shardformer's teardown.
THREADS_AT_EXIT = r'''
import atexit, os, sys
def threads_left():
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    print("threads at exit:", names, flush=True)
atexit.register(threads_left)
import torch, torch.distributed as dist
rank, port, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
import shardformer
import torch.distributed.nn.functional as dnf      # after init: its defaults capture the world group
assert dnf.all_reduce.__defaults__[-1] is dist.group.WORLD
def build_mesh():                                     # the program keeps no reference; the cache did
    return shardformer.mesh(tp=2).tp.size()
assert build_mesh() == 2
if case == "destroyed":
    dist.destroy_process_group()
    assert not dist.is_initialized()
print(f"rank {rank} leaving", flush=True)
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(script: str, case: str) -> str:
    """Run `script` as ranks 0 and 1; returns their output, asserting both exited cleanly."""
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), port, case], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0])
    report = "\n".join(f"--- rank {r} exit {p.returncode} ---\n{o}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    assert "terminate called" not in report, report
    return report


@pytest.mark.parametrize("case", ["running", "destroyed"])
def test_exit_with_a_busy_shm_worker_does_not_abort(case):
    _run_two_ranks(RANK, case)


@pytest.mark.parametrize("case", ["destroyed", "left_alive"])
def test_no_backend_thread_left_at_exit(case):
    """Whether the program destroyed its groups or not, and although a module
    imported after init and shardformer.mesh() held them, every gloo thread
    was joined before the program's last exit handler (so before finalization)."""
    report = _run_two_ranks(THREADS_AT_EXIT, case)
    lines = [ln for ln in report.splitlines() if ln.startswith("threads at exit:")]
    assert len(lines) == 2, report
    assert not any("gloo" in ln or "tcpstore" in ln for ln in lines), report
