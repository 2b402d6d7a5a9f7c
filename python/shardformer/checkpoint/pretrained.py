"""Load a HuggingFace checkpoint into a sharded (or plain) model, each rank
reading only its own slices.

load_pretrained(model, path): for every tensor of model.state_dict() (HF
names), find its source in the checkpoint (reader.CheckpointReader), check
everything, then copy.  A sharded parameter (a ParallelModule's
`sharded_params`: dimension d cut by a DimShard) has the full shape of its
shard with dimension d at `shard.full`; the rank reads only the DimShard's
ranges of dimension d (for a fused QKV or [gate | up] weight, a GQA layout
with replicated KV heads, or a padded vocabulary, the ranges already say
which rows: per head, repeated, or short of the padding) and zeroes its
padding.  Replicated tensors are read whole.

Names.  A checkpoint key becomes a model key through transformers' own
conversion mapping (transformers.conversion_mapping: renamings such as
Mixtral's `block_sparse_moe.` -> `mlp.` or LayerNorm gamma/beta, the
base-model prefix added or stripped as from_pretrained does), so what HF's
save_pretrained writes loads.  Where that mapping merges several checkpoint
tensors into one model tensor (MoE experts: `experts.N.w1/w3.weight` ->
`experts.gate_up_proj` by MergeModulelist(dim=0) + Concatenate(dim=1)), the
model tensor is a stack / concatenation of the checkpoint's and each rank
still reads only its slices of each expert.  Other conversion operations
(transposes, chunks, permutations) are refused with the key and the
operation.  A checkpoint that already holds the model's own names (fused
experts) loads directly.

Tied parameters (one tensor under two names): the checkpoint may hold any of
the names.  Non-persistent buffers are not expected.  Missing / unexpected
keys that HF itself tolerates for the model (`_keys_to_ignore_on_load_*`,
old rotary inv_freq and position_ids buffers) are tolerated the same way.
dtypes convert as from_pretrained(torch_dtype=...) does: any floating point
dtype into any other (bf16 checkpoint into a float32 model and back);
float8 and integers only where torch casts them safely.
"""
from __future__ import annotations

import math
import os
import re
import types
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..layer.expert_parallel import refuse_expert_parallel
from ..pipeline.stages import runtime_of
from . import mapped
from .full import named_tensors, shard_info, problem_report
from .reader import CheckpointReader

PROGRESS_BYTES = 256 << 20  # a progress bar by default above this checkpoint size


# ------------------------------------------------------------ sources
class _Leaf:
    """One checkpoint tensor."""

    def __init__(self, reader: CheckpointReader, key: str):
        self.key, self.shape, self.dtype = key, tuple(reader.shape(key)), reader.dtype(key)

    def leaves(self):
        yield self

    def read_into(self, reader, out, dim, ranges):
        reader.read_into(self.key, out, dim, ranges)


class _Stack:
    """Checkpoint tensors stacked along a new dimension `dim` (HF's MergeModulelist)."""

    def __init__(self, parts, dim: int):
        self.parts, self.dim = tuple(parts), dim
        shapes = {p.shape for p in self.parts}
        inner = self.parts[0].shape if len(shapes) == 1 else None
        self.shape = None if inner is None else inner[:dim] + (len(self.parts),) + inner[dim:]
        self.why = None if inner is not None else f"the stacked tensors differ in shape: {sorted(shapes)}"

    def leaves(self):
        for p in self.parts:
            yield from p.leaves()

    def read_into(self, reader, out, dim, ranges):
        if dim == self.dim:                        # select whole parts
            pos = 0
            for start, n in ranges:
                for i in range(start, start + n):
                    self.parts[i].read_into(reader, out.select(self.dim, pos), None, None)
                    pos += 1
            return
        inner = None if dim is None else (dim if dim < self.dim else dim - 1)
        for i, p in enumerate(self.parts):
            p.read_into(reader, out.select(self.dim, i), inner, ranges)


