"""Shared-memory communicators: collectives for the CPU ranks of a group on one host.

One `ShmCommunicator` per process group.  Setting one up is itself a
collective over the group (every rank must call `communicator(group)` at the
same point, which `communicator.get_communicator` does on a group's first
CPU collective; the collectives reach it through `communicator.ShmBackend`):

    the ranks all-gather their host names (so every rank is present before a
    segment exists); rank 0 removes the stale segments of dead processes (see
    below), creates a segment (mode 0600, name `/shardformer-<pid>-<random>`,
    space reserved with posix_fallocate) and broadcasts its name and a random
    nonce through the group's torch.distributed backend; every other rank maps
    it and checks the nonce; the ranks all-gather whether they succeeded;
    rank 0 unlinks the name.  If any rank could not map it (another host, a
    full /dev/shm) the group has no communicator and `reason(group)` says why.

What can be left in /dev/shm.  From the unlink on, nothing of ours is visible
there, even if every rank is killed: the mappings die with the processes.
Before it, for the few milliseconds between rank 0's create and the unlink
(every rank is already waiting, so the window is the attach itself, not a late
rank's start-up), a SIGKILL of rank 0 leaves the named file
`/dev/shm/shardformer-<pid>-<hex>` (the segment's full size: P*(2 MiB +
P*256 KiB) with the defaults, 5 MiB for 2 ranks); if rank 0 survives, its `finally` unlinks it even when its peers
die (after the torch.distributed timeout).  Such a file is removed the next
time any process of the same user on this host creates a segment (rank 0 of
any group's set-up; `remove_stale_segments()` does it on demand): a file
owned by this uid whose creator pid no longer exists goes.  Kept: files of
another uid, and files whose pid is alive -- including a dead creator's pid
reused by a new process (cleaned once that one exits) and, when /dev/shm is
shared between pid namespaces (containers), a creator alive in another
namespace whose pid happens to be alive here.  A creator in another namespace
whose pid is free here could lose its name during its set-up window; the late
rank then fails to attach and the group has no communicator (never wrong
results: attach checks the nonce).

Lifetime.  A communicator lives as long as its process group and no longer.
The tables that map groups to communicators, here and in communicator.py and
nccl.py, are `GroupTable`s: keyed by id(group), they hold no reference to the
group (communicators hold none either), so they never keep a destroyed group
-- and its gloo sockets -- alive.  A group's entries are dropped (here: its
segment closed)

  * when the group object is collected: a weak reference's callback, so the
    usual `dist.destroy_process_group(g); del g` frees everything at once;
  * when any communicator is created (rare, so the check is cheap): every
    table drops the groups torch.distributed no longer knows -- destroyed but
    still referenced, or every group after `dist.destroy_process_group()`;
  * by `forget(group)` (one group) or `release_destroyed()` (the sweep on
    demand), for a deterministic point.

torch offers no hook on destroy_process_group and we do not wrap it:
replacing a torch function surprises every other library in the process and
breaks silently when torch changes it.  What the paths above leave is one
segment per group that was destroyed while the program still references it,
until the program drops the reference or creates another communicator.  A new
`init_process_group` after `destroy_process_group()` gets fresh communicators.

Threads.  The C side (csrc/comm/shm_*.c) does the work with the GIL released;
one call runs in a communicator at a time.  Calls with `async_op=True` run on
one worker thread per communicator, in issue order, and return a `Handle`; a
blocking call first waits for them.  `close()` may be called from any thread
at any time and never waits for peers: later calls raise RuntimeError, calls
already issued (a blocking call in another thread, async calls queued) still
run, and the segment is unmapped when the last of them returns (the C side
counts calls in flight).  The worker exits after the calls queued before
close; at exit every communicator is closed the same way (the worker is a
daemon: a call still waiting for a peer does not hold the process).

Environment: SHARDFORMER_SHM_TIMEOUT (seconds a rank waits for its peers,
default 300), SHARDFORMER_SHM_WORKSPACE (bytes per rank, default 2 MiB),
SHARDFORMER_SHM_ONESHOT_MAX (largest all-reduce in bytes done one-shot rather
than reduce-scatter + all-gather).
"""
from __future__ import annotations

import os
import queue
import re
import secrets
import socket
import threading
import time
import weakref

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

