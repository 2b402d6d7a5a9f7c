"""Read a HuggingFace checkpoint directory a slice at a time.

CheckpointReader(path) opens a checkpoint as HF writes it:

    model.safetensors.index.json   sharded safetensors (the index maps names to files)
    model.safetensors              one safetensors file
    pytorch_model.bin.index.json   sharded torch pickles (fallback)
    pytorch_model.bin              one torch pickle (fallback)

(path may also name one of these files).  It lists every tensor's name, shape
and dtype from the files' headers without reading tensor data, and copies
selected index ranges of one dimension of a tensor into a destination tensor
(`read_into`), converting the dtype on the way: `read_shard` is one rank's
shard of a tensor split along a dimension (its DimShard ranges back to back,
zero padding after them).

Safetensors files are read through mapped.map_range: each read maps
just the rows it copies (copy-on-write, see mapped.py), copies them
straight into the destination (one copy, converting the dtype on the way;
torch's copy releases the GIL, so several threads read at once) and unmaps
them; `mapped_rows` hands out such a mapping itself, for a caller that
keeps it as a tensor's storage (pretrained.py aliases a shard that is one
contiguous byte range of the file that way).  A block of rows touches at
most `block_budget` bytes (map_budget unless a caller splits it between
threads).

Memory (.bin files).  The files are memory-mapped (safetensors' `safe_open`; for .bin,
torch.load(mmap=True, weights_only=True)), and every page touched through a
mapping counts in the process's resident set until the mapping is closed:
a slice along a dimension other than the first touches every row of the
tensor.  So a file is re-opened whenever the bytes touched through its
current mapping would pass `map_budget` (64 MiB by default), and one range is
read in blocks of rows that each touch at most that much.  The peak above the
destination tensors is then about `map_budget`, whatever the checkpoint's
size (measured on a 1 GiB file of 8 tensors, reading half of each along
dim 1: kept open 1.76 GiB peak RSS, re-opened per 128 MiB tensor 0.84 GiB,
for 0.73 GiB of results and imports).  Re-opening costs a header parse (well
under a millisecond for HF-sized headers).

What this is not: a safetensors parser (the `safetensors` package does the
file format), nor a loader that knows about models (see pretrained.py).
"""
from __future__ import annotations

import json
import math
import os

import torch

from . import mapped

# safetensors' dtype names -> torch dtypes (the ones this torch has)
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}

# What a directory is searched for, in order: (file name, kind).
LAYOUTS = (
    ("model.safetensors.index.json", "safetensors-index"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "bin-index"),
    ("pytorch_model.bin", "bin"),
)

DEFAULT_MAP_BUDGET = 64 << 20


def _torch_dtype(name: str, where: str) -> torch.dtype:
    attr = _ST_DTYPES.get(name)
    dtype = getattr(torch, attr, None) if attr else None
    if dtype is None:
        raise ValueError(f"{where}: dtype {name} has no torch equivalent here")
    return dtype


def _st_offsets(file: str) -> dict[str, int]:
    """{tensor name: absolute byte offset of its data} of a safetensors file
    (its header: an 8-byte little-endian length, then JSON with each
    tensor's data_offsets relative to the end of the header)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _resolve(path: str) -> tuple[str, list[str], dict[str, str] | None]:
    """(kind, files, index weight_map or None) of a checkpoint directory or file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name, kind in LAYOUTS:
            if os.path.isfile(os.path.join(path, name)):
                return _resolve_file(os.path.join(path, name), kind)
        present = sorted(os.listdir(path))
        raise FileNotFoundError(
            f"{path}: no HuggingFace checkpoint here (looked for {', '.join(n for n, _ in LAYOUTS)}); "
            f"the directory holds: {', '.join(present[:20]) or 'nothing'}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    if path.endswith(".safetensors.index.json"):
        return _resolve_file(path, "safetensors-index")
    if path.endswith(".bin.index.json"):
        return _resolve_file(path, "bin-index")
    if path.endswith(".safetensors"):
        return _resolve_file(path, "safetensors")
    if path.endswith((".bin", ".pt", ".pth")):
        return _resolve_file(path, "bin")
    raise ValueError(f"{path}: not a checkpoint file this reader knows (.safetensors, .bin, or their "
                     f".index.json)")


def _resolve_file(path: str, kind: str) -> tuple[str, list[str], dict[str, str] | None]:
    if not kind.endswith("-index"):
        return kind, [path], None
    with open(path) as f:
        try:
            weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a checkpoint index (a JSON object with a 'weight_map'): {e}") from None
    base = os.path.dirname(path)
    files = sorted({os.path.join(base, v) for v in weight_map.values()})
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"{path}: the index names files that are not there: "
                                f"{', '.join(os.path.basename(f) for f in missing)}")
    return kind.removesuffix("-index"), files, {k: os.path.join(base, v) for k, v in weight_map.items()}


