"""ShardConfig: what optimize() should do to a model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

# Switches whose implementation has not landed yet, with where it is tracked.
# Switching one on is an error rather than a silent no-op.
_NOT_YET = {
    "enable_sequence_overlap": "sequence parallelism with communication overlap",
}
SEQUENCE_PARALLEL_MODES = ("split_gather", "all_to_all", "ring_attn")
_MODES_NOT_YET = ("all_to_all", "ring_attn")

# extra_kwargs understood by the built-in policies, with their defaults.
EXTRA_KWARGS_DEFAULTS = {
    # Vocabulary-parallel tables are padded to a multiple of tp_size * this.
    "make_vocab_size_divisible_by": 64,
    # LM heads return full-vocabulary logits (True) or this rank's shard (False,
    # for cross_entropy_1d).
    "gather_output": True,
    # optimize() checks that every rank holds the same weights (a fingerprint
    # per tensor, all-gathered) and raises if not; False skips the check.
    "check_replicas": True,
    # Broadcast rank 0's parameters and buffers to the group before sharding,
    # so the other ranks' weights do not matter.
    "broadcast_weights": False,
}


@dataclass
class ShardConfig:
    """How to shard a model.

    tensor_parallel_process_group: the group the model is split over (None =
        the default world group; a single process without torch.distributed
        initialized shards to size 1).
    pipeline_stage_manager: pipeline stages (not available yet).
    enable_tensor_parallelism: split attention heads, MLP features,
        vocabularies and classifier heads over the group.
    enable_fused_normalization: replace LayerNorm / RMSNorm modules by fused ones.
    enable_flash_attention: attention by the C flash-style kernel
        (shardformer.ops.attention) in every layer whose HF attention goes through
        transformers' AttentionInterface; other layers keep theirs (with a warning).
    enable_jit_fused: fused C kernels for the MLP activations.
    enable_sequence_parallelism: split the hidden states along the sequence
        between the tensor-parallel blocks (shardformer.layer.sequence), so
        norms, dropouts and residuals hold 1/tp of the activations;
        sequence_parallelism_mode "split_gather" (the default; SP group = TP
        group) is available for the Llama-shaped decoder families, the other
        modes ("all_to_all", "ring_attn") not yet.
    sequence_parallel_process_group: None (the TP group) or the TP group itself.
    enable_sequence_overlap: (not available yet); requires sequence parallelism.
    enable_all_optimization: switches on fused normalization, flash attention
        and jit fused operators.
    extra_kwargs: policy options, see EXTRA_KWARGS_DEFAULTS.
    """

    tensor_parallel_process_group: Any = None
    pipeline_stage_manager: Any = None
    enable_tensor_parallelism: bool = True
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_sequence_parallelism: bool = False
    enable_sequence_overlap: bool = False
    sequence_parallelism_mode: str | None = None
    sequence_parallel_process_group: Any = None
    enable_all_optimization: bool = False
    extra_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("enable_tensor_parallelism", "enable_fused_normalization", "enable_flash_attention",
                     "enable_jit_fused", "enable_sequence_parallelism", "enable_sequence_overlap",
                     "enable_all_optimization"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.extra_kwargs, dict):
            raise TypeError(f"ShardConfig.extra_kwargs must be a dict, got {type(self.extra_kwargs).__name__}")
        unknown = set(self.extra_kwargs) - set(EXTRA_KWARGS_DEFAULTS)
        if unknown:
            raise ValueError(f"ShardConfig.extra_kwargs: unknown keys {sorted(unknown)}; "
                             f"known: {sorted(EXTRA_KWARGS_DEFAULTS)}")
        for key in ("gather_output", "check_replicas", "broadcast_weights"):
            if not isinstance(self.extra_kwargs.get(key, False), bool):
                raise TypeError(f"ShardConfig.extra_kwargs[{key!r}] must be a bool, "
                                f"got {self.extra_kwargs[key]!r}")
        multiple = self.extra_kwargs.get("make_vocab_size_divisible_by", 1)
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"ShardConfig.extra_kwargs['make_vocab_size_divisible_by'] must be an int >= 1, "
                             f"got {multiple!r}")
        if self.enable_sequence_overlap and not self.enable_sequence_parallelism:
            raise ValueError("ShardConfig: enable_sequence_overlap=True needs enable_sequence_parallelism=True")
        if self.enable_sequence_parallelism and not self.enable_tensor_parallelism:
            raise ValueError("ShardConfig: enable_sequence_parallelism=True needs enable_tensor_parallelism=True")
        self._check_sequence_parallelism()
        if self.enable_all_optimization:
            self.enable_fused_normalization = True
            self.enable_flash_attention = True
            self.enable_jit_fused = True
        if self.tensor_parallel_process_group is not None:
            check_process_group(self.tensor_parallel_process_group)
        if self.pipeline_stage_manager is not None:
            raise NotImplementedError("ShardConfig.pipeline_stage_manager: pipeline parallelism is not "
                                      "available in this version of shardformer")
        for name, what in _NOT_YET.items():
            if getattr(self, name):
                reason = " (switched on by enable_all_optimization)" if self.enable_all_optimization \
                    and name in ("enable_flash_attention", "enable_jit_fused") else ""
                raise NotImplementedError(f"ShardConfig.{name}=True{reason}: {what} is not available "
                                          "in this version of shardformer")

    def _check_sequence_parallelism(self) -> None:
        mode = self.sequence_parallelism_mode
        if mode is not None and mode not in SEQUENCE_PARALLEL_MODES:
            raise ValueError(f"ShardConfig.sequence_parallelism_mode={mode!r}: one of {SEQUENCE_PARALLEL_MODES}")
        if not self.enable_sequence_parallelism:
            if mode is not None or self.sequence_parallel_process_group is not None:
                raise ValueError("ShardConfig: sequence_parallelism_mode / sequence_parallel_process_group are "
                                 "given but enable_sequence_parallelism is False")
            return
        if mode is None:
            self.sequence_parallelism_mode = mode = "split_gather"
        if mode in _MODES_NOT_YET:
            raise NotImplementedError(f"ShardConfig.sequence_parallelism_mode={mode!r} is not available in this "
                                      f"version of shardformer (split_gather is)")
        group = self.sequence_parallel_process_group
        if group is not None and group is not self.tensor_parallel_process_group:
            raise ValueError("ShardConfig.sequence_parallel_process_group: split_gather runs over the tensor-"
                             "parallel group; pass None or tensor_parallel_process_group itself")

    @property
    def sequence_parallel(self) -> bool:
        """Split-gather sequence parallelism is on."""
        return self.enable_sequence_parallelism and self.sequence_parallelism_mode == "split_gather"

    def option(self, name: str):
        """An extra_kwargs option, or its default."""
        return self.extra_kwargs.get(name, EXTRA_KWARGS_DEFAULTS[name])

    @property
    def tensor_parallel_size(self) -> int:
        return group_size_and_rank(self.tensor_parallel_process_group)[0]

    @property
    def tensor_parallel_rank(self) -> int:
        return group_size_and_rank(self.tensor_parallel_process_group)[1]


def group_size_and_rank(process_group) -> tuple[int, int]:
    """(tp_size, rank) of a tensor-parallel group (None = the default group;
    a single process without torch.distributed initialized is size 1, rank 0).

    The one place that asks torch.distributed: the sharder calls it once per
    optimize() and hands the result to every layer in its plan; a layer built
    directly, outside the sharder, gets it through ParallelModule.plan_for."""
    if process_group is not None:
        check_process_group(process_group)
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(f"tensor_parallel_process_group: this process (global rank {dist.get_rank()}) is not a "
                         f"member of the group; every rank of the group, and only those, calls optimize()")
    return dist.get_world_size(process_group), rank


def check_process_group(process_group) -> None:
    """A process group given to ShardConfig must be a torch.distributed
    ProcessGroup, with torch.distributed initialized (ValueError / TypeError,
    raised before optimize() changes anything)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"ShardConfig.tensor_parallel_process_group: a process group was given "
                         f"({type(process_group).__name__}) but torch.distributed is not initialized "
                         f"(destroyed, or never set up in this process); call "
                         f"torch.distributed.init_process_group first, or pass None to shard to one process")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"ShardConfig.tensor_parallel_process_group must be a torch.distributed ProcessGroup "
                        f"(or None for the default group), got {type(process_group).__name__}")
