"""save_pretrained: an ordinary HuggingFace checkpoint from a sharded model,
streamed and atomic.

Every rank of the model's tensor-parallel group calls it (optimize() binds
it over the model's own `save_pretrained` / `push_to_hub`).  The group whose
first rank is global rank 0 writes; other groups (data-parallel replicas)
return at once.  Within the writing group:

  * Streaming.  The tensors go one at a time: a sharded tensor (split along
    the dimension its layer's DimShard says) is gathered to the group's first
    rank only, which receives the full, padding-stripped tensor; replicated
    tensors are read from that rank's own copy.  Full tensors are packed
    into output files of at most `max_shard_size` bytes (a larger tensor gets
    a file of its own), and each file is written and freed before the next
    tensor is gathered: no rank holds more than its shards plus one output
    file plus the tensor being gathered (a gather needs one receive buffer of
    the tensor's size besides the result).  Output files are named as HF
    names them (`model.safetensors`, or `model-00001-of-0000N.safetensors`
    with `model.safetensors.index.json`; `pytorch_model*.bin` with
    safe_serialization=False; `variant` inserted as HF does), safetensors
    metadata {"format": "pt"}.
  * HF's names.  What HF 5.x `save_pretrained` does to a state dict is done
    here too: `_keys_to_ignore_on_save` dropped; tied tensors written once,
    under the name HF keeps (names matching a module's `_tied_weights_keys`
    are dropped, as `remove_tied_weights_from_state_dict` does, so that
    `from_pretrained` re-ties them without warnings); HF's conversion mapping
    reverted (`revert_weight_conversion`: e.g. Mixtral's fused
    `mlp.experts.gate_up_proj` [E, 2I, H] is written as the per-expert
    `block_sparse_moe.experts.{e}.w1/w3.weight` of the original format).
    Conversions run on the smallest group of tensors that reverts on its own
    (found once on shape-only meta tensors), so streaming survives them.
  * Atomic.  Everything is written into a temporary sibling directory
    `.NAME.partial-XXXX`; each file is fsynced, then the directory, and only
    then is it put in place: renamed to NAME when NAME does not exist, or
    exchanged with the existing NAME in one step (Linux renameat2 with
    RENAME_EXCHANGE) and the old one removed.  A crash or SIGKILL at any
    point leaves under NAME either the previous complete checkpoint or the
    new complete one.  Where RENAME_EXCHANGE is not available (another OS,
    a file system without it) the fallback renames the old directory aside
    to `.NAME.old-XXXX`, renames the new one to NAME and removes the old: a
    crash between those two renames leaves NAME missing for a moment, with
    the old complete checkpoint in `.NAME.old-XXXX` (and the new complete one
    in `.NAME.partial-XXXX`); the next save (or recover_directory(NAME))
    renames the old one back first.  Stale temporary
    siblings of an earlier killed save are removed by the next save.  Files
    in an existing NAME that are not this checkpoint's (a tokenizer, a
    README, sub-directories) are carried over into the new directory (hard
    links where possible); the previous checkpoint's weight files, indexes
    and manifest, of any format or variant (atomic.CHECKPOINT_FILES), are
    not: the directory holds exactly one checkpoint.  A symbolic link to a
    directory saves into the directory it points to.  One save to a given directory at a time.
  * Every rank of the group learns whether the write succeeded: a failure
    on the writing rank raises there and a RuntimeError on the others, and
    the previous checkpoint (if any) stays under the name.

A tqdm progress bar shows on the writing rank when the model is larger than
256 MB (or with progress=True).

A model class whose own `save_pretrained` is not HF's (a custom writer) is
saved the old way: its tensors are gathered to rank 0, which calls the
class's writer (still atomically).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import concrete_group
from ..layer.expert_parallel import expert_shards
from ..layer.parallel_module import ParallelModule
from ..pickling import BoundMethod
from ..pipeline.stages import runtime_of
from .atomic import fsync, make_temp, put_in_place, recover_directory, save_target  # noqa: F401
from .full import gather_dim_to_root as _gather_to_root  # one gather-to-root (tests wrap it here)
from .full import group_root, named_tensors, shard_info, gather_full_state_dict
from .mapped import materialize_mapped

__all__ = ["bind_hf_methods", "push_to_hub", "save_pretrained", "recover_directory"]

PROGRESS_BYTES = 256 * 1024 * 1024


# ---------------------------------------------------------------- arguments

def _parse_size(size, model_name: str) -> int:
    """Bytes from an int or a string such as "2GB" (10^9) or "500MiB" (2^20), as HF reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"{model_name}: save_pretrained: max_shard_size={size} must be positive")
        return size
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{model_name}: save_pretrained: max_shard_size={size!r} is not a size "
                         f"(an int of bytes, or digits and a unit: '2GB', '500MB', '1GiB')")
    return int(float(m.group(1)) * units[(m.group(2) or "").upper()])