class _Cat:
    """Tensors concatenated along `dim` (HF's Concatenate)."""

    def __init__(self, parts, dim: int):
        self.parts, self.dim = tuple(parts), dim
        shapes = [p.shape for p in self.parts]
        rest = {s[:dim] + s[dim + 1:] for s in shapes if s is not None}
        ok = None not in shapes and len(rest) == 1
        self.shape = (shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]) if ok else None
        self.why = None if ok else f"the concatenated tensors do not fit together: {shapes}"

    def leaves(self):
        for p in self.parts:
            yield from p.leaves()

    def read_into(self, reader, out, dim, ranges):
        offsets = [0]
        for p in self.parts:
            offsets.append(offsets[-1] + p.shape[self.dim])
        if dim != self.dim:
            for i, p in enumerate(self.parts):
                p.read_into(reader, out.narrow(self.dim, offsets[i], offsets[i + 1] - offsets[i]), dim, ranges)
            return
        pos = 0
        for start, n in ranges:                    # a range may cross from one part into the next
            while n > 0:
                i = max(j for j in range(len(self.parts)) if offsets[j] <= start)
                k = min(n, offsets[i + 1] - start)
                self.parts[i].read_into(reader, out.narrow(dim, pos, k), dim, ((start - offsets[i], k),))
                start, n, pos = start + k, n - k, pos + k


# ------------------------------------------------------------ names
_MAPPINGS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _hf_mapping(model: nn.Module):
    """(renamings, converters, rename_source_key) of transformers' conversion
    mapping for this model, or None (not a transformers model).  Kept per
    model object: building it compiles hundreds of patterns (0.2 s), and
    ShardFormer.from_pretrained plans the same model twice (lazy, then sharded)."""
    if model in _MAPPINGS:
        return _MAPPINGS[model]
    _MAPPINGS[model] = mapping = _build_hf_mapping(model)
    return mapping


def _build_hf_mapping(model: nn.Module):
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return renamings, converters, rename_source_key


@dataclass
class _Sources:
    nodes: dict          # model key -> source (_Leaf / _Stack / _Cat)
    origin: dict         # model key -> the checkpoint key(s) it comes from (for messages)
    unexpected: dict     # model-side name -> checkpoint key, for keys that name no model tensor
    problems: list       # keys whose conversion cannot be read in slices


def _map_keys(model: nn.Module, reader: CheckpointReader, model_keys) -> _Sources:
    """Which checkpoint tensor(s) each model key comes from.  A checkpoint
    whose every key already names a model tensor (what this transformers'
    save_pretrained writes for most models) is read as is, without building
    transformers' conversion mapping (hundreds of patterns, compiled once
    per process: ~30 ms)."""
    meta = dict.fromkeys(model_keys, True)
    mapping = None if all(key in meta for key in reader.keys()) else _hf_mapping(model)
    prefix = getattr(model, "base_model_prefix", None) or None
    direct: dict[str, list[str]] = {}
    merged: dict[str, tuple[object, dict[str, list[tuple[int | None, str]]]]] = {}
    for key in reader.keys():
        target, pattern = key, None
        if mapping is not None:
            renamings, converters, rename = mapping
            target, pattern = rename(key, renamings, converters, prefix, meta)
        if pattern is None:
            direct.setdefault(target, []).append(key)
            continue
        conv = next(c for c in mapping[1] if pattern in c.source_patterns)
        renamed, _ = rename(key, mapping[0], [], None, None)
        m = re.search(re.escape(pattern.lstrip("^").rstrip("$")).replace(r"\*", r"(\d+)"), renamed)
        index = int(m.group(1)) if m and m.groups() else None
        merged.setdefault(target, (conv, {}))[1].setdefault(pattern, []).append((index, key))
    nodes, origin, unexpected, problems = {}, {}, {}, []
    for target, keys in direct.items():
        if len(keys) > 1:
            problems.append(f"{target}: held by several checkpoint keys ({', '.join(keys)})")
        nodes[target], origin[target] = _Leaf(reader, keys[0]), keys[0]
    for target, (conv, by_pattern) in merged.items():
        keys = [k for items in by_pattern.values() for _, k in items]
        origin[target] = f"{keys[0]} ... ({len(keys)} checkpoint tensors)" if len(keys) > 1 else keys[0]
        if target in nodes:
            problems.append(f"{target}: held both as is and as {origin[target]}")
            continue
        node, why = _converted(reader, conv, by_pattern)
        if why:
            problems.append(f"{target} (from {origin[target]}): {why}")
        else:
            nodes[target] = node
    for target in list(nodes):
        if target not in meta:
            unexpected[target] = origin.pop(target)
            del nodes[target]
    return _Sources(nodes, origin, unexpected, problems)


