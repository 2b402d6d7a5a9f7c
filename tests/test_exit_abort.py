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


# A rank that leaves while its peer waits for it (shardformer.distributed.failures._at_exit, the
# pid check of csrc/comm/shm_wait.c): world of 4, rank 0 shares a two-rank group (and its shm
# communicator) with each of ranks 1..3 and waits in an all_reduce over each in turn; rank k leaves
# its own way once rank 0 waits.  Rank 0's wait must end within 5 s with PeerFailed naming k.
# (os._exit is SIGKILL's case for the peer: no Python runs, the process is gone; a fifth process
# would cost CI its imports.)
EXITS = {1: "uncaught", 2: "sys.exit", 3: "SIGKILL"}
EXITING_RANK = r'''
import os, signal, sys, time
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
from shardformer.distributed import shm
from shardformer.distributed.failures import PeerFailed
store = dist.distributed_c10d._get_default_store()
groups = {k: dist.new_group([0, k]) for k in range(1, 4)}
comms = {k: shm.communicator(g) for k, g in groups.items() if rank in (0, k)}
t = torch.ones(64)
if rank == 0:
    for k in range(1, 4):
        store.set(f"go/{k}", "1")
        start = time.time()
        try:
            comms[k].all_reduce(t)
            print(f"case {k}: returned", flush=True)
        except Exception as e:
            ok = isinstance(e, PeerFailed) and e.ranks == [k]
            print(f"case {k}: {time.time() - start:.2f} s {'PeerFailed' if ok else type(e).__name__}: {e}", flush=True)
    os._exit(0)
store.wait([f"go/{rank}"])
time.sleep(0.3)                       # rank 0 waits in the all_reduce by now
if rank == 1:
    raise ValueError("bad shard on rank 1")
if rank == 2:
    sys.exit(3)
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_rank_that_exits_is_named_by_its_waiting_peer():
    """An uncaught exception, sys.exit() and SIGKILL on one rank while its peer waits
    for it in an shm all_reduce: the peer raises PeerFailed naming that rank (and the exception
    where Python still ran) within BOUND_S, not after SHARDFORMER_SHM_TIMEOUT (20 s here; 300 s
    by default).  Failed before: rank 0 timed out after 20 s in every case."""
    bound_s = 5.0
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDFORMER_SHM_TIMEOUT="20")
    procs = [subprocess.Popen([sys.executable, "-c", EXITING_RANK, str(r), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(4)]
    try:
        out = procs[0].communicate(timeout=150)[0]
    finally:
        for p in procs[1:]:
            p.kill()
            p.communicate()
    cases = {int(ln.split()[1].rstrip(":")): ln for ln in out.splitlines() if ln.startswith("case ")}
    assert sorted(cases) == [1, 2, 3], out
    expect = {1: "global rank 1 raised builtins.ValueError: bad shard on rank 1",
              2: "global rank 2 raised exit: the process exited (sys.exit or the end of its program)",
              3: "global rank 3 exited (its process is gone"}
    for k, line in cases.items():
        assert "PeerFailed" in line and expect[k] in line, f"{EXITS[k]}: {line}"
        assert float(line.split()[2]) <= bound_s, f"{EXITS[k]}: {line}"
