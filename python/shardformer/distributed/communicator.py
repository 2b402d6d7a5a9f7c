"""One communicator per (process group, device type), chosen once.

Every collective shardformer runs -- the functions of `collectives.py`, the
autograd region operators of `mappings.py`, and through them every parallel
layer -- goes through a `Communicator`.  There is one per (group, device
type), made on first use and cached; `get_communicator(group, device)` is the
one lookup.  A communicator has the same methods whatever its backend:

    all_reduce(t, op="sum")            in place; op "sum" or "max"; returns t
    all_gather_into_tensor(out, t)     out = concat over ranks of t (dim 0)
    reduce_scatter_tensor(out, t)      out = this rank's block of the sum
    all_to_all_single(out, t)          dim-0 chunk j of t to rank j; chunk i of out from rank i
    broadcast(t, src)                  in place, from group rank src
    send(t, dst) / recv(t, src)        point to point, group ranks
    exchange(send, dst, recv, src)     send to dst while receiving from src (a ring step)
    size, rank, backend ("shm" | "nccl" | "torch"), group, overlaps

Asynchronous calls.  all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, send and recv take `async_op=True` on every backend
and then return a handle whose wait() returns once the call is complete
(exchange always does); the tensors may not be touched before.  What runs
meanwhile depends on the backend, never on the caller: "shm" runs the call on
the communicator's worker thread, "torch" hands it to torch.distributed
(gloo's or NCCL's own threads / stream; torch's Work.wait() orders the
current stream after it), "nccl" enqueues it on a side CUDA stream whose
handle's wait() orders the stream current then after it (streams.py), a
group of one rank has nothing to send.  `overlaps`
says whether the host can compute while an async call moves data ("shm",
"torch"): a layer asks it, never the backend's name (layer/sequence.py's
start_all_gather, layer/ring_attention.py's ring).  send / recv take a
`tag` (torch.distributed matches messages by it; shm and nccl run a pair's
messages in issue order and ignore it).

Backends:

    "shm"    ShmCommunicator (shm.py): CPU ranks of a group on one host
    "nccl"   NcclCommunicator (nccl.py): CUDA tensors, direct NCCL calls
    "torch"  torch.distributed (gloo on CPU, NCCL or gloo on CUDA); works everywhere

CUDA tensors.  The "torch" backend hands CUDA tensors to the group's own
torch.distributed backend for CUDA (`cuda_transport`).  NCCL runs every
operation on them.  gloo runs only all_reduce and broadcast on CUDA tensors
(torch's documentation, "Backends"); for the others (all_gather,
reduce_scatter, all_to_all, send, recv) a StagedTorchCommunicator copies
the inputs into pinned CPU buffers, runs the operation there and copies the
result back (`staged_ops`; two ranks sharing one GPU must use gloo, as
NCCL refuses two ranks on one device).  A group whose backend has nothing
for CUDA ("cpu:gloo") stages every operation.  See docs/gpu.md.

Choosing.  `SHARDFORMER_COMM=torch|shm|nccl` forces a backend; it is read
ONCE per (group, device type), when that communicator is created, and never
again: changing it afterwards changes nothing for that group (so a group can
never run some collectives on one backend and some on another), and
`backend_for()` raises if it finds the variable changed since.  Tests that
switch backends call `reset_communicators()` on every rank (see below).
Forcing a backend that cannot run raises with the reason; it never falls
back, so a benchmark never measures the wrong thing.  Left alone, CPU tensors
of a group whose ranks all mapped one shared-memory segment use "shm", and
everything else (CUDA tensors included) uses "torch"; the direct NCCL path
runs only when SHARDFORMER_COMM=nccl asks for it.  An
auto-picked shm communicator hands the dtypes shm cannot reduce (bool, int8,
...) to torch.distributed (a per-dtype decision inside the communicator,
checked first by a small shm all-gather of what every rank hands over, so
ranks that disagree raise instead of waiting on two transports); a forced
one raises for them.  A group of one rank
gets a communicator that does no communication (the forced backend is still
checked, so a misconfiguration shows on one process too).

Creating a communicator is itself a collective over the group (the shm
segment or the NCCL id is set up through torch.distributed), so every rank of
the group must make its first call for a (group, device type) at the same
point -- which a collective's first call is.  send/recv involve two ranks,
which cannot set up a group's communicator: they use the one that already
exists (made by an earlier collective, or by calling `get_communicator` on
every rank); without one they use torch.distributed for that call (or raise,
when shm or nccl is forced).

The single path.  Each collective is one cache lookup and one method call on
the communicator, which holds the group's size and rank.

Cross-rank checks.  A collective whose ranks disagree (4 elements against 8,
all_reduce against all_gather, different broadcast roots, a send of 4 against
a recv of 8) must raise on every rank, naming both sides, rather than return
wrong values.  The shm backend checks every call in C at no cost.  For the
torch and nccl backends the check is opt-in: with SHARDFORMER_CHECK_COLLECTIVES=1
(read once, when the communicator is created, like SHARDFORMER_COMM) `_get`
wraps the communicator `_create` returns in a `CheckedCommunicator`, which
before each collective all-gathers a descriptor of 7 int64 (operation,
element count, dtype, reduction, root or peer, the group's call number,
"arguments rejected here") over the group, on the tensor's device, through
the wrapped communicator itself, and raises RuntimeError on every rank when
they differ, before running the collective (so the group stays usable);
send/recv swap the descriptor with the peer.  Arguments one rank rejects (a
bad op, a gather output of the wrong shape) are flagged, so the other ranks
raise too instead of waiting.  On CUDA the check reads the descriptors back,
so each collective synchronizes the host with the stream, and it cannot run
inside CUDA graph capture: a debugging aid, off by default.  Cost: one more
small collective per call (send/recv: a message each way) and ~30 us of
Python.  Measured with gloo, 2 ranks, all_reduce of 16 float32 (medians of
2000-3000 calls, on the 2-core development machine while other jobs ran,
load average 8-12): 185-380 us unchecked, 520-1000 us checked, about 3x.

Counting.  `shardformer.comm_stats()` (ledger.py) records every call of the
methods above, on every subclass, while a ledger is active, by wrapping them
for that time only (nothing is wrapped otherwise); renaming one means
updating ledger.py's table, which raises if it finds one missing.

Lifetime.  The caches here (`_CACHE`, `_INFO`) are shm.GroupTables: they
hold no reference to a group, and neither do communicators (GroupInfo keeps
a weak one), so a group destroyed with `dist.destroy_process_group(g)` is
freed with everything of ours once the program drops it, or at the next
communicator creation if it keeps it (see shm.py's "Lifetime").  After
`dist.destroy_process_group()` and a new `init_process_group`, None names the
new default group and gets fresh communicators.  Using a communicator whose
group was collected raises RuntimeError.
"""
from __future__ import annotations