def _add_variant(name: str, variant: str | None) -> str:
    """HF's rule: model.safetensors -> model.VARIANT.safetensors (before the last dot)."""
    if not variant:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


@dataclass(frozen=True)
class _Names:
    """The file names of one checkpoint format and variant."""

    single: str       # model.safetensors
    index: str        # model.safetensors.index.json

    def shard(self, i: int, n: int) -> str:
        stem, ext = self.single.rsplit(".", 1)
        return f"{stem}-{i:05d}-of-{n:05d}.{ext}"


def _names(safe: bool, variant: str | None) -> _Names:
    if safe:
        return _Names(_add_variant("model.safetensors", variant), _add_variant("model.safetensors.index.json", variant))
    return _Names(_add_variant("pytorch_model.bin", variant), _add_variant("pytorch_model.bin.index.json", variant))


# ---------------------------------------------------------------- what is saved

@dataclass
class _Entry:
    """One tensor of the model to save: every state-dict name it has (tied
    parameters have several), its split (dim, DimShard, group) or None."""

    names: list[str]
    tensor: torch.Tensor
    split: tuple | None
    full_shape: tuple[int, ...] = field(default=())

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.full_shape:
            n *= s
        return n * self.tensor.element_size()


def _save_entries(model: nn.Module) -> list[_Entry]:
    """The model's persistent tensors, each once, in state_dict order, minus
    `_keys_to_ignore_on_save`.  The same list on every rank of the group: it
    fixes the order of the gathers."""
    info = shard_info(model)
    persistent = set(model.state_dict().keys())
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    entries: dict[int, _Entry] = {}
    for name, t in named_tensors(model):
        if name not in persistent or name in ignore:
            continue
        if id(t) in entries:
            entries[id(t)].names.append(name)
            continue
        split = info.get(id(t))
        shape = list(t.shape)
        if split is not None:
            shape[split[0]] = split[1].full
        entries[id(t)] = _Entry([name], t, split, tuple(shape))
    return list(entries.values())


def _tied_patterns(model: nn.Module) -> list[str]:
    """The `_tied_weights_keys` of every sub-module, prefixed with its path
    (HF reads them as regular expressions)."""
    out = []
    for path, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        for key in (tied.keys() if isinstance(tied, dict) else tied):
            out.append(f"{path}.{key}" if path else key)
    return out


def _kept_names(names: list[str], patterns: list[str]) -> list[str]:
    """Which names of one tied tensor are written: the names that match a
    tied-weights pattern are dropped, in sorted order, as long as one name
    remains (HF's remove_tied_weights_from_state_dict); names tied without
    being declared are all kept (each gets its own copy in the file)."""
    if len(names) < 2:
        return list(names)
    drop, found = set(), 0
    for name in sorted(names):
        if any(re.search(p, name) for p in patterns):
            found += 1
            if found < len(names):
                drop.add(name)
    return [n for n in names if n not in drop]


