"""Direct NCCL calls for CUDA tensors, through a dlopen'ed libnccl.so.2.

`available()` loads the library once (SHARDFORMER_NCCL_PATH overrides the
path; the copy torch already loaded is preferred) and says why not when it
cannot: no library, or no CUDA device.  One `NcclCommunicator` per process
group: rank 0's unique id is broadcast through the group's torch.distributed
backend.  Tensors reach C through DLPack like every other `_C` entry point
(`_C.nccl_all_reduce` & co. check device, dtype, contiguity and sizes there);
every call is enqueued on the caller's current CUDA stream (passed to C as an
integer), so it can be captured in a CUDA graph; the GIL is released while
NCCL enqueues.

Lifetime: the NcclCommunicator of a group is destroyed by `destroy()`, by
`forget(group)`, or when its group goes (the group object is collected, or a
sweep at the next communicator creation finds torch.distributed destroyed it:
shm.GroupTable, see shm.py's "Lifetime").  The table never keeps the group
alive and the communicator does not hold it.  A destroyed group's
communicator is aborted (ncclCommAbort: local, never waits on peers that may
have left), as nothing may still be running on a destroyed group; an
`NcclCommunicator` made directly and dropped without `destroy()` is not
destroyed by garbage collection (ncclCommDestroy may wait for the peers).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import _C
from .shm import GroupTable, release_destroyed

_state: dict = {}


def _load() -> tuple[bool, str]:
    if "ok" not in _state:
        path = os.environ.get("SHARDFORMER_NCCL_PATH") or None
        try:
            code, _where = _C.nccl_load(path)       # (version code, the library's path)
            _state.update(ok=True, code=code, why="")
        except OSError as e:
            _state.update(ok=False, code=0, why=f"NCCL cannot be loaded: {e}")
    return _state["ok"], _state["why"]


def available() -> tuple[bool, str]:
    """(True, "") when NCCL can run here, else (False, the reason)."""
    ok, why = _load()
    if not torch.cuda.is_available():
        gpu = "no CUDA device (torch.cuda.is_available() is False"
        gpu += f", torch built for CUDA {torch.version.cuda})" if torch.version.cuda else \
            ", this torch is a CPU-only build)"
        return False, gpu + ("" if ok else f"; {why}")
    return ok, why


def version() -> tuple[int, int, int] | None:
    """NCCL's (major, minor, patch), or None when it is not loaded."""
    ok, _ = _load()
    if not ok:
        return None
    code = _state["code"]
    if code >= 10000:  # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


class NcclCommunicator:
    """An NCCL communicator over a process group's ranks (one GPU per rank)."""

    def __init__(self, group=None):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"NCCL backend unavailable: {why}")
        # The group is used for the id's broadcast and not kept (see "Lifetime").
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        uid = [_C.nccl_unique_id() if self.rank == 0 else None]
        if self.size > 1:
            root = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)[0]
            dist.broadcast_object_list(uid, src=root, group=group)
        self._comm = _C.nccl_comm_init(self.size, uid[0], self.rank)

    def destroy(self, abort: bool = False) -> None:
        if self._comm is not None:
            _C.nccl_comm_destroy(self._comm, abort)
            self._comm = None

    def _stream(self, t: torch.Tensor) -> int:
        """The caller's current CUDA stream on t's device, as an integer (0 for a
        CPU tensor, which _C refuses with a clear error)."""
        if self._comm is None:
            raise RuntimeError("NCCL communicator destroyed")
        return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0

    # _C checks the tensors (contiguous CUDA tensors of an NCCL dtype, one
    # dtype and device, out = size x t for the gathers) before NCCL sees them.
    # detach(): DLPack refuses tensors that require grad; the storage is shared.

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        _C.nccl_all_reduce(self._comm, t.detach(), op, self._stream(t))
        return t

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        _C.nccl_all_gather(self._comm, out.detach(), t.detach(), self._stream(t))
        return out

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        _C.nccl_reduce_scatter(self._comm, out.detach(), t.detach(), op, self._stream(t))
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Block j of t (size equal blocks) to rank j; block i of out from rank i:
        one NCCL group of grouped ncclSend/ncclRecv."""
        _C.nccl_all_to_all(self._comm, out.detach(), t.detach(), self._stream(t))
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        _C.nccl_broadcast(self._comm, t.detach(), src, self._stream(t))
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        _C.nccl_send(self._comm, t.detach(), dst, self._stream(t))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        _C.nccl_recv(self._comm, t.detach(), src, self._stream(t))
        return t


def _abort(comm: NcclCommunicator) -> None:
    comm.destroy(abort=True)


_COMMS = GroupTable(on_drop=_abort)  # group (None: not initialized) -> NcclCommunicator


def _key(group):
    return group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)


def communicator(group=None) -> NcclCommunicator | None:
    """The group's NCCL communicator, made on first call (collective); None if unavailable."""
    if not available()[0]:
        return None
    key = _key(group)
    comm = _COMMS.get(key)
    if comm is None:
        release_destroyed()
        comm = NcclCommunicator(group)
        _COMMS.put(key, comm)
    return comm


def forget(group=None, abort: bool = False) -> None:
    """Destroy and drop the group's NCCL communicator now (every rank, same point
    unless abort)."""
    key = _key(group)
    comm = _COMMS.get(key)
    if comm is not None:
        comm.destroy(abort)
    _COMMS.drop(key)
