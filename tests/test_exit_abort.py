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
non-contiguous tensor at that moment.)"""
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["running", "destroyed"])
def test_exit_with_a_busy_shm_worker_does_not_abort(case):
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, case], env=env, stdout=subprocess.PIPE,
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
