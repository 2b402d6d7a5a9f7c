"""What save_sharded's files say about themselves, and the checks of them.

Each rank file carries, in its safetensors metadata under "shardformer", a
record of what it holds:

    {"rank": r, "tp_size": n,
     "tensors": {key: {"shape": [...],          # the stored (local) shape
                       "ranges": [[off, len], ...] | null,   # r's place in the
                       "crc32": c}}}            # full split dimension; CRC-32
                                                # of the stored bytes

The loader checks every file against the manifest (file i of the manifest
must say rank i of tp_size n, and hold each tensor at the manifest's place
for rank i, with the manifest's local shape) and the content of the files
against their CRC-32s, and names the file, the tensor and both values of
every disagreement.  The manifest itself is checked for the keys and types
the loader reads, so that a damaged one is named, not a KeyError.
"""
from __future__ import annotations

import json
import os
import zlib

import torch

RECORD = "shardformer"


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of the bytes of a contiguous CPU tensor (0 for an empty one)."""
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())


def file_record(rank: int, n: int, tensors: dict[str, torch.Tensor], ranges: dict[str, list | None],
                pieces: dict[str, list] | None = None) -> dict:
    """The safetensors metadata of rank `rank`'s file (of `n`); `pieces`: the
    box format's pieces each tensor's data are written for (boxes.py)."""
    recs = {key: {"shape": list(t.shape), "ranges": ranges[key], "crc32": crc32(t)} for key, t in tensors.items()}
    for key, p in (pieces or {}).items():
        recs[key]["pieces"] = p
    return {"format": "pt", "rank": str(rank), "tp_size": str(n),
            RECORD: json.dumps({"rank": rank, "tp_size": n, "tensors": recs}, sort_keys=True)}


# ---------------------------------------------------------------- the manifest

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x) -> bool:
    return isinstance(x, list) and all(_is_int(v) for v in x)


def manifest_problems(manifest) -> list[str]:
    """What is missing or malformed in a parsed manifest ([] if nothing)."""
    if not isinstance(manifest, dict):
        return [f"a JSON {type(manifest).__name__} instead of an object"]
    problems = []
    for key, kind in (("format", str), ("version", int), ("tp_size", int), ("files", list), ("tensors", dict)):
        if key not in manifest:
            problems.append(f"no {key!r} key")
        elif not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            problems.append(f"{key!r} is a {type(manifest[key]).__name__}, not a {kind.__name__}")
    if problems:
        return problems
    n, files = manifest["tp_size"], manifest["files"]
    if n < 1:
        problems.append(f"'tp_size' is {n}")
    if len(files) != n:
        problems.append(f"'files' names {len(files)} files for tp_size {n}")
    bad = [f for f in files if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", "..")]
    if bad:
        problems.append(f"'files' holds entries that are not file names: {bad[:3]}")
    mesh = manifest.get("mesh")           # absent in manifests written before it was recorded
    if mesh is not None and (not isinstance(mesh, dict) or not all(_is_int(mesh.get(k)) for k in
                                                                    ("tp", "pp", "dp", "ep", "sp"))
                             or not _int_list(mesh.get("ranks"))):
        problems.append(f"'mesh' malformed ({mesh!r:.80})")
    for name, rec in manifest["tensors"].items():
        why = _record_problem(rec, n)
        if why:
            problems.append(f"'tensors'[{name!r}]: {why}")
    return problems


def _record_problem(rec, n: int) -> str | None:
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not an object"
    missing = [k for k in ("key", "shape", "dtype", "split") if k not in rec]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    if not isinstance(rec["key"], str) or not isinstance(rec["dtype"], str) or not _int_list(rec["shape"]):
        return "'key', 'dtype' or 'shape' malformed"
    boxes = rec.get("files")
    if boxes is not None:
        if not isinstance(boxes, dict) or not all(
                isinstance(v, dict) and _int_list(v.get("shape")) and isinstance(v.get("pieces"), list)
                and str(f).isdigit() and int(f) < n
                and all(isinstance(p, list) and len(p) == 3 and all(_int_list(x) and len(x) == len(rec["shape"])
                                                                   for x in p) for p in v["pieces"])
                for f, v in boxes.items()):
            return f"'files' malformed ({boxes!r:.80})"
    s = rec["split"]
    if s is None:
        return None
    if not isinstance(s, dict) or not _is_int(s.get("dim")) or not 0 <= s["dim"] < len(rec["shape"]):
        return f"'split' malformed ({s!r:.80})"
    ranges, lengths = s.get("ranges"), s.get("lengths")
    if not isinstance(ranges, list) or len(ranges) != n or not _int_list(lengths) or len(lengths) != n:
        return f"'split' does not give ranges and lengths for each of the {n} ranks"
    for rs in ranges:
        if not isinstance(rs, list) or not all(_int_list(r) and len(r) == 2 and r[0] >= 0 and r[1] >= 0
                                               and r[0] + r[1] <= rec["shape"][s["dim"]] for r in rs):
            return f"'split' has a range outside [0, {rec['shape'][s['dim']]})"
    return None


# ---------------------------------------------------------------- the files

def read_record(f) -> dict | None:
    """The "shardformer" record of an open safetensors file (None when the
    file has none: written before records existed, or not by save_sharded)."""
    meta = f.metadata() or {}
    raw = meta.get(RECORD)
    if raw is None:
        if "rank" in meta and "tp_size" in meta:      # an older save_sharded file: rank and size only
            try:
                return {"rank": int(meta["rank"]), "tp_size": int(meta["tp_size"]), "tensors": None}
            except ValueError:
                return {"rank": meta["rank"], "tp_size": meta["tp_size"], "tensors": None}
        return None
    try:
        rec = json.loads(raw)
    except ValueError as e:
        return {"damaged": f"its {RECORD!r} metadata is not JSON ({e})"}
    return rec if isinstance(rec, dict) else {"damaged": f"its {RECORD!r} metadata is not an object"}


def file_problems(fname: str, f, r: int, manifest: dict, stored: dict, verify: bool) -> list[str]:
    """Disagreements of the open file `f` (manifest entry r) with the
    manifest: its rank and size, and for each stored key (`stored`: key ->
    (state-dict name, local shapes by rank)) its presence, shape, place in
    the full tensor and, with `verify`, its content's CRC-32."""
    n = manifest["tp_size"]
    rec = read_record(f)
    if rec is None:
        return [f"{fname}: not written by save_sharded (no rank record in its metadata)"]
    if "damaged" in rec:
        return [f"{fname}: {rec['damaged']}"]
    out = []
    if rec.get("rank") != r or rec.get("tp_size") != n:
        out.append(f"{fname}: holds the shards of rank {rec.get('rank')} of {rec.get('tp_size')}, the manifest "
                   f"lists it as rank {r} of {n}")
        return out                                 # every tensor would disagree: name the cause once
    keys = set(f.keys())
    records = rec.get("tensors")
    for key, (local, nm) in stored.items():
        if local[r] is None:                       # the box format: a tensor this file does not hold
            continue
        if key not in keys:
            out.append(f"{fname}: no tensor {key} (for {nm})")
            continue
        shape = list(f.get_slice(key).get_shape())
        if shape != local[r]:
            out.append(f"{fname}: {key} has shape {shape}, the manifest says {local[r]}")
            continue
        if records is None:
            continue
        trec = records.get(key)
        if not isinstance(trec, dict):
            out.append(f"{fname}: {key} is not in the file's record")
            continue
        split = manifest["tensors"][nm]["split"]
        expect = None if split is None else split["ranges"][r]
        listed = (manifest["tensors"][nm].get("files") or {}).get(str(r), {}).get("pieces", [])
        if any(p not in (trec.get("pieces") or []) for p in listed):
            out.append(f"{fname}: {key} holds the pieces {trec.get('pieces')} of the full tensor, the manifest "
                       f"says file {r} holds {listed}")
        elif trec.get("ranges") != expect:
            out.append(f"{fname}: {key} holds the full tensor's ranges {trec.get('ranges')}, the manifest "
                       f"says rank {r} holds {expect}")
        elif verify:
            got, recorded = crc32(f.get_tensor(key)), trec.get("crc32")
            if got != recorded:
                shown = f"{recorded:#010x}" if _is_int(recorded) else repr(recorded)
                out.append(f"{fname}: {key}: the content's CRC-32 is {got:#010x}, the file recorded {shown} "
                           f"when it was written (the file is damaged)")
    return out
