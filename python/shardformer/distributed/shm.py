"""Shared-memory communicators: collectives for the CPU ranks of a group on one host.

One `ShmCommunicator` per process group.  Setting one up is itself a
collective over the group (every rank must call `communicator(group)` at the
same point, which `communicator.get_communicator` does on a group's first
CPU collective; the collectives reach it through `communicator.ShmBackend`):

    rank 0 creates a segment (mode 0600, random name, space reserved with
    posix_fallocate) and broadcasts its name and a random nonce through the
    group's torch.distributed backend; every other rank maps it and checks
    the nonce; the ranks all-gather whether they succeeded; rank 0 unlinks
    the name.  From then on nothing of ours is visible in /dev/shm, even if a
    rank is killed.  If any rank could not map it (another host, a full
    /dev/shm) the group has no communicator and `reason(group)` says why.

The C side (csrc/comm/shm.c) does the work with the GIL released.  Calls
with `async_op=True` run on one worker thread per communicator, in issue
order, and return a `Handle`; a blocking call first waits for them.

Environment: SHARDFORMER_SHM_TIMEOUT (seconds a rank waits for its peers,
default 300), SHARDFORMER_SHM_WORKSPACE (bytes per rank, default 2 MiB),
SHARDFORMER_SHM_ONESHOT_MAX (largest all-reduce in bytes done one-shot rather
than reduce-scatter + all-gather).
"""
from __future__ import annotations

import atexit
import os
import queue
import secrets
import socket
import threading

import torch
import torch.distributed as dist

from .. import _C

DEFAULT_TIMEOUT = 300.0
# Measured on the development machine (2-core EPYC, 512 KiB L2 per core): a
# 32 MiB all-reduce over 2 ranks takes 6.5 ms with 2 MiB per rank (chunks of
# 1 MiB stay in cache), 6.8 ms with 4 MiB and 10.7 ms with 8 MiB.
DEFAULT_WORKSPACE = 2 << 20
DEFAULT_P2P = 256 << 10  # per ordered pair of ranks: P*P of them
# benchmarks/collectives.py, 2 ranks: one-shot wins up to 64 KiB, reduce-scatter
# + all-gather from 256 KiB (4 ranks: the same within noise).
DEFAULT_ONESHOT_MAX = 128 << 10

REDUCIBLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)


def _env_number(name: str, default, cast):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


class Handle:
    """A collective in flight; wait() blocks until it is done and re-raises its error."""

    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result = None

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError("shm collective still running after wait(timeout)")
        if self._error is not None:
            raise self._error
        return self._result


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


