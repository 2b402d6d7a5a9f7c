"""ModelSharder: sequences the policy hooks around the C sharder engine
(csrc/sharder.h: sharder_policy.c, sharder_walk.c, sharder_apply.c).

The engine reads and checks the policy (ModulePolicyDescription data, the one
place its shape is checked), walks the tree, matches, resolves suffixes and
per-rank values, asks each replacement class what it splits (plan_shard) and
resolves every shard layout in C; then it applies the plan.  (tp_size, rank)
are decided here, once per optimize(), and travel to the layers in their
plans.

A failed optimize() leaves the model as it was:

  * everything that can fail on a bad model or policy runs before the model
    changes: the group and replica checks, the plan, and, in the engine's
    first phase, building every replacement module;
  * the engine then swaps the replacements in, journaled, and undoes the
    swaps if one fails (or is interrupted); the flash-attention switch and
    the hooks adopt merged are put back too;
  * the one exception is a change that cannot be undone (a policy's
    param_replacement callable that ran, a replacement changed in place
    without prepare_native_module, a policy postprocess that failed): the
    model is then marked, and every later optimize() or forward on it raises
    "partially sharded by a failed optimize() (...); rebuild it".

With extra_kwargs broadcast_weights=True the group's rank-0 weights, once
broadcast (after the plan, before the build), stay even if a later step fails.
KeyboardInterrupt, SystemExit, MemoryError and RecursionError come out as
raised (same object), after the rollback.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings

from torch import nn

from . import _C, compile_refusal, ddp_guard, input_check, lazy, pickling, step_guard
from .autopolicy import get_autopolicy, registered_class
from .checkpoint import bind_hf_methods
from .config import ShardConfig, group_size_and_rank
from .distributed.agree import agree, members
from .grad_norm import whole_parameters
from .inherit import Inheritance, check_replaceable
from .layer.attention_weights import gather_attention_weights
from .layer.rank_streams import guard_random_streams
from .lm_loss import LMLossPlan
from .replicas import broadcast_weights, check_same_model
from .ties import find_ties
from .optimizations import enable_attention, optimization_policy
from .policy import Policy

SHARDED_MARK = "_shardformer_sharded"
BROKEN_MARK = "_shardformer_broken"


def _optimization_ops(model, name: str, cfg: ShardConfig, ops: list, tp_size: int, rank: int) -> list:
    """The plan of the optimizations (fused norms, fused MLP activations) for
    the modules the policy's plan `ops` leaves alone (shardformer.optimizations)."""
    replaced = {op.path for op in ops if op.kind == "sub"}
    methods = {op.path for op in ops if op.kind == "method"}
    extra = optimization_policy(model, cfg, replaced, methods)
    if not extra:
        return []
    return _C.sharder_plan(model, name, extra, tp_size, rank)[0]


def _check_expert_plan(name: str, policy, cfg: ShardConfig, ops: list) -> None:
    """With an expert-parallel group, the plan must split some experts over
    it (a model without MoE blocks, or a policy that does not map them, is
    refused before anything changes)."""
    if cfg.expert_parallel_process_group is None:
        return
    from .layer.expert_parallel import ExpertParallelExperts

    if not any(op.kind == "sub" and op.target is ExpertParallelExperts for op in ops):
        raise ValueError(f"{name}: ShardConfig.expert_parallel_process_group is set, but {type(policy).__name__} "
                         f"splits no mixture-of-experts block of {name} over it (the model has none, or its "
                         f"policy does not map expert parallelism); leave expert_parallel_process_group None")


# optimize() (and from_pretrained) run their collectives under this lock: two threads sharding at once
# would interleave their collectives on one group (gloo aborts the process on the mixed-up messages, or
# the ranks wait on different calls).  Serialized, each call's collectives run whole; the ranks then pair
# their calls in the order each took the lock, and _agree_on_call refuses, on every rank and by name,
# a pairing of different models.  Reentrant: from_pretrained holds it around its own optimize().
SERIAL = threading.RLock()

_GROUP_FIELDS = ("tensor_parallel_process_group", "pipeline_stage_manager", "sequence_parallel_process_group",
                 "expert_parallel_process_group")


