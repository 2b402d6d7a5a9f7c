"""The training loops users bring, driving a model sharded by shardformer.

    from shardformer.integrations import ShardedTrainer   # transformers.Trainer for a sharded model

(docs/trainer.md: the Trainer recipe, and the accelerate recipe.)  The
import of transformers happens here, not at `import shardformer`.
"""
from .trainer import ShardedTrainer, load_training_state, save_training_state

__all__ = ["ShardedTrainer", "load_training_state", "save_training_state"]