import os
import weakref
import zlib
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from . import nccl as _nccl
from . import shm as _shm
from .streams import SideStream

BACKENDS = ("torch", "shm", "nccl")
ENV = "SHARDFORMER_COMM"

# torch renamed the flat-tensor collectives (2.13 deprecates the old names): the one
# spelling of each this torch has (out, in, group=, async_op=), for the torch backend, tests and benchmarks.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_SHM_REDUCIBLE = frozenset(_shm.REDUCIBLE)


# ---- wait handles ------------------------------------------------------------------

class Done:
    """The handle of a call that completed before it returned (a group of one
    rank; a blocking call's async form)."""

    __slots__ = ()

    def wait(self, timeout=None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


DONE = Done()


class TorchWork:
    """A torch.distributed Work; `then` runs once it completes (the copy of a
    contiguous buffer back into a strided output).  `keep` holds the
    tensors the call reads until then."""

    __slots__ = ("work", "then", "keep")

    def __init__(self, work, then=None, keep=None):
        self.work, self.then, self.keep = work, then, keep

    def wait(self, timeout=None) -> None:
        if self.work is not None:
            self.work.wait()
            self.work, then, self.keep = None, self.then, None
            if then is not None:
                then()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class Both:
    """Two handles waited on as one (an exchange's send and recv)."""

    __slots__ = ("first", "second")

    def __init__(self, first, second):
        self.first, self.second = first, second

    def wait(self, timeout=None) -> None:
        self.first.wait()
        self.second.wait()

    def is_completed(self) -> bool:
        return self.first.is_completed() and self.second.is_completed()


def _torch_async(call, t: torch.Tensor, read: bool = True) -> TorchWork:
    """call(buffer) -> Work writing into `t`: on `t` itself when contiguous,
    else on a contiguous buffer (holding t's values when `read`) copied back
    when the work completes."""
    if t.is_contiguous():
        return TorchWork(call(t), keep=t)
    buf = t.contiguous() if read else torch.empty_like(t, memory_format=torch.contiguous_format)
    return TorchWork(call(buf), then=lambda: t.copy_(buf), keep=buf)


def _forced() -> str | None:
    """SHARDFORMER_COMM, validated; read when a communicator is created (and by backend_for)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def _world():
    """The default group (None when torch.distributed is not initialized)."""
    return dist.group.WORLD


def _device_type(device) -> str:
    if isinstance(device, torch.Tensor):
        return _tensor_device(device)
    return torch.device(device).type


def _tensor_device(t: torch.Tensor) -> str:
    # t.device builds a torch.device (~0.6 us); the flags are ~0.06 us.
    if t.is_cpu:
        return "cpu"
    if t.is_cuda:
        return "cuda"
    return t.device.type


def _bad_op(op) -> ValueError:
    return ValueError(f"all_reduce: op={op!r}, expected 'sum' or 'max'")


def _check_gather(out: torch.Tensor, t: torch.Tensor, n: int) -> None:
    if out.shape[0] != t.shape[0] * n or out.shape[1:] != t.shape[1:]:
        raise ValueError(
            f"all_gather_into_tensor: out has shape {tuple(out.shape)}, expected "
            f"({t.shape[0] * n}, {', '.join(map(str, t.shape[1:]))}) for {n} ranks"
        )


def _check_scatter(out: torch.Tensor, t: torch.Tensor, n: int) -> None:
    if t.shape[0] != out.shape[0] * n or out.shape[1:] != t.shape[1:]:
        raise ValueError(
            f"reduce_scatter_tensor: input has shape {tuple(t.shape)}, expected dimension 0 "
            f"= {out.shape[0]} * {n} ranks"
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes of memory `t` can touch (a superset for strided views;
    torch strides are never negative)."""
    start = t.data_ptr()
    if t.is_contiguous():  # the common case, ~10x cheaper than the strides' walk
        return start, start + t.nbytes
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + extent * t.element_size()


def _check_all_to_all(out: torch.Tensor, t: torch.Tensor, n: int) -> None:
    """all_to_all_single's arguments: the same shape, dtype and device, dimension 0
    a multiple of the group size, no shared memory between the two."""
    if t.dim() == 0:
        raise ValueError(f"all_to_all_single: tensor is a scalar (shape ()); it needs a dimension 0 "
                         f"of {n} equal chunks, one per rank")
    if out.shape != t.shape:
        raise ValueError(f"all_to_all_single: out has shape {tuple(out.shape)} but tensor has shape "
                         f"{tuple(t.shape)}; they must be equal")
    if out.dtype != t.dtype:
        raise ValueError(f"all_to_all_single: out is {out.dtype} but tensor is {t.dtype} "
                         f"(shape {tuple(t.shape)}); they must be equal")
    if out.device != t.device:
        raise ValueError(f"all_to_all_single: out is on {out.device} but tensor on {t.device}")
    if t.shape[0] % n:
        raise ValueError(f"all_to_all_single: tensor has shape {tuple(t.shape)}: dimension 0 of length "
                         f"{t.shape[0]} is not divisible by the group size {n}")
    (a, b), (c, d) = _byte_span(out), _byte_span(t)
    if a < d and c < b:
        raise ValueError(f"all_to_all_single: out and tensor (shape {tuple(t.shape)}) share memory; "
                         f"pass a separate output")


# ---- groups ------------------------------------------------------------------------

class GroupInfo:
    """A process group's size, this process's rank in it and its global ranks,
    asked of torch.distributed once.  Holds the group by a weak reference:
    `group` raises once the group object is gone (see "Lifetime")."""

    __slots__ = ("ref", "size", "rank", "ranks")

    def __init__(self, group):
        if group is None:  # torch.distributed not initialized: a world of one
            self.ref = _shm._no_group
            self.size, self.rank, self.ranks = 1, 0, [0]
        else:
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self.ranks = dist.get_process_group_ranks(group)
            self.ref = weakref.ref(group)

    @property
    def group(self):
        group = self.ref()
        if group is None and self.ref is not _shm._no_group:
            raise RuntimeError(f"{self.label()} was destroyed and its ProcessGroup object freed; "
                               f"its communicators cannot be used")
        return group

    def label(self) -> str:
        if self.ref is _shm._no_group:
            return "the default group (torch.distributed not initialized)"
        return f"the group of global ranks {self.ranks}"

    def global_rank(self, r: int, what: str) -> int:
        if not 0 <= r < self.size:
            raise ValueError(f"{what}: rank {r} is not in {self.label()} (size {self.size})")
        return self.ranks[r]


_INFO = _shm.GroupTable()  # group (normalized: None -> WORLD) -> GroupInfo


def group_info(group=None) -> GroupInfo:
    """Size, rank and global ranks of `group` (None: the default group), cached."""
    if group is None:
        group = _world()
    info = _INFO.get(group)
    if info is None:
        info = GroupInfo(group)
        _INFO.put(group, info)
    return info


# ---- the interface and its backends ---------------------------------------------------

class Communicator(ABC):
    """The collectives of one process group on one device type.

    Subclasses implement every method; tensors are on the communicator's
    device type.  In-place methods return their tensor, gathers their output.
    """

    backend = ""
    overlaps = False  # whether the host computes while an async_op call moves data

    def __init__(self, info: GroupInfo, device: str, forced: str | None):
        self.info = info
        self.group_ref = info.ref  # the group by weak reference (hot paths compare it)
        self.size = info.size
        self.rank = info.rank
        self.device = device
        self.forced = forced  # SHARDFORMER_COMM when this communicator was chosen

    @property
    def group(self):
        """The process group (None: torch.distributed not initialized); raises
        once the group object is gone."""
        return self.info.group

    @abstractmethod
    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In-place reduction (sum or max) of `t` over the group.  Returns `t`
        (async_op: a handle, see "Asynchronous calls")."""

    @abstractmethod
    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """out = the ranks' `t` concatenated along dimension 0, in rank order.
        Returns `out` (async_op: a handle)."""

    @abstractmethod
    def reduce_scatter_tensor(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """out = this rank's dimension-0 chunk of the sum over ranks of `t`.
        Returns `out` (async_op: a handle)."""

    @abstractmethod
    def all_to_all_single(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Dimension 0 of `t` (and of `out`, same shape and dtype) is p equal
        chunks: chunk j of `t` goes to group rank j, chunk i of `out` comes
        from group rank i.  Returns `out`."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """In-place broadcast of `t` from group rank `src`."""

    @abstractmethod
    def send(self, t: torch.Tensor, dst: int, async_op: bool = False, tag: int = 0):
        """Send `t` to group rank `dst` (async_op: returns a handle)."""

    @abstractmethod
    def recv(self, t: torch.Tensor, src: int, async_op: bool = False, tag: int = 0):
        """Receive into `t` from group rank `src`.  Returns `t` (async_op: a handle)."""

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0):
        """Start sending `send` to group rank `dst` and receiving group rank
        `src`'s message into `recv` (a ring step: dst = rank + 1, src = rank - 1,
        or the reverse); returns one handle.  Neither buffer may be touched
        before its wait().  Even ranks issue the send first, odd ranks the
        receive: on a transport that runs a rank's calls one at a time in
        issue order (shm's worker), a ring of any size then cannot deadlock
        (some rank receives first and unblocks its left neighbour)."""
        if self.rank % 2 == 0:
            first = self.send(send, dst, async_op=True, tag=tag)
            return Both(first, self.recv(recv, src, async_op=True, tag=tag))
        first = self.recv(recv, src, async_op=True, tag=tag)
        return Both(first, self.send(send, dst, async_op=True, tag=tag))

    def torch_transport(self) -> "Communicator":
        """A communicator of the same group and device on torch.distributed
        (this one when it is): for point-to-point traffic that should use
        gloo's kernel-buffered sockets even where shm runs the collectives
        (layer/ring_attention.py's P2P = "torch")."""
        transport = self.__dict__.get("_torch_transport")
        if transport is None:
            transport = self.__dict__["_torch_transport"] = torch_communicator(self.info, self.device, self.forced)
        return transport

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.backend} {self.device} rank {self.rank}/{self.size} "
                f"of {self.info.label()}>")


