"""ParallelModule: the base of every layer the sharder puts into a model.

A layer's shard is a ShardPlan: the group's size and this rank, and the
layout (DimShard) of each split dimension.  Where it comes from:

  * optimize(): the sharder decides (tp_size, rank) once, from the
    ShardConfig's group; for every replacement it calls
    `cls.plan_shard(native, tp_size, rank, **kwargs)` (Python checks that say
    what to split, as data: split specs and the lengths they cut), resolves
    the layouts in C (csrc/layout_spec.c, csrc/layout.c), and, once the whole model is planned,
    `cls.from_native_module(native, group, plan=plan, **kwargs)`.
  * a layer built directly (tests, benchmarks): `from_native_module(native,
    group, **kwargs)` or the constructor without a plan; `plan_for` is the one
    place that plans those (the group's size and rank, then plan_shard, then
    the same C resolution).

`from_native_module` is written once, here, driven by what each layer class
declares: `split_params` {parameter: (dim, layout name)} are cut out of the
native module's parameters along `dim` by the plan's layout of that name,
`whole_params` are copied whole; `native_args(module)` gives the constructor
arguments.
"""
from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace

import torch
from torch import nn

from .. import _C
from ..config import group_size_and_rank
from ..distributed.mappings import split_along
from ..lazy import is_lazy, is_uninitialized, materialize, materialize_like
from ..layout import DimShard, SplitSpec
from .state_shard import LocalShard, layout_text

__all__ = ["ParallelModule", "ShardPlan", "check_param", "group_size_and_rank", "plan_directly", "shard_of"]


class ShardPlan:
    """What the sharder hands a layer: `tp_size`, `rank`, and the layouts of
    its split dimensions by name.

    plan_shard fills `requests` {name: (spec data, full length, what,
    no_replicate)} with `split()`; the C planner (`_C.resolve_plan`) turns
    them into `resolved` {name: DimShard fields}; `plan[name]` is the DimShard.
    `no_replicate`, when given, is the message of the error raised if the
    layout would keep some indices on several ranks.
    """

    __shardformer_plan__ = True

    def __init__(self, tp_size: int, rank: int):
        self.tp_size, self.rank = int(tp_size), int(rank)
        self.requests: dict[str, tuple] = {}
        self.resolved: dict[str, tuple] | None = None

    def split(self, name: str, spec: SplitSpec, full: int, what: str = "dimension",
              no_replicate: str | None = None) -> "ShardPlan":
        if not isinstance(spec, SplitSpec):
            raise TypeError(f"{what}: expected a split spec (shardformer.layout), got {spec!r}")
        self.requests[name] = (spec.data, int(full), what, no_replicate)
        return self

    @cached_property
    def layouts(self) -> dict[str, DimShard]:
        if self.resolved is None:
            raise RuntimeError("ShardPlan: the layouts have not been resolved (_C.resolve_plan)")
        return {name: DimShard(*fields) for name, fields in self.resolved.items()}

    def __getitem__(self, name: str) -> DimShard:
        return self.layouts[name]

    def __repr__(self) -> str:
        return f"ShardPlan(tp_size={self.tp_size}, rank={self.rank}, splits={sorted(self.requests)})"


def plan_directly(target, module, process_group=None, **kwargs) -> ShardPlan:
    """The plan of `target` for `module` outside the sharder: this group's
    size and rank, `target.plan_shard`, and the C layout resolution."""
    tp_size, rank = group_size_and_rank(process_group)
    return _C.resolve_plan(target.plan_shard(module, tp_size, rank, **kwargs))


def shapes_only(**shapes) -> SimpleNamespace:
    """A stand-in module whose parameters have the given shapes (meta
    tensors), for planning a layer built from sizes rather than a module."""
    return SimpleNamespace(**{name: torch.empty(shape, device="meta") for name, shape in shapes.items()})


def shard_of(full: torch.Tensor, dim: int, shard: DimShard) -> torch.Tensor:
    """A new tensor holding this rank's shard of `full` along `dim`.

    CPU tensors are cut by the C layout kernel (strided source, no
    temporaries); other devices use torch's narrow/cat.  A lazy tensor
    (shardformer.lazy_init) is materialized whole for the cut and freed
    after it, or, marked uninitialized, allocated at the shard's size.
    """
    if is_lazy(full):                       # lazy_init(): build the full tensor now, or skip it
        shape = list(full.shape)
        shape[dim] = shard.length
        out = materialize_like(full, shape)
        if out is not None:                 # to be loaded: its values do not matter
            return out
        full = materialize(full)
    full = full.detach()
    if full.device.type != "cpu":
        return split_along(full, dim, shard).clone()
    shape = list(full.shape)
    shape[dim] = shard.length
    out = torch.empty(shape, dtype=full.dtype, device=full.device)
    _C.copy_shard(full, out, dim, shard.ranges)
    return out


