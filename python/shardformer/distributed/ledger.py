"""The communication ledger: `shardformer.comm_stats()`.

    with shardformer.comm_stats() as s:
        loss = model(**batch).loss
        loss.backward()
    print(s)              # a table: group, kind, calls, bytes, seconds
    s.summary()           # {kind: {"calls": n, "bytes": b, "seconds": t}}
    s.summary(by_group=True)   # {(global ranks of the group): {kind: {...}}}

What is counted.  Every collective and point-to-point call shardformer's
code makes on this rank, whatever the backend:

  * every call of a `Communicator` method (communicator.py: the "torch",
    "shm" and "nccl" backends, the solo one of a one-rank group, and any
    subclass defined later) -- the region operators, the functions of
    collectives.py, the pipeline's p2p.py (activations, gradients and their
    headers all go through `shardformer.distributed.send / recv`), data
    parallelism and grad_norm;
  * calls made on an shm communicator directly (`ShmCommunicator` methods;
    shardformer's own asynchronous calls -- the sequence-parallel overlap's,
    ring attention's exchanges -- go through the Communicator's async_op
    methods and are counted there, once each);
  * calls of torch.distributed functions made from a module of the
    shardformer package (the dropout seed's broadcast, the pipeline's
    output metadata, checkpoint flags, the replica and input checks, the
    shm / NCCL set-up).  They are
    recorded here, not routed through a communicator: most are object
    collectives or run before a communicator exists.

Only the OUTERMOST such call is recorded: what a communicator does inside
(TorchCommunicator's dist.all_reduce, ShmBackend's torch fallback, the
opt-in cross-rank check's descriptor exchange of
SHARDFORMER_CHECK_COLLECTIVES) belongs to the call that made it.  The user's
own torch.distributed calls (from modules outside shardformer) are not
counted; calls through `shardformer.distributed` are (they are ours).  Calls
on a group of one rank communicate nothing and are not recorded.  Not seen:
what torch runs in C++ on our behalf -- the bucketed gradient all-reduces
of DistributedDataParallel (`shardformer.data_parallel` wraps the model in
it; `shardformer.average_gradients` is ours and counted), and the
collectives inside torch.distributed.checkpoint.

How.  Nothing is hooked while no ledger is active: entering the first
ledger replaces the methods and functions above by recording wrappers,
leaving the last one puts the originals back (`hooked()` says which state
holds).  So a program that never opens a ledger runs exactly the code it
ran before -- no check, no extra call.  The Communicator subclasses are
found when the first ledger is entered (one defined while a ledger is
active is hooked from the next).  Ledgers nest: each records the calls
made while it is active (an outer one sees its inner ones' calls too).
Recording is process-wide (every thread's calls), like the communicators.

Bytes: the payload this rank contributes, i.e. the size of this rank's
block of the collective's data, in bytes (numel * element size):

    all_reduce       the tensor (every rank holds the whole tensor)
    all_gather       the local input (the output is group size x that)
    reduce_scatter   the local output (= the input / group size)
    all_to_all       the local input (all p blocks, its own included)
    broadcast        the tensor, on every rank (root or not)
    send / recv      the tensor
    gather / scatter / reduce   torch.distributed's rooted calls: the local
                     tensor (input of gather and reduce, output of scatter)
    barrier          0
Object collectives (all_gather_object, broadcast_object_list,
gather_object, scatter_object_list) are counted under all_gather,
broadcast, gather and scatter with the size of this rank's pickled object
(after the call, for a receiving rank).

So a reduce-scatter followed by an all-gather of its result count the same
bytes each, both 1/p of an all-reduce of the same tensor.  `wire_bytes()`
turns the payload into the bytes each rank sends under the bandwidth-optimal
algorithms (ring all-reduce 2(p-1)/p x, all-gather / reduce-scatter
(p-1) x the block, all-to-all (p-1)/p x, broadcast (p-1)/p x averaged over
the group, send 1x, recv 0): the figure to divide by a link's bandwidth.

Seconds: wall time from entering the call to its return; for an async call
(async_op=True, isend / irecv) the time to issue it plus the time its
handle's wait() blocks.
"""
from __future__ import annotations

import functools
import inspect
import pickle
import sys
import threading
import time

import torch

from .communicator import Communicator, group_info
from .shm import ShmCommunicator

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")

