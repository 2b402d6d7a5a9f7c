"""ShardConfig: what optimize() should do to a model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

SEQUENCE_PARALLEL_MODES = ("split_gather", "all_to_all", "ring_attn")
SEQUENCE_PARALLEL_RECOMPUTE = (None, "selective")
# Modes whose attention runs across the sequence split, over a group of their own.
_SPLIT_ATTENTION_MODES = ("all_to_all", "ring_attn")

# extra_kwargs understood by the built-in policies, with their defaults.
EXTRA_KWARGS_DEFAULTS = {
    # Vocabulary-parallel tables are padded to a multiple of tp_size * this.
    "make_vocab_size_divisible_by": 64,
    # optimize() checks that every rank holds the same weights (a fingerprint
    # per tensor, all-gathered) and raises if not; False skips the check.
    "check_replicas": True,
    # Broadcast rank 0's parameters and buffers to the group before sharding,
    # so the other ranks' weights do not matter.
    "broadcast_weights": False,
    # With gathered logits (parallel_output=False), a model called with labels
    # computes its LM loss on the vocabulary shards and gathers the logits for
    # its output only (shardformer.lm_loss); False: HF's loss on the gathered logits.
    "loss_on_shards": True,
}


class StageManager:
    """What ShardConfig.pipeline_stage_manager must be: the base of
    shardformer.pipeline.PipelineStageManager (its one implementation),
    declared here so that the config checks it without importing the
    pipeline (config.py imports no other shardformer module).  It holds
    `group`, `stage`, `num_stages`, `num_model_chunks` and
    `num_layers_per_stage`."""

    __slots__ = ()


@dataclass
class ShardConfig:
    """How to shard a model.

    tensor_parallel_process_group: the group the model is split over (None =
        the default world group; a single process without torch.distributed
        initialized shards to size 1).
    pipeline_stage_manager: a shardformer.pipeline.PipelineStageManager: each
        rank keeps the layers of its pipeline stage(s) only (the first stage
        also the embeddings, the last the final norm and heads), and the
        model then runs through a schedule (shardformer.pipeline); None: no
        pipeline.  Tensor parallelism applies within each stage.
    enable_tensor_parallelism: split attention heads, MLP features,
        vocabularies and classifier heads over the group.
    enable_fused_normalization: replace LayerNorm / RMSNorm modules by fused ones.
    enable_flash_attention: attention by the C flash-style kernel
        (shardformer.ops.attention) in every layer whose HF attention goes through
        transformers' AttentionInterface; other layers keep theirs (with a warning).
    enable_jit_fused: fused C kernels for the MLP activations.
    enable_skinny_linear: the tensor-parallel linear layers (and LM heads)
        called on 2 to 4 rows in float32 (1 to 4 in bfloat16 where the CPU
        has AVX512-BF16) without gradients, as in a decode step of 1 to 4
        sequences (torch.no_grad or inference mode, CPU), read their weight
        shard through the C kernel shardformer.ops.skinny_linear instead of
        torch's matmul, which reads the weights at about half the rate for
        those shapes (shardformer.layer.linear.skinny_min_rows says where and
        why); a memory-mapped column shard (a strided view) is read in place.
        Results equal torch's up to fp32 rounding of the sums.
    enable_fast_decode: generate() of a tensor-parallel Llama-shaped model
        (Llama, Mistral, Qwen2/3) runs each decode step as one lean loop over
        the layers' shards (shardformer.decode) instead of HF's module
        forwards; exact (HF's math), and only where it applies: every other
        call takes HF's forward (shardformer.decode.stats says which and
        why; docs/decode.md).  False: always HF's forward.
    enable_sequence_parallelism: split the hidden states along the sequence
        between the tensor-parallel blocks (shardformer.layer.sequence), so
        norms, dropouts and residuals hold 1/tp of the activations;
        sequence_parallelism_mode "split_gather" (the default; SP group = TP
        group): blocks gather the sequence in and reduce-scatter it out
        (shardformer.layer.sequence); "all_to_all" (Ulysses) and
        "ring_attn": every layer runs on its rows and attention crosses the
        split (an all-to-all over heads, or K/V passed around a ring;
        shardformer.layer.sequence_attention), over the SP group.
    sequence_parallel_process_group: split_gather: None or the TP group
        itself.  all_to_all / ring_attn: None means the TP group when tensor
        parallelism is off (pure sequence parallelism); with tensor
        parallelism on, a group of its own whose ranks hold the same TP
        shard (e.g. TP {0,1},{2,3} and SP {0,2},{1,3}).
    enable_sequence_overlap: with split_gather, the column layers that
        gather their own input rows overlap the all-gather with the matmul
        on the rows already here, and in backward the reduce-scatter of dX
        with the dW matmul (the result is unchanged); refused for policies
        that do not implement it (Policy.supports_sequence_overlap).
    sequence_parallel_recompute: with split_gather, "selective" keeps fewer
        activations for backward and recomputes them there, bit for bit:
        the outputs of the elementwise multiplications, SiLU and GeLU inside
        each layer (the norms' x_hat and outputs, the gated MLP's activation
        and product) whose inputs are saved anyway (shardformer.layer.
        recompute); costs those elementwise ops again in backward.  None
        (default): everything autograd saves is kept.  Refused for policies
        that do not implement it (Policy.supports_sequence_recompute).
    enable_all_optimization: switches on fused normalization, flash attention,
        jit fused operators and the skinny linear kernel.
    parallel_output: LM heads return this rank's shard of the logits (the
        columns of its vocabulary rows, see VocabParallelLMHead1D) instead of
        all-gathering the full vocabulary, and a model called with `labels`
        computes its loss on those shards (cross_entropy_1d: HF's label
        shift, ignore_index and num_items_in_batch kept; shardformer.lm_loss),
        so no rank ever holds [batch, seq, vocab].  generate() gathers the
        logits it needs as before.  With gathered logits (False, the default)
        a model called with `labels` computes the same loss on its shards
        too and gathers the logits only for its output (extra_kwargs
        loss_on_shards=False: HF's loss on the gathered logits).
    expert_parallel_process_group: expert parallelism for mixture-of-experts
        blocks (shardformer.layer.expert_parallel): each rank of this group
        owns a contiguous block of every MoE block's experts (still split
        over TP inside) and tokens are exchanged with all_to_all to the rank
        owning their expert.  A subgroup of the data-parallel group (ranks
        holding the same TP shard, seeing different data):
        shardformer.mesh(..., ep=k).ep.  None: experts are split over TP
        only.  Train with shardformer.data_parallel (or average_gradients
        with the mesh), which keep expert parameters out of the DP
        all-reduce.  With a pipeline_stage_manager its ranks are ranks of
        one stage (mesh(pp=, dp=, ep=) builds such groups) and every
        pipeline runs the same schedule: the exchanges of a micro-batch
        meet in the same step (the schedule checks that the EP ranks run
        the same one).  Refused with sequence parallelism.
    check_inputs_every: the sharded model compares a fingerprint of its
        inputs across the ranks that must be given the same batch (tensor-
        parallel, sequence-parallel and pipeline groups) on its first forward
        and every this many forwards after, and raises naming the ranks given
        other rows (a sampler or DDP spanning the tensor-parallel ranks;
        shardformer.input_check).  0: never.
    extra_kwargs: policy options, see EXTRA_KWARGS_DEFAULTS.
    """

    tensor_parallel_process_group: Any = None
    pipeline_stage_manager: Any = None
    enable_tensor_parallelism: bool = True
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_skinny_linear: bool = False
    enable_fast_decode: bool = True
    enable_sequence_parallelism: bool = False
    enable_sequence_overlap: bool = False
    sequence_parallelism_mode: str | None = None
    sequence_parallel_process_group: Any = None
    sequence_parallel_recompute: str | None = None
    enable_all_optimization: bool = False
    parallel_output: bool = False
    expert_parallel_process_group: Any = None
    check_inputs_every: int = 100
    extra_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("enable_tensor_parallelism", "enable_fused_normalization", "enable_flash_attention",
                     "enable_jit_fused", "enable_skinny_linear", "enable_fast_decode", "enable_sequence_parallelism",
                     "enable_sequence_overlap",
                     "enable_all_optimization", "parallel_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardConfig.{name} must be a bool, got {getattr(self, name)!r}")
        every = self.check_inputs_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"ShardConfig.check_inputs_every must be an int >= 0 (0: never), got {every!r}")
        if not isinstance(self.extra_kwargs, dict):
            raise TypeError(f"ShardConfig.extra_kwargs must be a dict, got {type(self.extra_kwargs).__name__}")
        if "gather_output" in self.extra_kwargs:
            raise ValueError("ShardConfig.extra_kwargs['gather_output'] was replaced by ShardConfig(parallel_output="
                             "...): parallel_output=True is the old gather_output=False, and the model's own loss "
                             "then runs on the vocabulary shards")
        unknown = set(self.extra_kwargs) - set(EXTRA_KWARGS_DEFAULTS)
        if unknown:
            raise ValueError(f"ShardConfig.extra_kwargs: unknown keys {sorted(unknown)}; "
                             f"known: {sorted(EXTRA_KWARGS_DEFAULTS)}")
        for key in ("check_replicas", "broadcast_weights", "loss_on_shards"):
            if not isinstance(self.extra_kwargs.get(key, False), bool):
                raise TypeError(f"ShardConfig.extra_kwargs[{key!r}] must be a bool, "
                                f"got {self.extra_kwargs[key]!r}")
        multiple = self.extra_kwargs.get("make_vocab_size_divisible_by", 1)
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"ShardConfig.extra_kwargs['make_vocab_size_divisible_by'] must be an int >= 1, "
                             f"got {multiple!r}")
        if self.enable_sequence_overlap and not self.enable_sequence_parallelism:
            raise ValueError("ShardConfig: enable_sequence_overlap=True needs enable_sequence_parallelism=True")
        self._check_sequence_parallelism()
        if self.enable_all_optimization:
            self.enable_fused_normalization = True
            self.enable_flash_attention = True
            self.enable_jit_fused = True
            self.enable_skinny_linear = True
        if self.tensor_parallel_process_group is not None:
            check_process_group(self.tensor_parallel_process_group)
        self._check_expert_parallelism()
        if self.pipeline_stage_manager is not None:
            if not isinstance(self.pipeline_stage_manager, StageManager):
                raise TypeError(f"ShardConfig.pipeline_stage_manager must be a shardformer.pipeline."
                                f"PipelineStageManager, got {type(self.pipeline_stage_manager).__name__}")
            self._check_pipeline_groups()

    def _check_pipeline_groups(self) -> None:
        """The pipeline group and the tensor- / sequence- / expert-parallel
        group of a rank meet in that rank only (stages hold different layers;
        the ranks of one stage split them, or exchange their tokens): a group
        used for both would have every rank wait on itself, so it is refused
        by name."""
        manager = self.pipeline_stage_manager
        if manager.num_stages < 2 or not dist.is_available() or not dist.is_initialized():
            return
        pp = set(_group_ranks(manager.group))
        inner = []
        if self.enable_tensor_parallelism:
            inner.append(("tensor_parallel_process_group", self.tensor_parallel_process_group))
        if self.split_attention_mode and (not self.enable_tensor_parallelism
                                          or self.sequence_group is not self.tensor_parallel_process_group):
            inner.append(("sequence_parallel_process_group", self.sequence_group))
        if self.expert_parallel_process_group is not None:
            inner.append(("expert_parallel_process_group", self.expert_parallel_process_group))
        for name, group in inner:
            ranks = _group_ranks(group)
            shared = sorted(pp & set(ranks))
            if len(shared) > 1:
                raise ValueError(
                    f"ShardConfig: the pipeline_stage_manager's group (global ranks {sorted(pp)}) and {name}"
                    f"{'' if group is not None else ' (None: the default group)'} (global ranks {ranks}) share "
                    f"ranks {shared}; pipeline stages and the ranks that split one stage must be different ranks "
                    f"(shardformer.mesh(pp=..., tp=..., sp=..., dp=..., ep=...) builds such groups: .pp, .tp, .sp, "
                    f".ep; docs/parallel-modes.md#combining-modes)")

    def _check_expert_parallelism(self) -> None:
        group = self.expert_parallel_process_group
        if group is None:
            return
        check_process_group(group)
        if self.enable_sequence_parallelism:
            raise NotImplementedError(f"ShardConfig: expert_parallel_process_group with sequence parallelism "
                                      f"({self.sequence_parallelism_mode!r}) is not supported")
        if not self.enable_tensor_parallelism:
            raise ValueError("ShardConfig: expert_parallel_process_group needs enable_tensor_parallelism=True "
                             "(the experts are replaced by the tensor-parallel policy; a TP group of one rank "
                             "is fine)")
        tp = self.tensor_parallel_process_group
        tp_ranks = set(dist.get_process_group_ranks(tp)) if tp is not None else set(range(dist.get_world_size()))
        shared = tp_ranks & set(dist.get_process_group_ranks(group))
        if len(shared) > 1:
            raise ValueError(f"ShardConfig: expert_parallel_process_group shares ranks {sorted(shared)} with the "
                             "tensor-parallel group; its ranks must hold the same tensor-parallel shard and see "
                             "different data (a subgroup of the data-parallel group: mesh(..., ep=k).ep)")

    def _check_sequence_parallelism(self) -> None:
        mode = self.sequence_parallelism_mode
        if mode is not None and mode not in SEQUENCE_PARALLEL_MODES:
            raise ValueError(f"ShardConfig.sequence_parallelism_mode={mode!r}: one of {SEQUENCE_PARALLEL_MODES}")
        self._check_recompute()
        if not self.enable_sequence_parallelism:
            if mode is not None or self.sequence_parallel_process_group is not None:
                raise ValueError("ShardConfig: sequence_parallelism_mode / sequence_parallel_process_group are "
                                 "given but enable_sequence_parallelism is False")
            return
        if mode is None:
            self.sequence_parallelism_mode = mode = "split_gather"
        group = self.sequence_parallel_process_group
        if group is not None:
            check_process_group(group)
        if mode == "split_gather":
            if not self.enable_tensor_parallelism:
                raise ValueError("ShardConfig: sequence_parallelism_mode='split_gather' needs "
                                 "enable_tensor_parallelism=True (its blocks are the tensor-parallel layers); "
                                 "all_to_all and ring_attn run without tensor parallelism")
            if group is not None and group is not self.tensor_parallel_process_group:
                raise ValueError("ShardConfig.sequence_parallel_process_group: split_gather runs over the tensor-"
                                 "parallel group; pass None or tensor_parallel_process_group itself")
            return
        if self.enable_sequence_overlap:
            raise ValueError(f"ShardConfig: enable_sequence_overlap applies to split_gather; "
                             f"sequence_parallelism_mode={mode!r} overlaps its own communication")
        if self.enable_tensor_parallelism and (group is None or group is self.tensor_parallel_process_group):
            raise ValueError(f"ShardConfig: sequence_parallelism_mode={mode!r} with tensor parallelism needs a "
                             f"sequence_parallel_process_group of its own (ranks holding the same tensor-parallel "
                             f"shard), or enable_tensor_parallelism=False to split the sequence over "
                             f"tensor_parallel_process_group")

    def _check_recompute(self) -> None:
        recompute = self.sequence_parallel_recompute
        if recompute not in SEQUENCE_PARALLEL_RECOMPUTE:
            raise ValueError(f"ShardConfig.sequence_parallel_recompute={recompute!r}: one of "
                             f"{SEQUENCE_PARALLEL_RECOMPUTE}")
        if recompute is not None and not (self.enable_sequence_parallelism and self.sequence_parallelism_mode
                                          in (None, "split_gather")):
            raise ValueError(f"ShardConfig.sequence_parallel_recompute={recompute!r} applies to split_gather "
                             f"sequence parallelism (enable_sequence_parallelism=True, sequence_parallelism_mode="
                             f"'split_gather'); got enable_sequence_parallelism={self.enable_sequence_parallelism}, "
                             f"sequence_parallelism_mode={self.sequence_parallelism_mode!r}")

    @property
    def split_attention_mode(self) -> str | None:
        """"all_to_all" / "ring_attn" when one of those is on, else None."""
        if self.enable_sequence_parallelism and self.sequence_parallelism_mode in _SPLIT_ATTENTION_MODES:
            return self.sequence_parallelism_mode
        return None

    @property
    def sequence_group(self):
        """The group the sequence is split over (None: the default group)."""
        if self.split_attention_mode and self.sequence_parallel_process_group is not None:
            return self.sequence_parallel_process_group
        return self.tensor_parallel_process_group

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


def concrete_group(process_group):
    """The ProcessGroup that `process_group` names: None means the default
    group, which is the world (dist.group.WORLD) once torch.distributed is
    initialized; without it, None (a single process).

    Every reader of a layer's or a ShardConfig's group that needs the group
    itself (its size, its first rank's global rank, a collective over it)
    goes through here, so that None is never mistaken for "not sharded"."""
    if process_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return process_group


def _group_ranks(group) -> list[int]:
    """Global ranks of `group` (None: the default group)."""
    return list(range(dist.get_world_size())) if group is None else list(dist.get_process_group_ranks(group))


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
