"""Tensors over a byte range of a checkpoint file, memory-mapped
copy-on-write, and the registry of parameters that alias such a mapping.

map_range(file, start, nbytes, dtype, shape) maps bytes [start, start+nbytes)
of `file` (the page-aligned range around them: mmap offsets are multiples of
the page size) and returns a tensor over exactly those bytes.  Nothing is
read: a page enters the process (from the page cache, as a file page shared
with every other process mapping it) when it is first touched, and leaves
when the last tensor over the mapping is freed.  This is how transformers
loads a safetensors file (safetensors maps it); a rank whose shard of a
tensor is one contiguous byte range of the file (a row block of a row-major
tensor: a column-parallel weight's output rows, a vocabulary shard, a
replicated tensor) holds its parameter this way with no copy at all, and
a column shard (a row-parallel weight's input columns) as a strided view
of its whole tensor's mapping.

Writes never reach the file.  The mapping is MAP_PRIVATE with PROT_WRITE:
the first write to a page (an optimizer step, `p.data.mul_`, anything) makes
the kernel copy that one page into the process's private memory, and the
write lands in the copy.  The alternative, copying a whole tensor on its
first write, would need a hook on every in-place op torch has (optimizers
write through `torch._foreach_*` on `p.data`, invisible to tensor hooks); the
kernel's copy-on-write sees every write, costs one 4 KiB page at a time,
and keeps the pages never written shared with the page cache.

The one thing a private mapping does not survive is someone changing the
file in place underneath it: Linux shows a page that was never written as
the file holds it now, and a file truncated shorter raises SIGBUS on the
pages past its end.  shardformer's own savers never write into an existing
file (they write a new directory and rename it into place; the old file
stays intact, unlinked, for as long as it is mapped), and before writing
they call materialize_mapped(model, directory) so that no parameter keeps
a file of the directory they replace.  Any other writer that rewrites the
checkpoint file in place needs materialize_mapped(model) first
(docs/load.md).
"""
from __future__ import annotations

import mmap
import os

import torch
from torch import nn

PAGE = mmap.ALLOCATIONGRANULARITY

# The attribute a tensor whose storage is a checkpoint mapping carries:
# (file, data_ptr when mapped); a data_ptr that no longer matches means the
# storage was replaced since (e.g. by `p.data = ...`).
_ATTR = "_shardformer_mapped"


def map_range(file: str, start: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over bytes [start, start + nbytes) of
    `file`, mapped private (copy-on-write) and writable; the mapping lives
    as long as the tensor (or a view of it) does.  `start` must be a
    multiple of dtype's size (safetensors aligns its tensors)."""
    if nbytes <= 0 or start % dtype.itemsize:
        raise ValueError(f"{file}: cannot map {nbytes} bytes at offset {start} as {dtype}")
    base = start - start % PAGE
    with open(file, "rb") as f:
        mm = mmap.mmap(f.fileno(), start + nbytes - base, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    # frombuffer keeps `mm` alive through the tensor's storage; the mapping is
    # unmapped when the last tensor over it is freed.
    return torch.frombuffer(mm, dtype=dtype, offset=start - base, count=nbytes // dtype.itemsize).view(shape)


def register(tensor: torch.Tensor, file: str) -> None:
    """Record that `tensor` (a parameter or buffer) now aliases `file`."""
    setattr(tensor, _ATTR, (os.path.realpath(file), tensor.data_ptr()))


def _entry(t: torch.Tensor) -> tuple[str, int] | None:
    """(file, data_ptr) when `t` still aliases a checkpoint file, else None."""
    entry = getattr(t, _ATTR, None)
    return entry if entry is not None and entry[1] == t.data_ptr() else None


def mapped_files(model: nn.Module) -> dict[str, list[str]]:
    """{checkpoint file: names of model's tensors that still alias it}."""
    out: dict[str, list[str]] = {}
    for name, t in _tensors(model):
        entry = _entry(t)
        if entry is not None:
            out.setdefault(entry[0], []).append(name)
    return out


def _tensors(model: nn.Module):
    seen = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield name, t


def materialize_mapped(model: nn.Module, directory=None) -> int:
    """Copy every tensor of `model` that aliases a checkpoint file (under
    `directory`, when given) into the process's own memory, keeping its
    values (pages written since loading included); returns how many.  After
    it no tensor of the model depends on those files: they may be rewritten
    in place or deleted.  Tensors stay the same objects (`.data` is replaced),
    so optimizers and tied names still see them.  Local: each rank its own."""
    root = None if directory is None else os.path.realpath(os.fspath(directory))
    done = 0
    with torch.no_grad():
        for _, t in _tensors(model):
            entry = _entry(t)
            if entry is None:
                continue
            if root is not None and os.path.dirname(entry[0]) != root:
                continue
            t.data = t.data.clone(memory_format=torch.contiguous_format)   # a column view: its shard only
            delattr(t, _ATTR)
            done += 1
    return done