def _total_parameters(model: nn.Module) -> int:
    """Parameters of the unsharded model (tied ones once), as HF's num_parameters()."""
    info = shard_info(model)
    seen, total = set(), 0
    for _, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            n = n // max(p.shape[dim], 1) * shard.full if p.shape[dim] else 0
        total += n
    return total


# ---------------------------------------------------------------- HF's conversion mapping

class _Conversion:
    """HF's `revert_weight_conversion` (model names -> checkpoint names and
    layouts), cut into the smallest groups of model names that revert on
    their own.  Found once on meta tensors: a name whose tensor comes out
    unchanged is only renamed; the others are tried one by one, then by
    layer (`...layers.3.`), then all together, and a grouping is accepted
    when its outputs are exactly those of reverting everything at once."""

    def __init__(self, model: nn.Module, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.model = model
        self.rename: dict[str, str] = {n: n for n in specs}
        self.group_of: dict[str, tuple[str, ...]] = {}
        self.revert = None
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:
            return
        metas = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in specs.items()}
        out = revert_weight_conversion(model, dict(metas))
        if out is metas or all(out.get(n) is m for n, m in metas.items()) and len(out) == len(metas):
            return
        self.revert = revert_weight_conversion
        by_id = {id(t): n for n, t in out.items()}
        rest = [n for n, m in metas.items() if id(m) not in by_id]
        for n, m in metas.items():
            if id(m) in by_id:
                self.rename[n] = by_id[id(m)]
            else:
                del self.rename[n]
        expect = {n: (tuple(t.shape), t.dtype) for n, t in out.items() if n not in set(self.rename.values())}
        for key in (lambda n: n, lambda n: (re.match(r"(.*?\.\d+\.)", n) or [n])[0], lambda n: ""):
            groups: dict[str, list[str]] = {}
            for n in rest:
                groups.setdefault(key(n), []).append(n)
            if self._covers(groups.values(), specs, expect):
                for members in groups.values():
                    for n in members:
                        self.group_of[n] = tuple(members)
                return
        raise RuntimeError(f"{type(model).__name__}: save_pretrained: HF's weight conversion of "
                           f"{len(rest)} tensors could not be reverted in groups")

    def _covers(self, groups, specs, expect) -> bool:
        got = {}
        for members in groups:
            try:
                out = self.revert(self.model, {n: torch.empty(specs[n][0], dtype=specs[n][1], device="meta")
                                               for n in members})
            except Exception:  # noqa: BLE001 - a group that does not revert alone
                return False
            for n, t in out.items():
                if n in got or expect.get(n) != (tuple(t.shape), t.dtype):
                    return False
                got[n] = True
        return got.keys() == expect.keys()

    def outputs(self, pending: dict[str, torch.Tensor], name: str):
        """(checkpoint name, tensor) pairs ready once `name` has arrived in
        `pending` (its group's members are removed from `pending`)."""
        if name in self.rename:
            yield self.rename[name], pending.pop(name)
            return
        members = self.group_of[name]
        if not all(n in pending for n in members):
            return
        out = self.revert(self.model, {n: pending.pop(n) for n in members})
        for n, t in out.items():
            yield n, t[0] if isinstance(t, list) else t


# ---------------------------------------------------------------- gather and write

def _write_file(tensors: dict[str, torch.Tensor], path: str, safe: bool, metadata: dict) -> None:
    """One output file, fsynced."""
    if safe:
        import safetensors.torch

        safetensors.torch.save_file(tensors, path, metadata=metadata)
    else:
        # torch.save writes whole storages: give views storages of their own.
        own = {k: t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
               for k, t in tensors.items()}
        torch.save(own, path)
    fsync(path)


