"""A model family as data: its body's shape, its head classes and their heads.

A built-in family file (policies/<family>.py) holds one `Family`:

    FAMILY = Family(
        "mistral", "mistral.modeling_mistral", DecoderShape,
        options={"prefix": "Mistral"},
        heads={"MistralModel": (),
               "MistralForCausalLM": lm("lm_head"),
               "MistralForSequenceClassification": gathered("score")},
    )

From it come, without another line per class:

  * one Policy class per head class (`MistralForCausalLMPolicy`): the shape
    class (a Policy describing the shared body: decoder block, encoder
    layer, vision stage; see shardformer.policies.shapes) with the family's
    options as class attributes, plus the class's heads;
  * the registry entries (shardformer.autopolicy), keyed by the model class's
    full name ("transformers.models.<hf_module>.<class>"), or by the bare
    class name for remote code (`hf_module=""`).

Heads are split by kind (the plan styles of shardformer.plan, HEAD_STYLES):

    lm(suffix)          VocabParallelLMHead1D: the vocabulary (output rows) split,
                        logits gathered unless ShardConfig(parallel_output=True);
                        still tied to the input embeddings when HF had tied them;
                        `bias_of` names a module whose `bias` HF ties to the head's
    gathered(suffix)    Linear1D_Col with gather_output: a small classifier, its
                        labels split (any count) and all-gathered forward
    replicated_dropout(suffix)   DropoutForReplicatedInput: one mask on every rank

A custom model needs none of this: a `shardformer.Policy` subclass written by
hand is passed to optimize(model, policy=...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import ShardConfig
from .lm_loss import HOOK, LMLoss
from .plan import (PlanContext, has_module, hf_entries, install_hooks, install_window_overlaps, interpret,
                   record_hidden_states, record_ties, refuse, replacement, stage_split)
from .policy import ModulePolicyDescription, Policy, merge_policies
from .policy import SubModuleReplacementDescription as Sub
from .spec import Capabilities, PolicySpec

_HF = "transformers.models"


@dataclass(frozen=True)
class Head:
    """One head module of a model class: `suffix` (dotted path under the model),
    `kind` ("lm", "gathered", "replicated_dropout"), and for "lm" the module
    whose `bias` is the head's own bias (`bias_of`) and how the class
    computes its loss from the logits (`loss`, see shardformer.lm_loss: it
    matters under ShardConfig(parallel_output=True))."""

    suffix: str
    kind: str
    bias_of: str | None = None
    loss: LMLoss = HOOK

    def __post_init__(self):
        if self.kind not in ("lm", "gathered", "replicated_dropout"):
            raise ValueError(f"Head({self.suffix!r}): unknown kind {self.kind!r}")
        if not isinstance(self.loss, LMLoss):
            raise TypeError(f"Head({self.suffix!r}): loss must be an LMLoss, got {self.loss!r}")


#: The plan style of each kind of head (shardformer.plan).
HEAD_STYLES = {"lm": "vocab_lm_head", "gathered": "colwise_gather_output", "replicated_dropout": "dropout_replicated"}


def lm(suffix: str = "lm_head", bias_of: str | None = None, loss: str = "hook",
       also: tuple[str, str] | None = None) -> Head:
    """An LM head; `loss`/`also`: how the class computes its loss (LMLoss):
    "hook" where HF calls self.loss_function, "causal" / "masked" /
    "seq2seq" where it calls nn.CrossEntropyLoss itself."""
    return Head(suffix, "lm", bias_of, LMLoss(loss, also))


def gathered(suffix: str) -> Head:
    return Head(suffix, "gathered")


def replicated_dropout(suffix: str) -> Head:
    return Head(suffix, "replicated_dropout")


def sequence_mode_refused(model: str, path: str, mode: str, why: str) -> NotImplementedError:
    """The error of a sequence_parallelism_mode a composed model cannot take:
    names the model class, the module path the mode would apply to, the mode
    and the reason (raised from config_sanity_check, before anything changes)."""
    return NotImplementedError(f"{model}: sequence_parallelism_mode={mode!r} is not available for {path}: {why}")


def _as_heads(value) -> tuple[Head, ...]:
    if value is None:
        return ()
    if isinstance(value, Head):
        return (value,)
    heads = tuple(value)
    for h in heads:
        if not isinstance(h, Head):
            raise TypeError(f"heads: expected Head values (lm(), gathered(), ...), got {h!r}")
    return heads


@dataclass(frozen=True)
class Family:
    """name        the family ("llama"): its policy file and its row in the support matrix
    hf_module   the modeling module under transformers.models ("llama.modeling_llama"),
                "" for remote code (registry keys are then bare class names)
    shape       the Policy class describing the body (shardformer.policies.shapes)
    heads       {model class name: Head or tuple of Heads}; () for a base model
    options     class attributes of the generated policies (read by the shape)
    """

    name: str
    hf_module: str
    shape: type
    heads: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not (isinstance(self.shape, type) and issubclass(self.shape, FamilyPolicy)):
            raise TypeError(f"Family {self.name!r}: shape must be a FamilyPolicy subclass, got {self.shape!r}")
        for cls_name, value in self.heads.items():
            _as_heads(value)

    def registry_key(self, class_name: str) -> str:
        return f"{_HF}.{self.hf_module}.{class_name}" if self.hf_module else class_name

    def policy_classes(self) -> dict[str, type]:
        """{"<Class>Policy": generated Policy class} for every head class."""
        out = {}
        for cls_name, value in self.heads.items():
            name = f"{cls_name}Policy"
            attrs = dict(self.options, family=self, model_class=cls_name, heads=_as_heads(value),
                         __module__=f"shardformer.policies.{self.name}",
                         __doc__=f"The {self.name} policy of {cls_name} (generated from the family's data).")
            out[name] = type(name, (self.shape,), attrs)
        return out

    def registry(self) -> dict[str, tuple[str, str]]:
        """{registry key: (family, policy class name)}."""
        return {self.registry_key(c): (self.name, f"{c}Policy") for c in self.heads}

    def tp_plan(self, model: nn.Module, shard_config=None, policy_of=None) -> dict[str, str]:
        """The tensor-parallel split this family's policy makes of `model` (one
        of its head classes), in transformers' notation: {module path pattern
        ("model.layers.*.self_attn.q_proj"): transformers style}
        (FamilyPolicy.tp_plan; `shard_config` defaults to ShardConfig()).
        `policy_of`: the registry (shardformer.autopolicy.get_autopolicy), for
        a family whose policy composes another's (Gemma 3's, BLIP-2's)."""
        name = type(model).__name__
        if name not in self.heads:
            raise ValueError(f"Family {self.name!r} has no policy for {name} (its classes: {', '.join(self.heads)})")
        policy = self.policy_classes()[f"{name}Policy"]()
        policy.set_model(model)
        policy.set_shard_config(shard_config if shard_config is not None else ShardConfig())
        policy.begin(policy_of)
        return policy.tp_plan()


