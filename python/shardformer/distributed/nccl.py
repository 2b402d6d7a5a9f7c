"""Direct NCCL calls for CUDA tensors, through a dlopen'ed libnccl.so.2.

`available()` loads the library once (SHARDFORMER_NCCL_PATH overrides the
path; the copy torch already loaded is preferred) and says why not when it
cannot: no library, or no CUDA device.  One `NcclCommunicator` per process
group: rank 0's unique id is broadcast through the group's torch.distributed
backend.  Every call is enqueued on the caller's current CUDA stream (passed
to C as an integer), so it can be captured in a CUDA graph; the GIL is
released while NCCL enqueues.  Communicators are destroyed only by
`destroy()`, never by garbage collection.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import _C

# NCCL's ncclDataType_t codes.
_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}

_state: dict = {}


def _load() -> tuple[bool, str]:
    if "ok" not in _state:
        path = os.environ.get("SHARDFORMER_NCCL_PATH") or None
        try:
            code, where = _C.nccl_load(path)
            _state.update(ok=True, code=code, where=where, why="")
        except OSError as e:
            _state.update(ok=False, code=0, where="", why=f"NCCL cannot be loaded: {e}")
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


def library_path() -> str:
    _load()
    return _state["where"]


class NcclCommunicator:
    """An NCCL communicator over a process group's ranks (one GPU per rank)."""

    def __init__(self, group=None):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"NCCL backend unavailable: {why}")
        self.group = group
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

    @staticmethod
    def _args(t: torch.Tensor):
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"NCCL needs a contiguous CUDA tensor, got {t.device} "
                             f"contiguous={t.is_contiguous()}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"NCCL has no type for {t.dtype}")
        return _DTYPES[t.dtype], torch.cuda.current_stream(t.device).cuda_stream

    def _call(self, kind, send, recv, count, t, arg):
        if self._comm is None:
            raise RuntimeError("NCCL communicator destroyed")
        dtype, stream = self._args(t)
        _C.nccl_call(kind, self._comm, send, recv, count, dtype, arg, stream)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._call("all_reduce", t.data_ptr(), t.data_ptr(), t.numel(), t, _OPS[op])
        return t

    def _pair(self, what: str, big: torch.Tensor, small: torch.Tensor) -> None:
        """NCCL trusts the counts: check big = size x small, same dtype and device."""
        self._args(big)
        if big.dtype != small.dtype or big.device != small.device:
            raise ValueError(f"NCCL {what}: tensors differ: {big.dtype} on {big.device} vs "
                             f"{small.dtype} on {small.device}")
        if big.numel() != small.numel() * self.size:
            raise ValueError(f"NCCL {what}: {big.numel()} elements != {self.size} ranks x "
                             f"{small.numel()} elements")

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self._pair("all_gather", out, t)
        self._call("all_gather", t.data_ptr(), out.data_ptr(), t.numel(), t, 0)
        return out

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._pair("reduce_scatter", t, out)
        self._call("reduce_scatter", t.data_ptr(), out.data_ptr(), out.numel(), t, _OPS[op])
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self._call("broadcast", t.data_ptr(), t.data_ptr(), t.numel(), t, src)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._call("send", t.data_ptr(), 0, t.numel(), t, dst)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self._call("recv", 0, t.data_ptr(), t.numel(), t, src)
        return t


_COMMS: dict = {}


def communicator(group=None) -> NcclCommunicator | None:
    """The group's NCCL communicator, made on first call (collective); None if unavailable."""
    if not available()[0]:
        return None
    key = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if key not in _COMMS:
        _COMMS[key] = NcclCommunicator(group)
    return _COMMS[key]