SHM_DIR = "/dev/shm"
_SEGMENT_NAME = re.compile(r"shardformer-(\d+)-[0-9a-f]+")


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


# ---- per-group tables that follow the groups' lifetime -------------------------------

_TABLES: list = []  # every GroupTable (here, communicator.py, nccl.py): swept together


# The "weak reference" of the None group (torch.distributed not initialized):
# NoneType() returns None, and is a C call, cheap on the collectives' hot path.
_no_group = type(None)


_SAME = object()  # GroupTable.put's default owner: the group itself


def group_alive(group) -> bool:
    """Whether torch.distributed still knows `group`; None stands for the world
    of one of an uninitialized torch.distributed, alive until it is initialized."""
    if group is None:
        return not dist.is_initialized()
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)  # KeyError once destroy_process_group(group) ran
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


class GroupTable:
    """Values kept per process group that neither keep the group alive nor outlive it.

    `items` maps (id(group), sub) to a value: a plain dict, so a hot path looks
    up `items.get((id(g), sub))` with no reference to the group.  Each entry
    belongs to an owner group (the group itself unless `put` says otherwise:
    communicator.py files the None alias of the default group under the
    default group), and the table keeps one weak reference per owner whose
    callback drops the owner's entries when the object is collected -- before
    its id can be reused.  `sweep()` drops the entries of owners torch no
    longer knows (destroyed, still referenced); `drop(group)` those of one
    owner.  `on_drop(value)` runs for every value dropped, whichever way.
    """

    def __init__(self, on_drop=None):
        self.items: dict = {}
        self._owners: dict = {}  # id(owner) -> (weak reference, keys of its entries)
        self._owner_of: dict = {}  # key -> id(owner)
        self._on_drop = on_drop
        _TABLES.append(self)

    def get(self, group, sub=None):
        return self.items.get((id(group), sub))

    def put(self, group, value, sub=None, owner=_SAME) -> None:
        """items[(id(group), sub)] = value, dropped with `owner` (default: `group`)."""
        if owner is _SAME:
            owner = group
        key, oid = (id(group), sub), id(owner)
        held = self._owners.get(oid)
        if held is None:
            held = self._owners[oid] = (self._reference(owner, oid), set())
        previous = self._owner_of.get(key)
        if previous is not None and previous != oid:
            self._owners[previous][1].discard(key)
        self._owner_of[key] = oid
        held[1].add(key)
        old = self.items.get(key)
        self.items[key] = value
        if old is not None and old is not value and self._on_drop is not None:
            self._on_drop(old)

    def values(self) -> list:
        return list(self.items.values())

    def drop(self, group) -> None:
        """Drop every entry owned by `group`."""
        self._drop_owner(id(group))

    def sweep(self) -> None:
        """Drop the entries of owners that are collected or that torch no longer knows."""
        for oid, (ref, _) in list(self._owners.items()):
            owner = ref()
            if (owner is None and ref is not _no_group) or not group_alive(owner):
                self._drop_owner(oid)

    def clear(self) -> None:
        for oid in list(self._owners):
            self._drop_owner(oid)

    def _reference(self, owner, oid: int):
        if owner is None:
            return _no_group
        try:
            return weakref.ref(owner, self._collected_callback(oid))
        except TypeError:  # not a ProcessGroup (torch's NON_GROUP_MEMBER): held, swept
            return lambda: owner

    def _collected_callback(self, oid: int):
        def collected(ref, table=self, oid=oid):
            held = table._owners.get(oid)
            if held is not None and held[0] is ref:  # not an owner that reused the id since
                table._drop_owner(oid)
        return collected

    def _drop_owner(self, oid: int) -> None:
        held = self._owners.pop(oid, None)
        if held is None:
            return
        for key in held[1]:
            self._owner_of.pop(key, None)
            value = self.items.pop(key, None)
            if value is not None and self._on_drop is not None:
                self._on_drop(value)


def release_destroyed() -> None:
    """Drop, in every table, the groups torch.distributed no longer knows
    (closing their segments).  Runs whenever a communicator is created."""
    for table in list(_TABLES):
        table.sweep()


# ---- stale segments of dead creators -----------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's; not a pid: keep
        return True
    return True