def _converted(reader, conv, by_pattern):
    """(source, None) for a model tensor HF builds from several checkpoint
    tensors, or (None, why not)."""
    state = {}
    for pattern, items in by_pattern.items():
        indices = [i for i, _ in items]
        if None not in indices and sorted(indices) != list(range(len(items))):
            return None, f"{pattern}: the checkpoint holds indices {sorted(indices)}, expected 0..{len(items) - 1}"
        items = sorted(items, key=lambda it: (it[0], "") if it[0] is not None else (-1, it[1]))
        state[pattern] = [_Leaf(reader, k) for _, k in items]
    for op in conv.operations:
        kind = type(op).__name__
        if kind == "MergeModulelist":
            state = {p: _Stack(v, op.dim) if isinstance(v, list) else v for p, v in state.items()}
        elif kind == "Concatenate":
            parts = [state[p] for p in conv.source_patterns if p in state]
            if any(isinstance(p, list) and len(p) != 1 for p in parts):
                return None, "Concatenate of lists: not a layout this loader reads"
            state = {"": _Cat([p[0] if isinstance(p, list) else p for p in parts], op.dim)}
        else:
            return None, (f"transformers converts it with {kind}, which load_pretrained cannot read in slices "
                          f"(it reads MergeModulelist / Concatenate only)")
    if len(state) != 1:
        return None, f"the conversion leaves {len(state)} tensors, expected one"
    (node,) = state.values()
    if isinstance(node, list):
        if len(node) != 1:
            return None, f"{len(node)} checkpoint tensors and no operation merging them"
        node = node[0]
    why = getattr(node, "why", None)
    return (None, why) if why else (node, None)


def _tolerated(model: nn.Module, missing: set, unexpected: set) -> tuple[set, set]:
    """Drop the missing / unexpected keys that HF's from_pretrained tolerates for this model."""
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is None:
        return missing, unexpected
    info = types.SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
    adjust(info)
    return info.missing_keys, info.unexpected_keys


# ------------------------------------------------------------ checks
def _converts(src: torch.dtype, dst: torch.dtype) -> bool:
    """A checkpoint dtype loads into a model dtype as from_pretrained(torch_dtype=...) casts."""
    if src == dst:
        return True
    fp8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
    if src in fp8 or dst in fp8:
        return False       # scaled formats: a plain cast would load wrong values
    if src.is_floating_point and dst.is_floating_point:
        return True
    return torch.can_cast(src, dst)


@dataclass
class _Item:
    """One model tensor (under all its names) and where its values come from."""
    names: list
    tensor: torch.Tensor
    split: tuple | None       # (dim, DimShard) of a sharded parameter
    source: object
    key: str                  # the model key the source was found under


def _fit(item: _Item, origin: str) -> str | None:
    """Why item's source cannot fill item's tensor (None: it can)."""
    t, name = item.tensor, item.key
    expected = list(t.shape)
    if item.split is not None:
        expected[item.split[0]] = item.split[1].full
    if list(item.source.shape) != expected:
        where = (f" (dimension {item.split[0]} is split over {item.split[1].tp_size} ranks)"
                 if item.split is not None else "")
        return f"{name}: checkpoint shape {list(item.source.shape)} ({origin}), model expects {expected}{where}"
    bad = sorted({str(leaf.dtype) for leaf in item.source.leaves() if not _converts(leaf.dtype, t.dtype)})
    if bad:
        return f"{name}: checkpoint dtype {', '.join(bad)} does not convert to the model's {t.dtype}"
    if t.device.type == "meta":
        return f"{name}: the model tensor has no storage (meta device): materialize the model first"
    return None


def _pipeline_aliases(model: nn.Module) -> dict[str, list[str]]:
    """{name: the other names of its tied set} across pipeline stages ({} without a pipeline)."""
    stages = runtime_of(model)
    if stages is None:
        return {}
    out = {}
    for names in stages.plan.shared:
        for name in names:
            out[name] = [n for n in names if n != name]
    return out


