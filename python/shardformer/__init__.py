"""shardformer: tensor-parallel HuggingFace transformers with one call.

    from shardformer import ShardConfig, ShardFormer
    model, shared_params = ShardFormer(shard_config=ShardConfig()).optimize(model)
"""
from .config import ShardConfig
from .lazy import lazy_init
from .policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription
from .shardformer import ShardFormer

__version__ = "0.1.0"

__all__ = [
    "ModulePolicyDescription",
    "Policy",
    "ShardConfig",
    "ShardFormer",
    "SubModuleReplacementDescription",
    "lazy_init",
]