class SplitAttentionPolicy:
    """The all_to_all / ring_attn sequence parallelism of a policy, as data
    (mixed into FamilyPolicy and DerivedPolicy): the module calling the
    layers and their ModuleList (`split_attention_at`, or
    `split_attention_targets()`), where SequenceAttentionParallel hooks in."""

    #: (owner class, layers attribute): the module whose forward calls the
    #: layers ("{prefix}" and "{base_model}" filled from the shape's options)
    #: and its ModuleList of layers, where the all_to_all / ring_attn modes
    #: hook in; None where those modes are not available.
    split_attention_at: tuple[str, str] | None = None
    #: extra kwargs of SequenceAttentionParallel at `split_attention_at`
    #: (e.g. {"repeated": True} for layers run more than once per forward)
    split_attention_options: dict | None = None
    #: for attention outside transformers' AttentionInterface: where the split
    #: runs (shardformer.layer.sequence_attention.AttentionSeam); None: the registry
    attention_seam = None

    def split_attention_modes(self) -> tuple[str, ...]:
        """("all_to_all", "ring_attn") where the shape names the layers they
        apply to (`split_attention_at`), else ()."""
        return ("all_to_all", "ring_attn") if self.split_attention_at else ()

    def split_attention_policy(self) -> dict:
        """The all_to_all / ring_attn sequence parallelism of the body, as
        data: {owner class: its `layers` ModuleList takes
        SequenceAttentionParallel} (shardformer.layer.sequence_attention),
        from `split_attention_at`; {} when those modes are off.  Refuses
        (before anything changes) what the split layers cannot run:
        cross-attention to encoder states given from outside
        (add_cross_attention=True; encoder-decoder shapes name their cross
        attention in split_attention_targets), layerdrop (a skipped first or
        last layer would skip the split or the gather), and what the family's
        `attention_seam` refuses (AttentionSeam.refuse: another attention
        implementation)."""
        from .layer.sequence_attention import SequenceAttentionParallel

        cfg, name = self.shard_config, type(self.model).__name__
        if not cfg.split_attention_mode or cfg.split_attention_mode not in self.split_attention_modes():
            return {}
        mode = cfg.split_attention_mode
        config = getattr(self.model, "config", None)
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError(f"{name}: sequence_parallelism_mode={mode!r} with cross-attention "
                                      f"(add_cross_attention=True) is not available")
        for key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
            if getattr(config, key, 0.0):
                raise NotImplementedError(f"{name}: sequence_parallelism_mode={mode!r} with {key}="
                                          f"{getattr(config, key)}: a skipped first or last layer would skip the "
                                          f"split or the gather, and each rank would skip different layers; set it "
                                          f"to 0")
        if self.attention_seam is not None:
            self.attention_seam.refuse(self.model, mode, name)
        policy: dict = {}
        for owner, layers, base, options in self.split_attention_targets():
            sub = Sub(layers, SequenceAttentionParallel,
                      kwargs={"mode": mode, "group": cfg.sequence_group, "base": base, "name": name,
                              "seam": self.attention_seam, **options})
            policy.setdefault(owner, ModulePolicyDescription(sub_module_replacement=[]))
            policy[owner].sub_module_replacement.append(sub)
        return policy

    def split_attention_targets(self) -> list[tuple[str, str, nn.Module, dict]]:
        """(policy key: the owner's class name, path of the layers ModuleList
        under the owner, the module calling the layers, extra kwargs of
        SequenceAttentionParallel) per split stack: the one of
        `split_attention_at`.  Encoder-decoder shapes name one per stack."""
        template, layers = self.split_attention_at
        owner = template.format(prefix=getattr(self, "prefix", ""), base_model=getattr(self, "base_model", ""))
        found = [m for m in self.model.modules() if type(m).__name__ == owner]
        if len(found) != 1:
            raise ValueError(f"{type(self.model).__name__}: expected one {owner} module for sequence parallelism, "
                             f"found {len(found)}")
        return [(owner, layers, found[0], dict(self.split_attention_options or {}))]


