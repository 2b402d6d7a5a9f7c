"""64-bit fingerprints of tensor values, the leaf under the cross-rank checks.

    tensor_hash(t)   the C fingerprint (_C.fingerprint) of t's values, any
                     device: CPU tensors in one call, device tensors through
                     the CPU in chunks of _CHUNK_BYTES, each chunk seeded with
                     the hash so far (h_k = F(chunk_k, seed=h_{k-1}), h_0 = 0)
    signed(h)        h in [0, 2^64) as the int64 of the same bits, for
                     torch.int64 tables

Lazy tensors are not handled here (lazy.recipe_fingerprint hashes how they
will be built; replicas.fingerprint picks one or the other), so that lazy
init and the replica checks can both sit on this module.
"""
from __future__ import annotations

import torch

from . import _C

__all__ = ["signed", "tensor_hash"]

_CHUNK_BYTES = 64 << 20   # device tensors are fingerprinted through the CPU in chunks


def tensor_hash(t: torch.Tensor) -> int:
    """64-bit fingerprint of a materialized tensor's values (0 on the meta
    device: no values yet)."""
    t = t.detach()
    if t.device.type == "meta":
        return 0
    if t.device.type == "cpu":
        return _C.fingerprint(t.contiguous())
    flat = t.contiguous().view(-1)
    step = max(1, _CHUNK_BYTES // max(1, t.element_size()))
    h = 0
    for i in range(0, flat.numel(), step):
        h = _C.fingerprint(flat[i:i + step].cpu(), seed=h)
    return h


def signed(h: int) -> int:
    """The unsigned 64-bit `h` as the signed int64 with the same bits."""
    return h - (1 << 64) if h >= 1 << 63 else h
