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

__all__ = ["signed", "tensor_hash", "value_fingerprint"]

_CHUNK_BYTES = 64 << 20   # device tensors are fingerprinted through the CPU in chunks
_HASH_STEP = 0x9E3779B97F4A7C15 - (1 << 64)     # an odd int64 for the device checksum's position weights


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


def _device_checksum(t: torch.Tensor) -> int:
    """An exact integer checksum of `t`'s bytes, computed on its device:
    sum_i w_i * x_i over int64 words x_i (wrapping), with position weights
    w_i = (i + 1) * an odd constant, so permuted rows differ too."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()])
    words = flat.to(torch.int64)
    weights = (torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64) * _HASH_STEP)
    return int((words * weights).sum().item()) ^ words.numel()


def value_fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint of a tensor's values (signed, for an int64 table)."""
    if t.device.type == "meta" or t.numel() == 0:
        return 0
    if t.device.type == "cpu":
        t = t.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        return signed(_C.fingerprint(t.contiguous()))
    return signed(_device_checksum(t) & ((1 << 64) - 1))