_ACTIVE: list = []          # the ledgers entered and not yet left, outermost first
_LOCK = threading.Lock()    # guards _ACTIVE, the hooks and every ledger's table
_LOCAL = threading.local()  # .depth: > 0 inside a recorded call (its inner calls are not counted)
_SAVED: list = []           # (owner, name, original) of every hook installed


# ---- the wrappers -----------------------------------------------------------------

def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _record(kind: str, ranks: tuple, nbytes: int, seconds: float, targets: list, calls: int = 1) -> None:
    where = None
    with _LOCK:
        for ledger in targets:
            ledger._add(kind, ranks, calls, nbytes, seconds)
            if ledger.trace is not None and calls:
                where = where or _caller()
                ledger.trace.append((kind, ranks, nbytes, seconds, where))


_OWN = ("shardformer.distributed.", "shardformer.layer.sequence", "torch.", "functools")


def record_native(kind: str, ranks: tuple, nbytes: int, seconds: float, calls: int) -> None:
    """Record `calls` calls of `kind`, `nbytes` each, that C code made itself
    (the decode step's all-reduces, decode_native.py) in the open ledgers."""
    if len(ranks) < 2:
        return
    with _LOCK:
        targets = list(_ACTIVE)
    _record(kind, ranks, nbytes * calls, seconds, targets, calls)


def _caller() -> str:
    """'module:line function' of the innermost frame outside the communication
    layers (the code that asked for the call: a layer, a schedule, ...)."""
    mark = " (in backward)" if torch._C._current_graph_task_id() != -1 else ""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_OWN) and name != __name__:
            return f"{name}:{frame.f_lineno} {frame.f_code.co_name}{mark}"
        frame = frame.f_back
    return "?" + mark


class _TimedHandle:
    """An async call's handle: wait() adds the time it blocks to the call's seconds."""

    def __init__(self, handle, kind: str, ranks: tuple, targets: list):
        self._handle, self._kind, self._ranks, self._targets = handle, kind, ranks, targets

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._handle.wait(*args, **kwargs)
        finally:
            _record(self._kind, self._ranks, 0, time.perf_counter() - t0, self._targets, calls=0)
            self._targets = []   # a second wait() adds nothing

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _recording(fn, describe):
    """fn wrapped: outside any recorded call, run it and record
    describe(args, kwargs, result) -> (kind, ranks, bytes); inside one, just run it."""

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        if getattr(_LOCAL, "depth", 0):
            return fn(*args, **kwargs)
        _LOCAL.depth = 1
        t0 = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            _LOCAL.depth = 0
        seconds = time.perf_counter() - t0
        what = describe(args, kwargs, result)
        if what is None:
            return result
        kind, ranks, nbytes = what
        if len(ranks) < 2:
            return result   # a group of one rank communicates nothing
        with _LOCK:
            targets = list(_ACTIVE)
        _record(kind, ranks, nbytes, seconds, targets)
        if result is not None and hasattr(result, "wait") and not isinstance(result, torch.Tensor):
            return _TimedHandle(result, kind, ranks, targets)
        return result

    recorded.__wrapped_by_ledger__ = fn
    return recorded


# -- Communicator methods (ranks: self.info.ranks) and ShmCommunicator's (self.ranks)

def _method_kind(kind: str, size_of, ranks_of):
    def describe(args, kwargs, result):
        return kind, tuple(ranks_of(args[0])), size_of(args, kwargs)
    return describe


def _size(i: int, name: str):
    """The bytes of argument i (or keyword `name`)."""
    return lambda args, kwargs: _nbytes(args[i] if len(args) > i else kwargs[name])


# method name -> (kind, bytes of the call); (self, t, ...) or (self, out, t)
_COMM_METHODS = {
    "all_reduce": ("all_reduce", _size(1, "t")),
    "all_gather_into_tensor": ("all_gather", _size(2, "t")),
    "reduce_scatter_tensor": ("reduce_scatter", _size(1, "out")),
    "all_to_all_single": ("all_to_all", _size(2, "t")),
    "broadcast": ("broadcast", _size(1, "t")),
    "send": ("send", _size(1, "t")),
    "recv": ("recv", _size(1, "t")),
}
# shm.py's names for the same calls (same arguments), and its barrier
_SHM_NAMES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_to_all_single": "all_to_all"}
_SHM_METHODS = dict({_SHM_NAMES.get(k, k): v for k, v in _COMM_METHODS.items()},
                    barrier=("barrier", lambda args, kwargs: 0))


