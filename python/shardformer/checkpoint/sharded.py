"""Per-rank checkpoints: save_sharded / load_sharded, for fast save and
resume at the same or another tensor-parallel size.

save_sharded(model, out_dir) writes, collectively over the model's
tensor-parallel group (the group holding global rank 0; replicas return;
the default group of ShardConfig() is the world):

  * `rank{r:05d}-of-{n:05d}.safetensors` from every rank r of the n ranks:
    that rank's model.state_dict() as it is (each sharded tensor is the
    rank's shard: its ranges of the split dimension laid back to back, then
    the zero padding up to its length), tied tensors stored once, replicated
    tensors in every file (so each rank can resume from its own file), and
    in its metadata a record of what it holds: its rank and the TP size, and
    for each tensor the stored shape, its ranges of the full tensor and the
    CRC-32 of its bytes (integrity.py);
  * `shardformer_manifest.json`, once: for every state-dict name the key it
    is stored under, the full (HF) shape, the dtype, and for a sharded
    tensor the split dimension with every rank's DimShard ranges (offset,
    length in the full dimension) and shard length: enough to rebuild any
    slice of the full tensor from the files;
  * `config.json` (HF models).

Atomic as save_pretrained (save.py): the ranks write into one temporary
sibling directory, the group agrees that every file was written (fsynced),
then the first rank writes the manifest, fsyncs and swaps the directory in.

load_sharded(model, out_dir) loads into the model as it is sharded now, at
the same or another TP size, or unsharded: each rank reads only the parts of
the saved ranks' files that overlap the full ranges its own shards need
(safetensors get_slice), preferring its own rank's file where the saved
layout replicates indices, zero-fills its padding and converts the dtype.
Every name, shape, dtype, file and stored shard is checked before anything
is copied: each file's record against the manifest (its rank and size, each
shard's place and shape), the manifest's keys and types, and the content's
CRC-32s (each rank of the loading group verifies every size-th file, so that
together they read each file once).  One ValueError lists every problem and
the model is untouched.  The loading group agrees on the outcome (one small
all-gather): where any rank found a problem every rank raises (the others a
RuntimeError naming the ranks), none is left waiting.  Same TP size and the
same layouts: each rank reads its own file only.

Every layout.  A model with pipeline stages or expert-parallel layers is
saved in the box format (boxes.py): the files come from the ranks reachable
from global rank 0 through their TP, pipeline and EP groups, each tensor's
record lists the boxes of the full tensor each file holds, and save_sharded
/ load_sharded are collective over the world.  Any checkpoint loads into any
layout (a TP-only manifest is read as boxes when the loading model has
stages or experts).  The manifest's `mesh` records the saving layout: tp,
pp, dp, ep, sp sizes, the world size and the saving ranks (a manifest
without it, from before it was recorded, still loads).

A save into a directory holding a checkpoint of any format (HF or sharded)
supersedes it: its weight files, indexes and manifest are not carried over
(atomic.CHECKPOINT_FILES).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..config import concrete_group
from ..pipeline.stages import runtime_of
from . import boxes
from .atomic import fsync, put_in_place, recover_directory, save_target
from .full import group_root, shard_info, problem_report
from .integrity import file_problems, file_record, manifest_problems
from .mapped import materialize_mapped
from .save import SaveFlags, sharded_group

__all__ = ["save_sharded", "load_sharded", "MANIFEST"]

MANIFEST = "shardformer_manifest.json"
FORMAT = "shardformer-sharded"
VERSION = 1


def _rank_file(rank: int, n: int) -> str:
    return f"rank{rank:05d}-of-{n:05d}.safetensors"


def _temp_name(directory: str, token: int) -> str:
    """The temporary sibling every rank writes into (save.py's naming, so a
    later save removes it if this one is killed)."""
    return os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}.partial-s{token:x}")


def _entries(model: nn.Module):
    """[(names, tensor, (dim, DimShard) | None)]: the persistent tensors, each once."""
    return boxes.entries(model, {key: split[:2] for key, split in shard_info(model).items()})


def _full_shape(t: torch.Tensor, split) -> list[int]:
    shape = list(t.shape)
    if split is not None:
        shape[split[0]] = split[1].full
    return shape


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def _manifest(model: nn.Module, entries, n: int, ranks: list[int] | None) -> dict:
    tensors = {}
    for names, t, split in entries:
        rec = {"key": names[0], "shape": _full_shape(t, split), "dtype": _dtype_name(t.dtype), "split": None}
        if split is not None:
            dim, shard = split
            rec["split"] = {"dim": dim, "ranges": [[list(r) for r in rs] for rs in shard.all_ranges],
                            "lengths": list(shard.all_lengths)}
        for name in names:
            tensors[name] = rec
    return {"format": FORMAT, "version": VERSION, "model_class": type(model).__name__, "tp_size": n,
            "files": [_rank_file(r, n) for r in range(n)], "tensors": tensors,
            "mesh": boxes.mesh_record(model, ranks)}


def _general_manifest(model: nn.Module, parts: list, ranks: list[int]) -> dict:
    """The manifest of a save in the box format (boxes.py): `parts`, each file's tensors."""
    n = len(parts)
    return {"format": FORMAT, "version": VERSION, "model_class": type(model).__name__, "tp_size": n,
            "files": [_rank_file(r, n) for r in range(n)], "tensors": boxes.merge_records(parts),
            "mesh": boxes.mesh_record(model, ranks)}