class FamilyPolicy(SplitAttentionPolicy, Policy):
    """The base of every shape.  A shape's `body_policy()` describes the body
    (for whichever model class is being sharded); this class adds the heads of
    `model_class` and ties the LM heads after substitution."""

    family: Family | None = None
    model_class: str = ""
    heads: tuple[Head, ...] = ()
    def body_policy(self) -> dict:
        """{module class or class name: ModulePolicyDescription} for the body."""
        return {}

    def active_heads(self) -> tuple[Head, ...]:
        """The heads this model has (a shape drops optional ones, e.g. a
        classifier that HF makes an nn.Identity when num_labels=0)."""
        return self.heads

    def tp_plan(self) -> dict[str, str]:
        """This policy's split of the bound model in transformers' notation:
        {path pattern: style} for every replacement made from a plan style
        (shardformer.plan) that transformers has a name for.  A policy key
        (a module class) is written as the paths of its modules, layer
        indices as `*`; our refinements keep transformers' coarser name
        (colwise_heads, colwise_kv_heads, colwise_qkv: "colwise";
        vocab_lm_head: "colwise_gather_output"), and moe_tp_experts adds
        its parameters' entries (gate_up_proj packed_colwise, down_proj
        rowwise) as transformers writes them."""
        where: dict[str, set[str]] = {}
        for path, module in self.model.named_modules():
            where.setdefault(type(module).__name__, set()).add(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path))
        out = {}
        for key, description in self.module_policy().items():
            key_name = key if isinstance(key, str) else key.__name__
            for base in sorted(where.get(key_name, ())):
                for sub in description.sub_module_replacement:
                    if sub.style is not None:
                        out.update(hf_entries(f"{base}.{sub.suffix}" if base else sub.suffix, sub.style))
        return out

    def input_embeddings(self) -> nn.Module:
        """The input embedding an LM head may be tied to."""
        return self.model.get_input_embeddings()

    def module_policy(self) -> dict:
        policy = merge_policies(self.body_policy(), self.split_attention_policy())
        heads = self.active_heads()
        if self.tensor_parallel and heads:
            subs = [self.head_replacement(h) for h in heads]
            self.append_or_create_submodule_replacement(subs, policy, self.model_class)
        return policy

    def head_replacement(self, head: Head) -> Sub:
        return replacement(head.suffix, HEAD_STYLES[head.kind], PlanContext(self))

    def preprocess(self) -> nn.Module:
        # An LM head's tie is recorded (and checked after substitution) exactly when HF tied it
        # (the same Parameter as the input embedding's), whatever the config
        # says: shardformer.plan.record_ties, the one way ties are recorded.
        embeddings = self.input_embeddings() if self.tensor_parallel else None
        if embeddings is not None:
            source = self.path_of(embeddings)
            record_ties(self.state, self.model, [(source, h.suffix) for h in self.active_heads() if h.kind == "lm"])
        return super().preprocess()

    def tie_followers(self) -> list[tuple[nn.Module, str]]:
        """The `bias` of each LM head's `bias_of` module: postprocess points it
        at the head's split bias."""
        own = [(self.model.get_submodule(h.bias_of), "bias") for h in self.active_heads()
               if self.tensor_parallel and h.kind == "lm" and h.bias_of is not None]
        return own + super().tie_followers()

    def postprocess(self) -> nn.Module:
        super().postprocess()                   # the ties recorded in preprocess (Policy.postprocess)
        install_hooks(self.model, self.shard_config, self.state)      # the spec's Hook rows
        install_window_overlaps(self.model, self.shard_config, self.state)   # its Stack rows' WindowOverlap
        if self.tensor_parallel:
            for head in self.active_heads():
                if head.kind == "lm" and head.bias_of is not None:  # HF keeps the decoder bias as the owner's `bias`
                    setattr(self.model.get_submodule(head.bias_of), "bias", self.model.get_submodule(head.suffix).bias)
        return self.model

    def hf_class(self, name: str):
        """transformers.models.<family hf_module>.<name>."""
        import importlib

        return getattr(importlib.import_module(f"{_HF}.{self.family.hf_module}"), name)