# -- torch.distributed functions called from shardformer's modules

def _pickled(obj) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - an object torch pickles its own way: count nothing
        return 0


def _objects(key: str):
    return lambda a: sum(_pickled(o) for o in (a.get(key) or ()))


# function name -> (kind, bytes from the bound arguments)
_DIST_FUNCTIONS = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["tensor"])),
    "all_gather": ("all_gather", lambda a: _nbytes(a["tensor"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a["input_tensor"])),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["input_tensor"])),
    "reduce_scatter": ("reduce_scatter", lambda a: _nbytes(a["output"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["output"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["output"])),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a["input"])),
    "all_to_all": ("all_to_all", lambda a: sum(_nbytes(t) for t in a["input_tensor_list"])),
    "broadcast": ("broadcast", lambda a: _nbytes(a["tensor"])),
    "reduce": ("reduce", lambda a: _nbytes(a["tensor"])),
    "send": ("send", lambda a: _nbytes(a["tensor"])),
    "isend": ("send", lambda a: _nbytes(a["tensor"])),
    "recv": ("recv", lambda a: _nbytes(a["tensor"])),
    "irecv": ("recv", lambda a: _nbytes(a["tensor"])),
    "gather": ("gather", lambda a: _nbytes(a["tensor"])),
    "scatter": ("scatter", lambda a: _nbytes(a["tensor"])),
    "barrier": ("barrier", lambda a: 0),
    "all_gather_object": ("all_gather", lambda a: _pickled(a["obj"])),
    "gather_object": ("gather", lambda a: _pickled(a["obj"])),
    "broadcast_object_list": ("broadcast", _objects("object_list")),
    "scatter_object_list": ("scatter", _objects("scatter_object_output_list")),
}


def _group_ranks(group) -> tuple:
    return tuple(group_info(group).ranks)


def _dist_kind(fn, kind: str, size_of):
    signature = inspect.signature(fn)

    def describe(args, kwargs, result):
        caller = sys._getframe(2).f_globals.get("__name__", "")
        if caller != "shardformer" and not caller.startswith("shardformer."):
            return None   # the user's own call
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return kind, _group_ranks(a.get("group")), size_of(a)
    return describe


# ---- installing and removing the hooks -------------------------------------------------

def _subclasses(cls) -> list:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _hook(owner, name: str, wrapper) -> None:
    _SAVED.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
    setattr(owner, name, wrapper)


def _install() -> None:
    import torch.distributed as dist

    missing = [f"Communicator.{n}" for n in _COMM_METHODS if not hasattr(Communicator, n)] + \
        [f"ShmCommunicator.{n}" for n in _SHM_METHODS if n not in ShmCommunicator.__dict__]
    if missing:   # a renamed method would go uncounted: say so rather than under-count
        raise RuntimeError(f"comm_stats(): {', '.join(missing)} not found; update shardformer.distributed.ledger's "
                           f"tables of the calls it records")
    for cls in _subclasses(Communicator):
        for name, (kind, size_of) in _COMM_METHODS.items():
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "__isabstractmethod__", False):
                _hook(cls, name, _recording(fn, _method_kind(kind, size_of, lambda c: c.info.ranks)))
    for name, (kind, size_of) in _SHM_METHODS.items():
        _hook(ShmCommunicator, name, _recording(ShmCommunicator.__dict__[name],
                                                _method_kind(kind, size_of, lambda c: c.ranks)))
    for name, (kind, size_of) in _DIST_FUNCTIONS.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            _hook(dist, name, _recording(fn, _dist_kind(fn, kind, size_of)))


def _uninstall() -> None:
    while _SAVED:
        owner, name, original = _SAVED.pop()
        setattr(owner, name, original)


def hooked() -> bool:
    """Whether the recording wrappers are in place (exactly while some ledger is active)."""
    return bool(_SAVED)


# ---- the ledger ----------------------------------------------------------------------

def wire_factor(kind: str, p: int) -> float:
    """Bytes each rank sends per byte of payload (the convention above) under the
    bandwidth-optimal algorithm on a group of p ranks (see the module docstring)."""
    if p <= 1:
        return 0.0
    return {"all_reduce": 2 * (p - 1) / p, "all_gather": p - 1, "reduce_scatter": p - 1,
            "all_to_all": (p - 1) / p, "broadcast": (p - 1) / p, "send": 1.0, "gather": (p - 1) / p,
            "scatter": (p - 1) / p, "reduce": (p - 1) / p}.get(kind, 0.0)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


