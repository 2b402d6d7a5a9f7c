"""ModelSharder: sequences the policy hooks around the C sharder engine
(csrc/sharder.c).

The engine reads and checks the policy (ModulePolicyDescription data, the one
place its shape is checked), walks the tree, matches, resolves suffixes and
per-rank values, asks each replacement class what it splits (plan_shard) and
resolves every shard layout in C; then it applies the plan.  (tp_size, rank)
are decided here, once per optimize(), and travel to the layers in their
plans.
"""
from __future__ import annotations

from torch import nn

from . import _C
from .checkpoint import bind_hf_methods
from .config import ShardConfig, group_size_and_rank
from .inherit import Inheritance, check_replaceable
from .replicas import broadcast_weights, check_same_model
from .optimizations import enable_attention, optimization_policy
from .policy import Policy

SHARDED_MARK = "_shardformer_sharded"


def _optimization_ops(model, name: str, cfg: ShardConfig, ops: list, tp_size: int, rank: int) -> list:
    """The plan of the optimizations (fused norms, fused MLP activations) for
    the modules the policy's plan `ops` leaves alone (shardformer.optimizations)."""
    replaced = {op[1] for op in ops if op[0] == "sub"}
    methods = {op[1] for op in ops if op[0] == "method"}
    extra = optimization_policy(model, cfg, replaced, methods)
    if not extra:
        return []
    return _C.sharder_plan(model, name, extra, tp_size, rank)[0]


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
        module_policy = policy.module_policy()
        tp_size, rank = group_size_and_rank(group)      # decided once; the plans carry them to the layers
        ops, matched = _C.sharder_plan(model, name, module_policy, tp_size, rank)
        if module_policy and matched == 0:
            keys = ", ".join(k if isinstance(k, str) else k.__qualname__ for k in module_policy)
            raise ValueError(f"{name}: {type(policy).__name__} matched no module of the model "
                             f"(policy keys: {keys})")
        ops += _optimization_ops(model, name, cfg, ops, tp_size, rank)
        check_replaceable(name, ops)
        if cfg.option("broadcast_weights"):      # the plan is valid: now rank 0's weights everywhere
            broadcast_weights(model, group)
        inheritance = Inheritance(model)
        enable_attention(model, cfg)
        policy.model = policy.preprocess()
        _C.sharder_apply(ops, group, inheritance)
        self.model = policy.postprocess()
        inheritance.finish(self.model, name)
        bind_hf_methods(self.model)
        object.__setattr__(self.model, SHARDED_MARK, True)
        return policy.get_shared_params()
