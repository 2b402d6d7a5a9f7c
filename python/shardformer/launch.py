"""Start local rank processes from a notebook or a single script.

    from shardformer.launch import spawn

    def work(rank, n):              # module-level: the children import it
        import torch.distributed as dist
        ...                         # the default process group is ready here
        return {"rank": rank, "world": dist.get_world_size()}

    results = spawn(work, nprocs=2, args=(3,))   # [value of rank 0, value of rank 1]

`spawn()` starts `nprocs` processes (multiprocessing's "spawn" start method, so
torch state is never forked), gives them a free loopback port, initializes
torch.distributed in each (`rank`, `world_size`; RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT are set too, as torchrun would), runs
`fn(rank, *args)` and returns the per-rank return values as a list indexed by
rank.  A rank that raises makes `spawn()` raise `RankError` in the caller,
carrying the rank number and that rank's traceback text; ranks left waiting in
a collective are stopped after a grace period instead of hanging the caller.

`init_rank(rank, world_size, port)` is the set-up every rank of `spawn()` goes
through (environment, torch threads, default process group), for processes
started some other way, e.g. a persistent pool of ranks or a test that must
kill one rank by its pid.

torch is imported in the child processes and inside these functions only.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import time
import traceback

__all__ = ["RankError", "spawn", "free_port", "init_rank"]


class RankError(RuntimeError):
    """A rank of `spawn()` raised (or died).

    `rank` is the first rank that failed, `traceback` its traceback text, and
    `failures` maps every rank that failed to its text.
    """

    def __init__(self, rank: int, tb: str, failures: dict[int, str] | None = None):
        self.rank = rank
        self.traceback = tb
        self.failures = dict(failures or {rank: tb})
        others = "".join(f"\n  rank {r} failed too: {_last_line(t)}" for r, t in sorted(self.failures.items())
                         if r != rank)
        super().__init__(f"rank {rank} failed: {_last_line(tb)}{others}\n--- traceback of rank {rank} ---\n"
                         f"{tb.rstrip()}")

    @property
    def message(self) -> str:
        """The failing rank's exception, one line."""
        return _last_line(self.traceback)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "failed"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_environ(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment variables torchrun would give local rank `rank` of `world_size`."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def init_rank(rank: int, world_size: int, port: int, backend: str = "gloo", timeout_s: float = 1800.0,
              threads: int | None = None):
    """Make this process rank `rank` of `world_size` local ranks meeting at 127.0.0.1:`port`.

    Sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (as torchrun would), torch's thread count when `threads` is
    given (OMP_NUM_THREADS must be set before torch is imported to take
    effect, so that one is the caller's), and initializes the default process
    group (`backend`, collective timeout `timeout_s`).  Returns
    torch.distributed.  Every rank of `spawn()` is set up by this function.
    The groups are torn down at exit however the rank's code returns
    (shardformer.distributed.teardown, registered on import).
    """
    os.environ.update(_rank_environ(rank, world_size, port))
    import datetime

    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist


def _dumps_callable(fn, args) -> bytes:
    """Pickle (fn, args) for the children, which import fn by its module."""
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    interactive = module == "__main__" and not getattr(main, "__file__", None)
    if interactive:
        # A function typed into a notebook or REPL has no module the children can import.
        try:
            import cloudpickle  # type: ignore[import-not-found]
        except ImportError:
            raise ValueError(
                f"spawn: {getattr(fn, '__qualname__', fn)!r} is defined in an interactive session (notebook or "
                "REPL); the spawned processes cannot import it. Put it in a .py file next to the notebook and "
                "import it from there, or `pip install cloudpickle` (spawn then sends it by value)."
            ) from None
        return b"C" + cloudpickle.dumps((fn, args))
    try:
        return b"P" + pickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001 - any pickling failure, reported with its cause
        raise ValueError(f"spawn: cannot send {getattr(fn, '__qualname__', fn)!r} and its args to the "
                         f"child processes: {type(e).__name__}: {e}") from e


def _loads_callable(blob: bytes):
    if blob[:1] == b"C":
        import cloudpickle  # type: ignore[import-not-found]

        return cloudpickle.loads(blob[1:])
    return pickle.loads(blob[1:])


