"""Large CPU tensors whose memory is reused once nothing uses it any more.

Why: a tensor above the C allocator's mmap threshold (glibc's is at most
32 MiB) is mapped afresh on every allocation and unmapped when freed, so a
step that makes one pays a page fault per 4 KiB page the first time it
writes it.  Measured on the 2-core CI machine, one thread: a fresh
[16000, 1024] float32 ``torch.zeros`` takes 55 ms, zeroing one that stays
mapped 2 ms.  The vocabulary-parallel embedding's weight gradient [V/p, h]
and the vocabulary-parallel cross-entropy's logits gradient [tokens, V/p]
are such tensors, made once per training step (issue 34: "the step at its
compute floor").

How: each buffer is a numpy array this module keeps; the tensor handed out
is ``torch.from_numpy``'s view of it, whose storage holds one reference to
the array.  So the array's reference count says whether any tensor, view or
storage still uses the memory: only when this module alone holds it does
the next request of the same byte size take it, instead of mapping new
pages.  Memory in use is never handed out twice.  Contents are NOT cleared:
callers write every element.  The price: up to KEEP idle buffers per byte
size stay mapped between steps (as a caching allocator's do); release()
frees the idle ones.
"""
from __future__ import annotations

import math
import sys
import threading

import numpy as np
import torch

#: Tensors smaller than this come from torch.empty (the C allocator reuses such sizes itself).
MIN_BYTES = 16 << 20
#: At most this many buffers are kept per byte size; past it, requests get torch.empty.
KEEP = 4

_lock = threading.Lock()
_pool: dict[int, list] = {}
#: Requests served from a kept buffer ("reused") or by a new kept buffer ("new"): tests read these.
STATS = {"reused": 0, "new": 0}


#: A kept-alike array no tensor ever uses: its count, read the same way, is an idle buffer's.
_SENTINEL = [np.empty(0, dtype=np.uint8)]


def _idle(kept: list) -> list[int]:
    """Indices of the buffers in `kept` that no tensor uses: reference count no
    higher than the sentinel's (held by a list alone), read by the same
    expression, so however the interpreter counts its temporaries; a
    tensor's storage adds one reference to its array."""
    base = sys.getrefcount(_SENTINEL[0])
    return [i for i in range(len(kept)) if sys.getrefcount(kept[i]) <= base]


def empty(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """An uninitialized contiguous tensor, like torch.empty(shape, dtype=dtype,
    device=device); on the CPU and of at least MIN_BYTES, its memory is a
    kept buffer that nothing uses any more, when one of that size exists."""
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (device is not None and torch.device(device).type != "cpu") or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    with _lock:
        kept = _pool.setdefault(nbytes, [])
        idle = _idle(kept)
        if idle:
            buf = kept[idle[0]]
            STATS["reused"] += 1
        elif len(kept) < KEEP:
            buf = np.empty(nbytes, dtype=np.uint8)
            kept.append(buf)
            STATS["new"] += 1
        else:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(buf).view(dtype).view(shape)


def release() -> int:
    """Free the kept buffers nothing uses (the ones in use are dropped from the
    pool and freed with their last tensor); returns the bytes freed now."""
    freed = 0
    with _lock:
        for nbytes, kept in _pool.items():
            freed += nbytes * len(_idle(kept))
        _pool.clear()
    return freed
