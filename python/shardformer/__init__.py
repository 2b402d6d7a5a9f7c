"""shardformer: tensor-parallel HuggingFace transformers with one call.

    from shardformer import ShardConfig, ShardFormer
    model, shared_params = ShardFormer(shard_config=ShardConfig()).optimize(model)
"""
from . import compile_ops as _compile_ops   # registers the kernels' custom ops (ops.TRACEABLE)
from .autopolicy import supported_models
from .config import ShardConfig
from .distributed.ledger import comm_stats
from .distributed.teardown import register as _register_teardown
from .grad_norm import average_gradients, clip_grad_norm_, data_parallel
from .lazy import lazy_init
from .parallel_mesh import Mesh, mesh
from .pickling import register as _register_pickling
from .policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription
from .shardformer import ShardFormer
from .verification import verify

__version__ = "0.1.0"

_register_pickling()   # process groups pickle by reference (shardformer.pickling)
_register_teardown()   # process groups end at exit before finalization (shardformer.distributed.teardown)

__all__ = [
    "Mesh",
    "ModulePolicyDescription",
    "Policy",
    "ShardConfig",
    "ShardFormer",
    "SubModuleReplacementDescription",
    "average_gradients",
    "clip_grad_norm_",
    "comm_stats",
    "data_parallel",
    "lazy_init",
    "mesh",
    "supported_models",
    "verify",
]