def _child(rank: int, nprocs: int, port: int, backend: str, threads: int | None, timeout_s: float,
           blob: bytes, conn) -> None:
    """Body of one rank process: set up, run fn, send back ("ok"|"error", payload)."""
    # The environment first: the user's module (imported to unpickle fn) may read it.
    os.environ.update(_rank_environ(rank, nprocs, port))
    status, payload = "error", b""
    dist = None
    try:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        fn, args = _loads_callable(blob)
        dist = init_rank(rank, nprocs, port, backend, timeout_s)
        value = fn(rank, *args)
        # Plain pickle (not multiprocessing's): torch tensors travel by value,
        # not as shared-memory handles that die with this process.
        try:
            payload = pickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"the return value of rank {rank} cannot be pickled: {type(e).__name__}: {e}") from e
        status = "ok"
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        payload = traceback.format_exc().encode()
    try:
        conn.send_bytes(status.encode() + b"\0" + payload)
    except (BrokenPipeError, OSError):
        pass
    if status == "ok" and dist is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    conn.close()
    # After an error the process group may be stuck mid-collective: leave
    # without running destructors that could wait on the other ranks, but
    # release this process's named semaphores (tqdm's lock, multiprocessing
    # locks), or the resource tracker reports them as leaked.
    if status != "ok":
        with contextlib.suppress(Exception):
            import multiprocessing.util

            multiprocessing.util._run_finalizers(0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


@contextlib.contextmanager
def _environ(**values: str):
    """Set environment variables for the children (spawn copies os.environ at start)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(fn, nprocs: int, args: tuple = (), backend: str = "gloo", threads_per_rank: int | None = 1,
          timeout_s: float = 1800.0, grace_s: float = 10.0) -> list:
    """Run `fn(rank, *args)` on `nprocs` local processes joined in one process group.

    fn:               a module-level function (the children import it by name;
                      in a notebook, put it in a .py file, or install cloudpickle)
    backend:          torch.distributed backend ("gloo" for CPU, "nccl" for one GPU per rank)
    threads_per_rank: torch threads (and OMP_NUM_THREADS) of each rank; None leaves torch's default
    timeout_s:        wall-clock limit of the whole run, also the process group's timeout
    grace_s:          after a rank fails, how long the others get to finish before they are stopped

    Returns the values `fn` returned, indexed by rank (they must pickle).
    Raises RankError (with .rank and .traceback) if a rank raised or died, and
    TimeoutError if ranks were still running after `timeout_s`.
    """
    import multiprocessing as mp

    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ValueError(f"spawn: threads_per_rank must be >= 1 or None, got {threads_per_rank!r}")
    if not isinstance(args, tuple):
        args = tuple(args)
    blob = _dumps_callable(fn, args)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    pending: set[int] = set()
    env = {"OMP_NUM_THREADS": str(threads_per_rank)} if threads_per_rank is not None else {}
    try:
        with _environ(**env):
            for rank in range(nprocs):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=f"shardformer-rank{rank}", daemon=True,
                                args=(rank, nprocs, port, backend, threads_per_rank, timeout_s, blob, child))
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
        results: list = [None] * nprocs
        failures: dict[int, str] = {}
        first_failed, fail_time = None, 0.0
        pending = set(range(nprocs))
        deadline = time.monotonic() + timeout_s
        while pending:
            limit = deadline if first_failed is None else min(deadline, fail_time + grace_s)
            if time.monotonic() > limit:
                break
            progressed = False
            for r in sorted(pending):
                msg = None
                if conns[r].poll(0):
                    try:
                        msg = conns[r].recv_bytes()
                    except (EOFError, OSError):
                        msg = None
                    if msg is None:
                        procs[r].join(5)
                        msg = (f"error\0rank {r} exited (exit code {procs[r].exitcode}) without returning a "
                               f"result: it crashed or was killed (see its output above)").encode()
                elif not procs[r].is_alive() and not conns[r].poll(0):
                    msg = (f"error\0rank {r} exited (exit code {procs[r].exitcode}) without returning a "
                           f"result: it crashed or was killed (see its output above)").encode()
                if msg is None:
                    continue
                progressed = True
                pending.discard(r)
                status, _, payload = msg.partition(b"\0")
                if status == b"ok":
                    results[r] = pickle.loads(payload)
                else:
                    failures[r] = payload.decode(errors="replace")
                    if first_failed is None:
                        first_failed, fail_time = r, time.monotonic()
            if not progressed:
                # Wake up when any pipe has data or any process exits.
                mp.connection.wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=0.2)
        if first_failed is not None:
            for r in sorted(pending):
                failures[r] = (f"rank {r} was still running {grace_s:.0f} s after rank {first_failed} failed "
                               "(waiting in a collective?) and was stopped")
            raise RankError(first_failed, failures[first_failed], failures)
        if pending:
            raise TimeoutError(f"spawn: ranks {sorted(pending)} of {nprocs} did not finish within {timeout_s:.0f} s "
                               "and were stopped")
        return results
    finally:
        # Ranks that reported exit on their own within moments; the others are stopped.
        deadline = time.monotonic() + 5
        for r, p in enumerate(procs):
            if r not in pending:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()
