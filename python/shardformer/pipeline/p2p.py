"""Activations and gradients between pipeline stages.

Each message goes through shardformer.distributed.send / recv over the
pipeline group (shm on one host, NCCL for CUDA tensors, torch.distributed
otherwise).  The receiver must know the shape and dtype it receives: the
first message under a key (the schedule's description of it: kind, sending
virtual stage, the micro-batch's shapes) is preceded by a small header
(dtype, rank, sizes); both sides cache it, so later messages under the same
key travel alone.

Sends and receives are blocking; the schedules order them so that they
cannot deadlock (schedule.py, "Communication").
"""
from __future__ import annotations

import torch

from .. import distributed as D

__all__ = ["StageLink"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8
# Messages sent / received by this process, by kind (for tests: proof the traffic ran).
COUNTS = {"sent": 0, "received": 0, "headers": 0}


class StageLink:
    """This rank's point-to-point traffic along the pipeline group."""

    def __init__(self, manager):
        self.manager = manager
        self.group = manager.group
        self._sent: set = set()
        self._shapes: dict = {}

    def send(self, t: torch.Tensor, to_stage: int, key) -> None:
        if key not in self._sent:
            if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
                raise ValueError(f"pipeline: cannot send a {t.dtype} tensor of {t.dim()} dimensions between stages")
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
            header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            D.send(header.to(t.device), to_stage, self.group)
            COUNTS["headers"] += 1
            self._sent.add(key)
        D.send(t.detach().contiguous(), to_stage, self.group)
        COUNTS["sent"] += 1

    def recv(self, from_stage: int, key, device) -> torch.Tensor:
        if key not in self._shapes:
            header = D.recv(torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device), from_stage, self.group)
            code, ndim = int(header[0]), int(header[1])
            self._shapes[key] = (tuple(int(x) for x in header[2:2 + ndim]), _DTYPES[code])
        shape, dtype = self._shapes[key]
        out = D.recv(torch.empty(shape, dtype=dtype, device=device), from_stage, self.group)
        COUNTS["received"] += 1
        return out
