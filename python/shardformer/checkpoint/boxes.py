"""save_sharded / load_sharded for every layout: pieces of the full tensors as boxes.

A sharded tensor's piece is a box of the full (HuggingFace) tensor: offsets
and sizes per dimension, stored at offsets `at` of a rank file's tensor.
For a tensor split along dimensions d_1, d_2, ... (an expert-parallel
layer's experts along dim 0 over EP, its features over TP; one dimension
for TP; none for a whole tensor) a rank's pieces are the products of each
dimension's ranges (checkpoint/dcp.py: the same pieces DCP writes), so any
layout is a list of boxes per file:

    record["files"] = {file index: {"shape": stored shape,
                                    "pieces": [[offsets], [sizes], [at]], ...]}}

The pieces of all files tile the full tensor exactly once: each file lists
the pieces it writes first (a KV head replicated over TP ranks, a tensor
replicated over data-parallel, expert-data-parallel or pipeline replicas is
listed by the first file holding it), although every file stores its
rank's whole local tensor.

Loading reads, for each box this rank holds, the intersections with the
saved boxes: box [o, o + s) and [o', o' + s') overlap in [max(o, o'),
min(o + s, o' + s')) along each dimension, read from the stored tensor at
at + (max(o, o') - o) and written into the local tensor at the target
piece's position plus (max(o, o') - o').  A manifest of the TP-only format
(one split dimension, ranges per rank: integrity.py) is read as the same
boxes, so old checkpoints load into every layout too.

The saving group.  For a model with pipeline stages or expert-parallel
layers the files come from the ranks reachable from global rank 0 through
their TP, pipeline and EP groups (every distinct shard once; data-parallel
replicas outside it return), and save_sharded / load_sharded are then
collective over the world.  The manifest's `mesh` records the sizes (tp,
pp, dp, ep, sp) and the saving ranks.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from ..config import concrete_group
from ..layer.expert_parallel import expert_shards
from ..parallel_mesh import MESHES
from ..pipeline.stages import runtime_of
from .dcp import first_held, unsharded_shape, held_pieces, placements_of
from .full import named_tensors
from .save import sharded_group


def is_general(model: nn.Module) -> bool:
    """Whether the model has pipeline stages or expert-parallel layers (the box format's layouts)."""
    stages = runtime_of(model)
    return (stages is not None and stages.manager.num_stages > 1) or bool(expert_shards(model))


def _members(group) -> list[int]:
    if group is None or not dist.is_initialized():
        return list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(concrete_group(group))


def model_groups(model: nn.Module) -> dict:
    """{"tp": group, "pp": group, "ep": group} of the model on this rank (None where it has none;
    a missing TP group when nothing is split over TP)."""
    stages = runtime_of(model)
    experts = list(expert_shards(model).values())
    pp = stages.manager.group if stages is not None and stages.manager.num_stages > 1 else None
    tp = sharded_group(model, "save_sharded")
    if tp is None and stages is not None:
        tp = stages.tp_group
    return {"tp": tp, "pp": pp, "ep": experts[0][1] if experts else None}


def writers(model: nn.Module) -> list[int]:
    """The global ranks that write files (collective over the world): the
    closure of {0} under the ranks' TP, pipeline and EP groups."""
    mine = [_members(g) for g in model_groups(model).values() if g is not None]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    reach, todo = {0}, [0]
    while todo:
        r = todo.pop()
        for ranks in every[r]:
            for q in ranks:
                if q not in reach:
                    reach.add(q)
                    todo.append(q)
    return sorted(reach)


def mesh_record(model: nn.Module, ranks: list[int] | None) -> dict:
    """The layout the model is sharded in: the sizes tp, pp, dp, ep, sp (from
    the shardformer.mesh() whose groups the model uses, when there is one;
    else dp = world / (tp * pp), sp = 1) and the saving ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = model_groups(model)
    sizes = {dim: len(_members(g)) if g is not None else 1 for dim, g in groups.items()}
    rec = {"tp": sizes["tp"], "pp": sizes["pp"], "ep": sizes["ep"], "dp": world // (sizes["tp"] * sizes["pp"]),
           "sp": 1, "world": world}
    if dist.is_initialized():
        for _, m in MESHES.values():
            if _members(m.tp) == _members(groups["tp"]) and m.sizes["pp"] == sizes["pp"] and \
                    (groups["ep"] is None or m.ep_size == sizes["ep"]):
                rec.update(dp=m.sizes["dp"], sp=m.sizes["sp"])
                break
    rec["ranks"] = list(ranks) if ranks is not None else list(range(rec["tp"]))
    return rec


def local_boxes(t: torch.Tensor, splits, write: bool) -> list[tuple[list, list, list]]:
    """This rank's pieces of the tensor `t` as ([offsets], [sizes], [at]):
    all of them (write=False, what it loads) or those it writes first."""
    if not splits:
        return [([0] * t.dim(), list(t.shape), [0] * t.dim())]
    which = first_held if write else held_pieces
    out = []
    for combo in itertools.product(*(which(shard) for _, shard in splits)):
        offsets, sizes, at = [0] * t.dim(), list(t.shape), [0] * t.dim()
        for (dim, _), (off, n, pos) in zip(splits, combo):
            offsets[dim], sizes[dim], at[dim] = off, n, pos
        out.append((offsets, sizes, at))
    return out


def entries(model: nn.Module, splits: dict) -> list:
    """[(names, tensor, splits[id(tensor)] or None)]: the persistent tensors, each once."""
    persistent = set(model.state_dict().keys())
    out: dict[int, tuple] = {}
    for name, t in named_tensors(model):
        if name not in persistent:
            continue
        if id(t) in out:
            out[id(t)][0].append(name)
        else:
            out[id(t)] = ([name], t, splits.get(id(t)))
    return list(out.values())


def file_entries(model: nn.Module) -> list:
    """entries() with every split dimension of each tensor ([(dim, DimShard), ...])."""
    return entries(model, placements_of(model))


full_shape = unsharded_shape


def merge_records(parts: list) -> dict:
    """The manifest's tensor records from every file's {key: (names, full shape,
    dtype, stored shape, written pieces)} (parts[i]: file i's): each piece
    listed by the first file that writes it, so the pieces tile each tensor once."""
    tensors: dict[str, dict] = {}
    seen: dict[str, set] = {}
    for f, part in enumerate(parts):
        for key, (names, shape, dtype, stored, pieces) in part.items():
            rec = tensors.setdefault(key, {"key": key, "shape": shape, "dtype": dtype, "split": None, "files": {}})
            done = seen.setdefault(key, set())
            mine = []
            for p in pieces:
                box = (tuple(p[0]), tuple(p[1]))
                if box not in done:
                    done.add(box)
                    mine.append([list(x) for x in p])
            rec["files"][str(f)] = {"shape": stored, "pieces": mine}
            rec.setdefault("names", [])
            rec["names"] = sorted(set(rec["names"]) | set(names))
    out = {}
    for rec in tensors.values():
        for name in rec.pop("names"):
            out[name] = rec
    return out


def saved_boxes(rec: dict, n: int) -> list[tuple[int, list, list, list]]:
    """(file, [offsets], [sizes], [at]) of every saved piece of a manifest
    record: its "files" boxes, or a TP-only record's split read as boxes."""
    if rec.get("files") is not None:
        return [(int(f), *p) for f, v in rec["files"].items() for p in v["pieces"]]
    shape, s = rec["shape"], rec["split"]
    if s is None:
        return [(0, [0] * len(shape), list(shape), [0] * len(shape))]
    out, d = [], s["dim"]
    for r, ranges in enumerate(s["ranges"]):
        pos = 0
        for off, k in ranges:
            offsets, sizes, at = [0] * len(shape), list(shape), [0] * len(shape)
            offsets[d], sizes[d], at[d] = off, k, pos
            if k > 0:
                out.append((r, offsets, sizes, at))
            pos += k
    return out


def fill(t: torch.Tensor, splits, rec: dict, files, n: int) -> None:
    """Copy this rank's pieces of the saved tensor `rec` into `t` (padding zeroed)."""
    if splits and any(shard.length > shard.real for _, shard in splits):
        t.zero_()
    saved = saved_boxes(rec, n)
    for offsets, sizes, at in local_boxes(t, splits, write=False):
        for f, s_off, s_size, s_at in saved:
            lo = [max(a, b) for a, b in zip(offsets, s_off)]
            hi = [min(a + x, b + y) for a, x, b, y in zip(offsets, sizes, s_off, s_size)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            src = tuple(slice(sa + low - so, sa + h - so) for sa, low, h, so in zip(s_at, lo, hi, s_off))
            dst = t
            for d, (low, h, o, a) in enumerate(zip(lo, hi, offsets, at)):
                dst = dst.narrow(d, a + low - o, h - low)
            dst.copy_(files[f].get_slice(rec["key"])[src] if t.dim() else files[f].get_tensor(rec["key"]))