class SoloCommunicator(Communicator):
    """A group of one rank: nothing to communicate.  `backend` is the one that
    would run (the forced one, else "torch")."""

    def __init__(self, info, device, forced, backend: str):
        super().__init__(info, device, forced)
        self.backend = backend

    def all_reduce(self, t, op="sum", async_op=False):
        if op != "sum" and op != "max":
            raise _bad_op(op)
        return DONE if async_op else t

    def all_gather_into_tensor(self, out, t, async_op=False):
        _check_gather(out, t, 1)
        out.copy_(t)
        return DONE if async_op else out

    def reduce_scatter_tensor(self, out, t, async_op=False):
        _check_scatter(out, t, 1)
        out.copy_(t)
        return DONE if async_op else out

    def all_to_all_single(self, out, t):
        _check_all_to_all(out, t, 1)
        out.copy_(t)
        return out

    def broadcast(self, t, src):
        self.info.global_rank(src, "broadcast")
        return t

    def send(self, t, dst, async_op=False, tag=0):
        raise ValueError(f"send to rank {dst}: {self.info.label()} has one rank")

    def recv(self, t, src, async_op=False, tag=0):
        raise ValueError(f"recv from rank {src}: {self.info.label()} has one rank")

    def torch_transport(self):
        return self


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchCommunicator(Communicator):
    """torch.distributed on the group (gloo on CPU, NCCL on CUDA)."""

    backend = "torch"
    overlaps = True

    def all_reduce(self, t, op="sum", async_op=False):
        reduce_op = _TORCH_OPS.get(op)
        if reduce_op is None:
            raise _bad_op(op)
        if async_op:
            return _torch_async(lambda buf: dist.all_reduce(buf, op=reduce_op, group=self.group, async_op=True), t)
        if t.is_contiguous():
            dist.all_reduce(t, op=reduce_op, group=self.group)
        else:
            work = t.contiguous()
            dist.all_reduce(work, op=reduce_op, group=self.group)
            t.copy_(work)
        return t

    def all_gather_into_tensor(self, out, t, async_op=False):
        _check_gather(out, t, self.size)
        src = t.contiguous()
        if async_op:
            return TorchWork(all_gather_flat(out, src, group=self.group, async_op=True), keep=(out, src))
        all_gather_flat(out, src, group=self.group)
        return out

    def reduce_scatter_tensor(self, out, t, async_op=False):
        _check_scatter(out, t, self.size)
        src = t.contiguous()
        if async_op:
            return TorchWork(reduce_scatter_flat(out, src, group=self.group, async_op=True), keep=(out, src))
        reduce_scatter_flat(out, src, group=self.group)
        return out

    def all_to_all_single(self, out, t):
        _check_all_to_all(out, t, self.size)
        src = t.contiguous()
        return _into(out, lambda buf: dist.all_to_all_single(buf, src, group=self.group), read=False)

    def broadcast(self, t, src):
        dist.broadcast(t, self.info.global_rank(src, "broadcast"), group=self.group)
        return t

    def send(self, t, dst, async_op=False, tag=0):
        peer, src = self.info.global_rank(dst, "send"), t.contiguous()
        if async_op:
            return TorchWork(dist.isend(src, peer, group=self.group, tag=tag), keep=src)
        dist.send(src, peer, group=self.group, tag=tag)

    def recv(self, t, src, async_op=False, tag=0):
        peer = self.info.global_rank(src, "recv")
        if async_op:
            return _torch_async(lambda buf: dist.irecv(buf, peer, group=self.group, tag=tag), t, read=False)
        dist.recv(t, peer, group=self.group, tag=tag)
        return t

    def torch_transport(self):
        return self