class _Mapping:
    """One open (memory-mapped) checkpoint file and the bytes touched through it."""

    def __init__(self, kind: str, file: str):
        self.kind, self.file, self.touched = kind, file, 0
        if kind == "safetensors":
            import safetensors

            self.handle = safetensors.safe_open(file, framework="pt", device="cpu")
        else:
            self.handle = _load_bin(file)

    def get(self, name: str, index: tuple):
        """A view (or copy) of tensor `name` indexed by `index` (a tuple of slices)."""
        if self.kind == "safetensors":
            return self.handle.get_slice(name)[index] if index else self.handle.get_tensor(name)
        return self.handle[name][index]


def _load_bin(file: str) -> dict:
    """torch.load of a .bin checkpoint (memory-mapped where the format allows);
    a damaged or truncated file raises a ValueError naming it."""
    try:
        try:
            return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:
            # A legacy (non-zip) pickle cannot be memory-mapped: read it whole.
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's errors name no file
        size = os.path.getsize(file) if os.path.exists(file) else 0
        raise ValueError(f"{file}: not a readable PyTorch checkpoint ({size} bytes; damaged or truncated?): "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


class CheckpointReader:
    """Names, shapes and dtypes of a HF checkpoint's tensors, and their slices.

    Use as a context manager (or call close()) so that no file stays mapped."""

    def __init__(self, path, map_budget: int = DEFAULT_MAP_BUDGET):
        self.path = os.fspath(path)
        self.map_budget = int(map_budget)
        self.kind, self.files, weight_map = _resolve(self.path)
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}
        self._nontensors: list[str] = []
        self._offsets: dict[str, int] = {}      # safetensors: name -> byte offset of its data in its file
        for file in self.files:
            self._scan(file)
        if weight_map is not None:
            wrong = [k for k, f in weight_map.items() if k not in self._meta or self._meta[k][2] != f]
            if wrong:
                raise ValueError(f"{self.path}: the index does not match the files for {len(wrong)} tensor(s): "
                                 f"{', '.join(wrong[:10])}")
        self._open: _Mapping | None = None
        self.block_budget = self.map_budget

    # ----------------------------------------------------------- metadata
    def _scan(self, file: str) -> None:
        """Record the names, shapes and dtypes of `file` (headers only)."""
        if self.kind == "safetensors":
            import safetensors

            try:
                handle = safetensors.safe_open(file, framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors' errors name no file
                raise ValueError(f"{file}: not a readable safetensors checkpoint ({os.path.getsize(file)} bytes; "
                                 f"damaged or truncated?): {type(e).__name__}: {e}") from e
            offsets = _st_offsets(file)
            with handle as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    dtype = _torch_dtype(s.get_dtype(), f"{file}: {name}")
                    self._add(name, tuple(s.get_shape()), dtype, file)
                    self._offsets[name] = offsets[name]
            return
        for name, t in _load_bin(file).items():
            if isinstance(t, torch.Tensor):
                self._add(name, tuple(t.shape), t.dtype, file)
            else:
                self._nontensors.append(name)

    def _add(self, name, shape, dtype, file):
        if name in self._meta:
            raise ValueError(f"{self.path}: tensor {name} is stored twice ({self._meta[name][2]} and {file})")
        self._meta[name] = (shape, dtype, file)

    def keys(self) -> list[str]:
        return list(self._meta)

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def file_of(self, name: str) -> str:
        return self._meta[name][2]

    def nbytes(self, name: str) -> int:
        shape, dtype, _ = self._meta[name]
        return math.prod(shape) * dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._meta)

    @property
    def non_tensors(self) -> list[str]:
        """Entries of a .bin checkpoint that are not tensors."""
        return list(self._nontensors)

    # ----------------------------------------------------------- reading
    def _mapping(self, file: str, touch: int) -> _Mapping:
        """The open mapping of `file`, re-opened first when `touch` more bytes
        would take what it has touched past the budget."""
        m = self._open
        if m is not None and (m.file != file or (m.touched and m.touched + touch > self.map_budget)):
            self.close()
            m = None
        if m is None:
            m = self._open = _Mapping(self.kind, file)
        m.touched += touch
        return m

    def _view(self, name: str, index: tuple, touch: int) -> torch.Tensor:
        """Tensor `name` indexed by `index` (slices, one per leading dimension);
        `touch` is how many bytes of the file that reaches.  Every read goes
        through here."""
        if self._aligned(name):
            shape = self.shape(name)
            if not shape:
                return self._rows(name, None, None)
            rows = index[0] if index else slice(0, shape[0])
            block = self._rows(name, rows.start, rows.stop)
            return block[(slice(None),) + index[1:]] if len(index) > 1 else block
        return self._mapping(self.file_of(name), touch).get(name, index)

    def _aligned(self, name: str) -> bool:
        """Whether safetensors tensor `name` starts at a multiple of its
        dtype's size (then its rows map as tensors; safetensors writes
        them so)."""
        return name in self._offsets and self._offsets[name] % self.dtype(name).itemsize == 0

    def _rows(self, name: str, start, stop) -> torch.Tensor:
        """Rows [start, stop) of safetensors tensor `name`, mapped (None, None:
        a 0-d tensor)."""
        shape, dtype, file = self._meta[name]
        if start is None:
            return mapped.map_range(file, self._offsets[name], dtype.itemsize, dtype, shape)
        row = self.nbytes(name) // max(shape[0], 1)
        if row == 0 or stop == start:
            return torch.empty((stop - start,) + shape[1:], dtype=dtype)
        return mapped.map_range(file, self._offsets[name] + start * row, (stop - start) * row, dtype,
                                (stop - start,) + shape[1:])

    def mapped_rows(self, name: str, start: int, n: int) -> torch.Tensor | None:
        """Rows [start, start + n) of tensor `name` as a writable tensor over
        the file's own bytes (copy-on-write: writes never reach the file; see
        mapped.py), or None where the file cannot be aliased (a .bin, an
        empty or 0-d tensor, data not aligned to its dtype)."""
        shape = self.shape(name)
        if not self._aligned(name) or not shape or n <= 0 or math.prod(shape[1:]) == 0:
            return None
        return self._rows(name, start, start + n)

    def read_into(self, name: str, out: torch.Tensor, dim: int | None = None,
                  ranges=None) -> None:
        """Copy tensor `name` into `out`, converting to out's dtype: the whole
        tensor when dim is None, else its index ranges ((start, n), ...) of
        dimension `dim` back to back (out's dim has their total length)."""
        shape = self.shape(name)
        if dim is None:
            dim, ranges = 0, ((0, shape[0]),) if shape else None
        if not shape:                                   # a 0-d tensor
            out.copy_(self._view(name, (), self.nbytes(name)))
            return
        row = self.nbytes(name) // max(shape[0], 1)     # bytes of one index of dim 0
        rows_per_block = max(1, self.block_budget // max(row, 1))
        pos = 0
        for start, n in ranges:
            if dim == 0:
                for s in range(start, start + n, rows_per_block):
                    k = min(rows_per_block, start + n - s)
                    out.narrow(0, pos + s - start, k).copy_(self._view(name, (slice(s, s + k),), k * row))
            else:
                lead = (slice(None),) * (dim - 1) + (slice(start, start + n),)
                for s in range(0, shape[0], rows_per_block):
                    k = min(rows_per_block, shape[0] - s)
                    piece = self._view(name, (slice(s, s + k),) + lead, k * row)
                    out.narrow(dim, pos, n).narrow(0, s, k).copy_(piece)
            pos += n

    def read_shard(self, name: str, dim: int, shard, dtype: torch.dtype | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """One rank's shard of tensor `name` along `dim`: the DimShard's ranges
        back to back, then zero padding up to shard.length, in `dtype` (the
        checkpoint's when None); written into `out` when given."""
        if out is None:
            shape = list(self.shape(name))
            shape[dim] = shard.length
            out = torch.empty(shape, dtype=dtype or self.dtype(name))
        self.read_into(name, out.narrow(dim, 0, shard.real), dim, shard.ranges)
        if shard.length > shard.real:
            out.narrow(dim, shard.real, shard.length - shard.real).zero_()
        return out

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor `name` (a new tensor)."""
        out = torch.empty(self.shape(name), dtype=dtype or self.dtype(name))
        self.read_into(name, out)
        return out

    def close(self) -> None:
        """Unmap the open file, if any."""
        self._open = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"CheckpointReader({self.path!r}: {self.kind}, {len(self.files)} file(s), {len(self._meta)} tensors)"
