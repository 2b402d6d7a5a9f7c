"""ModelSharder: hands a policy to the C sharder engine (csrc/sharder.c).

This file only normalizes the policy into the plain tuples the engine reads
and sequences the policy hooks; the tree walk, matching, suffix resolution,
per-rank values, layout planning and substitution run in _C.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from . import _C
from .checkpoint import bind_hf_methods
from .config import ShardConfig
from .inherit import Inheritance, check_replaceable
from .replicas import broadcast_weights, check_same_model
from .policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription

SHARDED_MARK = "_shardformer_sharded"


def _policy_entries(model_name: str, module_policy: dict[Any, ModulePolicyDescription]) -> dict:
    if not isinstance(module_policy, dict):
        raise TypeError(f"{model_name}: module_policy() must return a dict, got {type(module_policy).__name__}")
    entries = {}
    for key, desc in module_policy.items():
        if not isinstance(key, (type, str)):
            raise TypeError(f"{model_name}: policy key {key!r} must be a module class or a class name")
        if not isinstance(desc, ModulePolicyDescription):
            raise TypeError(f"{model_name}: policy[{key!r}] must be a ModulePolicyDescription, "
                            f"got {type(desc).__name__}")
        attrs = tuple((str(k), v) for k, v in (desc.attribute_replacement or {}).items())
        params = tuple(desc.param_replacement or ())
        subs = []
        for sub in desc.sub_module_replacement or ():
            if not isinstance(sub, SubModuleReplacementDescription):
                raise TypeError(f"{model_name}: policy[{key!r}].sub_module_replacement items must be "
                                f"SubModuleReplacementDescription, got {type(sub).__name__}")
            if not hasattr(sub.target_module, "from_native_module"):
                raise TypeError(f"{model_name}: policy[{key!r}]: target_module {sub.target_module!r} "
                                f"for '{sub.suffix}' has no from_native_module")
            subs.append((sub.suffix, sub.target_module, dict(sub.kwargs or {}), bool(sub.ignore_if_not_exist)))
        methods = tuple((str(k), v) for k, v in (desc.method_replacement or {}).items())
        entries[key] = (attrs, params, tuple(subs), methods)
    return entries


class ModelSharder:
    """Shard `model` in place according to `policy` and `shard_config`."""

    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig | None = None) -> None:
        self.model = model
        self.policy = policy
        self.shard_config = shard_config if shard_config is not None else ShardConfig()

    def shard(self) -> list[dict[int, nn.Parameter]]:
        model, policy, cfg = self.model, self.policy, self.shard_config
        name = type(model).__name__
        if getattr(model, SHARDED_MARK, False):
            raise ValueError(f"{name}: this model has already been sharded by optimize()")
        group = cfg.tensor_parallel_process_group
        if cfg.option("broadcast_weights"):
            check_same_model(model, group, name, content=False)
        elif cfg.option("check_replicas"):
            check_same_model(model, group, name)
        policy.set_model(model)
        policy.set_shard_config(cfg)
        policy.config_sanity_check()
        entries = _policy_entries(name, policy.module_policy())
        tp_size, rank = cfg.tensor_parallel_size, cfg.tensor_parallel_rank
        ops, matched = _C.sharder_plan(model, name, entries, tp_size, rank)
        if entries and matched == 0:
            keys = ", ".join(k if isinstance(k, str) else k.__qualname__ for k in entries)
            raise ValueError(f"{name}: {type(policy).__name__} matched no module of the model "
                             f"(policy keys: {keys})")
        check_replaceable(name, ops)
        if cfg.option("broadcast_weights"):      # the plan is valid: now rank 0's weights everywhere
            broadcast_weights(model, group)
        inheritance = Inheritance(model)
        policy.model = policy.preprocess()
        _C.sharder_apply(ops, cfg.tensor_parallel_process_group, inheritance)
        self.model = policy.postprocess()
        inheritance.finish(self.model, name)
        bind_hf_methods(self.model)
        object.__setattr__(self.model, SHARDED_MARK, True)
        return policy.get_shared_params()