def plan_load(model: nn.Module, reader: CheckpointReader, strict: bool = True) -> list[_Item]:
    """Match and check every model tensor against the checkpoint; the list of
    tensors to fill.  Raises one ValueError listing every problem (missing,
    unexpected, wrong shape or dtype, unreadable conversion), touching nothing."""
    refuse_expert_parallel(model, "loading a HF checkpoint's slices (load_pretrained)")
    info = shard_info(model)
    persistent = list(model.state_dict().keys())
    wanted = set(persistent)
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in named_tensors(model):
        if name in wanted and t is not None:
            groups.setdefault(id(t), ([], t))[0].append(name)
    # A pipeline stage holding one side of a tied pair (an LM head tied to the input
    # embedding on another stage) reads it from whichever name the checkpoint stores.
    aliases = _pipeline_aliases(model)
    for names, _ in groups.values():
        names.extend(a for n in list(names) for a in aliases.get(n, ()) if a not in names)
    others = list(dict.fromkeys(a for alias in aliases.values() for a in alias if a not in wanted))
    sources = _map_keys(model, reader, persistent + others)
    items, missing, wrong = [], set(), list(sources.problems)
    for names, t in groups.values():
        found = [n for n in names if n in sources.nodes]
        if not found:
            missing.update(names)
            continue
        split = info[id(t)][:2] if id(t) in info else None
        item = _Item(names, t, split, sources.nodes[found[0]], found[0])
        problem = _fit(item, sources.origin[found[0]])
        for other in found[1:]:           # a tied tensor stored under several names
            problem = problem or _fit(_Item(names, t, split, sources.nodes[other], other), sources.origin[other])
        if problem:
            wrong.append(problem)
        else:
            items.append(item)
    unexpected = set(sources.unexpected) | set(reader.non_tensors)
    missing, unexpected = _tolerated(model, missing, unexpected)
    # A tied group is missing only if none of its names is tolerated.
    miss, unexp = [], []
    if strict:
        missing_groups = [names for names, _ in groups.values() if set(names) <= missing]
        miss = sorted(n for names in missing_groups for n in names)
        unexp = sorted(f"{sources.unexpected[n]} (read as {n})" if n in sources.unexpected and
                       sources.unexpected[n] != n else n for n in unexpected)
    problems = problem_report(("missing keys", miss), ("unexpected keys", unexp), ("tensors that do not fit", wrong))
    if problems:
        raise ValueError(f"load_pretrained({type(model).__name__}): the checkpoint {reader.path} does not fit "
                         f"the model; nothing was loaded:{problems}")
    order = {f: i for i, f in enumerate(reader.files)}
    keys = {k: i for i, k in enumerate(reader.keys())}
    first = lambda it: next(iter(it.source.leaves())).key  # noqa: E731
    return sorted(items, key=lambda it: (order[reader.file_of(first(it))], keys[first(it)]))


# ------------------------------------------------------------ filling
def _block(item: _Item) -> tuple[str, int, int, int] | None:
    """(checkpoint key, dim, first index, count) when item's tensor is one
    contiguous range [first, first + count) of one dimension of one
    checkpoint tensor, in the model's dtype, on the CPU: the whole tensor
    (replicated: dim 0, all of it), or a shard whose ranges are back to back
    with no padding.  Such a tensor is a view of the file's bytes: for a
    row-major tensor of shape (d0, ..., dn), element (i0, ..., in) sits at
    byte itemsize * sum_k i_k * stride_k with stride_k = prod(d_{k+1..n});
    along dim 0 the range is one byte range (a column-parallel weight's
    output rows, a vocabulary shard); along dim d > 0 it is every row's
    bytes [first * stride_d, (first + count) * stride_d), i.e.
    mapping.narrow(d, first, count) (a row-parallel weight's input columns:
    strides (in, 1) for an (out, in / tp) shard, which BLAS reads in place
    with leading dimension `in`).  None for anything else (padding, a dtype
    conversion, ranges with gaps, a tensor merged from several)."""
    src, t = item.source, item.tensor
    if not isinstance(src, _Leaf) or src.dtype != t.dtype or t.device.type != "cpu" or not src.shape:
        return None
    if item.split is None:
        return src.key, 0, 0, src.shape[0]
    dim, shard = item.split
    if shard.length != shard.real or not shard.ranges:
        return None
    start, n = shard.ranges[0]
    for s, k in shard.ranges[1:]:
        if s != start + n:
            return None
        n += k
    return src.key, dim, start, n


def mmap_mode(mmap, who: str):
    """load_pretrained's / from_pretrained's `mmap` checked: True, False or
    "rows"; ValueError naming the value otherwise."""
    if mmap is True or mmap is False or mmap == "rows":
        return mmap
    raise ValueError(f"{who}: mmap={mmap!r}: expected True (map row and column shards), \"rows\" (map only "
                     f"shards that are one byte range of the file; column shards copied) or False (copy every "
                     f"shard); see docs/load.md")


def alias(item: _Item, reader: CheckpointReader, columns: bool = True) -> bool:
    """Make item's tensor a copy-on-write mapping of its bytes in the file
    when it is one contiguous range of one dimension (see _block and
    mapped.py): a contiguous tensor for a range of dim 0, a strided view of
    the mapped tensor for a range of another dimension.  False (nothing
    changed) where it is not, or where it is a range of another dimension
    and `columns` is False."""
    block = _block(item)
    if block is None or (block[1] != 0 and not columns):
        return False
    key, dim, start, n = block
    if dim == 0:
        view = reader.mapped_rows(key, start, n)
    else:
        whole = reader.mapped_rows(key, 0, reader.shape(key)[0])
        view = None if whole is None else whole.narrow(dim, start, n)
    if view is None or view.shape != item.tensor.shape:
        return False
    item.tensor.data = view
    mapped.register(item.tensor, reader.file_of(key))
    return True


