"""A persistent pool of CPU rank processes for distributed tests.

Starting a process group costs seconds (spawn, import torch and transformers,
rendezvous); a suite of hundreds of model checks cannot pay that per test.
The pool starts `world_size` processes once, joined in one gloo group, with
sub-groups made up front: tensor-parallel size k uses ranks [0, k).  A test
sends a module-level function; each rank in the group runs
`fn(ctx, *args)` and the results come back as a list indexed by rank.
Arguments and results cross pipes by pickle: pass NumPy arrays or plain
values, not torch tensors (those would travel as shared-memory handles).

A rank that raises sends its traceback back; the pool then waits briefly for
the others (GRACE_S) and restarts itself if any is stuck in a collective, so
one failing test never hangs the suite.  A stuck rank cannot read the stop
message, so it is killed at once rather than waited for; `run_within(s, ...)`
gives one call a shorter limit than call_timeout (a test that would hang on
a regression fails in s seconds, not 240).
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass

from shardformer.launch import free_port, init_rank

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class RankContext:
    rank: int
    world_size: int
    tp_size: int
    group: object  # the ProcessGroup of ranks [0, tp_size)


def _worker(rank: int, world_size: int, port: int, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, TESTS_DIR)
    # The set-up of every rank of shardformer.launch.spawn: torchrun's variables, threads, gloo group.
    dist = init_rank(rank, world_size, port, "gloo", timeout_s=120, threads=1)
    groups = {}
    for k in range(1, world_size + 1):
        g = dist.new_group(list(range(k)))  # collective: every rank makes every group
        groups[k] = g
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the driver is gone: leave through the same clean exit
            break
        if msg is None:
            break
        module_name, fn_name, tp_size, args, kwargs = msg
        if rank >= tp_size:
            conn.send(("ok", None))
            continue
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            ctx = RankContext(rank, world_size, tp_size, groups[tp_size])
            conn.send(("ok", fn(ctx, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the driver
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    # Leave without the interpreter's finalization (tearing down torch's and transformers' modules
    # took most of a pool's stop, 8 ranks on 2 cores): the atexit handlers (shardformer's
    # communicators unlinking their segments) run as at a normal exit, then the process ends.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(0)


GRACE_S = 20.0     # how long the other ranks may still take once one rank failed


class RankPool:
    def __init__(self, world_size: int = 4, call_timeout: float = 240.0):
        self.world_size = world_size
        self.call_timeout = call_timeout
        self.procs = []
        self.conns = []

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs, self.conns = [], []
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world_size, port, child), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        for r, c in enumerate(self.conns):
            if not c.poll(300):
                self.stop()
                raise RuntimeError(f"rank {r} did not start within 300 s")
            c.recv()

    def stop(self, stuck=()) -> None:
        """Stop every rank: the ranks in `stuck` (in a collective, deaf to the
        stop message) are killed at once, the others leave cleanly."""
        for r in stuck:
            self.procs[r].kill()
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.time() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self.conns = [], []

    def run(self, fn, tp_size: int, *args, **kwargs) -> list:
        """Run fn(ctx, *args, **kwargs) on ranks [0, tp_size); results by rank."""
        return self.run_within(self.call_timeout, fn, tp_size, *args, **kwargs)

    def run_within(self, seconds: float, fn, tp_size: int, *args, **kwargs) -> list:
        """run(), failing (and restarting the pool) when the call takes longer than `seconds`."""
        if tp_size > self.world_size:
            raise ValueError(f"tp_size={tp_size} > pool size {self.world_size}")
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.stop()
            self.start()
        msg = (fn.__module__, fn.__name__, tp_size, args, kwargs)
        for c in self.conns:
            c.send(msg)
        results, errors = [None] * self.world_size, []
        deadline = time.time() + seconds
        pending = set(range(self.world_size))
        first_error = None
        while pending:
            # after a failure the other ranks get GRACE_S from the first error on (fixed, not sliding)
            if errors and first_error is None:
                first_error = time.time()
            limit = min(deadline, first_error + GRACE_S) if first_error is not None else deadline
            ready = [r for r in pending if self.conns[r].poll(0.05)]
            for r in ready:
                try:
                    status, value = self.conns[r].recv()
                except EOFError:
                    status, value = "error", f"rank {r} died"
                pending.discard(r)
                if status == "ok":
                    results[r] = value
                else:
                    errors.append(f"--- rank {r} ---\n{value}")
            if pending and time.time() > limit:
                self.stop(stuck=pending)  # restart the pool on the next call
                why = f"{GRACE_S:g} s after rank {errors[0].split()[2]} failed" if errors else f"{seconds:g} s"
                errors.append(f"ranks {sorted(pending)} did not finish within {why} (killed; pool restarted)")
                break
        if errors:
            raise AssertionError(f"{fn.__name__} failed on the rank pool:\n" + "\n".join(errors))
        return results[:tp_size]
