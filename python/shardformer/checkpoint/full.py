"""Full (HuggingFace-shaped) checkpoints of sharded models.

gather_full_state_dict(model, rank0_only=False, offload_to_cpu=False): the
unsharded tensors, padding stripped, contiguous, under the HuggingFace names;
the result loads into the unsharded model with load_state_dict and saves with
safetensors.  Collective over each tensor-parallel group.  With rank0_only,
shards travel to the group's first rank only (torch.distributed.gather) and
the other ranks get {}: at no point does any rank other than the first hold
more than its own shards plus one full tensor's worth of receive buffers.

load_full_state_dict(model, state_dict): cut this rank's shards out of full
tensors, so a checkpoint saved at one TP size loads at any other.

save_pretrained (streamed, atomic) lives in save.py.

`model.state_dict()` on a sharded model stays what torch makes it: this
rank's shards under the HF names (use it, per rank, to resume at the same
TP size; use the functions here for anything HF-shaped).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..config import concrete_group
from ..distributed.mappings import gather_along
from ..layer.expert_parallel import expert_shards
from ..layer.parallel_module import ParallelModule, shard_of
from ..pipeline.stages import runtime_of


def shard_info(model: nn.Module) -> dict[int, tuple[int, object, object]]:
    """id(parameter) -> (dim, DimShard, process_group) for every sharded
    parameter; the default group (a layer's None) is given as the world."""
    info = {}
    for module in model.modules():
        if isinstance(module, ParallelModule):
            for name, (dim, shard) in module.sharded_params.items():
                t = getattr(module, name, None)
                if t is not None:
                    info[id(t)] = (dim, shard, concrete_group(module.process_group))
    return info


def named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def group_root(group) -> int:
    """Global rank of the first rank of `group` (None: the default group)."""
    group = concrete_group(group)
    if group is None:
        return 0
    return dist.get_global_rank(group, 0)


def _is_group_root(group) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def gather_dim_to_root(x: torch.Tensor, dim: int, shard, group, device=None) -> torch.Tensor | None:
    """The full tensor (padding stripped, contiguous) on the group's first
    rank, on `device` (default: x's); None on the others, which send their
    shard.  The receiving rank holds one buffer of all shards plus the result."""
    x = x.detach()
    tp = shard.tp_size if dist.is_initialized() else 1
    xs = x.movedim(dim, 0)
    if xs.shape[0] < shard.chunk:
        xs = torch.cat([xs, xs.new_zeros((shard.chunk - xs.shape[0],) + tuple(xs.shape[1:]))], 0)
    xs = xs.contiguous()
    if tp == 1:
        parts = [xs]
    else:
        root = _is_group_root(group)
        buf = xs.new_empty((shard.chunk * tp,) + tuple(xs.shape[1:])) if root else None
        parts = list(buf.split(shard.chunk)) if root else None
        dist.gather(xs, parts, dst=group_root(group), group=group)
        if not root:
            return None
    shape = list(x.shape)
    shape[dim] = shard.full
    out = torch.empty(shape, dtype=x.dtype, device=x.device if device is None else device)
    for r, part in enumerate(parts):
        src = part.movedim(0, dim)
        pos = 0
        for off, n in shard.all_ranges[r]:
            out.narrow(dim, off, n).copy_(src.narrow(dim, pos, n))
            pos += n
    return out


def _owned(t: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    """A contiguous tensor of our own (never a view of the model's storage)."""
    t = t.detach()
    if offload_to_cpu and t.device.type != "cpu":
        return t.to("cpu", memory_format=torch.contiguous_format)
    return t.clone(memory_format=torch.contiguous_format)


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, rank0_only: bool = False,
                           offload_to_cpu: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded, contiguous state dict under the HuggingFace names.

    Collective: every rank of the model's tensor-parallel group(s) must call
    it, with the same arguments.  rank0_only=True: the full tensors are
    gathered to each group's first rank only; every other rank returns {}.
    offload_to_cpu=True: each full tensor is moved to the CPU as soon as it
    is gathered (a CUDA model never holds more than one full tensor on the
    GPU).  Expert-parallel experts are gathered over their EP group too
    (all-gathers; with rank0_only kept on the ranks first in every group).
    Tied parameters come back as one tensor under each name, as in
    the unsharded model's state_dict().  A pipelined model's stages are
    merged (collective over the pipeline group too): every stage gets the
    whole model's tensors, or with rank0_only the pipeline group's first
    rank only."""
    stages = runtime_of(model)
    if stages is not None and stages.manager.num_stages > 1:
        mine = _gather_own(model, rank0_only, offload_to_cpu, stages.tp_group)
        return _merge_stages(model, stages, mine, rank0_only)
    return _gather_own(model, rank0_only, offload_to_cpu)


def _merge_stages(model: nn.Module, stages, mine: dict, rank0_only: bool) -> dict:
    """The stages' full tensors, merged: on every rank, or (rank0_only) on the
    pipeline group's first rank, as CPU tensors.  Stages hand their tensors
    over by torch.distributed's object collectives (the tensors travel pickled)."""
    group = stages.manager.group
    n = stages.manager.num_stages
    if rank0_only:
        parts = [None] * n if dist.get_rank(group) == 0 else None
        dist.gather_object({k: t.cpu() for k, t in mine.items()}, parts, dst=group_root(group), group=group)
        if parts is None:
            return {}
    else:
        parts = [None] * n
        dist.all_gather_object(parts, {k: t.cpu() for k, t in mine.items()}, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    if not merged:                               # rank0_only: a pipeline of ranks that keep nothing
        return {}
    missing = [k for k in stages.plan.names if k not in merged]
    if missing:
        raise RuntimeError(f"{type(model).__name__}: the pipeline stages together hold no {missing[:5]}")
    merged = {k: merged[k] for k in stages.plan.names}
    for a, *rest in stages.plan.shared:          # tied across stages (equal: the schedules sync them): one tensor
        for b in rest:
            merged[b] = merged[a]
    return merged


def _gather_own(model: nn.Module, rank0_only: bool, offload_to_cpu: bool,
                tp_group=None) -> dict[str, torch.Tensor]:
    """This rank's tensors, gathered over tensor parallelism (`tp_group`: the
    group whose first rank keeps them with rank0_only when nothing is sharded)."""
    info = shard_info(model)
    experts = expert_shards(model)
    persistent = set(model.state_dict().keys())
    groups = list({id(g): g for _, _, g in info.values()}.values()) or [tp_group]
    groups += [g for _, g in experts.values()]
    keep = not rank0_only or all(_is_group_root(g) for g in groups)
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor | None] = {}
    for name, t in named_tensors(model):
        if name not in persistent:
            continue
        if id(t) in experts:            # TP, then the experts over EP (all-gathers, kept on the roots)
            if id(t) not in gathered:
                full = t.detach()
                if id(t) in info:
                    dim, shard, group = info[id(t)]
                    full = gather_along(full, dim, shard, group)
                shard, group = experts[id(t)]
                gathered[id(t)] = _owned(gather_along(full, 0, shard, group), offload_to_cpu)
            if keep:
                out[name] = gathered[id(t)]
        elif id(t) in info:
            if id(t) not in gathered:
                dim, shard, group = info[id(t)]
                if rank0_only:                  # a new contiguous tensor already: no copy of it
                    gathered[id(t)] = gather_dim_to_root(t, dim, shard, group,
                                                          device="cpu" if offload_to_cpu else None)
                else:
                    gathered[id(t)] = _owned(gather_along(t.detach(), dim, shard, group), offload_to_cpu)
            if keep and gathered[id(t)] is not None:
                out[name] = gathered[id(t)]
        elif keep:
            if id(t) not in gathered:
                gathered[id(t)] = _owned(t, offload_to_cpu)
            out[name] = gathered[id(t)]
    return out


def expert_blocks(state_dict: Mapping, tensors: list, experts: dict) -> Mapping:
    """`state_dict` with each expert-parallel parameter's full tensor cut to
    this rank's experts along dim 0 (a new dict when any is; a tensor whose
    dim 0 is not the expert count is left for the shape check to report)."""
    cut = {}
    for name, t in tensors:
        full = state_dict.get(name) if id(t) in experts else None
        shard = experts[id(t)][0] if full is not None else None
        if isinstance(full, torch.Tensor) and full.dim() > 0 and full.shape[0] == shard.full:
            cut[name] = shard_of(full, 0, shard)
    return {**state_dict, **cut} if cut else state_dict


def _listed(label: str, items: list[str], limit: int = 20) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"\n  {label} ({len(items)}): " + "; ".join(items[:limit]) + more


def problem_report(*sections: tuple[str, list[str]]) -> str:
    """The problems of a load, one line per non-empty (label, items) section
    ("" when there are none): what the checks raise in one ValueError."""
    return "".join(_listed(label, items) for label, items in sections if items)


def check_tensor(name: str, full, t: torch.Tensor, split) -> str | None:
    """Why `full` cannot be loaded into the model's tensor `t` (None: it can).
    `split` is (dim, DimShard) for a sharded parameter: its full shape is the
    shard's with the split dimension at its full length."""
    if not isinstance(full, torch.Tensor):
        return f"{name}: not a tensor ({type(full).__name__})"
    expected = list(t.shape)
    if split is not None:
        dim, shard = split
        expected[dim] = shard.full
    if list(full.shape) != expected:
        where = f" (dimension {split[0]} is split over {split[1].tp_size} ranks)" if split is not None else ""
        return f"{name}: shape {list(full.shape)}, expected {expected}{where}"
    if full.device.type == "meta":
        return f"{name}: a meta tensor (no values)"
    if not torch.can_cast(full.dtype, t.dtype):
        return f"{name}: dtype {full.dtype} does not convert to the model's {t.dtype} without losing values"
    return None


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full (HuggingFace-shaped) tensors into a sharded model, each rank
    cutting its shard.

    Every tensor is checked before anything is copied: its whole shape (a
    sharded parameter's full shape is its shard's with the split dimension at
    full length), that it has values, and that its dtype converts to the
    model's (torch.can_cast).  strict=True also refuses missing keys (the
    model's state_dict() keys) and unexpected keys; strict=False ignores both
    but still refuses wrong tensors.  All the problems are reported in one
    ValueError, listing the keys, and the model is then left untouched.
    A pipeline stage loads its own tensors from the whole model's dict (the
    other stages' keys are not unexpected)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_full_state_dict: state_dict must be a mapping of names to tensors, "
                        f"got {type(state_dict).__name__}")
    info = shard_info(model)
    tensors = list(named_tensors(model))
    state_dict = expert_blocks(state_dict, tensors, expert_shards(model))
    known = {name for name, _ in tensors}
    loads, wrong = [], []
    for name, t in tensors:
        if name not in state_dict:
            continue
        split = info[id(t)][:2] if id(t) in info else None
        problem = check_tensor(name, state_dict[name], t, split)
        if problem is None:
            loads.append((t, state_dict[name], split))
        else:
            wrong.append(problem)
    missing = [name for name in model.state_dict() if name not in state_dict] if strict else []

    stages = runtime_of(model)                  # a pipeline stage: other stages' keys are expected
    whole = set(stages.plan.names) if stages is not None else set()
    unexpected = [name for name in state_dict if name not in known and name not in whole] if strict else []
    problems = problem_report(("missing keys", missing), ("unexpected keys", unexpected),
                              ("tensors that do not fit", wrong))
    if problems:
        raise ValueError(f"load_full_state_dict({type(model).__name__}): the state dict does not fit the "
                         f"model; nothing was loaded:{problems}")
    for t, full, split in loads:
        if split is None:
            t.copy_(full)
        else:
            dim, shard = split
            t.copy_(shard_of(full.to(t.dtype), dim, shard))
