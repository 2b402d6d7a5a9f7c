"""ShardedTrainer: transformers.Trainer driving a model sharded by shardformer.

    m = shardformer.mesh(tp=2)                          # dp = world / tp
    model, _ = ShardFormer(m.shard_config()).optimize(model)
    trainer = ShardedTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, mesh=m)
    trainer.train()                                     # under torchrun, every rank
    trainer.save_model(out)                             # a plain HF checkpoint (rank 0 writes)

Under torchrun, plain Trainer hands the model to accelerate, which wraps it
in DDP over the whole world and gives every rank of the world its own rows;
for a sharded model both are wrong (shardformer.ddp_guard and input_check
refuse them).  What this subclass changes, and why the result is the
unsharded Trainer's on the same global batches:

  * Data parallelism over the DP group only.  With world W = DP x R (R =
    the ranks holding one replica: TP x SP), the model is wrapped by
    shardformer.data_parallel(model, mesh): DDP over mesh.dp, which averages
    the gradients of the DP replicas; the TP / SP peers inside a replica
    already hold the gradients of their own shards of the same batch.
  * One batch per replica.  accelerate's loader shards the batches over W
    processes (batch k of the sampler to process k mod W); here it shards
    them over the DP group (batch k to the DP rank k mod DP), so the ranks
    of a replica read the same rows and replica d reads the rows the
    unsharded Trainer sees as the d-th slice of its global batch of
    DP x per_device_train_batch_size.
  * The loss.  Trainer divides each rank's summed token losses by the token
    count N summed over the world and multiplies by W.  Every rank of a
    replica counts the same tokens, so that sum is R x G (G: the global
    batch's tokens), and the loss of replica d is S_d x W / (R x G) =
    S_d x DP / G; DDP's average over DP gives sum_d S_d / G, the unsharded
    mean.  The logged loss (averaged over the world, each replica R times)
    is that same mean on every rank.
  * Clipping by the norm of the whole model: shardformer.clip_grad_norm_
    (grad_norm.py), not the norm of this rank's shards.
  * Checkpoints.  save_model() writes an ordinary HF checkpoint (the
    collective checkpoint.save_pretrained: every rank takes part, rank 0
    writes) that from_pretrained() loads unsharded.  Trainer's own
    checkpoints (save_steps) add the model, optimizer and dropout-generator
    state through checkpoint.save_state (save_training_state: atomic, DCP
    underneath, every split tensor placed exactly, reshardable)
    and the scheduler; resume_from_checkpoint reads them back
    (load_training_state), each rank its own shards.

Refused by name at construction: a model optimize() did not shard, a
pipelined model (Trainer's training_step runs one forward and one
backward per batch on every rank; a pipeline needs its schedule driving
all stages: use OneForwardOneBackwardSchedule in your own loop, as
examples/train.py does), and a mesh whose groups are not the model's.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Trainer

from .. import checkpoint
from ..ddp_guard import GUARD_ATTR
from ..grad_norm import clip_grad_norm_, data_parallel
from ..grad_norm import grad_norm as whole_grad_norm
from ..input_check import CHECK_ATTR
from ..parallel_mesh import Mesh, mesh as build_mesh
from ..pipeline.stages import runtime_of
from ..sharder import SHARDED_MARK

DOCS = "docs/trainer.md"
STATE_DIR = "shardformer_state"       # the DCP directory inside a Trainer checkpoint
SCHEDULER_NAME = "scheduler.pt"       # transformers' name for the scheduler's state


def save_training_state(model, optimizer, directory: str) -> None:
    """The model's and the optimizer's state of a sharded model, and its
    random state (torch's and the dropout generators'), saved with
    checkpoint.save_state into `directory` (collective over the world, atomic,
    DCP underneath): every split tensor written once, loadable at another
    layout."""
    checkpoint.save_state(model, directory, optimizer=optimizer)


def load_training_state(model, optimizer, directory: str) -> None:
    """save_training_state's state read back in place with
    checkpoint.load_state (collective over the world), each rank reading its
    own shards."""
    checkpoint.load_state(model, directory, optimizer=optimizer)


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _model_groups(model) -> dict[str, list[int]]:
    """{"tp": ranks, "sp": ranks} of the groups the sharded `model` is split
    over (the ranks that must read one batch; "sp" when it is not the TP group)."""
    named = {}
    guard = model.__dict__.get(GUARD_ATTR)
    check = model.__dict__.get(CHECK_ATTR)
    for group, what in list(getattr(guard, "groups", ())) + list(getattr(check, "groups", ())):
        key = "tp" if what == "tensor-parallel" else "sp" if what == "sequence-parallel" else what
        named.setdefault(key, _ranks(group))
    if named.get("sp") == named.get("tp"):
        named.pop("sp")
    return named


def _mesh_for(model, given: Mesh | None) -> Mesh:
    """The mesh whose .dp the model trains over: `given` (checked against the
    model's groups) or shardformer.mesh() with the model's TP and SP sizes."""
    name = type(model).__name__
    groups = _model_groups(model)
    sizes = {k: len(v) for k, v in groups.items()}
    m = given if given is not None else build_mesh(tp=sizes.get("tp", 1), sp=sizes.get("sp", 1))
    if not isinstance(m, Mesh):
        raise TypeError(f"ShardedTrainer: mesh must be a shardformer.mesh(...), got {type(m).__name__}")
    for dim, ranks in groups.items():
        if m.ranks(dim) != ranks:
            where = "the mesh given" if given is not None else f"shardformer.mesh(tp={sizes.get('tp', 1)}, " \
                                                              f"sp={sizes.get('sp', 1)})"
            raise ValueError(f"ShardedTrainer: {name} is split over the ranks {ranks} ({dim}), but the {dim} group "
                             f"of {where} on rank {dist.get_rank()} is {m.ranks(dim)}: shard the model with that "
                             f"mesh's shard_config() (or pass mesh= the shardformer.mesh() whose groups sharded "
                             f"it); see {DOCS}")
    return m


def _check_model(model) -> None:
    """ValueError / NotImplementedError for what ShardedTrainer cannot train."""
    if model is None:
        raise ValueError(f"ShardedTrainer: pass model= a model sharded by ShardFormer(...).optimize() (model_init "
                         f"is not supported: the model is sharded before the Trainer is built); see {DOCS}")
    name = type(model).__name__
    if not getattr(model, SHARDED_MARK, False):
        raise ValueError(f"ShardedTrainer: {name} was not sharded by shardformer: call ShardFormer(cfg).optimize("
                         f"model) first (for an unsharded model, use transformers.Trainer); see {DOCS}")
    stages = runtime_of(model)
    if stages is not None and stages.manager.num_stages > 1:
        raise NotImplementedError(
            f"ShardedTrainer: {name} is split into {stages.manager.num_stages} pipeline stages; Trainer's "
            f"training_step runs one forward and one backward per batch on every rank, while a pipeline needs its "
            f"schedule to drive all stages at once (each stage holds other layers and passes activations on). "
            f"Train it with shardformer.pipeline's OneForwardOneBackwardSchedule in your own loop "
            f"(examples/train.py); see {DOCS}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"ShardedTrainer: torch.distributed is not initialized; launch with torchrun (the model "
                           f"{name} was sharded over process groups); see {DOCS}")


def _raw_optimizer(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


class ShardedTrainer(Trainer):
    """transformers.Trainer for a model already sharded by ShardFormer (see the
    module doc): data parallel over `mesh.dp` only, the same batch on the
    ranks of one replica, the whole model's gradient norm, HF and sharded
    checkpoints.  `mesh`: the shardformer.mesh() that sharded the model
    (default: shardformer.mesh() with the model's TP and SP sizes, data
    parallel over the ranks left)."""

    def __init__(self, model=None, args=None, *rest, mesh: Mesh | None = None, **kwargs):
        _check_model(model)
        self.mesh = _mesh_for(model, mesh)
        super().__init__(model, args, *rest, **kwargs)
        if self.args.push_to_hub:
            raise NotImplementedError(f"ShardedTrainer: push_to_hub is not covered: save_model(dir) writes the plain "
                                      f"HF checkpoint, upload it from rank 0; see {DOCS}")

    # ------------------------------------------------------------ data parallelism over mesh.dp

    def _ddp_kwargs(self) -> dict:
        out = {}
        for ours, theirs in (("ddp_find_unused_parameters", "find_unused_parameters"),
                             ("ddp_bucket_cap_mb", "bucket_cap_mb"), ("ddp_broadcast_buffers", "broadcast_buffers"),
                             ("ddp_static_graph", "static_graph")):
            value = getattr(self.args, ours, None)
            if value is not None:
                out[theirs] = value
        return out

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """DDP over mesh.dp for training (a one-rank DP group too: Trainer then
        leaves the model to accelerate's prepare() no more); the bare model
        for evaluation."""
        if not training or self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model
        return data_parallel(self.model, self.mesh, **self._ddp_kwargs())

    def _get_dataloader(self, *args, **kwargs):
        """Trainer's loader (accelerate's, sharding batches over the world),
        re-pointed at the DP group: batch k of the sampler to DP rank k mod DP."""
        loader = super()._get_dataloader(*args, **kwargs)
        shard = getattr(loader, "batch_sampler", None)
        if shard is None or not hasattr(shard, "num_processes"):
            if dist.get_world_size() > 1:
                raise NotImplementedError(
                    f"ShardedTrainer: accelerate prepared a loader of type {type(loader).__name__} without a "
                    f"batch-sampler shard (an IterableDataset, or dispatch_batches / split_batches): only "
                    f"datasets with __len__ are sharded over the data-parallel group; see {DOCS}")
            return loader
        shard.num_processes = self.mesh.sizes["dp"]
        shard.process_index = self.mesh.coords["dp"]
        return loader

    # ------------------------------------------------------------ the norm of the whole model

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:                  # max_grad_norm=0: the norm, without clipping
            grad_norm = whole_grad_norm(self.model).float()
        return grad_norm

    # ------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An ordinary HF checkpoint in `output_dir` (collective: call it on
        every rank; rank 0 writes it, with the tokenizer and the training
        arguments as Trainer does)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        checkpoint.save_pretrained(self.model, output_dir, safe_serialization=self.args.save_safetensors
                                   if hasattr(self.args, "save_safetensors") else True)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        dist.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_training_state(self.model, _raw_optimizer(self.optimizer), os.path.join(output_dir, STATE_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        dist.barrier()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights of a Trainer checkpoint: each rank reads its slices of
        the HF files (the DCP state, with the optimizer, follows in
        _load_optimizer_and_scheduler)."""
        checkpoint.load_pretrained(self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        state = os.path.join(checkpoint_dir, STATE_DIR)
        if not os.path.isdir(state):
            raise FileNotFoundError(f"ShardedTrainer: {checkpoint_dir} holds no {STATE_DIR}/ (the model and "
                                    f"optimizer state a ShardedTrainer checkpoint saves); it was not written by "
                                    f"ShardedTrainer; see {DOCS}")
        load_training_state(self.model, _raw_optimizer(self.optimizer), state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint_dir, SCHEDULER_NAME), weights_only=True))
