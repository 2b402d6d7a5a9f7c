"""Full (HuggingFace-shaped) state dicts of sharded models.

gather_full_state_dict(model): every rank of the group gets the unsharded
tensors, padding stripped, under the HuggingFace names; the result loads into
the unsharded model with load_state_dict.

load_full_state_dict(model, state_dict): cut this rank's shards out of full
tensors, so a checkpoint saved at one TP size loads at any other.
"""
from __future__ import annotations

import torch
from torch import nn

from .distributed.mappings import _gather_dim
from .layer.parallel_module import ParallelModule, shard_of


def _shard_info(model: nn.Module) -> dict[int, tuple[int, object, object]]:
    """id(parameter) -> (dim, DimShard, process_group) for every sharded parameter."""
    info = {}
    for module in model.modules():
        if isinstance(module, ParallelModule):
            for name, (dim, shard) in module.sharded_params.items():
                t = getattr(module, name, None)
                if t is not None:
                    info[id(t)] = (dim, shard, module.process_group)
    return info


def _named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


@torch.no_grad()
def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded state dict (collective: every rank of each group must call it)."""
    info = _shard_info(model)
    persistent = set(model.state_dict().keys())
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for name, t in _named_tensors(model):
        if name not in persistent:
            continue
        if id(t) in info:
            if id(t) not in gathered:
                dim, shard, group = info[id(t)]
                gathered[id(t)] = _gather_dim(t.detach(), dim, shard, group).clone()
            out[name] = gathered[id(t)]
        else:
            out[name] = t.detach().clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full tensors into a sharded model, each rank cutting its shard."""
    info = _shard_info(model)
    missing = []
    for name, t in _named_tensors(model):
        if name not in state_dict:
            missing.append(name)
            continue
        full = state_dict[name]
        if id(t) in info:
            dim, shard, _ = info[id(t)]
            if full.shape[dim] != shard.full:
                raise ValueError(f"load_full_state_dict: {name} has {full.shape[dim]} rows along dim {dim} "
                                 f"but the model expects {shard.full}")
            piece = shard_of(full.to(t.dtype), dim, shard)
            t.copy_(piece)
        else:
            if full.shape != t.shape:
                raise ValueError(f"load_full_state_dict: {name} has shape {tuple(full.shape)}, "
                                 f"model expects {tuple(t.shape)}")
            t.copy_(full)
    if strict and missing:
        persistent = set(model.state_dict().keys())
        missing = [m for m in missing if m in persistent]
        if missing:
            raise KeyError(f"load_full_state_dict: missing keys {missing[:10]}{'...' if len(missing) > 10 else ''}")