class ComposedPolicy(FamilyPolicy):
    """A policy whose spec (`build_spec()`) composes the policies of models
    inside the model (PolicySpec.compose: a multimodal model's language
    model, found in the registry by its class and bound to it): the spec's
    replacements (shardformer.plan.interpret) and then each composed
    policy's, their sanity checks, pre- and postprocess run with this one's;
    the sequence-parallel modes and enable_sequence_overlap are the first
    composed policy's (the language model's: sequence parallelism splits its
    sequence), the spec's capabilities without one."""

    def build_spec(self) -> PolicySpec:
        raise NotImplementedError(f"{type(self).__name__}: a ComposedPolicy states its PolicySpec in build_spec()")

    def composed_policies(self) -> list[Policy]:
        """The registered policies of the spec's composed models the bound model
        has (a class without one skips it: PolicySpec.compose), bound to them."""
        return [self.sub_policy(self.model.get_submodule(path)) for path in self.build_spec().compose
                if has_module(self.model, path)]

    def config_sanity_check(self) -> None:
        """The composed policies' checks, the spec's refusals (plan.refuse: the
        conditions "composed" / "not_composed" say whether the model has one),
        then a sequence_parallelism_mode the composed model's policy does not
        implement refused by name (its path and class)."""
        inner = self.composed_policies()
        for policy in inner:
            policy.config_sanity_check()
        spec = self.build_spec()
        refuse(spec, self.model, self.shard_config)
        cfg = self.shard_config
        for path, policy in zip((p for p in spec.compose if has_module(self.model, p)), inner):
            if cfg.enable_sequence_parallelism and cfg.sequence_parallelism_mode not in policy.sequence_parallel_modes():
                raise sequence_mode_refused(type(self.model).__name__,
                                            f"{path} ({type(self.model.get_submodule(path)).__name__})",
                                            cfg.sequence_parallelism_mode,
                                            f"{type(policy).__name__} implements "
                                            f"{', '.join(policy.sequence_parallel_modes()) or 'no mode'}")

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        inner = self.composed_policies()
        return inner[0].sequence_parallel_modes() if inner else tuple(self.build_spec().capabilities.sp_modes)

    def supports_sequence_overlap(self) -> bool:
        inner = self.composed_policies()
        return inner[0].supports_sequence_overlap() if inner else self.build_spec().capabilities.sequence_overlap

    def body_policy(self) -> dict:
        policy = interpret(self.build_spec(), self.model, self.shard_config, self.state, self)
        for inner in self.composed_policies():
            merge_policies(policy, inner.module_policy())
        return policy

    def preprocess(self) -> nn.Module:
        for inner in self.composed_policies():
            inner.preprocess()
        return super().preprocess()

    def postprocess(self) -> nn.Module:
        """The composed policies' postprocess, then this one's; a spec with
        split-gather stacks of its own (BLIP-2's vision encoder and Q-Former)
        records their full sequences for output_hidden_states=True
        (plan.record_hidden_states)."""
        for inner in self.composed_policies():
            inner.postprocess()
        model = super().postprocess()
        return record_hidden_states(self, model) if self.build_spec().split_gather is not None else model


