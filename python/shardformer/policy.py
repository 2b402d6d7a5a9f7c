"""Policy: what to replace in a model, as data.

A policy maps module classes (or, for remote code, class names) to a
ModulePolicyDescription: attributes to set, parameter callables, sub-modules
to swap for parallel layers, and methods to replace.  The sharder resolves
the whole description against the model and validates it before it changes
anything.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from .config import ShardConfig

if TYPE_CHECKING:
    from .lm_loss import LMLoss


@dataclass
class SubModuleReplacementDescription:
    """Replace the sub-module at `suffix` (dotted, relative to the matched
    module; `*` matches every child of a ModuleList / ModuleDict) by
    `target_module.from_native_module(native, process_group, **kwargs)`.
    A missing sub-module is an error unless `ignore_if_not_exist`.

    optimize() builds every replacement before it swaps any in, so
    from_native_module must not change `native`.  A target that changes the
    native module in place instead provides
    `prepare_native_module(native, process_group, **kwargs)`, returning an
    object whose commit() makes the change (returning the module) and whose
    rollback() undoes it (see shardformer.layer.param_shard.ShardParams).

    `style`: the plan style this replacement was made from (shardformer.plan;
    None when written by hand): it lets a policy's plan be written back in
    transformers' notation (FamilyPolicy.tp_plan)."""

    suffix: str
    target_module: Any
    kwargs: dict[str, Any] | None = None
    ignore_if_not_exist: bool = False
    style: str | None = None


@dataclass
class ModulePolicyDescription:
    """What to do to each module of one class.

    attribute_replacement: {dotted attribute: value}; a value may be a
        shardformer.layout.PerRank, resolved to this rank's value.
    param_replacement: callables fn(module) run on the module, in the swap
        phase (after every replacement was built); what they do cannot be
        undone, so a later failure leaves the model marked partially sharded.
    sub_module_replacement: SubModuleReplacementDescription list.
    method_replacement: {method name: function(self, ...)} bound to the module.
    """

    attribute_replacement: dict[str, Any] = field(default_factory=dict)
    param_replacement: list[Callable[[nn.Module], None]] = field(default_factory=list)
    sub_module_replacement: list[SubModuleReplacementDescription] = field(default_factory=list)
    method_replacement: dict[str, Callable] = field(default_factory=dict)


@dataclass
class OptimizeState:
    """What one optimize() learns about its model between a policy's hooks.

    The sharder makes one per optimize() (Policy.begin), the policy's hooks
    read and write it through `policy.state`, and the sharder drops it when
    the call ends (Policy.end): a policy instance keeps nothing of a model
    between calls (but `model` / `shard_config`, the seed's API), so one
    instance can shard two models, one after the other.

    sequence_state  the model's shardformer.layer.sequence.SequenceState under
                    split-gather SP (the sharder hands it to pipeline stages)
    ties            (source, target) module paths whose weights postprocess
                    checks are still one: the model's own ties, recorded once each by
                    shardformer.plan.record_ties (a spec's ties, the LM heads
                    HF had tied to the input embedding)
    sub_policies    {id(module): Policy} of the models composed inside this one
    policy_of       module -> its registered Policy (shardformer.autopolicy),
                    passed down by the caller so that no policy reaches up
                    for the registry; None where no registry was given
    window_overlaps {block path: (SequenceState, gather_at, attention)} of the
                    windowed blocks whose overlapped gather the policy's
                    postprocess hooks on (layer/window_overlap.py: the blocks
                    take other replacements of their own)
    hooks           (module, path, hook, kwargs, SequenceState) of the spec's Hook
                    rows (shardformer.spec.Hook), installed after substitution
                    on what then sits at `path` under `module`
                    (shardformer.plan.install_hooks)
    """

    sequence_state: Any = None
    ties: list[tuple[str, str]] = field(default_factory=list)
    sub_policies: dict[int, "Policy"] = field(default_factory=dict)
    policy_of: Callable[[nn.Module], "Policy"] | None = None
    window_overlaps: dict[str, tuple] = field(default_factory=dict)
    hooks: list[tuple] = field(default_factory=list)