class ShmCommunicator:
    """The shared-memory segment of one process group and its collectives.

    Tensors must be CPU and contiguous; reductions take float32, float16,
    bfloat16, float64, int32 and int64, summed in rank order (so every rank
    gets the same bits; 16-bit floats accumulate in fp32 and round once).
    """

    def __init__(self, group=None, *, workspace: int | None = None, p2p: int | None = None,
                 timeout: float | None = None, oneshot_max: int | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.ranks = _group_ranks(group)
        self.label = f"shm group of global ranks {self.ranks}"
        workspace = workspace or _env_number("SHARDFORMER_SHM_WORKSPACE", DEFAULT_WORKSPACE, int)
        p2p = p2p or DEFAULT_P2P
        self.timeout = timeout or _env_number("SHARDFORMER_SHM_TIMEOUT", DEFAULT_TIMEOUT, float)
        if oneshot_max is None:
            oneshot_max = _env_number("SHARDFORMER_SHM_ONESHOT_MAX", DEFAULT_ONESHOT_MAX, int)
        self._comm = self._setup(workspace, p2p)
        _C.shm_configure(self._comm, self.label, float(self.timeout), int(oneshot_max))
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._pending: Handle | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    def _setup(self, workspace: int, p2p: int):
        root = self.ranks[0]
        comm, error = None, None
        if self.rank == 0:
            name = f"/shardformer-{os.getpid()}-{secrets.token_hex(16)}"
            nonce = secrets.randbits(63)
            try:
                comm = _C.shm_create(name, self.size, workspace, p2p, nonce)
            except (OSError, ValueError) as e:
                error = str(e)
            msg = [(name, nonce, error)]
        else:
            msg = [None]
        try:
            dist.broadcast_object_list(msg, src=root, group=self.group)
            name, nonce, root_error = msg[0]
            if self.rank != 0 and root_error is None:
                try:
                    comm = _C.shm_attach(name, self.size, self.rank, nonce)
                except (OSError, ValueError) as e:
                    error = str(e)
            status = [None] * self.size
            dist.all_gather_object(status, (socket.gethostname(), error), group=self.group)
        finally:
            if self.rank == 0:
                _C.shm_unlink(name)  # every rank has mapped it (or given up)
        failed = [(r, host, err) for r, (host, err) in enumerate(status) if err is not None]
        if failed:
            if comm is not None:
                _C.shm_close(comm)
            detail = "; ".join(f"rank {r} on {host}: {err}" for r, host, err in failed)
            raise ShmUnavailable(f"{self.label}: not every rank could map the segment ({detail})")
        return comm

    # -- lifecycle ------------------------------------------------------------

    def info(self) -> dict:
        return _C.shm_info(self._comm)

    def close(self) -> None:
        """Unmap the segment (after the pending calls finish).  Idempotent."""
        if self._comm is None:
            return
        self._drain()
        if self._queue is not None:
            self._queue.put(None)
            self._worker.join()
            self._queue = self._worker = None
        _C.shm_close(self._comm)
        self._comm = None
        _LIVE.discard(self)

    # -- running calls in order --------------------------------------------------

    def _drain(self) -> None:
        pending = self._pending
        if pending is not None:
            pending._done.wait()
            self._pending = None

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, handle = item
            try:
                with self._lock:
                    result = fn(*args)
                handle._finish(result)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                handle._finish(error=e)

    def _call(self, async_op: bool, fn, *args):
        if self._comm is None:
            raise RuntimeError(f"{self.label}: communicator is closed")
        if not async_op:
            if self._pending is not None:
                self._drain()
            with self._lock:  # one call in the C communicator at a time
                return fn(*args)
        if self._worker is None:
            self._queue = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._loop, name="shardformer-shm", daemon=True)
            self._worker.start()
        handle = Handle()
        self._pending = handle
        self._queue.put((fn, args, handle))
        return handle

    # -- collectives ---------------------------------------------------------------

    @staticmethod
    def _plain(t: torch.Tensor, what: str) -> torch.Tensor:
        if not t.is_cpu:
            raise ValueError(f"shm {what}: tensor is on {t.device}, the shm backend is CPU-only")
        # DLPack will not export a tensor that requires grad; detach only then.
        return t.detach() if t.requires_grad else t

    def all_reduce(self, t: torch.Tensor, op: str = "sum", algo: int = 0, async_op: bool = False):
        """In-place t = op over ranks of t.  algo: 0 by size, 1 one-shot, 2 RS+AG."""
        user, t = t, self._plain(t, "all_reduce")
        work = t if t.is_contiguous() else t.contiguous()
        return self._call(async_op, self._all_reduce_into, work, op, algo, t, user)

    def _all_reduce_into(self, work, op, algo, t, user):
        _C.shm_all_reduce(self._comm, work, op, algo)
        if work is not t:
            t.copy_(work)
        return user

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """out (contiguous) = concat over ranks of t, along dimension 0."""
        t = self._plain(t, "all_gather").contiguous()
        return self._call(async_op, self._run_out, _C.shm_all_gather, out, t)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum",
                       async_op: bool = False):
        """out (contiguous) = this rank's block (dimension 0) of op over ranks of t."""
        t = self._plain(t, "reduce_scatter").contiguous()
        return self._call(async_op, self._run_out, _C.shm_reduce_scatter, out, t, op)

    def _run_out(self, fn, user, t, *extra):
        out = self._plain(user, "output")
        work = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        fn(self._comm, work, t, *extra)
        if work is not out:
            out.copy_(work)
        return user

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        """In-place broadcast of t from group rank src."""
        user, t = t, self._plain(t, "broadcast")
        work = t if t.is_contiguous() else t.contiguous()
        return self._call(async_op, self._bytes_into, _C.shm_broadcast, work, src, t, user)

    def send(self, t: torch.Tensor, dst: int, async_op: bool = False):
        t = self._plain(t, "send").contiguous()
        return self._call(async_op, _C.shm_send, self._comm, t, dst)

    def recv(self, t: torch.Tensor, src: int, async_op: bool = False):
        user, t = t, self._plain(t, "recv")
        work = t if t.is_contiguous() else t.contiguous()
        return self._call(async_op, self._bytes_into, _C.shm_recv, work, src, t, user)

    def _bytes_into(self, fn, work, peer, t, user):
        fn(self._comm, work, peer)
        if work is not t:
            t.copy_(work)
        return user

    def barrier(self, async_op: bool = False):
        return self._call(async_op, _C.shm_barrier, self._comm)


class ShmUnavailable(RuntimeError):
    """The group's ranks could not share a segment (not one host, or /dev/shm full)."""


_LIVE: set = set()
_COMMS: dict = {}     # group -> ShmCommunicator
_REASONS: dict = {}   # group -> why the group has none


def _key(group):
    return group if group is not None else dist.group.WORLD


def existing(group=None) -> ShmCommunicator | None:
    """The group's communicator if one was set up; never communicates."""
    return _COMMS.get(_key(group))


def communicator(group=None) -> ShmCommunicator | None:
    """The group's communicator, set up on first call (a collective over the
    group: every rank must call it at the same point).  None when the group
    cannot use shared memory; `reason(group)` then says why."""
    key = _key(group)
    comm = _COMMS.get(key)
    if comm is not None:
        return comm
    if key in _REASONS:
        return None
    try:
        comm = ShmCommunicator(group)
    except ShmUnavailable as e:
        _REASONS[key] = str(e)
        return None
    _COMMS[key] = comm
    return comm


def reason(group=None) -> str | None:
    """Why the group has no shm communicator (None if it has one or was never tried)."""
    return _REASONS.get(_key(group))


def forget(group=None) -> None:
    """Close and drop the group's communicator (before destroying the group)."""
    key = _key(group)
    _REASONS.pop(key, None)
    comm = _COMMS.pop(key, None)
    if comm is not None:
        comm.close()


@atexit.register
def _close_all() -> None:
    for comm in list(_LIVE):
        try:
            comm.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