def remove_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove our segment files left by killed creators: `shardformer-<pid>-<hex>`
    files owned by this uid whose pid no longer exists.  Returns their paths.
    Runs on rank 0 before every segment is created (see the module docstring)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _SEGMENT_NAME.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid or _pid_alive(int(m.group(1))):
                continue
            os.unlink(path)
        except OSError:
            continue  # gone meanwhile (another process cleaned it), or not ours to remove
        removed.append(path)
    return removed


# ---- the communicator --------------------------------------------------------------

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


def _serve(calls: queue.SimpleQueue) -> None:
    """The async worker: run (fn, args, handle) items in order until None.

    A function of the queue only, not a method: between calls the thread holds
    no reference to its communicator, which can then be collected."""
    while True:
        item = calls.get()
        if item is None:
            return
        fn, args, handle = item
        if _EXITING.is_set() and handle is not None:     # see _close_all: no new torch work at exit
            handle._finish(error=RuntimeError("shm: the process is exiting; this queued call was not run"))
            del item, fn, args, handle
            continue
        try:
            result = fn(*args)
            if handle is not None:
                handle._finish(result)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            if handle is not None:
                handle._finish(error=e)
        del item, fn, args, handle


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


class ShmCommunicator:
    """The shared-memory segment of one process group and its collectives.

    Tensors must be CPU and contiguous; reductions take float32, float16,
    bfloat16, float64, int32 and int64, summed in rank order (so every rank
    gets the same bits; 16-bit floats accumulate in fp32 and round once).
    The group is used to set the segment up and not kept.
    """

    def __init__(self, group=None, *, workspace: int | None = None, p2p: int | None = None,
                 timeout: float | None = None, oneshot_max: int | None = None):
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.ranks = _group_ranks(group)
        self.label = f"shm group of global ranks {self.ranks}"
        workspace = workspace or _env_number("SHARDFORMER_SHM_WORKSPACE", DEFAULT_WORKSPACE, int)
        p2p = p2p or DEFAULT_P2P
        self.timeout = timeout or _env_number("SHARDFORMER_SHM_TIMEOUT", DEFAULT_TIMEOUT, float)
        if oneshot_max is None:
            oneshot_max = _env_number("SHARDFORMER_SHM_ONESHOT_MAX", DEFAULT_ONESHOT_MAX, int)
        self._comm = self._setup(group, workspace, p2p)  # the C capsule, kept after close
        _C.shm_configure(self._comm, self.label, float(self.timeout), int(oneshot_max))
        self._closed = False
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._pending: Handle | None = None
        self._lock = threading.Lock()  # one call in the C communicator at a time
        self._backward = False         # the phase last handed to C (shm_set_phase)
        # _closed, _queue and _worker change together; reentrant: a garbage
        # collection inside may close this communicator (its group collected).
        self._state = threading.RLock()
        _LIVE.add(self)

    def _setup(self, group, workspace: int, p2p: int):
        root = self.ranks[0]
        # Every rank is here before the segment exists, so the window in which
        # its name is visible (create .. unlink) is the attach, not a late rank.
        hosts = [None] * self.size
        dist.all_gather_object(hosts, host_identity(), group=group)
        if len(set(hosts)) > 1:     # every rank sees the same list: all of them give up together
            spread = ", ".join(f"{h} (ranks {[r for r, x in enumerate(hosts) if x == h]})" for h in dict.fromkeys(hosts))
            raise ShmUnavailable(f"{self.label}: its ranks are on more than one host ({spread}); "
                                 f"its collectives go through torch.distributed")
        comm, error, name = None, None, None
        if self.rank == 0:
            remove_stale_segments()
            name = f"/shardformer-{os.getpid()}-{secrets.token_hex(16)}"
            nonce = secrets.randbits(63)
            try:
                comm = _C.shm_create(name, self.size, workspace, p2p, nonce)
            except (OSError, ValueError, OverflowError) as e:
                error = str(e)
            msg = [(name, nonce, error)]
        else:
            msg = [None]
        try:
            dist.broadcast_object_list(msg, src=root, group=group)
            name, nonce, root_error = msg[0]
            if self.rank != 0 and root_error is None:
                try:
                    comm = _C.shm_attach(name, self.size, self.rank, nonce)
                except (OSError, ValueError, OverflowError) as e:
                    error = str(e)
            status = [None] * self.size
            dist.all_gather_object(status, error, group=group)
        finally:
            if self.rank == 0:
                _C.shm_unlink(name)  # every rank has mapped it (or given up)
        failed = [(r, hosts[r], err) for r, err in enumerate(status) if err is not None]
        if failed:
            if comm is not None:
                _C.shm_close(comm)
            detail = "; ".join(f"rank {r} on {host}: {err}" for r, host, err in failed)
            raise ShmUnavailable(f"{self.label}: not every rank could map the segment ({detail})")
        return comm

    # -- lifecycle ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def info(self) -> dict:
        self._check_open()
        return _C.shm_info(self._comm)

    def close(self) -> None:
        """Stop taking calls and release the segment.  Idempotent; any thread;
        never waits for peers (see "Threads" in the module docstring): calls
        already issued still run, the segment is unmapped when the last returns,
        and the async worker exits after the calls queued before this one."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            calls, self._queue, self._worker = self._queue, None, None
        _LIVE.discard(self)
        if calls is None:
            _C.shm_close(self._comm)
        else:
            calls.put((_C.shm_close, (self._comm,), None))
            calls.put(None)

    def abort(self, token: int) -> None:
        """This rank failed outside any call (its code raised): break the
        communicator for the whole group, so that every rank's waits, now and
        later, fail within milliseconds naming this rank.  `token` (nonzero)
        travels with the record (abort_record).  Never waits; any thread."""
        self._check_open()
        _C.shm_abort(self._comm, int(token))

    def rank_states(self) -> list[tuple[int, bool]]:
        """Per group rank: (barriers it entered, whether the call it published
        last runs in backward).  Read from the segment; never waits."""
        self._check_open()
        return _C.shm_rank_states(self._comm)

    def abort_record(self) -> tuple[int, int, int] | None:
        """The group's first failure: None, or (group rank, reason, token);
        reason 1 timeout, 2 interrupt, 3 out of step, 4 raised (abort(); token
        is its token, else the bit mask of the ranks it waited for).  A
        closed communicator reads None."""
        if self._closed:
            return None
        return _C.shm_abort_record(self._comm)

    # -- running calls in order --------------------------------------------------

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"{self.label}: the communicator is closed (its group was destroyed, "
                            f"or close() / shm.forget() was called)")

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _drain(self) -> None:
        pending = self._pending
        if pending is not None:
            pending._done.wait()
            self._pending = None

    def _run(self, fn, args, backward: bool = False):
        with self._lock:
            try:
                if backward is not self._backward:
                    _C.shm_set_phase(self._comm, backward)
                    self._backward = backward
                return fn(*args)
            except ValueError as e:
                # closed by another thread after this call's check: _C says "closed"
                if self._closed and "closed" in str(e):
                    raise self._closed_error() from e
                raise
            except RuntimeError as e:
                told = on_peer_failure(self, e) if on_peer_failure is not None else None
                if told is not None:
                    raise told from e
                raise

    def _call(self, async_op: bool, fn, *args):
        self._check_open()
        # the call's phase travels in its descriptor (sf_shm_set_phase): a forward call never
        # pairs with a backward one on another rank
        backward = in_backward()
        if not async_op:
            if self._pending is not None:
                self._drain()
            return self._run(fn, args, backward)
        handle = Handle()
        with self._state:
            self._check_open()
            if self._worker is None:
                self._queue = queue.SimpleQueue()
                self._worker = threading.Thread(target=_serve, args=(self._queue,),
                                                name="shardformer-shm", daemon=True)
                self._worker.start()
                _WORKERS.add(self._worker)
                # Collected without close(): the capsule unmaps, this stops the worker.
                weakref.finalize(self, self._queue.put, None)
            self._pending = handle
            self._queue.put((self._run, (fn, args, backward), handle))
        return handle

    def run_native(self, fn, *args):
        """fn(capsule, *args): a C entry point that makes its own calls on this
        communicator with the GIL released (the decode step's layer loop,
        _C.decode_step), run as one blocking call: after the async calls
        issued before it, never beside another call."""
        self._check_open()
        if self._pending is not None:
            self._drain()
        return self._run(lambda *a: fn(self._comm, *a), args, in_backward())

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
            _copy_back(t, work)
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

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """out = the blocks this rank receives: t and out hold `size` equal blocks
        (along the flattened elements, so dimension 0 when it divides); block j
        of t goes to group rank j, block i of out comes from group rank i."""
        t = self._plain(t, "all_to_all").contiguous()
        return self._call(async_op, self._run_out, _C.shm_all_to_all, out, t)

    def _run_out(self, fn, user, t, *extra):
        out = self._plain(user, "output")
        work = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        fn(self._comm, work, t, *extra)
        if work is not out:
            _copy_back(out, work)
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
            _copy_back(t, work)
        return user

    def barrier(self, async_op: bool = False):
        return self._call(async_op, _C.shm_barrier, self._comm)


#: called first at exit with the open communicators (distributed.failures)
at_exit: list = []
#: set by distributed.failures: (communicator, the RuntimeError a call raised) -> the
#: PeerFailed to raise instead (a peer's abort reached a call outside any guarded step,
#: e.g. in loss.backward()), or None
on_peer_failure = None


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward (a graph task)."""
    return torch._C._current_graph_task_id() != -1