class Policy(ABC):
    """Base class of model policies.  optimize() calls, in order:
    set_model, set_shard_config, begin, config_sanity_check, the capability
    checks (sequence_parallel_modes, supports_sequence_overlap,
    supports_sequence_recompute, pipeline_split), module_policy (then the
    sharder plans and validates), preprocess, (the sharder applies),
    postprocess, get_shared_params, end.

    This class declares everything the sharder, the LM loss
    (shardformer.lm_loss) and the pipeline read from a policy.  Capabilities
    are class data (`sp_modes`, `sequence_overlap`, `sequence_recompute`,
    `pipeline_split`, ...) read through one accessor each
    (`sequence_parallel_modes()`, `supports_sequence_overlap()`, ...); a
    subclass sets the data, or overrides the accessor where the answer
    depends on the model."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.shard_config: ShardConfig | None = None

    def set_model(self, model: nn.Module) -> None:
        self.model = model

    def set_shard_config(self, shard_config: ShardConfig) -> None:
        self.shard_config = shard_config

    @property
    def state(self) -> OptimizeState:
        """This optimize()'s OptimizeState (a fresh one when the policy is
        used outside optimize(), e.g. Family.tp_plan)."""
        state = self.__dict__.get("_optimize_state")
        if state is None:
            state = self.__dict__["_optimize_state"] = OptimizeState()
        return state

    def begin(self, policy_of: Callable[[nn.Module], "Policy"] | None = None) -> OptimizeState:
        """Start one optimize(): a fresh OptimizeState, returned (the sharder
        keeps it) and readable as `self.state` until end()."""
        state = self.__dict__["_optimize_state"] = OptimizeState(policy_of=policy_of)
        return state

    def end(self) -> None:
        """End the optimize() begun by begin(): the policy forgets its state
        (and that of the policies composed in it)."""
        self.__dict__.pop("_optimize_state", None)

    @property
    def tp_size(self) -> int:
        return self.shard_config.tensor_parallel_size

    @property
    def process_group(self):
        return self.shard_config.tensor_parallel_process_group

    # ---- Capabilities: data, each read by one accessor below. ----

    #: The sequence_parallelism_modes this policy implements in its own layers
    #: ("split_gather"); sequence_parallel_modes() adds split_attention_modes().
    sp_modes: tuple[str, ...] = ()
    #: Whether it implements ShardConfig.enable_sequence_overlap.
    sequence_overlap: bool = False
    #: Why it does not (the sharder's refusal) when sequence_overlap is False.
    sequence_overlap_why: str = "its sequence-parallel blocks gather their input before the projections"
    #: Whether it implements ShardConfig.sequence_parallel_recompute.
    sequence_recompute: bool = False
    #: Under split_gather, whether its layers' rows are marked (plan.split_gather_ends)
    #: so that output_hidden_states=True returns full sequences; False: refused by name
    #: (plan.record_hidden_states).
    records_hidden_states: bool = True
    #: Where pipeline parallelism splits the model (a shardformer.pipeline.StageSplit:
    #: the module running the layers, its layer list, the children that run after
    #: them); None: the policy does not implement pipeline parallelism.
    pipeline_split = None
    #: Why pipeline_split is None, for the refusal ("" : not said).
    pipeline_refusal = ""
    #: Class-name fillers of the pipeline's and the split attention's templates
    #: ("{prefix}DecoderLayer", "{base_model}"): the family's options.
    prefix: str = ""
    base_model: str = ""
    #: The heads of the model class (shardformer.family.Head: lm(), gathered(), ...).
    heads: tuple = ()
    #: How the model computes its LM loss when no `lm()` head says it
    #: (shardformer.lm_loss.LMLoss; None: "hook").
    lm_loss: "LMLoss | None" = None
    #: For attention outside transformers' AttentionInterface: where flash
    #: attention and the split attention run (shardformer.layer.sequence_attention.AttentionSeam).
    attention_seam = None
    #: output_attentions under TP (shardformer.layer.attention_weights): the index of the
    #: attention weights in the output tuple of an attention class, where it is not 1.
    attention_weights_at: dict[str, int] = {}
    #: attention classes whose weights fold the heads into the batch ([B*H, S_q, S_k]).
    attention_weights_folded: tuple[str, ...] = ()
    #: attention classes that also drop a replicated tensor (BLOOM's dropout_add of the
    #: residual): they keep torch's shared generator stream (shardformer.layer.rank_streams).
    attention_draws_replicated: tuple[str, ...] = ()

    def attention_data(self) -> tuple[dict[str, int], tuple[str, ...], tuple[str, ...]]:
        """(attention_weights_at, attention_weights_folded,
        attention_draws_replicated) of every policy class, merged: they are
        keyed by HF class names, and a model that composes families (BLIP-2
        with a T5 or OPT language model) holds attentions of other families'
        policies."""
        index_of, folded, replicated = {}, set(), set()
        for cls in _policy_classes(type(self)):
            index_of.update(vars(cls).get("attention_weights_at", {}))
            folded.update(vars(cls).get("attention_weights_folded", ()))
            replicated.update(vars(cls).get("attention_draws_replicated", ()))
        return index_of, tuple(sorted(folded)), tuple(sorted(replicated))

    def config_sanity_check(self) -> None:
        """Raise if the model's configuration is one this policy cannot shard."""

    def build_spec(self):
        """This policy's shardformer.spec.PolicySpec; None: a hand-written
        policy, no spec (its LM heads honour parallel_output)."""
        return None

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        """The sequence_parallelism_modes this policy implements: `sp_modes`,
        then split_attention_modes() (none by default: optimize() refuses SP
        for it, naming the policy and mode)."""
        own = tuple(self.sp_modes)
        return own + tuple(m for m in self.split_attention_modes() if m not in own)

    def split_attention_modes(self) -> tuple[str, ...]:
        """The modes that split the sequence inside the attention ("all_to_all",
        "ring_attn") this policy implements (shardformer.family.SplitAttentionPolicy)."""
        return ()

    def sequence_parallel_refusal(self, mode: str) -> str:
        """Why `mode` is not in sequence_parallel_modes() ("" : not said)."""
        return ""

    def supports_sequence_overlap(self) -> bool:
        """Whether this policy implements ShardConfig.enable_sequence_overlap
        (`sequence_overlap`; optimize() refuses the switch, naming the policy,
        when it does not)."""
        return self.sequence_overlap

    def sequence_overlap_refusal(self) -> str:
        """Why this policy does not implement enable_sequence_overlap (the
        sharder's message when supports_sequence_overlap() is False)."""
        return self.sequence_overlap_why

    def supports_sequence_recompute(self) -> bool:
        """Whether this policy implements ShardConfig.sequence_parallel_recompute
        (`sequence_recompute`; optimize() refuses it, naming the policy, when
        it does not)."""
        return self.sequence_recompute

    def active_heads(self) -> tuple:
        """The heads this model has (`heads`; a policy drops optional ones, e.g.
        a classifier HF makes an nn.Identity when num_labels=0)."""
        return self.heads

    def preprocess(self) -> nn.Module:
        """Runs after validation, before substitution; must not fail and must
        not change the model (record on the policy what postprocess needs):
        a failed optimize() puts back only what the sharder changed.  (The
        optimizations -- fused norms, fused MLP activations, flash attention --
        are the sharder's, by module type: shardformer.optimizations.)"""
        return self.model

    @abstractmethod
    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        """{module class or class name: ModulePolicyDescription}."""

    def postprocess(self) -> nn.Module:
        """Runs after substitution.  Here: the ties the policy recorded
        (state.ties, (source, target) module paths: shardformer.plan.record_ties)
        are checked, not made.  The engine already bound them: every
        Parameter the model held under several names before substitution is
        one Parameter in the replacements before they are swapped in
        (shardformer.ties, by identity), so each target's `weight` is its
        source's; one that is not raises, naming both paths.  If it raises,
        the model is marked partially sharded (see ModelSharder)."""
        for source, target in self.state.ties:
            held = getattr(self.model.get_submodule(source), "weight", None)
            if getattr(self.model.get_submodule(target), "weight", None) is not held:
                raise RuntimeError(f"{type(self.model).__name__}: {target}.weight is no longer {source}.weight after "
                                   f"substitution, though the model tied them (shardformer.ties binds ties by "
                                   f"Parameter identity)")
        return self.model

    def path_of(self, module: nn.Module) -> str:
        """The dotted path of `module` in the bound model."""
        for path, each in self.model.named_modules():
            if each is module:
                return path
        raise ValueError(f"{type(self.model).__name__}: {type(module).__name__} is not a module of the model")

    def tie_followers(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) pairs, on modules this plan leaves alone,
        whose parameter is tied to one the plan splits and that postprocess
        points at the split one itself (an alias the module's forward never
        reads, such as HF's decoder bias kept as the prediction head's
        `bias`): the sharder's tie check (shardformer.ties) leaves them to
        it.  Default: those of the sub-policies (sub_policy)."""
        return [f for inner in self.state.sub_policies.values() for f in inner.tie_followers()]

    def get_shared_params(self) -> list[dict[int, nn.Parameter]]:
        """Parameters shared across pipeline stages ({stage: param} per set)."""
        return []

    # Helpers shared by the built-in policies.

    @property
    def tensor_parallel(self) -> bool:
        return self.shard_config.enable_tensor_parallelism

    def vocab_kwargs(self) -> dict[str, Any]:
        """kwargs for VocabParallelEmbedding1D / VocabParallelLMHead1D."""
        return {"make_vocab_size_divisible_by": self.shard_config.option("make_vocab_size_divisible_by")}

    def lm_head_kwargs(self) -> dict[str, Any]:
        return dict(self.vocab_kwargs(), gather_output=not self.shard_config.parallel_output)

    def tie_weight(self, source: str, target: str, name: str = "weight") -> None:
        """Make module `target`'s parameter `name` the same Parameter as
        module `source`'s (e.g. an LM head tied to the input embedding)."""
        src = self.model.get_submodule(source)
        setattr(self.model.get_submodule(target), name, getattr(src, name))

    def sub_policy(self, module: nn.Module) -> "Policy":
        """The registered policy of `module`, a model inside this one (a
        multimodal model's language model, say), bound to it and to this
        shard config: a policy composes it by merging its module_policy()
        (merge_policies) and forwarding its sanity check, pre- and
        postprocess.  Made once per module and optimize(), from the registry
        the caller passed down (OptimizeState.policy_of)."""
        state = self.state
        inner = state.sub_policies.get(id(module))
        if inner is None:
            if state.policy_of is None:
                raise RuntimeError(f"{type(self).__name__}: composing the policy of {type(module).__name__} needs "
                                   f"the policy registry: pass it down (Policy.begin(policy_of=shardformer.autopolicy.get_autopolicy); "
                                   f"optimize() and get_autopolicy() do)")
            inner = state.sub_policies[id(module)] = state.policy_of(module)
            inner.begin(state.policy_of)
        inner.set_model(module)
        inner.set_shard_config(self.shard_config)
        return inner

    @staticmethod
    def append_or_create_submodule_replacement(
        description: SubModuleReplacementDescription | list[SubModuleReplacementDescription],
        policy: dict[Any, ModulePolicyDescription],
        target_key: Any,
    ) -> dict[Any, ModulePolicyDescription]:
        """Add sub-module replacements to policy[target_key], creating the entry."""
        items = description if isinstance(description, list) else [description]
        entry = policy.setdefault(target_key, ModulePolicyDescription())
        entry.sub_module_replacement.extend(items)
        return policy


def merge_policies(policy: dict[Any, ModulePolicyDescription],
                   other: dict[Any, ModulePolicyDescription]) -> dict[Any, ModulePolicyDescription]:
    """Add `other`'s descriptions to `policy` (one description per key); returns `policy`."""
    for key, desc in other.items():
        mine = policy.setdefault(key, ModulePolicyDescription())
        mine.attribute_replacement.update(desc.attribute_replacement)
        mine.param_replacement.extend(desc.param_replacement)
        mine.sub_module_replacement.extend(desc.sub_module_replacement)
        mine.method_replacement.update(desc.method_replacement)
    return policy


def _policy_classes(own: type) -> list[type]:
    """Every Policy subclass defined (the built-in policies, the user's), with
    `own` (the policy in use) last so that its entries win."""
    seen, stack = [], [Policy]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return [c for c in seen if c is not own] + [own]