def _general_part(entries) -> dict:
    """This rank's file's tensors for the manifest: key -> (names, full shape, dtype, stored shape, pieces)."""
    return {names[0]: (names, boxes.full_shape(t, splits), _dtype_name(t.dtype), list(t.shape),
                       [[list(x) for x in box] for box in boxes.local_boxes(t, splits, write=True)])
            for names, t, splits in entries}


def save_sharded(model: nn.Module, out_dir) -> None:
    """Every rank writes its own shards, the first rank the manifest (see the
    module docstring).  Collective over the model's tensor-parallel group;
    with pipeline stages or expert-parallel layers over the world (the files
    then come from the ranks boxes.writers names)."""
    name = type(model).__name__
    general = boxes.is_general(model)
    group = None if general else sharded_group(model, "save_sharded")   # the default group: the world
    directory = save_target(out_dir, f"{name}: save_sharded")
    # No tensor keeps a file of the checkpoint this save replaces mapped (mapped.py).
    materialize_mapped(model, directory)
    if group_root(group) != 0:
        return
    distributed = dist.is_initialized()
    root = not distributed or dist.get_rank() == 0
    parts = None
    if general:
        ranks = boxes.writers(model)
        writer = dist.get_rank() in ranks
        n, rank = len(ranks), ranks.index(dist.get_rank()) if writer else -1
        entries = boxes.file_entries(model)
        part = _general_part(entries) if writer else None
        gathered = [None] * dist.get_world_size() if root else None
        dist.gather_object(part, gathered, dst=0)
        parts = [gathered[r] for r in ranks] if root else None
    elif group is None:                        # not sharded: one file, from global rank 0
        n, rank, writer, ranks = 1, 0, root, [0]
        entries = _entries(model)
    else:
        n, rank, writer = dist.get_world_size(group), dist.get_rank(group), True
        ranks, entries = dist.get_process_group_ranks(concrete_group(group)), _entries(model)
    flags = SaveFlags(group)
    error, token = None, 0
    if root:
        try:
            recover_directory(directory)
            os.makedirs(os.path.dirname(directory), exist_ok=True)
            token = secrets.randbits(62) | 1
            os.mkdir(_temp_name(directory, token))
        except BaseException as e:  # noqa: BLE001 - the others must not wait forever
            error, token = e, 0
    token = flags.send(token, dtype=torch.int64)
    if error is not None:
        raise error
    if token == 0:
        raise RuntimeError(f"{name}: save_sharded: rank 0 could not create the temporary directory "
                           f"beside {directory} (see its error)")
    tmp = _temp_name(directory, token)
    if writer:
        try:
            import safetensors.torch

            tensors = {names[0]: t.detach().contiguous().cpu() for names, t, _ in entries}
            if general:
                ranges = {names[0]: None for names, _, _ in entries}
                pieces = {key: rec[4] for key, rec in part.items()}
            else:
                ranges = {names[0]: None if split is None else [list(r) for r in split[1].ranges]
                          for names, _, split in entries}
                pieces = None
            path = os.path.join(tmp, _rank_file(rank, n))
            safetensors.torch.save_file(tensors, path, metadata=file_record(rank, n, tensors, ranges, pieces))
            fsync(path)
            del tensors
        except BaseException as e:  # noqa: BLE001
            error = e
    failed = flags.reduce_max(1 if error is not None else 0)
    if root and not failed:
        try:
            path = os.path.join(tmp, MANIFEST)
            with open(path, "w", encoding="utf-8") as f:
                manifest = _general_manifest(model, parts, ranks) if general else _manifest(model, entries, n, ranks)
                json.dump(manifest, f, indent=1, sort_keys=True)
            if getattr(model, "config", None) is not None and hasattr(model.config, "save_pretrained"):
                model.config.save_pretrained(tmp)
            put_in_place(tmp, directory)
        except BaseException as e:  # noqa: BLE001
            error = e
    if root and (failed or error is not None):
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    outcome = flags.send(1 if root and error is not None else 0)
    if error is not None:
        raise error
    if failed or outcome:
        raise RuntimeError(f"{name}: save_sharded failed on another rank (see its error); "
                           f"{directory} holds what it held before")


# ---------------------------------------------------------------- load