# ---- torch.distributed backends that cannot move CUDA tensors themselves ----------------

# What torch.distributed's gloo backend runs on CUDA tensors (torch's docs, "Backends":
# broadcast and all_reduce; send, recv, all_gather, reduce_scatter, all_to_all not).
_GLOO_CUDA_OPS = frozenset({"all_reduce", "broadcast"})
_ALL_OPS = frozenset({"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                      "all_to_all_single", "send", "recv"})


def cuda_transport(group) -> str:
    """The name of the torch.distributed backend that moves `group`'s CUDA
    tensors: "nccl", "gloo", ... or "" when the group has none for CUDA."""
    return transport_for_cuda(str(dist.get_backend(group)))


def transport_for_cuda(backend: str) -> str:
    """The CUDA entry of a torch.distributed backend name: "gloo" -> "gloo",
    "cpu:gloo,cuda:nccl" -> "nccl", "cpu:gloo" -> "" (none)."""
    name = backend.strip().lower()
    if ":" not in name:
        return name
    by_device = dict(pair.strip().split(":", 1) for pair in name.split(",") if ":" in pair)
    return by_device.get("cuda", "")


def staged_ops(group, device: str) -> frozenset:
    """The operations a torch communicator of `group` on `device` stages
    through CPU memory: none on CPU or when NCCL moves the CUDA tensors; on
    gloo, those it cannot run on CUDA tensors; every one without a CUDA backend."""
    if device != "cuda":
        return frozenset()
    transport = cuda_transport(group)
    if transport == "gloo":
        return _ALL_OPS - _GLOO_CUDA_OPS
    return _ALL_OPS if transport == "" else frozenset()


def torch_communicator(info: GroupInfo, device: str, forced: str | None) -> "TorchCommunicator":
    """torch.distributed on the group for `device`: staged through CPU memory
    for the operations its backend cannot run on that device (see StagedTorchCommunicator)."""
    staged = staged_ops(info.group, device) if info.size > 1 else frozenset()
    if staged:
        return StagedTorchCommunicator(info, device, forced, staged)
    return TorchCommunicator(info, device, forced)


def _host(t: torch.Tensor, read: bool = True) -> torch.Tensor:
    """A contiguous CPU copy of `t` (pinned when `t` is on CUDA; with `read`
    holding t's values: the copy waits for the kernels writing `t`)."""
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    if read:
        buf.copy_(t)                              # blocking device-to-host copy
    return buf


class Then:
    """A handle followed by `then()` (the copy of a host buffer back to the
    device) when waited on: the copy runs on the stream current at wait()."""

    __slots__ = ("inner", "then")

    def __init__(self, inner, then):
        self.inner, self.then = inner, then

    def wait(self, timeout=None) -> None:
        if self.inner is not None:
            self.inner.wait()
            then, self.inner, self.then = self.then, None, None
            then()

    def is_completed(self) -> bool:
        return self.inner is None or self.inner.is_completed()


class StagedTorchCommunicator(TorchCommunicator):
    """torch.distributed whose backend cannot run some operations on the
    device's tensors (gloo with CUDA tensors: see _GLOO_CUDA_OPS): those go
    through pinned CPU buffers.  The inputs are copied to the host (a
    blocking copy, after the kernels that wrote them), the operation runs on
    the CPU copies, and the result is copied back to the device, without
    blocking, on the stream current when the call returns (blocking calls)
    or when its handle is waited on (async_op).  The values are those of
    the direct operation; only the route differs.  `staged`: the operations
    routed so (the others run directly on the device's tensors)."""

    def __init__(self, info, device, forced, staged: frozenset):
        super().__init__(info, device, forced)
        self.staged = staged

    @staticmethod
    def _back(result, dst: torch.Tensor, buf: torch.Tensor, async_op: bool):
        """Copy the host result `buf` into `dst` once `result` (the host call's
        return: a handle when async_op) is complete."""
        def copy_back():
            dst.copy_(buf, non_blocking=True)
        if async_op:
            return Then(result, copy_back)
        copy_back()
        return dst

    def all_reduce(self, t, op="sum", async_op=False):
        if "all_reduce" not in self.staged:
            return super().all_reduce(t, op, async_op)
        buf = _host(t)
        return self._back(super().all_reduce(buf, op, async_op), t, buf, async_op)

    def broadcast(self, t, src):
        if "broadcast" not in self.staged:
            return super().broadcast(t, src)
        buf = _host(t)
        return self._back(super().broadcast(buf, src), t, buf, False)

    def all_gather_into_tensor(self, out, t, async_op=False):
        _check_gather(out, t, self.size)
        buf = _host(out, read=False)
        return self._back(super().all_gather_into_tensor(buf, _host(t), async_op), out, buf, async_op)

    def reduce_scatter_tensor(self, out, t, async_op=False):
        _check_scatter(out, t, self.size)
        buf = _host(out, read=False)
        return self._back(super().reduce_scatter_tensor(buf, _host(t), async_op), out, buf, async_op)

    def all_to_all_single(self, out, t):
        _check_all_to_all(out, t, self.size)
        buf = _host(out, read=False)
        return self._back(super().all_to_all_single(buf, _host(t)), out, buf, False)

    def send(self, t, dst, async_op=False, tag=0):
        return super().send(_host(t), dst, async_op=async_op, tag=tag)

    def recv(self, t, src, async_op=False, tag=0):
        buf = _host(t, read=False)
        return self._back(super().recv(buf, src, async_op=async_op, tag=tag), t, buf, async_op)

    def torch_transport(self):
        return self

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", staged through CPU: {', '.join(sorted(self.staged))}>"


_FALLBACK_OPS = ("all_reduce", "reduce_scatter")
_OPS = ("sum", "max")


class ShmBackend(Communicator):
    """The group's ShmCommunicator (shm.py).  `fallback` (auto-picked only)
    reduces the dtypes shm cannot; a forced one has none and raises for them."""

    backend = "shm"
    overlaps = True

    def __init__(self, info, device, forced, comm: _shm.ShmCommunicator,
                 fallback: Communicator | None):
        super().__init__(info, device, forced)
        self.shm = comm
        self.fallback = fallback

    def all_reduce(self, t, op="sum", async_op=False):
        if op != "sum" and op != "max":
            raise _bad_op(op)
        if t.dtype in _SHM_REDUCIBLE or self.fallback is None:
            return self.shm.all_reduce(t, op, async_op=async_op)
        self._agree_on_fallback("all_reduce", t, op)
        return self.fallback.all_reduce(t, op, async_op=async_op)

    def all_gather_into_tensor(self, out, t, async_op=False):
        _check_gather(out, t, self.size)
        return self.shm.all_gather(out, t, async_op=async_op)

    def reduce_scatter_tensor(self, out, t, async_op=False):
        _check_scatter(out, t, self.size)
        if t.dtype in _SHM_REDUCIBLE or self.fallback is None:
            return self.shm.reduce_scatter(out, t, async_op=async_op)
        self._agree_on_fallback("reduce_scatter", t, "sum")
        return self.fallback.reduce_scatter_tensor(out, t, async_op=async_op)

    def all_to_all_single(self, out, t):
        _check_all_to_all(out, t, self.size)
        return self.shm.all_to_all(out, t)  # moves bytes: every dtype

    def _agree_on_fallback(self, what: str, t: torch.Tensor, op: str) -> None:
        """Before a reduction of a dtype shm cannot reduce goes to torch.distributed:
        the ranks all-gather (on shm, so it is checked against whatever the
        others are calling there) what they are about to hand over, and raise
        on every rank if it differs.  Without it, a rank reducing bool while
        another reduces float32 would wait on two different transports until
        the timeout.  A 32-byte shm all_gather per call (these dtypes are rare
        in a model: masks, flags)."""
        mine = torch.tensor([_FALLBACK_OPS.index(what), _dtype_code(t.dtype), t.numel(),
                             ("sum", "max").index(op)], dtype=torch.int64)
        rows = torch.empty(self.size * 4, dtype=torch.int64)
        try:
            self.shm.all_gather(rows, mine)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (this rank's all_gather of 4 int64 is shardformer's check before it "
                               f"hands {what} of {t.dtype}, which shm cannot reduce, to torch.distributed)"
                               ) from None
        rows = rows.view(self.size, 4).tolist()
        if any(row != rows[0] for row in rows):
            sides = "; ".join(f"rank {r}: {_FALLBACK_OPS[a]}({_OPS[c]}, {n} elements, {_dtype_name(d)})"
                              for r, (a, d, n, c) in enumerate(rows))
            raise RuntimeError(f"{self.info.label()}: collective mismatch before handing {what} to "
                               f"torch.distributed: {sides}")

    def broadcast(self, t, src):
        return self.shm.broadcast(t, src)

    def send(self, t, dst, async_op=False, tag=0):
        return self.shm.send(t, dst, async_op=async_op)

    def recv(self, t, src, async_op=False, tag=0):
        return self.shm.recv(t, src, async_op=async_op)


class NcclBackend(Communicator):
    """The group's NcclCommunicator (nccl.py).  A blocking call is enqueued on
    the caller's current CUDA stream (later work on it is ordered after);
    an async_op call on the communicator's side stream, ordered after the
    caller's stream, its handle's wait() ordering the stream current then
    after it (streams.py), so the caller's kernels run while it moves data."""

    backend = "nccl"
    overlaps = True

    def __init__(self, info, device, forced, comm):
        super().__init__(info, device, forced)
        self.nccl = comm
        self.side = SideStream()

    def _run(self, call, anchor: torch.Tensor, tensors, async_op: bool, result):
        """call() now on the current stream, or (async_op) on the side stream: a handle."""
        if async_op:
            return self.side.run(call, anchor.device, tensors)
        call()
        return result

    def all_reduce(self, t, op="sum", async_op=False):
        if op != "sum" and op != "max":
            raise _bad_op(op)
        return self._run(lambda: _into(t, lambda buf: self.nccl.all_reduce(buf, op)), t, (t,), async_op, t)

    def all_gather_into_tensor(self, out, t, async_op=False):
        _check_gather(out, t, self.size)
        return self._run(lambda: self.nccl.all_gather(out, t.contiguous()), t, (out, t), async_op, out)

    def reduce_scatter_tensor(self, out, t, async_op=False):
        _check_scatter(out, t, self.size)
        return self._run(lambda: self.nccl.reduce_scatter(out, t.contiguous()), t, (out, t), async_op, out)

    def all_to_all_single(self, out, t):
        _check_all_to_all(out, t, self.size)
        src = t.contiguous()
        return _into(out, lambda buf: self.nccl.all_to_all(buf, src), read=False)

    def broadcast(self, t, src):
        self.info.global_rank(src, "broadcast")
        return _into(t, lambda buf: self.nccl.broadcast(buf, src))

    def send(self, t, dst, async_op=False, tag=0):
        return self._run(lambda: self.nccl.send(t.contiguous(), dst), t, (t,), async_op, None)

    def recv(self, t, src, async_op=False, tag=0):
        return self._run(lambda: _into(t, lambda buf: self.nccl.recv(buf, src), read=False), t, (t,),
                         async_op, t)


def _into(t: torch.Tensor, call, read: bool = True) -> torch.Tensor:
    """call(buffer) writing its result into `t`: on `t` itself when contiguous,
    else on a contiguous buffer (holding `t`'s values when `read`) copied back."""
    if t.is_contiguous():
        call(t)
        return t
    buf = t.contiguous() if read else torch.empty_like(t, memory_format=torch.contiguous_format)
    call(buf)
    t.copy_(buf)
    return t


# ---- the opt-in cross-rank check (torch and nccl backends) ----------------------------

CHECK_ENV = "SHARDFORMER_CHECK_COLLECTIVES"


def _check_requested() -> bool:
    """SHARDFORMER_CHECK_COLLECTIVES, validated; read when a communicator is created."""
    raw = os.environ.get(CHECK_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{CHECK_ENV}={raw!r}: expected 1 (check every collective) or 0")


# A descriptor: (call, elements, dtype, reduction, root or peer, call number, arguments rejected).
_FIELDS = 7
_CALLS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "send", "recv",
          "all_to_all_single")
_CALL_CODE = {name: i + 1 for i, name in enumerate(_CALLS)}
_REDUCTION_CODE = {"sum": 1, "max": 2}  # 0: none; -1: an op no backend knows
_REDUCTION_NAME = {1: "sum", 2: "max", -1: "unknown op"}


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number in every process (a checksum of the name, not a table)."""
    return zlib.crc32(str(dtype).encode())


def _dtype_name(code: int) -> str:
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and _dtype_code(value) == code:
            return str(value).removeprefix("torch.")
    return f"dtype #{code}"


def _describe(row) -> str:
    call, numel, dtype, reduction, peer = row[:5]
    name = _CALLS[call - 1] if 1 <= call <= len(_CALLS) else f"operation #{call}"
    what = f"{numel} {_dtype_name(dtype)} elements"
    if name in ("all_reduce", "reduce_scatter_tensor"):
        return f"{name}({_REDUCTION_NAME.get(reduction, reduction)}) of {what}"
    if name == "all_gather_into_tensor":
        return f"{name} of {what} per rank"
    if name == "all_to_all_single":
        return f"{name} of {what} in all"
    if name == "broadcast":
        return f"broadcast of {what} from rank {peer}"
    if name == "send":
        return f"send of {what} to rank {peer}"
    if name == "recv":
        return f"recv of {what} from rank {peer}"
    return f"{name} of {what}"


class CheckedCommunicator(Communicator):
    """`inner` (a torch or nccl communicator) with a cross-rank check before
    every call; made by `_get` when SHARDFORMER_CHECK_COLLECTIVES=1 (see
    "Cross-rank checks").  Each collective first all-gathers its descriptor
    through `inner` on the tensor's device; send/recv swap it with the peer."""

    def __init__(self, inner: Communicator):
        super().__init__(inner.info, inner.device, inner.forced)
        self.inner = inner
        self.backend = inner.backend
        self.overlaps = inner.overlaps
        self.calls = 0  # collectives on this group so far (every rank counts the same)

    # -- the check ---------------------------------------------------------------

    def _descriptor(self, call: str, t: torch.Tensor, reduction: int, peer: int, number: int,
                    error: Exception | None) -> list[int]:
        return [_CALL_CODE[call], t.numel(), _dtype_code(t.dtype), reduction, peer, number,
                int(error is not None)]

    def _agree(self, call: str, t: torch.Tensor, reduction: int = 0, root: int = 0,
               error: Exception | None = None) -> None:
        """All-gather this rank's descriptor; raise unless every rank's matches."""
        self.calls += 1
        mine = self._descriptor(call, t, reduction, root, self.calls, error)
        desc = torch.tensor(mine, dtype=torch.int64, device=t.device)
        every = torch.empty(self.size * _FIELDS, dtype=torch.int64, device=t.device)
        self.inner.all_gather_into_tensor(every, desc)
        rows = every.view(self.size, _FIELDS).tolist()
        if any(row[:-1] != rows[0][:-1] for row in rows):
            raise RuntimeError(self._mismatch(rows))
        if error is not None:
            raise error
        rejected = [q for q, row in enumerate(rows) if row[-1]]
        if rejected:
            raise RuntimeError(
                f"{CHECK_ENV}: rank(s) {rejected} of {self.info.label()} rejected the arguments of "
                f"{_describe(mine)} (collective #{self.calls}; see the error there); it ran on no rank")

    def _mismatch(self, rows) -> str:
        by_call: dict = {}
        for q, row in enumerate(rows):
            by_call.setdefault(tuple(row[:-1]), []).append(q)
        sides = "; ".join(
            f"rank{'s' if len(qs) > 1 else ''} {', '.join(map(str, qs))} call{'' if len(qs) > 1 else 's'} "
            f"{_describe(row)} (collective #{row[5]})" for row, qs in by_call.items())
        return (f"{CHECK_ENV}: the ranks of {self.info.label()} disagree on a collective: {sides} "
                f"(this is rank {self.rank}); it ran on no rank")

    def _swap(self, call: str, t: torch.Tensor, peer: int) -> None:
        """send/recv: exchange descriptors with `peer` (the sender speaks first)."""
        self.info.global_rank(peer, call)  # a bad peer cannot be told: raise here
        mine = self._descriptor(call, t, 0, peer, 0, None)
        desc = torch.tensor(mine, dtype=torch.int64, device=t.device)
        got = torch.empty(_FIELDS, dtype=torch.int64, device=t.device)
        if call == "send":
            self.inner.send(desc, peer)
            self.inner.recv(got, peer)
        else:
            self.inner.recv(got, peer)
            self.inner.send(desc, peer)
        theirs = got.tolist()
        want = _CALL_CODE["recv" if call == "send" else "send"]
        if theirs[0] != want or theirs[1:3] != mine[1:3] or theirs[4] != self.rank:
            raise RuntimeError(
                f"{CHECK_ENV}: ranks {self.rank} and {peer} of {self.info.label()} disagree: "
                f"rank {self.rank} calls {_describe(mine)}; rank {peer} calls {_describe(theirs)}; "
                f"nothing was transferred")

    @staticmethod
    def _rejects(check, *args) -> Exception | None:
        """The local argument check's error, to flag in the descriptor."""
        try:
            check(*args)
        except (ValueError, TypeError) as e:
            return e
        return None

    # -- the collectives -----------------------------------------------------------

    def all_reduce(self, t, op="sum", async_op=False):
        code = _REDUCTION_CODE.get(op, -1)
        self._agree("all_reduce", t, code, error=_bad_op(op) if code < 0 else None)
        return self.inner.all_reduce(t, op, async_op=async_op)

    def all_gather_into_tensor(self, out, t, async_op=False):
        self._agree("all_gather_into_tensor", t, error=self._rejects(_check_gather, out, t, self.size))
        return self.inner.all_gather_into_tensor(out, t, async_op=async_op)

    def reduce_scatter_tensor(self, out, t, async_op=False):
        self._agree("reduce_scatter_tensor", t, _REDUCTION_CODE["sum"],
                    error=self._rejects(_check_scatter, out, t, self.size))
        return self.inner.reduce_scatter_tensor(out, t, async_op=async_op)

    def all_to_all_single(self, out, t):
        self._agree("all_to_all_single", t, error=self._rejects(_check_all_to_all, out, t, self.size))
        return self.inner.all_to_all_single(out, t)

    def broadcast(self, t, src):
        error = self._rejects(self.info.global_rank, src, "broadcast")
        self._agree("broadcast", t, root=src, error=error)
        return self.inner.broadcast(t, src)

    def send(self, t, dst, async_op=False, tag=0):
        self._swap("send", t, dst)
        return self.inner.send(t, dst, async_op=async_op, tag=tag)

    def recv(self, t, src, async_op=False, tag=0):
        self._swap("recv", t, src)
        return self.inner.recv(t, src, async_op=async_op, tag=tag)

    def exchange(self, send, dst, recv, src, tag=0):
        """Unchecked: a ring's two directions may be issued in different
        orders on different ranks, which a blocking descriptor swap per
        message cannot follow (the messages themselves are told apart by tag)."""
        return self.inner.exchange(send, dst, recv, src, tag=tag)

    def torch_transport(self):
        return self.inner.torch_transport()

    def __repr__(self) -> str:
        return f"<checked {self.inner!r}>"


def _maybe_checked(comm: Communicator) -> Communicator:
    """Wrap a torch or nccl communicator of several ranks when the check is asked for."""
    if comm.size > 1 and isinstance(comm, (TorchCommunicator, NcclBackend)) and _check_requested():
        return CheckedCommunicator(comm)
    return comm


# ---- choosing and caching ------------------------------------------------------------

_CACHE = _shm.GroupTable()  # (group as passed, device type) -> Communicator
_LOOKUP = _CACHE.items  # the hot paths' plain dict: (id(group), device type) -> Communicator


def _check_forced(forced: str | None, device: str) -> None:
    """A forced backend must be able to run here: shm on CPU tensors, nccl on
    CUDA tensors with NCCL loadable.  Checked for groups of one rank too, so a
    misconfiguration shows on one process."""
    if forced == "shm" and device != "cpu":
        raise RuntimeError(f"{ENV}=shm: tensor is on {device}; shm is CPU-only")
    if forced == "nccl":
        ok, why = _nccl.available()
        if not ok:
            raise RuntimeError(f"{ENV}=nccl: {why}")
        if device != "cuda":
            raise RuntimeError(f"{ENV}=nccl: tensor is on {device}, not CUDA")


def _create(info: GroupInfo, device: str, setup: bool) -> Communicator | None:
    """Choose the backend (reading SHARDFORMER_COMM) and make the communicator.

    setup=False (send/recv): only wrap what already exists; None means "use
    torch.distributed for this call, cache nothing"."""
    forced = _forced()
    group = info.group
    _check_forced(forced, device)
    if info.size == 1:
        return SoloCommunicator(info, device, forced, forced or "torch")
    if forced == "torch":
        return torch_communicator(info, device, forced)
    if forced == "shm":
        comm = _shm.communicator(group) if setup else _shm.existing(group)
        if comm is None:
            why = _shm.reason(group) or (
                f"send/recv need the shm communicator of {info.label()} set up first: call "
                f"shardformer.distributed.get_communicator(group, 'cpu') on every rank")
            raise RuntimeError(f"{ENV}=shm: {why}")
        return ShmBackend(info, device, forced, comm, None)
    if forced == "nccl":
        if not setup:
            raise RuntimeError(
                f"{ENV}=nccl: send/recv need the NCCL communicator of {info.label()} set up "
                f"first: call shardformer.distributed.get_communicator(group, 'cuda') on every rank")
        return NcclBackend(info, device, forced, _nccl.communicator(group))
    # auto
    if device == "cpu":
        comm = _shm.communicator(group) if setup else _shm.existing(group)
        if comm is not None:
            return ShmBackend(info, device, forced, comm, TorchCommunicator(info, device, forced))
        if not setup and _shm.reason(group) is None:
            return None  # shm not tried yet: a later collective may still set it up
    return torch_communicator(info, device, forced)


def _get(group, device: str, setup: bool = True) -> Communicator | None:
    """The slow path: normalize the group, create on a miss, cache."""
    info = group_info(group)
    owner = info.group  # the group None names (WORLD), or None when not initialized
    comm = _CACHE.get(owner, device)
    if comm is None:
        if setup:
            _shm.release_destroyed()  # creating one: drop what destroyed groups left
        comm = _create(info, device, setup)
        if comm is None:
            return None
        comm = _maybe_checked(comm)
        _CACHE.put(owner, comm, device)
    # One communicator per group whatever names it (None or the WORLD object);
    # the entry under None goes when the default group does.
    _CACHE.put(group, comm, device, owner=owner)
    return comm


def _current(comm: Communicator | None, group) -> Communicator | None:
    """`comm` (a cache hit for `group`) unless `group` is None and names a
    default group that a re-initialization has since replaced."""
    if comm is not None and (group is not None or comm.group_ref() is dist.group.WORLD):
        return comm
    return None


def _cached(group, device: str) -> Communicator | None:
    return _current(_LOOKUP.get((id(group), device)), group)


def get_communicator(group=None, device="cpu") -> Communicator:
    """The communicator of `group` (None: the default group) for `device` (a
    device type, torch.device or a tensor on it), made on first call -- a
    collective over the group: every rank must make its first call at the same
    point.  SHARDFORMER_COMM is read then, once for this (group, device type)."""
    dev = _device_type(device)
    return _cached(group, dev) or _get(group, dev)


def communicator_for(t: torch.Tensor, group=None) -> Communicator:
    """get_communicator(group, t): the collectives' lookup."""
    dev = _tensor_device(t)
    comm = _LOOKUP.get((id(group), dev))
    if comm is not None and (group is not None or comm.group_ref() is dist.group.WORLD):
        return comm
    return _get(group, dev)


def parallel_communicator(t: torch.Tensor, group=None) -> Communicator | None:
    """The communicator for `t` over `group`, or None when the group has one
    rank (then nothing is chosen and SHARDFORMER_COMM is not read): the region
    operators' lookup."""
    dev = _tensor_device(t)
    comm = _LOOKUP.get((id(group), dev))
    if comm is None or (group is None and comm.group_ref() is not dist.group.WORLD):
        if group_info(group).size == 1:
            return None
        comm = _get(group, dev)
    return comm if comm.size > 1 else None


def existing_communicator(t: torch.Tensor, group=None) -> Communicator:
    """The communicator send/recv use: the cached one, one wrapping an shm
    communicator that exists already, else torch.distributed (not cached).
    Never sets anything up (raises when a forced backend would need to)."""
    dev = _tensor_device(t)
    comm = _cached(group, dev) or _get(group, dev, setup=False)
    if comm is None:
        return _maybe_checked(torch_communicator(group_info(group), dev, None))
    return comm


def check_unchanged(comm: Communicator) -> None:
    """Raise if SHARDFORMER_COMM changed since `comm` was chosen (it would be ignored)."""
    now = _forced()
    if now != comm.forced:
        raise RuntimeError(
            f"{ENV} is now {now!r} but was {comm.forced!r} when the {comm.backend} communicator of "
            f"{comm.info.label()} ({comm.device}) was chosen; it is read once per group and device "
            f"(so a group never mixes backends). Call "
            f"shardformer.distributed.reset_communicators() on every rank to choose again.")


def communicators() -> list[Communicator]:
    """The communicators made so far (each once)."""
    seen, out = set(), []
    for comm in _CACHE.values():
        if id(comm) not in seen:
            seen.add(id(comm))
            out.append(comm)
    return out


def forget_group(group) -> None:
    """Drop `group`'s communicators (every device type) and close its shm
    segment: the next collective on the group sets up new ones (a collective:
    every rank of the group must forget it at the same point of its program,
    e.g. after one failed step; shardformer.distributed.failures)."""
    owner = group_info(group).group
    _CACHE.drop(owner)
    if group is not owner:
        _CACHE.drop(group)
    _shm.forget(owner)


def reset_communicators() -> None:
    """Forget every choice: the next collective on a group chooses its backend
    again (re-reading SHARDFORMER_COMM and SHARDFORMER_CHECK_COLLECTIVES).  For tests and benchmarks that switch
    backends; call it on every rank at the same point, between collectives.

    Shared-memory segments are kept (shm.py caches them per group, and a new
    shm communicator reuses the group's segment); `shm.forget(group)` closes
    one.  NCCL communicators are likewise kept by nccl.py."""
    _CACHE.clear()
    _INFO.clear()