def host_identity() -> str:
    """The host this process is on, as the shm set-up compares it: the
    SHARDFORMER_HOST environment variable when set (to simulate several
    hosts on one machine, or to tell apart containers that share a host
    name), else the host name."""
    return os.environ.get("SHARDFORMER_HOST") or socket.gethostname()


class ShmUnavailable(RuntimeError):
    """The group's ranks could not share a segment (not one host, or /dev/shm full)."""


_LIVE: weakref.WeakSet = weakref.WeakSet()  # open communicators, closed at exit
_COMMS = GroupTable(on_drop=ShmCommunicator.close)  # group -> ShmCommunicator
_REASONS = GroupTable()  # group -> why the group has none


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
    if _REASONS.get(key) is not None:
        return None
    release_destroyed()
    try:
        comm = ShmCommunicator(key)
    except ShmUnavailable as e:
        _REASONS.put(key, str(e))
        return None
    _COMMS.put(key, comm)
    return comm


def reason(group=None) -> str | None:
    """Why the group has no shm communicator (None if it has one or was never tried)."""
    return _REASONS.get(_key(group))


def forget(group=None) -> None:
    """Close and drop the group's communicator now (destroying the group, or
    collecting it, does this too; see the module docstring)."""
    key = _key(group)
    _REASONS.drop(key)
    _COMMS.drop(key)