class _Writer:
    """Packs full tensors into files of at most `limit` bytes, writing each
    as soon as the next tensor would not fit; `finish()` names them as HF
    does and writes the index."""

    def __init__(self, directory: str, limit: int, names: _Names, safe: bool, bar=None):
        self.directory, self.limit, self.names, self.safe, self.bar = directory, limit, names, safe, bar
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_size = 0

    def add(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Add the tensors that came out of one gathered tensor (several when
        HF's conversion splits it: views of one storage).  They go into one
        file: the current one if they fit, else a new one; a group larger
        than a file fills files of its own, so that no storage outlives the
        file that holds a part of it."""
        group, total = [], 0
        for name, t in tensors:
            if not t.is_contiguous():
                t = t.contiguous()
            if t.device.type != "cpu":
                t = t.cpu()
            group.append((name, t, t.numel() * t.element_size()))
            total += group[-1][2]
        self.total_size += total
        if self.pending and self.pending_bytes + total > self.limit:
            self.flush()
        for name, t, nbytes in group:
            if self.pending and self.pending_bytes + nbytes > self.limit:
                self.flush()
            self.pending[name] = t
            self.pending_bytes += nbytes
        if total > self.limit:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            tensors, nbytes = self.pending, self.pending_bytes
            self.pending, self.pending_bytes = {}, 0
            self._write(tensors, nbytes)

    def _write(self, tensors: dict, nbytes: int) -> None:
        # (torch.save names its archive after the file's stem: not a dot file)
        path = os.path.join(self.directory, f"part-{len(self.files) + 1:05d}.tmp")
        _write_file(tensors, path, self.safe, {"format": "pt"})
        self.files.append((path, list(tensors)))
        if self.bar is not None:
            self.bar.update(nbytes)

    def finish(self, total_parameters: int) -> list[str]:
        self.flush()
        if not self.files:
            self._write({}, 0)
        n = len(self.files)
        if n == 1:
            os.rename(self.files[0][0], os.path.join(self.directory, self.names.single))
            return [self.names.single]
        weight_map, written = {}, []
        for i, (path, keys) in enumerate(self.files, 1):
            final = self.names.shard(i, n)
            os.rename(path, os.path.join(self.directory, final))
            weight_map.update({k: final for k in keys})
            written.append(final)
        index = {"metadata": {"total_parameters": total_parameters, "total_size": self.total_size},
                 "weight_map": weight_map}
        path = os.path.join(self.directory, self.names.index)
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fsync(path)
        return written + [self.names.index]


# ---------------------------------------------------------------- the group's protocol

class SaveFlags:
    """Small integers broadcast from the writing rank (global rank 0) to the
    group: the others stop gathering when it fails, and learn the outcome.
    alone=True: a rank on its own (no collective, nothing to agree on)."""

    def __init__(self, group, alone: bool = False):
        self.group = group                    # None: the default group (every rank of the world)
        self.active = not alone and dist.is_initialized() and dist.get_world_size(group) > 1
        self.device = "cpu"
        if self.active and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def send(self, code: int, dtype=torch.int32) -> int:
        if not self.active:
            return code
        flag = torch.tensor([code], dtype=dtype, device=self.device)
        dist.broadcast(flag, src=group_root(self.group), group=self.group)
        return int(flag.item())

    def failed_ranks(self, failed: bool) -> list[int]:
        """The global ranks of the group where `failed` is true, on every
        rank (one small all-gather: the ranks agree on an outcome)."""
        if not self.active:
            return [dist.get_rank() if dist.is_initialized() else 0] if failed else []
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=self.device)
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(flags, flag, group=self.group)
        ranks = dist.get_process_group_ranks(concrete_group(self.group))
        return [ranks[i] for i, f in enumerate(flags) if int(f.item())]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when `error` happened on any: this rank's own
        error, or a RuntimeError naming the ranks that failed and `what`."""
        failed = self.failed_ranks(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{what}: failed on rank{'s' if len(failed) > 1 else ''} "
                               f"{', '.join(map(str, failed))} (see the error there)")

    def reduce_max(self, code: int) -> int:
        """The largest of every rank's `code`, on every rank."""
        if not self.active:
            return code
        flag = torch.tensor([code], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())


def sharded_group(model: nn.Module, what: str = "save_pretrained"):
    groups = {id(g): g for _, _, g in shard_info(model).values()}
    if len(groups) > 1:
        raise ValueError(f"{type(model).__name__}: {what}: the model is sharded over "
                         f"{len(groups)} different process groups; gather with gather_full_state_dict "
                         f"and save from one rank instead")
    return next(iter(groups.values())) if groups else None


def _check_full(model: nn.Module, state_dict: dict) -> None:
    """A state_dict handed to save_pretrained must be HF-shaped, not a shard."""
    shapes = {}
    experts = expert_shards(model)
    for module_name, module in model.named_modules():
        if isinstance(module, ParallelModule):
            for pname, (dim, shard) in module.sharded_params.items():
                t = getattr(module, pname, None)
                if t is not None:
                    full = list(t.shape)
                    full[dim] = shard.full
                    if id(t) in experts:                  # the experts dimension, split over EP
                        full[0] = experts[id(t)][0].full
                    shapes[f"{module_name}.{pname}" if module_name else pname] = (tuple(full), dim, shard)
    for name, (full, dim, shard) in shapes.items():
        if name in state_dict and tuple(state_dict[name].shape) != full:
            raise ValueError(
                f"{type(model).__name__}: save_pretrained(state_dict=...): {name} has shape "
                f"{tuple(state_dict[name].shape)}, the unsharded model's is {full} (this looks like "
                f"a rank's shard, {shard.length} of {shard.full} along dim {dim}); pass "
                f"gather_full_state_dict(model) or no state_dict")


def _custom_writer(model: nn.Module) -> bool:
    """Whether the model's class brings its own save_pretrained (not HF's)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return True
    own = getattr(type(model), "save_pretrained", None)
    return own is not PreTrainedModel.save_pretrained or getattr(model, "_hf_peft_config_loaded", False)


def _write_config(model: nn.Module, directory: str) -> None:
    """config.json (dtype and architectures set as HF sets them), the
    generation config of a generating model, remote code's files."""
    config = model.config
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    if getattr(model, "is_remote_code", None) and model.is_remote_code():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, directory, config=config)
    config.save_pretrained(directory)
    if getattr(model, "can_generate", None) and model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(directory)


class _Session:
    """The writing rank's side of one save: temporary directory, writer,
    conversion, progress bar."""

    def __init__(self, model, directory, limit, safe, variant, specs, total_bytes, progress):
        self.model, self.directory, self.variant = model, directory, variant
        self.tmp = make_temp(directory)
        self.bar = None
        if progress or (progress is None and total_bytes > PROGRESS_BYTES):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, disable=False if progress else None,
                            desc=f"save_pretrained {os.path.basename(directory)}")
        self.writer = _Writer(self.tmp, limit, _names(safe, variant), safe, self.bar)
        self.conversion = _Conversion(model, specs)
        self.pending: dict[str, torch.Tensor] = {}

    def take(self, names: list[str], full: torch.Tensor) -> None:
        for i, name in enumerate(names):
            self.pending[name] = full if i == 0 else full.clone()
            out = list(self.conversion.outputs(self.pending, name))
            if out:
                self.writer.add(out)

    def commit(self) -> None:
        if self.pending:
            raise RuntimeError(f"{type(self.model).__name__}: save_pretrained: tensors left unconverted: "
                               f"{sorted(self.pending)[:10]}")
        self.writer.finish(_total_parameters(self.model))
        _write_config(self.model, self.tmp)
        put_in_place(self.tmp, self.directory)
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def abort(self) -> None:
        self.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def save_pretrained(model: nn.Module, save_directory, max_shard_size="2GB", *, progress: bool | None = None,
                    **kwargs):
    """Write an ordinary HuggingFace checkpoint of a sharded model, streamed
    and atomic (collective over its tensor-parallel group; see the module
    docstring).  HF's keyword arguments: max_shard_size (default 2GB here),
    variant, safe_serialization=False (pytorch_model*.bin), state_dict (a
    full, HF-shaped dict, written by rank 0 as it is), is_main_process=False
    on the writing rank (nothing written), push_to_hub (with repo_id,
    commit_message, create_pr, private, token).  A pipelined model's stages
    send their tensors to global rank 0, which writes them (collective over
    the pipeline group too; not streamed: rank 0 holds the full model)."""
    name = type(model).__name__
    state_dict = kwargs.pop("state_dict", None)
    is_main = kwargs.pop("is_main_process", True)
    safe = kwargs.pop("safe_serialization", True)
    variant = kwargs.pop("variant", None)
    push = kwargs.pop("push_to_hub", False)
    for unused in ("save_peft_format", "save_original_format", "distributed_checkpoint"):
        kwargs.pop(unused, None)
    directory = save_target(save_directory, f"{name}: save_pretrained")   # before anything is gathered
    # No tensor keeps a file of the checkpoint this save replaces mapped (mapped.py).
    materialize_mapped(model, directory)

    stages = runtime_of(model)
    if state_dict is None and ((stages is not None and stages.manager.num_stages > 1) or expert_shards(model)):
        # pipeline stages, or experts split over an EP group (other ranks than the TP group's):
        # the tensors merged on global rank 0, which writes them as a given dict
        state_dict = gather_full_state_dict(model, rank0_only=True, offload_to_cpu=True)
    group = sharded_group(model)
    if state_dict is not None:
        _check_full(model, state_dict)
    if _custom_writer(model):
        return _save_with_class_writer(model, save_directory, group, state_dict, is_main,
                                       dict(kwargs, max_shard_size=max_shard_size, variant=variant,
                                            push_to_hub=push))
    limit = _parse_size(max_shard_size, name)
    if group_root(group) != 0:                # a replica: the group holding global rank 0 writes
        return None
    root = not dist.is_initialized() or dist.get_rank() == 0
    flags = SaveFlags(group)
    entries = _save_entries(model) if state_dict is None else []
    error, session, hub = None, None, None
    if root and is_main:
        try:
            if push:
                hub = _hub_start(model, directory, kwargs)
            patterns = _tied_patterns(model)
            if state_dict is None:
                items = [(_kept_names(e.names, patterns), e) for e in entries]
                specs = {n: (e.full_shape, e.tensor.dtype) for names, e in items for n in names}
                total = sum(e.nbytes for _, e in items)
            else:
                items = _dict_items(model, state_dict, patterns)
                specs = {n: (tuple(t.shape), t.dtype) for names, t in items for n in names}
                total = sum(t.numel() * t.element_size() for _, t in items)
            session = _Session(model, directory, limit, safe, variant, specs, total, progress)
        except BaseException as e:  # noqa: BLE001 - the others must not wait forever
            error = e
    if state_dict is not None and session is not None:
        try:
            for names, t in items:
                session.take(names, t.detach())
        except BaseException as e:  # noqa: BLE001
            error = e
    for i, entry in enumerate(entries):
        if entry.split is None:
            if session is not None and error is None:
                try:
                    session.take(items[i][0], entry.tensor.detach())
                except BaseException as e:  # noqa: BLE001
                    error = e
            continue
        stop = 0 if (session is not None or not root) and error is None else 1
        if flags.send(stop if root else 0):
            break
        dim, shard, g = entry.split
        full = _gather_to_root(entry.tensor, dim, shard, g, device="cpu")
        if session is not None and error is None:
            try:
                session.take(items[i][0], full)
            except BaseException as e:  # noqa: BLE001
                error = e
        del full
    if session is not None and error is None:
        try:
            session.commit()
            if hub is not None:
                _hub_finish(model, directory, hub)
        except BaseException as e:  # noqa: BLE001
            error = e
    if session is not None and error is not None:
        session.abort()
    failed = flags.send(1 if root and error is not None else 0)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{name}: save_pretrained failed on rank 0 (see its error); "
                           f"{directory} holds what it held before")
    return None


