"""Replicated parameters applied inside a tensor-parallel region.

Some small modules keep their full parameters on every rank but act on
per-rank data, e.g. Qwen3's / Gemma3's q_norm and k_norm, RMSNorms over
head_dim applied to this rank's heads only.  Forward is unchanged; each rank's
parameter gradient is then the part from its own heads, so the full gradient
is the sum over ranks:

    dW = sum_i dW_i      (all-reduce of every parameter gradient, backward)

A KV head replicated on several ranks is counted correctly too: each rank's
gradient of it only carries its own query heads.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import distributed as D
from ..distributed.mappings import copy_to_tp_region
from .parallel_module import ShardPlan, plan_directly

_MARK = "_shardformer_grad_all_reduce"


class GradAllReduce:
    """Tensor hook of a parameter replicated over `group`: its gradient
    summed over the group (all-reduce in backward; nothing in forward).
    torch.save drops a parameter's tensor hooks, so the holders of these
    hooks check for them (has_grad_all_reduce) and register them again on
    a loaded model."""

    def __init__(self, group):
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        D.all_reduce(grad, self.group)
        return grad


def all_reduce_hook(group) -> GradAllReduce:
    return GradAllReduce(group)


def has_grad_all_reduce(p: torch.Tensor, group) -> bool:
    """Whether p's gradient is all-reduced over `group` by a GradAllReduce hook."""
    return any(isinstance(h, GradAllReduce) and h.group is group for h in (p._backward_hooks or {}).values())


class ReplicatedInParallelRegion:
    """Keeps the native module (same class, same parameters) and all-reduces
    its parameters' gradients over the group in backward.  kwarg
    `params=(name, ...)` limits this to those parameters of the module (e.g.
    SAM's rel_pos_h / rel_pos_w beside the attention's split qkv); a dotted
    name is a descendant's (BEiT's layers.0.lambda_1, on a layer that other
    replacements already hold)."""

    @staticmethod
    def _selected(module: nn.Module, params=None) -> list[nn.Parameter]:
        if params is None:
            return list(module.parameters())
        out = []
        for name in params:
            try:
                p = module.get_parameter(name)       # dotted: a descendant's (BEiT's layers.0.lambda_1)
            except AttributeError:
                p = None
            if not isinstance(p, nn.Parameter):
                raise TypeError(f"ReplicatedInParallelRegion: {type(module).__name__} has no parameter '{name}'")
            out.append(p)
        return out

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, params=None, **kwargs) -> ShardPlan:
        if not cls._selected(module, params):
            raise ValueError(f"{cls.__name__}: {type(module).__name__} has no parameters to keep in sync")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              params=None, **kwargs) -> "_GradientSync":
        """Choose the parameters now, change nothing: the sharder commits the
        returned change (the hooks) once every replacement of the model is
        built, and rolls it back if the optimize() fails."""
        if plan is None:   # not from the sharder
            plan = plan_directly(cls, module, process_group, params=params)
        chosen = [] if plan.tp_size == 1 else [
            p for p in cls._selected(module, params)
            if p.requires_grad and not getattr(p, _MARK, False)]   # one hook per parameter
        return _GradientSync(module, chosen, process_group)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           params=None, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, params=params, **kwargs).commit()


class _GradientSync:
    """The gradient all-reduce hooks of some parameters of `module`, registered
    by commit() and removed again by rollback()."""

    #: shardformer.decode's fast step may skip this hook (see decode._foreign_hooks)
    INERT_IN_DECODE = True

    def __init__(self, module: nn.Module, params: list, group):
        self.module, self.params, self.group = module, params, group
        self.handles: list = []
        self.hooked: list = []

    def commit(self) -> nn.Module:
        for p in self.params:
            # A parameter tied between two modules of the region (or one module under two
            # paths) is prepared twice: one all-reduce of its summed gradient, not two.
            if has_grad_all_reduce(p, self.group):
                continue
            self.handles.append(p.register_hook(all_reduce_hook(self.group)))
            self.hooked.append(p)
            setattr(p, _MARK, True)
        if self.params:
            self.handles.append(self.module.register_forward_pre_hook(self.reattach))
        return self.module

    def reattach(self, _module, _args) -> None:
        """Forward pre-hook: the all-reduce hooks registered again where the
        parameters lost them (a model loaded by torch.load: tensor hooks are
        not saved)."""
        for p in self.params:
            if not has_grad_all_reduce(p, self.group):
                p.register_hook(all_reduce_hook(self.group))

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        for p in self.hooked:
            p.__dict__.pop(_MARK, None)
        self.handles.clear()
        self.hooked.clear()


class SharedRopeKeyProjection:
    """The joint KV down-projection of multi-head latent attention (MLA:
    DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite), kept whole on every rank.

    It maps X [.., H] to [c_kv | k_pe], c_kv the kv_lora_rank latent and
    k_pe the rope_dim rotary key that every head shares.  With the heads
    split over the ranks (kv_b_proj column-parallel by heads, o_proj
    row-parallel), c_kv only reaches the split layers through kv_b_proj,
    whose input copy already all-reduces its gradient; k_pe goes straight
    into this rank's heads, so its gradient holds only this rank's heads:

        d k_pe = sum_i d k_pe_i     (all-reduce backward, identity forward)

    A forward hook passes the last `rope_dim` output features through
    copy_to_tp_region; the weight (and bias) then get the full, replicated
    gradient with no further reduction."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, rope_dim: int = 0, **kwargs) -> ShardPlan:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{cls.__name__}: {type(module).__name__} is not an nn.Linear")
        if not 0 < int(rope_dim) < module.out_features:
            raise ValueError(f"{cls.__name__}: rope_dim={rope_dim} is not inside the "
                             f"{module.out_features} output features of {type(module).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              rope_dim: int = 0, **kwargs) -> "_RopeGradSync":
        if plan is None:   # not from the sharder
            plan = plan_directly(cls, module, process_group, rope_dim=rope_dim)
        return _RopeGradSync(module, int(rope_dim), process_group, plan.tp_size)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           rope_dim: int = 0, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, rope_dim=rope_dim).commit()


class _RopeGradSync:
    """The forward hook of SharedRopeKeyProjection: registered by commit(),
    removed by rollback()."""

    def __init__(self, module: nn.Module, rope_dim: int, group, tp_size: int):
        self.module, self.rope_dim, self.group, self.tp_size = module, rope_dim, group, tp_size
        self.handle = None

    def _hook(self, _module, _args, output: torch.Tensor) -> torch.Tensor:
        latent, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent, copy_to_tp_region(rope, self.group)], dim=-1)

    def commit(self) -> nn.Module:
        if self.tp_size > 1 and self.handle is None:
            self.handle = self.module.register_forward_hook(self._hook)
        return self.module

    def rollback(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