#: The Capabilities fields a SpecPolicy answers from its spec, and the Policy
#: field (read by the sharder, the pipeline and plan.record_hidden_states) each fills.
_CAPABILITY_FIELDS = {"sp_modes": "sp_modes", "split_attention_at": "split_attention_at",
                      "sequence_overlap": "sequence_overlap", "overlap_refusal": "sequence_overlap_why",
                      "sequence_recompute": "sequence_recompute", "pipeline_split": "pipeline_split",
                      "pipeline_refusal": "pipeline_refusal", "records_hidden_states": "records_hidden_states"}


def spec_capabilities(policy, **given) -> Capabilities:
    """A policy's capability fields (sp_modes, sequence_overlap, ...) as
    spec Capabilities: what a shape's spec factory states, the class names
    of split_attention_at filled from its options ("{prefix}Model");
    `given`: Capabilities fields stated instead of read from the policy."""
    fields = {cap: given[cap] if cap in given else getattr(policy, name) for cap, name in _CAPABILITY_FIELDS.items()}
    at = fields["split_attention_at"]
    if at is not None:
        fields["split_attention_at"] = (at[0].format(prefix=policy.prefix, base_model=policy.base_model), at[1])
    return Capabilities(**fields)


def spec_stage_split(policy):
    """A policy's pipeline_split read from its spec (plan.stage_split of
    capabilities.pipeline_split on the bound model; None before a model is
    bound): `pipeline_split = property(spec_stage_split)` in a class whose
    spec states SplitWhen rows."""
    if getattr(policy, "model", None) is None:
        return None
    return stage_split(policy.build_spec().capabilities.pipeline_split, policy.model)