def _dict_items(model, state_dict: dict, patterns: list[str]):
    """(kept names, tensor) of a full state dict handed in: tied names are
    those sharing a tensor, `_keys_to_ignore_on_save` dropped."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    by_storage: dict[tuple, list[str]] = {}
    tensors = {}
    for n, t in state_dict.items():
        if n in ignore:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{type(model).__name__}: save_pretrained(state_dict=...): {n} is a "
                            f"{type(t).__name__}, not a tensor")
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) \
            if t.device.type != "meta" else (id(t),)
        by_storage.setdefault(key, []).append(n)
        tensors[n] = t
    return [(_kept_names(names, patterns), tensors[names[0]]) for names in by_storage.values()]


# ---------------------------------------------------------------- the Hub

def _hub_start(model, directory: str, kwargs: dict) -> dict:
    """Create the repository (named after the directory unless repo_id is
    given), as HF's save_pretrained(push_to_hub=True) does."""
    from huggingface_hub import create_repo

    hub = {"commit_message": kwargs.pop("commit_message", None), "create_pr": kwargs.pop("create_pr", False),
           "token": kwargs.get("token")}
    repo_id = kwargs.pop("repo_id", os.path.basename(directory))
    hub["repo_id"] = create_repo(repo_id, exist_ok=True, token=kwargs.get("token"),
                                 private=kwargs.get("private")).repo_id
    hub["timestamps"] = model._get_files_timestamps(directory) if os.path.isdir(directory) else {}
    return hub


