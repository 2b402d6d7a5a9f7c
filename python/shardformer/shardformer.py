"""ShardFormer: the user-facing facade."""
from __future__ import annotations

from torch import nn

from .autopolicy import get_autopolicy
from .config import ShardConfig
from .policy import Policy
from .sharder import ModelSharder


class ShardFormer:
    """Shard HuggingFace (or custom) models for tensor parallelism.

        model, shared_params = ShardFormer(shard_config=ShardConfig()).optimize(model)

    Every rank of the tensor-parallel group must call optimize() on a model
    built identically (same config, same weights) with the same policy.
    """

    def __init__(self, shard_config: ShardConfig | None = None) -> None:
        if shard_config is not None and not isinstance(shard_config, ShardConfig):
            raise TypeError(f"ShardFormer: shard_config must be a ShardConfig, got {type(shard_config).__name__}")
        self.shard_config = shard_config if shard_config is not None else ShardConfig()

    def optimize(self, model: nn.Module, policy: Policy | None = None):
        """Shard `model` in place; returns (model, shared_params).

        `policy` defaults to the registered policy of the model's class.  On
        any error (unsupported model, sizes that cannot be split, a policy
        naming modules that do not exist, a replacement failing to build, an
        interrupt) the model is left unchanged; where a change cannot be
        undone (see shardformer.sharder) the model is marked, and every later
        optimize() or forward on it raises "partially sharded ...; rebuild it".
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"ShardFormer.optimize: expected a torch.nn.Module, got {type(model).__name__}")
        if policy is None:
            policy = get_autopolicy(model)
        elif not isinstance(policy, Policy):
            raise TypeError(f"ShardFormer.optimize: policy must be a shardformer.Policy, got {type(policy).__name__}")
        shared_params = ModelSharder(model, policy, self.shard_config).shard()
        return model, shared_params
