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

from ..layout import SplitSpec
from .parallel_module import ParallelModule, ShardPlan, plan_directly, shard_of

_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """cls made a ParallelModule: a class made once per cls, named like it.
    It exists only in this table, so its instances pickle through
    _InPlaceSharded.__reduce_ex__ (as cls plus the module's state)."""
    if issubclass(cls, ParallelModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls, _InPlaceSharded), {"__module__": cls.__module__})
    return _CLASSES[cls]


def _new_sharded(native: type) -> nn.Module:
    """An empty instance of _sharded_class(native) (unpickling; the state follows)."""
    cls = _sharded_class(native)
    return cls.__new__(cls)


class _InPlaceSharded(ParallelModule):
    """The base of the classes _sharded_class makes."""

    def __reduce_ex__(self, protocol):
        native = next(c for c in type(self).__bases__ if c is not _InPlaceSharded)
        return _new_sharded, (native,), self.__getstate__()


class ShardParams:
    """Split parameters of a module in place: kwargs `params={name: (dim, spec)}`.
    The plan has one layout per parameter, named after it."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, params=None, **kwargs) -> ShardPlan:
        if not params:
            raise ValueError("ShardParams needs params={name: (dim, split spec)}")
        plan = ShardPlan(tp_size, rank)
        plan.dims = {}
        for name, (dim, spec) in params.items():
            t = getattr(module, name, None)
            if not isinstance(t, nn.Parameter):
                raise TypeError(f"ShardParams: {type(module).__name__} has no parameter '{name}'")
            if not isinstance(spec, SplitSpec) or not -t.dim() <= dim < t.dim():
                raise ValueError(f"ShardParams: '{name}' of shape {tuple(t.shape)}: bad dim {dim} / spec {spec!r}")
            dim %= t.dim()
            plan.dims[name] = dim
            plan.split(name, spec, t.shape[dim], what=f"{name}.shape[{dim}]",
                       no_replicate=f"ShardParams: '{name}' would be replicated on several ranks ({spec.describe()})")
        return plan

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              params=None, **kwargs) -> "_InPlaceShard":
        """Cut the shards now, change nothing: the sharder commits the returned
        change (an in-place change of `module`) once every replacement of the
        model has been built, and rolls it back if the optimize() fails."""
        if plan is None:   # not from the sharder
            plan = plan_directly(cls, module, process_group, params=params)
        split = {name: (dim, name) for name, dim in plan.dims.items()}
        if isinstance(module, ParallelModule):   # already sharded by an earlier plan: keep its layouts
            earlier = module.shard_plan
            plan.resolved = {**earlier.resolved, **plan.resolved}
            plan.__dict__.pop("layouts", None)
            split = {**module.split_params, **split}
        shards = {}
        for name, (dim, layout) in split.items():
            if name in plan.dims:
                old = getattr(module, name)
                shards[name] = nn.Parameter(shard_of(old, dim, plan[layout]), requires_grad=old.requires_grad)
        state = {"process_group": process_group, "shard_plan": plan, "tp_size": plan.tp_size,
                 "tp_rank": plan.rank, "split_params": split}
        return _InPlaceShard(module, _sharded_class(type(module)), shards, state)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           params=None, **kwargs):
        return cls.prepare_native_module(module, process_group, plan=plan, params=params, **kwargs).commit()


_ABSENT = object()


class _InPlaceShard:
    """A prepared in-place change of one module (new parameters, class and
    attributes), with everything it replaces remembered so that rollback()
    restores the module exactly, whether commit() completed or not."""

    def __init__(self, module: nn.Module, cls: type, params: dict, attrs: dict):
        self.module, self.cls, self.params, self.attrs = module, cls, params, attrs
        self.old_cls = type(module)
        self.old_params = {name: module._parameters[name] for name in params}
        self.old_attrs = {name: module.__dict__.get(name, _ABSENT) for name in attrs}

    def commit(self) -> nn.Module:
        module = self.module
        for name, p in self.params.items():
            setattr(module, name, p)
        module.__class__ = self.cls
        module.__dict__.update(self.attrs)
        return module

    def rollback(self) -> None:
        module = self.module
        for name, value in self.old_attrs.items():
            if value is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
        module.__class__ = self.old_cls
        module._parameters.update(self.old_params)