class ParallelModule(nn.Module):
    """A module whose parameters are sharded over a tensor-parallel group.

    `sharded_params` maps a parameter's local name to (dim, DimShard): which
    dimension is split and how; the checkpoint helpers use it to gather full
    HuggingFace-shaped tensors and to cut shards of any TP size.
    """

    # What each layer declares (see the module doc).
    split_params: dict[str, tuple[int, str]] = {}
    whole_params: tuple[str, ...] = ()

    def __init__(self, plan: ShardPlan, process_group=None):
        super().__init__()
        self.process_group = process_group
        self.shard_plan = plan
        self.tp_size, self.tp_rank = plan.tp_size, plan.rank

    @property
    def sharded_params(self) -> dict[str, tuple[int, DimShard]]:
        return {name: (dim, self.shard_plan[layout]) for name, (dim, layout) in self.split_params.items()
                if getattr(self, name, None) is not None}

    def partial_params(self) -> dict[str, str]:
        """Local parameter name -> how it is a part of a larger tensor (for
        messages), for every parameter this rank holds only a part of."""
        return {name: layout_text(dim, shard) for name, (dim, shard) in self.sharded_params.items()
                if shard.tp_size > 1}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """nn.Module's, with each partial parameter's value a LocalShard
        (a plain tensor that torch.distributed.checkpoint refuses: see
        layer/state_shard.py)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for name, layout in self.partial_params().items():
            value = destination.get(prefix + name)
            if isinstance(value, torch.Tensor) and not isinstance(value, LocalShard):
                destination[prefix + name] = LocalShard(value, prefix + name, layout)

    @classmethod
    def plan_shard(cls, module, tp_size: int, rank: int, **kwargs) -> ShardPlan:
        """Check that `module` can be replaced this way and say what to split
        (ShardPlan.split), without changing anything and without computing
        layouts (the C planner resolves them).  The sharder calls this for
        every replacement before it applies any of them."""
        return ShardPlan(tp_size, rank)

    @classmethod
    def plan_for(cls, module, process_group=None, **kwargs) -> ShardPlan:
        """The plan of a layer built directly, outside the sharder."""
        return plan_directly(cls, module, process_group, **kwargs)

    @classmethod
    def native_args(cls, module: nn.Module) -> dict:
        """The constructor arguments that describe `module` (sizes, dtype, device)."""
        raise NotImplementedError(f"{cls.__name__} does not implement native_args")

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        """The parallel layer replacing `module`, with its shard of the
        parameters.  `plan` comes from the sharder; without it (a layer built
        directly) plan_for plans it."""
        if plan is None:
            plan = cls.plan_for(module, process_group, **kwargs)
        layer = cls(**cls.native_args(module), process_group=process_group, plan=plan, **kwargs)
        layer.load_native(module)
        return layer

    def load_native(self, module: nn.Module) -> None:
        """Copy this rank's shard of `split_params` and the `whole_params` of
        `module` into this layer, keeping each parameter's requires_grad."""
        with torch.no_grad():
            for name, (dim, layout) in self.split_params.items():
                self._load(name, getattr(module, name, None), lambda t: shard_of(t, dim, self.shard_plan[layout]))
            for name in self.whole_params:
                self._load(name, getattr(module, name, None), torch.Tensor.detach)

    def _load(self, name, src, cut) -> None:
        dst = getattr(self, name, None)
        if src is None or dst is None:
            return
        if not is_uninitialized(src):           # a lazy tensor to be loaded later has no values to copy
            dst.copy_(cut(src))
        dst.requires_grad_(src.requires_grad)


def check_param(module, name: str, ndim: int, cls_name: str) -> torch.Tensor:
    t = getattr(module, name, None)
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        got = "missing" if t is None else f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(
            f"{cls_name} needs a module with a {ndim}-D '{name}', "
            f"got {type(module).__name__} with '{name}' {got}"
        )
    return t
