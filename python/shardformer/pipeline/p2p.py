"""Activations and gradients between pipeline stages.

Each message goes through shardformer.distributed.send / recv over the
pipeline group (shm for CPU tensors on one host, otherwise torch.distributed
or, with SHARDFORMER_COMM=nccl, direct NCCL calls for CUDA tensors).  The
receiver must know the shape and dtype it receives: the first message under
a key (the schedule's description of it: kind, sending virtual stage, the
micro-batch's shapes) is preceded by a small header
(dtype, rank, sizes); both sides cache it, so later messages under the same
key travel alone.

shardformer.comm_stats() counts every message, headers included, as the
send / recv of that communicator.

Sends and receives are blocking; the schedules order them so that they
cannot deadlock (schedule.py, "Communication").
"""
from __future__ import annotations

import torch

from .. import distributed as D

__all__ = ["StageLink"]

#: The dtypes a stage link sends, by their code in the header (a tensor's
#: dtype travels as its index here; pipeline.generate's logits header too).
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
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

    def send(self, t: torch.Tensor, to_stage: int, key, input_shape: tuple | None = None) -> None:
        """Send `t` to `to_stage`; the first message under `key` is preceded
        by its header, which also carries `input_shape` (the first stage's
        layer input shape, for the receiver's stand-ins; default t's)."""
        if key not in self._sent:
            input_shape = tuple(t.shape) if input_shape is None else tuple(input_shape)
            if t.dtype not in WIRE_DTYPES or t.dim() > _MAX_DIMS or len(input_shape) > _MAX_DIMS:
                raise ValueError(f"pipeline: cannot send a {t.dtype} tensor of {t.dim()} dimensions between stages")
            header = torch.zeros(3 + 2 * _MAX_DIMS, dtype=torch.int64)
            header[0], header[1], header[2] = WIRE_DTYPES.index(t.dtype), t.dim(), len(input_shape)
            header[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            header[3 + _MAX_DIMS:3 + _MAX_DIMS + len(input_shape)] = torch.tensor(input_shape, dtype=torch.int64)
            D.send(header.to(t.device), to_stage, self.group)
            COUNTS["headers"] += 1
            self._sent.add(key)
        D.send(t.detach().contiguous(), to_stage, self.group)
        COUNTS["sent"] += 1

    def recv(self, from_stage: int, key, device) -> torch.Tensor:
        if key not in self._shapes:
            header = D.recv(torch.zeros(3 + 2 * _MAX_DIMS, dtype=torch.int64, device=device), from_stage, self.group)
            code, ndim, nfull = int(header[0]), int(header[1]), int(header[2])
            if not (0 <= code < len(WIRE_DTYPES) and 0 <= ndim <= _MAX_DIMS and 0 <= nfull <= _MAX_DIMS):
                raise RuntimeError(f"pipeline: a malformed message header from stage {from_stage}: "
                                   f"{header.tolist()}")
            self._shapes[key] = (tuple(int(x) for x in header[3:3 + ndim]), WIRE_DTYPES[code],
                                 tuple(int(x) for x in header[3 + _MAX_DIMS:3 + _MAX_DIMS + nfull]))
        shape, dtype, _ = self._shapes[key]
        out = D.recv(torch.empty(shape, dtype=dtype, device=device), from_stage, self.group)
        COUNTS["received"] += 1
        return out

    def input_shape(self, key) -> tuple:
        """The first stage's layer input shape that came with `key`'s header."""
        if (key, "n") in self._shapes:               # a tuple message: it came with its first tensor
            return self._shapes[(key, 0)][2]
        return self._shapes[key][2]

    def send_message(self, message, to_stage: int, key, input_shape: tuple | None = None) -> None:
        """Send a tensor (send) or a tuple of tensors: the tuple's length first
        (once per key), then each tensor under (key, position), the first
        carrying `input_shape` in its header."""
        if isinstance(message, torch.Tensor):
            return self.send(message, to_stage, key, input_shape)
        if any(not isinstance(t, torch.Tensor) for t in message):
            raise ValueError(f"pipeline: a message holds {[type(t).__name__ for t in message]}, not tensors only")
        if (key, "n") not in self._sent:
            D.send(torch.tensor([len(message)], dtype=torch.int64, device=message[0].device), to_stage, self.group)
            COUNTS["headers"] += 1
            self._sent.add((key, "n"))
        for j, t in enumerate(message):
            self.send(t, to_stage, (key, j), input_shape if j == 0 else None)

    def recv_message(self, from_stage: int, key, device, many: bool):
        """Receive what send_message sent: a tensor, or with `many` a tuple of tensors."""
        if not many:
            return self.recv(from_stage, key, device)
        if (key, "n") not in self._shapes:
            n = int(D.recv(torch.zeros(1, dtype=torch.int64, device=device), from_stage, self.group)[0])
            if not 0 < n <= 64:
                raise RuntimeError(f"pipeline: a malformed tuple header from stage {from_stage}: {n} tensors")
            self._shapes[(key, "n")] = n
        return tuple(self.recv(from_stage, (key, j), device) for j in range(self._shapes[(key, "n")]))