def _hub_finish(model, directory: str, hub: dict) -> None:
    from transformers.utils.hub import create_and_tag_model_card

    card = create_and_tag_model_card(hub["repo_id"], getattr(model, "model_tags", None), token=hub["token"])
    card.save(os.path.join(directory, "README.md"))
    model._upload_modified_files(directory, hub["repo_id"], hub["timestamps"], commit_message=hub["commit_message"],
                                 token=hub["token"], create_pr=hub["create_pr"])


# ---------------------------------------------------------------- custom writers

def _save_with_class_writer(model, save_directory, group, state_dict, is_main, kwargs):
    """A class with its own save_pretrained: gather the full state dict to
    rank 0 and call the class's writer there, into a temporary directory put
    in place atomically (push_to_hub: in place, as HF names the repository
    after the directory)."""
    hf_save = type(model).save_pretrained
    directory = save_target(save_directory, f"{type(model).__name__}: save_pretrained")
    writes = group_root(group) == 0
    if state_dict is None and writes:
        state_dict = gather_full_state_dict(model, rank0_only=True, offload_to_cpu=True)
    root = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if root:
        try:
            if kwargs.get("push_to_hub"):
                hf_save(model, directory, state_dict=state_dict, is_main_process=is_main, **kwargs)
            else:
                tmp = make_temp(directory)
                try:
                    hf_save(model, tmp, state_dict=state_dict, is_main_process=is_main, **kwargs)
                    put_in_place(tmp, directory)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
        except BaseException as e:  # noqa: BLE001 - the others must not wait forever
            error = e
    state_dict = None
    if writes:
        failed = SaveFlags(group).send(1 if error is not None else 0)
        if error is None and failed:
            raise RuntimeError(f"{type(model).__name__}: save_pretrained failed on rank 0 "
                               f"(see its error); nothing complete was written to {directory}")
    if error is not None:
        raise error


def push_to_hub(model: nn.Module, *args, **kwargs):
    """HF's push_to_hub on a sharded model: rank 0 uploads (HF's push_to_hub
    saves through the collective save_pretrained above); every other rank
    takes part in that save only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        return type(model).push_to_hub(model, *args, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, os.path.join(tmp, "unused"))
    return None


def bind_hf_methods(model: nn.Module) -> None:
    """Make model.save_pretrained / model.push_to_hub the collective versions
    above (instance attributes: the class's methods stay as they were)."""

    if callable(getattr(type(model), "save_pretrained", None)):
        model.__dict__["save_pretrained"] = BoundMethod(save_pretrained, model)
    if callable(getattr(type(model), "push_to_hub", None)):
        model.__dict__["push_to_hub"] = BoundMethod(push_to_hub, model)