_EXITING = threading.Event()
_WORKERS: weakref.WeakSet = weakref.WeakSet()   # every async worker thread started (they end by themselves)
_EXIT_JOIN_S = 10.0     # how long exit waits for a worker to finish the call it is running


def _copy_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A result copied into the caller's non-contiguous tensor, after the C
    call: skipped once the process is exiting (see _close_all)."""
    if not _EXITING.is_set():
        dst.copy_(src)


def _close_all() -> None:
    """At exit (called first by shardformer.distributed.teardown._at_exit): close every communicator, never waiting for a peer, and stop
    the async workers before the interpreter finalizes.

    A worker is a daemon thread; one still inside a torch operation when
    the interpreter finalizes (torch releases the GIL inside every op) is
    stopped by CPython with pthread_exit when it takes the GIL back, and the
    unwinding through torch's C++ frames ends in std::terminate: SIGABRT,
    "terminate called without an active exception" (issue 30; rare, as the
    worker must be in an op at that moment: under load, where a thread is
    preempted mid-op).  So, before finalization: no worker starts a torch
    operation after this point (queued calls are skipped, the copy back
    after a C call is skipped), and each worker is given _EXIT_JOIN_S to
    finish what it is running and leave.  A worker still waiting for a peer
    in the C core after that is left: it holds no C++ frame, and CPython's
    pthread_exit unwinds C frames cleanly."""
    for hook in at_exit:              # failures: tell peers that wait for this rank
        try:
            hook(list(_LIVE))
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    _EXITING.set()
    for comm in list(_LIVE):
        try:
            comm.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    deadline = time.monotonic() + _EXIT_JOIN_S
    for worker in list(_WORKERS):      # the closed communicators' too: they may still be running a call
        if worker is not threading.current_thread():
            worker.join(max(0.0, deadline - time.monotonic()))