def _copy_all(items: list, reader: CheckpointReader, done) -> None:
    """fill() every item, several at a time where the reader allows: a
    safetensors read maps its own block and torch's copy releases the GIL,
    so torch.get_num_threads() threads copy at once, each within its share
    of the reader's map budget (together still at most map_budget)."""
    threads = min(len(items), torch.get_num_threads()) if reader.kind == "safetensors" else 1
    if threads <= 1:
        for item in items:
            fill(item, reader)
            done(item)
        return
    from concurrent.futures import ThreadPoolExecutor, as_completed

    reader.block_budget = max(1, reader.map_budget // threads)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="load_pretrained") as pool:
            futures = {pool.submit(torch.no_grad()(fill), item, reader): item for item in items}
            for f in as_completed(futures):
                f.result()
                done(futures[f])
    finally:
        reader.block_budget = reader.map_budget


def fill(item: _Item, reader: CheckpointReader) -> None:
    """Copy item's values (this rank's shard of them) into its tensor."""
    t = item.tensor.detach()
    if item.split is None:
        item.source.read_into(reader, t, None, None)
        return
    dim, shard = item.split
    item.source.read_into(reader, t.narrow(dim, 0, shard.real), dim, shard.ranges)
    if shard.length > shard.real:
        t.narrow(dim, shard.real, shard.length - shard.real).zero_()


def _first_rank(model: nn.Module) -> bool:
    """Whether this process is the first rank of the model's tensor-parallel group."""
    if not dist.is_initialized():
        return True
    groups = [g for _, _, g in shard_info(model).values()]
    return dist.get_rank(groups[0] if groups else None) == 0


def _bar(model, reader, items, progress):
    show = progress if progress is not None else reader.total_bytes > PROGRESS_BYTES
    if not show or not _first_rank(model):
        return None
    from tqdm.auto import tqdm

    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for it in items for leaf in it.source.leaves())
    # progress=True shows it even where TQDM_DISABLE (read when tqdm is imported) turns bars off
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=False if progress else None,
                desc=f"load_pretrained {os.path.basename(os.path.normpath(reader.path))}")


@torch.no_grad()
def load_pretrained(model: nn.Module, path, strict: bool = True, progress: bool | None = None,
                    mmap: bool | str = False) -> nn.Module:
    """Fill `model` (sharded by optimize(), or plain) from the HF checkpoint at
    `path` (a directory, or a .safetensors / .bin / index file), reading only
    this rank's slices of each sharded tensor.

    Every key is checked first (see plan_load): on any problem one ValueError
    lists them all and the model is untouched.  strict=False ignores missing
    and unexpected keys (the tensors that are present still must fit).
    progress: a tqdm bar on the first rank of the model's group; None shows
    it for checkpoints over 256 MiB.  Not collective: each rank reads alone.

    mmap=True: a tensor whose values are one contiguous range of one
    dimension of a safetensors tensor in the model's dtype (a replicated
    tensor, a row shard, a column shard without padding) is not copied: its
    `.data` becomes a copy-on-write mapping of those bytes, a strided view
    for a column shard (mapped.py: writes never reach the file; the file
    must not be rewritten in place while mapped, materialize_mapped()
    first).  mmap="rows": only the shards that are one byte range of the
    file (not the column views, whose resident pages are the whole tensor's:
    a smaller peak per rank, compact copies for training).  Only for
    a model nothing else holds views of (ShardFormer.from_pretrained passes
    it).  The other tensors are copied, several at a time.
    Returns the model."""
    mmap = mmap_mode(mmap, f"load_pretrained({type(model).__name__})")
    with CheckpointReader(path) as reader:
        items = plan_load(model, reader, strict=strict)
        bar = _bar(model, reader, items, progress)

        def done(item):
            if bar is not None:
                bar.update(sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in item.source.leaves()))
        try:
            copies = []
            for item in items:
                if mmap and alias(item, reader, columns=mmap is True):
                    done(item)
                else:
                    copies.append(item)
            _copy_all(copies, reader, done)
        finally:
            if bar is not None:
                bar.close()
    return model