def _read_manifest(name: str, directory: str) -> dict:
    """The parsed manifest, checked for every key and type the loader reads
    (ValueError naming the file and what is wrong)."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{name}: load_sharded: {directory} holds no {MANIFEST} (not written by "
                         f"save_sharded, or the save did not complete)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: load_sharded: {path} is damaged: not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: load_sharded: {path} is damaged: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    if isinstance(manifest, dict) and (manifest.get("format") != FORMAT or manifest.get("version") != VERSION):
        raise ValueError(f"{name}: load_sharded: {path} is not a {FORMAT} manifest of version {VERSION} "
                         f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})")
    problems = manifest_problems(manifest)
    if problems:
        raise ValueError(f"{name}: load_sharded: {path} is damaged: {'; '.join(problems)}")
    return manifest


def _same_layout(rec: dict, split, n_saved: int) -> bool:
    s = rec["split"]
    if split is None or s is None:
        return split is None and s is None
    dim, shard = split
    return (shard.tp_size == n_saved and s["dim"] == dim and list(s["lengths"]) == list(shard.all_lengths)
            and [[tuple(r) for r in rs] for rs in s["ranges"]] == [list(rs) for rs in shard.all_ranges])


def _owners(rec: dict, prefer: int):
    """For each index of the saved split dimension: (saved rank, position in
    that rank's shard), taking `prefer`'s file first where indices are
    replicated."""
    s = rec["split"]
    full = rec["shape"][s["dim"]]
    owner = np.full(full, -1, dtype=np.int64)
    pos = np.zeros(full, dtype=np.int64)
    order = [prefer] + [r for r in range(len(s["ranges"])) if r != prefer] if prefer < len(s["ranges"]) \
        else list(range(len(s["ranges"])))
    for r in order:
        p = 0
        for off, k in s["ranges"][r]:
            free = owner[off:off + k] < 0
            owner[off:off + k][free] = r
            pos[off:off + k][free] = np.arange(p, p + k)[free]
            p += k
    return owner, pos


def _runs(owner: np.ndarray, pos: np.ndarray, start: int, stop: int):
    """(saved rank, position, global start, count): consecutive indices of
    [start, stop) held back to back by one saved rank."""
    o, p = owner[start:stop], pos[start:stop]
    if len(o) == 0:
        return
    breaks = np.nonzero((o[1:] != o[:-1]) | (p[1:] != p[:-1] + 1))[0] + 1
    bounds = [0, *breaks.tolist(), len(o)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield int(o[a]), int(p[a]), start + a, b - a


class _Files:
    """The saved ranks' files, opened lazily (safetensors reads lazily too)."""

    def __init__(self, directory: str, names: list[str], stack: contextlib.ExitStack):
        self.directory, self.names, self.stack, self.open = directory, names, stack, {}

    def __getitem__(self, rank: int):
        if rank not in self.open:
            from safetensors import safe_open

            self.open[rank] = self.stack.enter_context(
                safe_open(os.path.join(self.directory, self.names[rank]), framework="pt"))
        return self.open[rank]


def _fill(t: torch.Tensor, split, rec: dict, files: _Files, prefer: int) -> None:
    """Copy this rank's part of the saved tensor `rec` into `t`."""
    key, s = rec["key"], rec["split"]     # s: the saved split (never None here)
    ndim = t.dim()
    if split is None:
        targets, mdim = [(0, 0, 0)], None
    else:
        mdim, shard = split
        targets, loc = [], 0
        for off, k in shard.ranges:
            targets.append((off, k, loc))
            loc += k
        if shard.length > loc:
            t.narrow(mdim, loc, shard.length - loc).zero_()
    sd = s["dim"]
    owner, pos = _owners(rec, prefer)
    for off, k, loc in targets:
        dst = t if mdim is None else t.narrow(mdim, loc, k)
        lo, hi = (off, off + k) if mdim == sd else (0, rec["shape"][sd])
        for rank, p, g, cnt in _runs(owner, pos, lo, hi):
            idx = [slice(None)] * ndim
            idx[sd] = slice(p, p + cnt)
            if mdim is not None and mdim != sd:
                idx[mdim] = slice(off, off + k)
            dst.narrow(sd, g - lo, cnt).copy_(files[rank].get_slice(key)[tuple(idx)])


def _check(model_name: str, directory: str, manifest: dict, entries, persistent: set[str],
           readers: tuple[int, int], general: bool = False) -> str:
    """Every problem of loading `manifest` into the model, as one text ('' if
    none).  `readers` is (size, rank) of the ranks loading: each verifies the
    content of every size-th file, so that together they read each once."""
    tensors, n = manifest["tensors"], manifest["tp_size"]
    missing = [nm for names, _, _ in entries for nm in names if nm not in tensors]
    unexpected = [nm for nm in tensors if nm not in persistent]
    wrong = []
    stored: dict[str, tuple[list[int], str]] = {}
    for names, t, split in entries:
        for nm in names:
            rec = tensors.get(nm)
            if rec is None:
                continue
            shape = boxes.full_shape(t, split) if general else _full_shape(t, split)
            if list(rec["shape"]) != shape:
                splits = (split or []) if general else [split] if split else []
                where = "".join(f" (dimension {d} split over {sh.tp_size} ranks)" for d, sh in splits)
                wrong.append(f"{nm}: saved shape {rec['shape']}, the model's full shape is {shape}{where}")
                continue
            saved = getattr(torch, rec["dtype"], None)
            if not isinstance(saved, torch.dtype) or not torch.can_cast(saved, t.dtype):
                wrong.append(f"{nm}: saved dtype {rec['dtype']} does not convert to the model's "
                             f"{_dtype_name(t.dtype)} without losing values")
                continue
            s = rec["split"]
            if rec.get("files") is not None:       # the box format: the files holding it
                local = [rec["files"][str(i)]["shape"] if str(i) in rec["files"] else None for i in range(n)]
            elif s is None:
                local = [list(rec["shape"])] * n
            else:
                local = [[L if d == s["dim"] else x for d, x in enumerate(rec["shape"])] for L in s["lengths"]]
            stored[rec["key"]] = (local, nm)
    files = []
    size, me = readers
    for r, fname in enumerate(manifest["files"]):
        path = os.path.join(directory, fname)
        if not os.path.isfile(path):
            files.append(f"{fname}: missing")
            continue
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                files += file_problems(fname, f, r, manifest, stored, verify=r % size == me)
        except Exception as e:  # noqa: BLE001 - a damaged file is one more problem to list
            files.append(f"{fname}: unreadable ({type(e).__name__}: {e})")
    return problem_report(("missing keys", missing), ("unexpected keys", unexpected),
                          ("tensors that do not fit", wrong), ("file problems", files))


def _known_keys(model: nn.Module) -> set[str]:
    """The state-dict keys a checkpoint of the model may hold: the model's, and
    for a pipeline stage the other stages' (the unsharded model's)."""
    stages = runtime_of(model)
    return set(model.state_dict().keys()) | (set(stages.plan.names) if stages is not None else set())


@torch.no_grad()
def load_sharded(model: nn.Module, out_dir) -> None:
    """Load a save_sharded checkpoint into `model` as it is sharded now (any
    TP size, or unsharded); see the module docstring."""
    name = type(model).__name__
    directory = os.path.abspath(os.fspath(out_dir))
    general = boxes.is_general(model)                  # pipeline stages or experts: collective over the world
    group = None if general else sharded_group(model, "load_sharded")   # the default group: the world
    alone = group is None and not general              # an unsharded model: each rank loads on its own
    flags = SaveFlags(group, alone=alone)
    readers = (1, 0) if alone else (dist.get_world_size(group), dist.get_rank(group))
    error = manifest = entries = None
    try:
        manifest = _read_manifest(name, directory)
        general = general or any(rec.get("files") is not None for rec in manifest["tensors"].values())
        entries = boxes.file_entries(model) if general else _entries(model)
        problems = _check(name, directory, manifest, entries, _known_keys(model), readers, general)
        if problems:
            raise ValueError(f"load_sharded({name}): {directory} (saved at TP={manifest['tp_size']}) does not "
                             f"fit the model; nothing was loaded:{problems}")
    except BaseException as e:  # noqa: BLE001 - every rank learns it: none is left waiting
        error = e
    flags.agree(error, f"load_sharded({name}) of {directory}: nothing was loaded; the checks")
    try:
        if general:
            with contextlib.ExitStack() as stack:
                files = _Files(directory, manifest["files"], stack)
                for names, t, splits in entries:
                    boxes.fill(t, splits, manifest["tensors"][names[0]], files, manifest["tp_size"])
        else:
            _copy_in(manifest, entries, directory)
    except BaseException as e:  # noqa: BLE001
        error = e
    flags.agree(error, f"load_sharded({name}) of {directory}: the model is partly loaded; reading the files")


def _copy_in(manifest: dict, entries, directory: str) -> None:
    n = manifest["tp_size"]
    own = (dist.get_rank() if dist.is_initialized() else 0) % n
    with contextlib.ExitStack() as stack:
        files = _Files(directory, manifest["files"], stack)
        for names, t, split in entries:
            rec = manifest["tensors"][names[0]]
            if split is None and rec["split"] is None:        # replicated: in every file
                t.copy_(files[own].get_tensor(rec["key"]))
            elif split is not None and _same_layout(rec, split, n):
                t.copy_(files[split[1].rank].get_tensor(rec["key"]))
            else:
                _fill(t, split, rec, files, split[1].rank if split is not None else own)
