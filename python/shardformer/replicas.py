"""Every rank of a tensor-parallel group must shard the same model.

optimize() cuts each rank's shard out of that rank's own copy of the full
model, so ranks built from different seeds (or different checkpoints, or
different configs) would silently assemble a model that is none of them.
Before anything changes, the ranks compare:

    structure   the names, shapes and dtypes of every parameter and buffer
                (one 64-bit fingerprint of the list, all-gathered)
    content     a 64-bit fingerprint of every tensor's bytes (C, 14 GB/s
                on one core here, GIL released), all-gathered as one
                [ranks, tensors] int64 table

and raise, naming the first tensors that differ and the ranks that hold
other values.  With ShardConfig(extra_kwargs={"broadcast_weights": True})
rank 0's parameters and buffers are broadcast to the group first instead,
so the other ranks may build theirs from any seed (or skip loading the
checkpoint's weights); the structure must still agree.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from . import lazy
from .distributed import collectives
from .hashes import signed, tensor_hash


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen, out = set(), []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint of a tensor's values (any device, any layout)."""
    if lazy.is_lazy(t):
        return lazy.recipe_fingerprint(t)   # how it will be built: seeds and recorded values
    return tensor_hash(t)                   # (meta: 0, no values yet; the structure check covers it)


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: list[int], group) -> torch.Tensor:
    """[ranks, len(values)] int64 table of every rank's values."""
    local = torch.tensor(values, dtype=torch.int64, device=_comm_device(group))
    out = local.new_empty((dist.get_world_size(group) * local.numel(),))
    collectives.all_gather_into_tensor(out, local, group)
    return out.view(dist.get_world_size(group), local.numel()).cpu()


def _differing_ranks(column: torch.Tensor) -> list[int]:
    return [r for r in range(column.numel()) if column[r] != column[0]]


def check_same_model(model: nn.Module, group, model_name: str, content: bool = True,
                     what: str = "tensor-parallel") -> None:
    """Raise ValueError unless every rank of `group` (the `what` group, for
    messages) holds the same model (collective; no-op for one rank or without
    torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    tensors = _tensors(model)
    layout = "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors).encode()
    structure = int.from_bytes(hashlib.blake2b(layout, digest_size=8).digest(), "little")
    table = all_gather_ints([signed(structure), len(tensors)], group)
    if _differing_ranks(table[:, 0]):
        names = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors], group=group)
        mine = names[0]
        detail = []
        for r, theirs in enumerate(names[1:], start=1):
            if theirs == mine:
                continue
            diff = [f"{a} vs {b}" for a, b in zip(mine, theirs) if a != b][:3]
            if len(theirs) != len(mine):
                diff.append(f"{len(mine)} tensors vs {len(theirs)}")
            detail.append(f"rank {r}: " + "; ".join(diff))
        raise ValueError(
            f"{model_name}: the ranks of the {what} group built different models (parameter names, "
            f"shapes or dtypes differ from rank 0's): {' | '.join(detail)}. Build the model from the same "
            f"config (and checkpoint) on every rank before optimize()")
    if not content:
        return
    table = all_gather_ints([signed(fingerprint(t)) for _, t in tensors], group)
    bad = [(name, _differing_ranks(table[:, i])) for i, (name, _) in enumerate(tensors)]
    bad = [(name, ranks) for name, ranks in bad if ranks]
    if bad:
        shown = ", ".join(f"{name} (ranks {ranks})" for name, ranks in bad[:5])
        raise ValueError(
            f"{model_name}: the ranks of the {what} group hold different weights: {len(bad)} of "
            f"{len(tensors)} tensors differ from rank 0's, e.g. {shown}. Every rank must build the model "
            f"from the same seed (torch.manual_seed before construction) or load the same checkpoint; or "
            f"pass ShardConfig(extra_kwargs={{'broadcast_weights': True}}) to use rank 0's weights everywhere")


@torch.no_grad()
def broadcast_weights(model: nn.Module, group) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's (collective)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    lazy.broadcast_recipes(model, group)
    for _, t in _tensors(model):
        if lazy.is_lazy(t) or t.device.type == "meta" or t.numel() == 0:
            continue
        buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
        # as bytes: one path for every dtype (bool and integer buffers too)
        collectives.broadcast(buf.view(-1).view(torch.uint8), 0, group)
        if buf is not t:
            t.data.copy_(buf)
