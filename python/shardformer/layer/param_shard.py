"""Per-head parameters held by modules that stay HuggingFace modules.

Some modules own a raw parameter with one slice per attention head and read
the head count from its shape, e.g. a relative position bias table
T [positions, heads] (Swin, BEiT) or a per-head logit scale s [heads, 1, 1]
(Swinv2).  Rank i keeps its heads' slice T[:, H_i] and its forward is the
native one: it produces the bias of its own heads only, which is what its
local attention scores need.  No collective in forward; in backward each
rank's gradient is exactly the gradient of its slice (no other rank reads it).

ShardParams keeps the module (same forward, same other parameters) and makes
it a ParallelModule so the sharded parameters carry their layout for
gradient checks and checkpoints.
"""
from __future__ import annotations

from torch import nn

from ..layout import DimShard, SplitSpec
from .parallel_module import ParallelModule, group_size_and_rank, shard_of

_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if issubclass(cls, ParallelModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls, ParallelModule), {"__module__": cls.__module__})
    return _CLASSES[cls]


class ShardParams:
    """Split parameters of a module in place: kwargs `params={name: (dim, spec)}`."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, params=None, **kwargs):
        if not params:
            raise ValueError("ShardParams needs params={name: (dim, split spec)}")
        plans = {}
        for name, (dim, spec) in params.items():
            t = getattr(module, name, None)
            if not isinstance(t, nn.Parameter):
                raise TypeError(f"ShardParams: {type(module).__name__} has no parameter '{name}'")
            if not isinstance(spec, SplitSpec) or not -t.dim() <= dim < t.dim():
                raise ValueError(f"ShardParams: '{name}' of shape {tuple(t.shape)}: bad dim {dim} / spec {spec!r}")
            dim %= t.dim()
            shard = spec.resolve(t.shape[dim], tp_size, rank, what=f"{name}.shape[{dim}]")
            if shard.replicated:
                raise ValueError(f"ShardParams: '{name}' would be replicated on several ranks ({spec.describe()})")
            plans[name] = (dim, shard)
        return plans

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan=None, params=None, **kwargs):
        tp_size, rank = group_size_and_rank(process_group)
        if plan is None:
            plan = cls.plan_shard(module, tp_size, rank, params=params)
        sharded: dict[str, tuple[int, DimShard]] = dict(getattr(module, "sharded_params", {}) or {})
        for name, (dim, shard) in plan.items():
            old = getattr(module, name)
            new = nn.Parameter(shard_of(old, dim, shard), requires_grad=old.requires_grad)
            setattr(module, name, new)
            sharded[name] = (dim, shard)
        module.__class__ = _sharded_class(type(module))
        module.process_group = process_group
        module.tp_size, module.tp_rank = tp_size, rank
        module.sharded_params = sharded
        return module
