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
from typing import Any, Callable

from torch import nn

from .config import ShardConfig


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


class Policy(ABC):
    """Base class of model policies.  optimize() calls, in order:
    set_model, set_shard_config, config_sanity_check, module_policy (then the
    sharder plans and validates), preprocess, (the sharder applies),
    postprocess, get_shared_params."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.shard_config: ShardConfig | None = None

    def set_model(self, model: nn.Module) -> None:
        self.model = model

    def set_shard_config(self, shard_config: ShardConfig) -> None:
        self.shard_config = shard_config

    @property
    def tp_size(self) -> int:
        return self.shard_config.tensor_parallel_size

    @property
    def process_group(self):
        return self.shard_config.tensor_parallel_process_group

    #: Where pipeline parallelism splits the model (a shardformer.pipeline.StageSplit:
    #: the module running the layers, its layer list, the children that run after
    #: them); None: the policy does not implement pipeline parallelism.
    pipeline_split = None
    #: Why pipeline_split is None, for the refusal ("" : not said).
    pipeline_refusal = ""
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

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        """The sequence_parallelism_modes this policy implements (none by
        default: optimize() refuses SP for it, naming the policy and mode)."""
        return ()

    def supports_sequence_overlap(self) -> bool:
        """Whether this policy implements ShardConfig.enable_sequence_overlap
        (optimize() refuses the switch, naming the policy, when it does not)."""
        return False

    def sequence_overlap_refusal(self) -> str:
        """Why this policy does not implement enable_sequence_overlap (the
        sharder's message when supports_sequence_overlap() is False)."""
        return "its sequence-parallel blocks gather their input before the projections"

    def supports_sequence_recompute(self) -> bool:
        """Whether this policy implements ShardConfig.sequence_parallel_recompute
        (optimize() refuses it, naming the policy, when it does not)."""
        return False

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
        """Runs after substitution (e.g. re-tie shared weights).  If it
        raises, the model is marked partially sharded (see ModelSharder)."""
        return self.model

    def tie_followers(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) pairs, on modules this plan leaves alone,
        whose parameter is tied to one the plan splits and that postprocess
        points at the split one itself (an alias the module's forward never
        reads, such as HF's decoder bias kept as the prediction head's
        `bias`): the sharder's tie check (shardformer.ties) leaves them to
        it.  Default: those of the sub-policies (sub_policy)."""
        return [f for inner in self.__dict__.get("_sub_policies", {}).values() for f in inner.tie_followers()]

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
        postprocess.  Made once per module."""
        from .autopolicy import get_autopolicy

        cache = self.__dict__.setdefault("_sub_policies", {})
        inner = cache.get(id(module))
        if inner is None:
            inner = cache[id(module)] = get_autopolicy(module)
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