class CommStats:
    """One ledger: calls, bytes and seconds per (group, kind), filled while it
    is active (see the module docstring for what is counted and how)."""

    def __init__(self, trace: bool = False):
        self._table: dict = {}   # (ranks, kind) -> [calls, bytes, seconds]
        self.active = False
        # with trace=True: every call as (kind, ranks, bytes, seconds, "module:line function" of the
        # code that made it, outside the communication layers; in backward, autograd runs the
        # operators' backward from C, so that is where backward() was called, marked "(in
        # backward)"); async calls' wait time is not in it
        self.trace: list | None = [] if trace else None

    def _add(self, kind, ranks, calls, nbytes, seconds):
        row = self._table.get((ranks, kind))
        if row is None:
            row = self._table[(ranks, kind)] = [0, 0, 0.0]
        row[0] += calls
        row[1] += nbytes
        row[2] += seconds

    def __enter__(self) -> "CommStats":
        with _LOCK:
            if self in _ACTIVE:
                raise RuntimeError("comm_stats(): this ledger is already active")
            if not _ACTIVE:
                try:
                    _install()
                except BaseException:
                    _uninstall()
                    raise
            _ACTIVE.append(self)
            self.active = True
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _ACTIVE.remove(self)
            self.active = False
            if not _ACTIVE:
                _uninstall()

    def reset(self) -> None:
        """Forget what was recorded so far (the ledger stays active)."""
        with _LOCK:
            self._table.clear()
            if self.trace is not None:
                self.trace.clear()

    def summary(self, by_group: bool = False) -> dict:
        """{kind: {"calls": n, "bytes": b, "seconds": t}} for every kind of
        KINDS (zeros when none ran) and any other kind seen (gather, scatter,
        reduce, barrier);
        by_group=True: {global ranks of the group (a tuple): {kind: {...}}}
        with the kinds that ran on that group."""
        with _LOCK:
            rows = [(ranks, kind, list(v)) for (ranks, kind), v in self._table.items()]
        if by_group:
            out: dict = {}
            for ranks, kind, (n, b, s) in sorted(rows, key=lambda r: (r[0], r[1])):
                out.setdefault(ranks, {})[kind] = {"calls": n, "bytes": b, "seconds": s}
            return out
        out = {k: {"calls": 0, "bytes": 0, "seconds": 0.0} for k in KINDS}
        for _, kind, (n, b, s) in rows:
            entry = out.setdefault(kind, {"calls": 0, "bytes": 0, "seconds": 0.0})
            entry["calls"] += n
            entry["bytes"] += b
            entry["seconds"] += s
        return out

    def total(self, key: str = "bytes"):
        """The sum over kinds and groups of "calls", "bytes" or "seconds"."""
        return sum(v[key] for v in self.summary().values())

    def wire_bytes(self) -> float:
        """Bytes this rank sends under the bandwidth-optimal algorithms: the
        payload of each (group, kind) times wire_factor(kind, group size)."""
        with _LOCK:
            return sum(v[1] * wire_factor(kind, len(ranks)) for (ranks, kind), v in self._table.items())

    def __str__(self) -> str:
        groups = self.summary(by_group=True)
        lines = [f"{'group (global ranks)':<24} {'kind':<15} {'calls':>7} {'bytes':>12} {'seconds':>10}"]
        for ranks, kinds in groups.items():
            label = "[" + ",".join(map(str, ranks)) + "]"
            for kind, v in kinds.items():
                lines.append(f"{label:<24} {kind:<15} {v['calls']:>7} {_human(v['bytes']):>12} "
                             f"{v['seconds']:>10.6f}")
        lines.append(f"{'total':<24} {'':<15} {self.total('calls'):>7} {_human(self.total('bytes')):>12} "
                     f"{self.total('seconds'):>10.6f}")
        return "\n".join(lines)

    __repr__ = __str__


def comm_stats(trace: bool = False) -> CommStats:
    """A ledger of shardformer's communication: `with shardformer.comm_stats() as s:`
    records every collective and point-to-point call shardformer makes on
    this rank while the block runs (see shardformer.distributed.ledger).
    trace=True also keeps each call, with the code that made it, in s.trace."""
    return CommStats(trace)