class SpecPolicy(FamilyPolicy):
    """A Policy that is a PolicySpec (shardformer.spec): module_policy() is
    shardformer.plan.interpret of `build_spec()` (plus the split attention
    of spec.capabilities.split_attention_at and the heads), the sanity check
    its refusals (plan.refuse), every capability the spec's field.

    Give the spec as `SpecPolicy(spec)` (a user's policy, see
    docs/writing-policies.md) or as a class's `build_spec()` (the built-in
    shapes: policies/shapes.py DecoderShape builds it from the family's
    options).  The answers come from the spec of the bound model's
    options, so a subclass overrides build_spec(), never the accessors."""

    spec: PolicySpec | None = None

    def __init__(self, spec: PolicySpec | None = None) -> None:
        super().__init__()
        if spec is not None:
            if not isinstance(spec, PolicySpec):
                raise TypeError(f"SpecPolicy: expected a shardformer.spec.PolicySpec, got {type(spec).__name__}")
            if spec.compose:
                raise TypeError(f"SpecPolicy: policy spec {spec.name!r} composes {list(spec.compose)}; a spec that "
                                f"composes other models' policies is run by a shardformer.family.ComposedPolicy "
                                f"subclass (its build_spec()), see docs/writing-policies.md")
            self.spec = spec
            for cap, name in _CAPABILITY_FIELDS.items():     # what the sharder and the pipeline read
                setattr(self, name, getattr(spec.capabilities, cap))
            self.split_attention_options = dict(spec.capabilities.split_attention_options)

    def build_spec(self) -> PolicySpec:
        """This policy's PolicySpec (default: the one it was made with)."""
        if self.spec is None:
            raise TypeError(f"{type(self).__name__}: a SpecPolicy needs a PolicySpec (SpecPolicy(spec)) or a "
                            f"build_spec() method")
        return self.spec

    def config_sanity_check(self) -> None:
        refuse(self.build_spec(), self.model, self.shard_config)

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        own = tuple(self.build_spec().capabilities.sp_modes)
        return own + tuple(m for m in self.split_attention_modes() if m not in own)

    def split_attention_modes(self) -> tuple[str, ...]:
        caps = self.build_spec().capabilities
        return ("all_to_all", "ring_attn") if caps.split_attention_at or caps.split_attention_stacks else ()

    def split_attention_targets(self) -> list:
        """The targets of the spec's split_attention_stacks (SplitAttention
        rows: each owner class's first module, its base), else the one of
        split_attention_at."""
        rows = self.build_spec().capabilities.split_attention_stacks
        if not rows:
            return super().split_attention_targets()
        targets = []
        for row in rows:
            owner = next((m for m in self.model.modules() if type(m).__name__ == row.owner), None)
            if owner is None:
                raise ValueError(f"{type(self.model).__name__}: no {row.owner} module for sequence parallelism over "
                                 f"{row.layers}")
            targets.append((row.owner, row.layers, owner.get_submodule(row.base) if row.base else owner,
                            dict(row.options)))
        return targets

    def sequence_parallel_refusal(self, mode: str) -> str:
        return self.build_spec().capabilities.sp_refusal

    def supports_sequence_overlap(self) -> bool:
        return self.build_spec().capabilities.sequence_overlap

    def sequence_overlap_refusal(self) -> str:
        return self.build_spec().capabilities.overlap_refusal

    def supports_sequence_recompute(self) -> bool:
        return self.build_spec().capabilities.sequence_recompute

    def body_policy(self) -> dict:
        return interpret(self.build_spec(), self.model, self.shard_config, self.state, self)

    def postprocess(self) -> nn.Module:
        return record_hidden_states(self, super().postprocess())