def _agree_on_call(model: nn.Module, policy, cfg: ShardConfig, groups: list, name: str) -> None:
    """Before the first collective: every rank of each group shards the same
    class of model with the same policy and switches, over the same group
    (shardformer.distributed.agree); else RuntimeError on every rank naming
    the ranks and what differs.  The models' contents are the replica
    check's (shardformer.replicas: it names the tensors that differ)."""
    common = {"model": name, "policy": type(policy).__qualname__}
    common.update((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in _GROUP_FIELDS)
    for group, what in groups:
        agree("ShardFormer.optimize", dict(common, **{f"{what} group": members(group)}), group)


def _decoding_groups(cfg: ShardConfig) -> list:
    """The groups whose ranks run generate() together: the tensor-parallel
    group, then the sequence-parallel one when it is another."""
    out = [cfg.tensor_parallel_process_group] if cfg.enable_tensor_parallelism else []
    if cfg.split_attention_mode and (not out or cfg.sequence_group is not out[0]):
        out.append(cfg.sequence_group)
    return out


def _refuse_broken(module: nn.Module, _args) -> None:
    """Forward pre-hook of a model a failed optimize() left partially sharded."""
    raise RuntimeError(module.__dict__[BROKEN_MARK])


def mark_broken(model: nn.Module, name: str, error: BaseException) -> None:
    """Mark `model` as left partially sharded by a failed optimize(): every
    later optimize() and forward raises, naming the original error."""
    if BROKEN_MARK in model.__dict__:
        return
    model.__dict__[BROKEN_MARK] = (
        f"{name}: this model is partially sharded by a failed optimize() ({type(error).__name__}: {error}); "
        f"rebuild it (construct or load it again) before using it")
    model.register_forward_pre_hook(_refuse_broken, prepend=True)


def check_usable(model: nn.Module, name: str) -> None:
    """Refuse a model that optimize() already sharded, or left partially sharded."""
    broken = model.__dict__.get(BROKEN_MARK)
    if broken:
        raise RuntimeError(broken)
    if getattr(model, SHARDED_MARK, False):
        raise ValueError(f"{name}: this model has already been sharded by optimize()")


class _AttentionSwitch:
    """What enable_attention changes, recorded to be put back when the
    optimize() fails: the attributes of every config the model's modules hold
    and of their sub-configs (HF sets the attention implementation
    recursively), and the model's own attributes and forward pre-hooks."""

    def __init__(self, model: nn.Module):
        configs, stack = {}, [getattr(m, "config", None) for m in model.modules()]
        while stack:
            cfg = stack.pop()
            if cfg is None or not hasattr(cfg, "__dict__") or id(cfg) in configs:
                continue
            configs[id(cfg)] = cfg
            stack.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", None) or ())
        self.model = model
        self.configs = [(cfg, dict(vars(cfg))) for cfg in configs.values()]
        self.attributes = set(vars(model))
        self.pre_hooks = set(model._forward_pre_hooks)

    def undo(self) -> None:
        for cfg, saved in self.configs:
            state = vars(cfg)
            state.clear()
            state.update(saved)
        for key in set(vars(self.model)) - self.attributes:
            del self.model.__dict__[key]
        for key in set(self.model._forward_pre_hooks) - self.pre_hooks:
            self.model._forward_pre_hooks.pop(key, None)
            self.model._forward_pre_hooks_with_kwargs.pop(key, None)
        from .attention import disable_seam

        disable_seam(self.model)


def _sequence_states(state, model: nn.Module) -> list:
    """The sequence-parallel states of a sharded model (told the sequence
    length by a pipeline stage that starts from received rows): the split
    policy's SequenceState (in this optimize()'s OptimizeState) and the
    hooked modules' (split_gather), the SequenceSplit its attention modules
    share (all_to_all / ring_attn).  With state None: the states of the
    modules under `model` only (one stack of an encoder-decoder)."""
    from .layer.sequence import STATE_MARK

    states = [state.sequence_state if state is not None else None]
    states += [m.__dict__.get(key) for m in model.modules() for key in (STATE_MARK, "_shardformer_sequence_split")]
    unique = {id(s): s for s in states if s is not None}
    return list(unique.values())


class ModelSharder:
    """Shard `model` in place according to `policy` and `shard_config`."""

    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig | None = None) -> None:
        self.model = model
        self.policy = policy
        self.shard_config = shard_config if shard_config is not None else ShardConfig()
        self.check_plan = None      # callable(ops), run on the plan before the model changes (shardformer.lora)

    def shard(self) -> list[dict[int, nn.Parameter]]:
        with SERIAL:                            # one optimize() at a time in this process (see SERIAL)
            try:
                return self._shard()
            finally:                            # the policy keeps no state of this model (OptimizeState)
                self.policy.end()

    def _shard(self) -> list[dict[int, nn.Parameter]]:
        model, policy, cfg = self.model, self.policy, self.shard_config
        name = type(model).__name__
        check_usable(model, name)
        group = cfg.tensor_parallel_process_group
        tp_size, rank = group_size_and_rank(group)      # decided once; the plans carry them to the layers
        # The sequence-parallel group of all_to_all / ring_attn may be a second group
        # (ranks holding the same TP shard): its ranks must agree on the model too.
        groups = [(group, "tensor-parallel")]
        if cfg.split_attention_mode and cfg.sequence_group is not group:
            groups.append((cfg.sequence_group, "sequence-parallel"))
        if cfg.expert_parallel_process_group is not None:
            groups.append((cfg.expert_parallel_process_group, "expert-parallel"))
        manager = cfg.pipeline_stage_manager
        if manager is not None and manager.num_stages > 1:
            groups.append((manager.group, "pipeline-parallel"))
        _agree_on_call(model, policy, cfg, groups, name)
        for each, what in groups:
            if cfg.option("broadcast_weights"):
                check_same_model(model, each, name, content=False, what=what)
            elif cfg.option("check_replicas"):
                check_same_model(model, each, name, what=what)
        policy.set_model(model)
        policy.set_shard_config(cfg)
        state = policy.begin(get_autopolicy)    # the registry passed down, for the models it composes
        policy.config_sanity_check()
        if cfg.enable_sequence_parallelism and cfg.sequence_parallelism_mode not in policy.sequence_parallel_modes():
            why = policy.sequence_parallel_refusal(cfg.sequence_parallelism_mode)
            raise NotImplementedError(
                f"{name}: sequence parallelism mode {cfg.sequence_parallelism_mode!r} is not available for "
                f"{type(policy).__name__} (it implements: {', '.join(policy.sequence_parallel_modes()) or 'none'})"
                + (f": {why}" if why else ""))
        if cfg.enable_sequence_overlap and not policy.supports_sequence_overlap():
            raise NotImplementedError(
                f"{name}: enable_sequence_overlap is not available for {type(policy).__name__} "
                f"({policy.sequence_overlap_refusal()}); switch it off")
        if cfg.sequence_parallel_recompute is not None and not policy.supports_sequence_recompute():
            raise NotImplementedError(
                f"{name}: sequence_parallel_recompute={cfg.sequence_parallel_recompute!r} is not available for "
                f"{type(policy).__name__} (its layers open no selective-recompute scope); leave it None")
        stages = self._plan_stages(name) if manager is not None else None
        # the LM loss on the vocabulary shards (with gathered logits too, when called with labels)
        losses = LMLossPlan(model, policy, name, registered_class, gathered=not cfg.parallel_output) \
            if cfg.enable_tensor_parallelism and (cfg.parallel_output or (tp_size > 1 and cfg.option("loss_on_shards"))) \
            else None
        module_policy = policy.module_policy()
        ops, matched = _C.sharder_plan(model, name, module_policy, tp_size, rank)
        if module_policy and matched == 0:
            keys = ", ".join(k if isinstance(k, str) else k.__qualname__ for k in module_policy)
            raise ValueError(f"{name}: {type(policy).__name__} matched no module of the model "
                             f"(policy keys: {keys})")
        _check_expert_plan(name, policy, cfg, ops)
        ops += _optimization_ops(model, name, cfg, ops, tp_size, rank)
        check_replaceable(name, ops)
        if self.check_plan is not None:
            self.check_plan(ops)
        if cfg.option("broadcast_weights"):      # the plan is valid: now rank 0's weights everywhere
            for each, _ in reversed(groups):      # SP first: then TP spreads the SP group's rank 0
                broadcast_weights(model, each)
        inheritance = self._apply(ops, name)
        try:
            self.model = policy.postprocess()
            if stages is not None:              # after the TP swaps: drop what other stages hold
                stages.apply(self.model)
                stages.sequence_states = _sequence_states(state, self.model)
                stages.stack_states = [_sequence_states(None, self.model.get_submodule(spec.module))
                                       for spec in stages.plan.stacks]
            lazy.materialize_module(self.model)  # the replicated parameters of a lazy_init() model
            if stages is not None:
                stages.bind_shared(self.model)
            if losses is not None:               # the heads are in: their models' losses go to the shards
                losses.install(self.model)
            if stages is None:                   # every rank of the groups decodes the same tokens
                from . import lockstep           # (imports transformers: not at `import shardformer`)

                # a rank raising in forward() / generate() stops its peers (step_guard); lockstep and
                # the fast decode path wrap what it put
                step_guard.install(self.model, cfg, name)

                lockstep.install(self.model, _decoding_groups(cfg), name, cfg.expert_parallel_process_group)
                if (tp_size > 1 and cfg.enable_fast_decode and cfg.enable_tensor_parallelism
                        and not cfg.enable_sequence_parallelism):
                    from . import decode         # decode steps of Llama-shaped models without HF's per-op Python

                    decode.install(self.model, group, name)
            else:                                # generate() through the stages (shardformer.pipeline.generate)
                from .pipeline import generate as pipeline_generate

                pipeline_generate.install(self.model, _decoding_groups(cfg) + [manager.group], name,
                                          bool(cfg.enable_sequence_parallelism), cfg.expert_parallel_process_group)
            if tp_size > 1:                      # torch's generator: streams per rank, layerdrop agreed
                index_of, folded, draws_replicated = policy.attention_data()
                guard_random_streams(self.model, group, rank, name, draws_replicated)
                gather_attention_weights(self.model, group, tp_size, rank, index_of, folded)
            messages = inheritance.finish(self.model, name)
            bind_hf_methods(self.model)
        except BaseException as e:
            mark_broken(model, name, e)        # the swaps are in: a postprocess cannot be undone
            raise
        object.__setattr__(self.model, SHARDED_MARK, True)
        # the ranks that must be given one batch compare their inputs; DDP may not span ranks holding other shards
        input_check.install(self.model, cfg, name, pipelined=stages is not None, whole=whole_parameters)
        step_guard.settle_before_other_hooks(self.model)
        ddp_guard.install(self.model, name, ([(group, "tensor-parallel")] if cfg.enable_tensor_parallelism else [])
                          + ([(manager.group, "pipeline")] if stages is not None else []))
        why = pickling.refusal_reason(name, cfg, stages is not None)
        if why is not None:                      # torch.save(model) refused with the reason
            self.model.register_forward_pre_hook(pickling.PickleRefusal(why), prepend=True)
        if cfg.enable_sequence_parallelism:      # torch.compile refused by name, before any other hook runs
            compile_refusal.refuse_sequence_parallel_compile(self.model, name, cfg.sequence_parallelism_mode)
        for message in messages:                 # last: a warning turned error finds the model complete
            warnings.warn(message, stacklevel=4)
        return policy.get_shared_params() + (stages.shared_params if stages is not None else [])

    def _plan_stages(self, name: str):
        """This rank's pipeline stage of the model, checked (nothing changes yet)."""
        from .pipeline.stages import StageRuntime, plan_stages

        policy, manager = self.policy, self.shard_config.pipeline_stage_manager
        split = policy.pipeline_split
        if split is None:
            why = policy.pipeline_refusal or "its policy sets no pipeline_split"
            raise NotImplementedError(f"{name}: pipeline parallelism is not available for {type(policy).__name__} "
                                      f"({why})")
        plan = plan_stages(self.model, split, manager, name, prefix=policy.prefix, base_model=policy.base_model)
        runtime = StageRuntime(plan, manager, name, self.shard_config.tensor_parallel_process_group)
        if self.shard_config.expert_parallel_process_group is not None:
            runtime.lockstep_groups.append((self.shard_config.expert_parallel_process_group, "expert-parallel"))
        # an LM head whose class computes its loss itself (nn.CrossEntropyLoss, a mean per call):
        # the schedule must not hand it num_items_in_batch, which that loss ignores
        runtime.own_mean_loss = any(h.kind == "lm" and h.loss.kind != "hook" for h in policy.active_heads())
        return runtime

    def _apply(self, ops: list, name: str) -> Inheritance:
        """Switch attention, preprocess, and apply the plan (the engine builds
        every replacement, the tied parameters are bound in them, then the
        engine swaps them in); on failure, put back what changed, or mark the
        model when something cannot be put back."""
        model, cfg = self.model, self.shard_config
        inheritance = Inheritance(model)
        attention = _AttentionSwitch(model) if cfg.enable_flash_attention else None
        journal: list = []                       # what the engine changed and could not undo
        try:
            enable_attention(model, cfg, self.policy.attention_seam)
            self.policy.model = self.policy.preprocess()
            # bound in the builds, before the swaps (shardformer.ties)
            ties = find_ties(model, name, self.policy.tie_followers())
            _C.sharder_apply(ops, cfg.tensor_parallel_process_group, inheritance, journal, ties)
            if cfg.enable_skinny_linear:
                from .layer.linear import set_skinny_linear

                set_skinny_linear(model)
        except BaseException as e:
            if journal:
                mark_broken(model, name, e)
            else:
                inheritance.undo()
                if attention is not None:
                    attention.undo()
            raise
        return inheritance
