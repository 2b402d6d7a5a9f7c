"""shardformer: tensor-parallel HuggingFace transformers with one call.

    from shardformer import ShardConfig, ShardFormer
    model, shared_params = ShardFormer(shard_config=ShardConfig()).optimize(model)
"""
from .config import ShardConfig
from .grad_norm import average_gradients, clip_grad_norm_, data_parallel
from .lazy import lazy_init
from .parallel_mesh import Mesh, mesh
from .policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription
from .shardformer import ShardFormer

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "ModulePolicyDescription",
    "Policy",
    "ShardConfig",
    "ShardFormer",
    "SubModuleReplacementDescription",
    "average_gradients",
    "clip_grad_norm_",
    "data_parallel",
    "lazy_init",
    "mesh",
]
