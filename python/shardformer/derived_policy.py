"""A policy derived from the model's own tensor-parallel plan.

transformers models carry a plan: `config.base_model_tp_plan` (paths relative
to the base model, e.g. "layers.*.self_attn.q_proj") and the head class's
`_tp_plan` (e.g. {"lm_head": "colwise_gather_output"}).  A model's resolved
plan is the head class's plan plus the base model's, prefixed by the base
model's attribute (`base_model_prefix`, "model."); transformers keeps it on
the instance as `model._tp_plan`.  `*` stands for a layer index.

When no built-in policy matches a model, shardformer.autopolicy falls back to
`DerivedPolicy` (optimize(model, plan=...) builds one from a plan the user
writes).  It maps each style of the plan onto a style of shardformer.plan,
whose interpreter the built-in policies use too, after looking at the
module (its width, whether it is in an attention or is the LM head):

    colwise                         Linear1D_Col, output left split.  Inside an
                                    attention module the split follows the heads
                                    (Heads.q / Heads.kv: KV heads replicated when
                                    fewer than ranks; a fused per-head projection,
                                    GPT-NeoX's [q_h k_h v_h] blocks, by whole heads)
    rowwise                         Linear1D_Row, input split like its colwise
                                    siblings (by query heads in an attention module)
    colwise_gather_output, _rep     Linear1D_Col(gather_output=True); on the output
                                    embeddings VocabParallelLMHead1D (padded vocabulary)
    rowwise_split_input, _rep       Linear1D_Row(input_is_parallel=False)
    embedding_rowwise (and rowwise  VocabParallelEmbedding1D (padded vocabulary,
      on an nn.Embedding)           the module's embed scale kept)
    packed_colwise                  Linear1D_Col split Fused.equal(2): each rank keeps
                                    its part of both halves ([gate | up])
    packed_rowwise                  Linear1D_Row, input split Fused.equal(2)
    replicated_with_grad_allreduce  ReplicatedInParallelRegion (gradients all-reduced)
    moe_tp_experts                  FusedExperts1D, when its gate_up_proj is
                                    packed_colwise (or grouped_gemm) and its
                                    down_proj rowwise (or grouped_gemm): every
                                    expert's intermediate features split, partial
                                    outputs all-reduced; the router stays replicated
    moe_tp_experts, with ShardConfig.expert_parallel_process_group:
                                    ExpertParallelExperts (shardformer.layer.expert_parallel):
                                    the experts split over the EP group (tokens
                                    exchanged by all_to_all), each still split over TP
    ep_router                       with an EP group: the router stays replicated (every
                                    rank routes its own tokens; the experts layer
                                    dispatches them); without one, refused
    grouped_gemm                    (on an experts module's 3-D parameters) the same
                                    FusedExperts1D split.  transformers' expert-parallel
                                    plans split the experts dimension instead and pair it
                                    with ep_router; without ep_router in the plan the
                                    router is replicated and an intermediate split gives
                                    the same sum, so that is what runs
    mla_kv_a_proj                   SharedRopeKeyProjection: multi-head latent attention's
                                    joint KV down-projection [c_kv | k_pe] stays whole; the
                                    rotary key k_pe, shared by every head, has its gradient
                                    all-reduced.  Its attention's q_b_proj / q_proj and
                                    kv_b_proj are split by whole heads (per head
                                    [q_nope | q_pe] and [k_nope | v] blocks), o_proj by
                                    the same heads; the low-rank path (q_a_proj and the
                                    latent norms) stays replicated with no reduction (the
                                    column layers' input copies already sum its gradient)

A latent attention that the model's own plan leaves out entirely (DeepSeek-V3,
Mistral 4, Kimi Linear) gets DeepSeek-V2's attention entries
(latent_attention_supplement), found by its shape, so it is split by heads too.

Anything else (sequence_parallel, all_reduce, ep_router without an EP group, megamoe_*,
moe_identity_expert, unknown names), a style on a module it does not fit,
or a head split that cannot be made, is refused while planning, before the
model changes, naming the style, the module path and the model class.  So
is a latent attention split by heads without mla_kv_a_proj, or with
parameterized children beside its latent path that the plan does not name.
Paths of the plan that match no module are skipped (as transformers does).

A module whose column layers leave their output split (an attention or MLP
block) has its other parameterized children, which the plan does not name
(an activation with parameters, a per-head norm), act on this rank's
features: their gradients are all-reduced (as replicated_with_grad_allreduce).
An attention module whose projections are split by heads gets its head-count
attributes set per rank (num_heads / num_attention_heads, num_key_value_heads,
num_key_value_groups, and all_head_size / hidden_size / embed_dim when they
are the query width); one whose forward reads head counts from `self.config`
gets a per-rank copy of the config.  An LM head tied to the input embeddings
stays tied: the input embeddings are then split by vocabulary as well.
What is read from the module tree rather than from the plan (which module is
an attention or a norm, head-count attributes, widths, forward sources) is
in one place, shardformer.derived_rules, each rule with why it is a guess.

Sequence and pipeline parallelism split around the layer list
(DerivedPolicy.layer_stack): the one ModuleList that `base_model_pp_plan`
names, or, for a config without that plan (OLMoE, NanoChat), the one
ModuleList under the base model that the tensor-parallel plan's per-layer
entries index ("model.layers.*.mlp.up_proj" -> layers).  None or several
(HRM-Text's two recurrent stacks): every mode and the pipeline refused,
naming the candidates.  all_to_all / ring_attn:
SequenceAttentionParallel on that list (shardformer.layer.sequence_attention:
the rows [B, S'/p, hidden] run every layer, attention exchanges heads or
passes K/V blocks around the ring through transformers' AttentionInterface).
split_gather: each child of a layer holding split layers is a region of
shardformer.layer.sequence (input all-gathered along S, backward
reduce-scatter; output reduce-scattered, backward all-gather), the norms
between them run on this rank's rows (gradients all-reduced), see
DerivedPolicy.split_gather_spec.  Refused by name, before the model changes:
layer types other than attention (linear attention, recurrent mixers), a
convolution along the sequence, attention outside the interface and attention
sinks (all_to_all, ring_attn), and under split_gather a layer child
with parameters the plan leaves replicated that is not a norm, and latent
attention (its shared mla_kv_a_proj projection stays whole).  Inside a
split MoE block, a replicated module whose output the block's forward adds
to the experts' (a shared expert, SolarOpen's) runs:
SharedExpertInSequenceParallel divides its output by p and all-reduces its
gradients (shardformer.layer.moe); any other replicated module there is
refused.
"""
from __future__ import annotations

import re
from dataclasses import replace

from torch import nn

from .derived_rules import added_children, attention_counts, is_attention, is_mla, norm_like, side_of_norm
from .family import SplitAttentionPolicy, sequence_mode_refused
from .layout import Heads
from .layer.sequence_layout import BLOCK, ENTER
from .plan import PlanError, interpret, record_hidden_states, style_of
from .policy import Policy, merge_policies
from .spec import Attribute, Capabilities, Entry, ModuleSpec, PolicySpec, Region, SplitGatherSpec

#: The styles DerivedPolicy maps (see the module docstring).
SUPPORTED_STYLES = (
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "packed_colwise", "packed_rowwise", "replicated_with_grad_allreduce", "moe_tp_experts",
    "grouped_gemm", "mla_kv_a_proj",
)
_COL = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
_ROW = ("rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise")
_WHY = {
    "sequence_parallel": "sequence parallelism comes from ShardConfig, not from the plan",
    "all_reduce": "a module with partial outputs has no shardformer layer yet",
    "ep_router": ("it splits the experts over ranks, which needs an expert-parallel group: pass "
                  "ShardConfig(expert_parallel_process_group=mesh(..., ep=k).ep), or drop ep_router from the "
                  "plan (moe_tp_experts alone splits every expert by its intermediate features)"),
    "megamoe_router": "DeepGEMM Mega MoE is not implemented",
    "megamoe_experts": "DeepGEMM Mega MoE is not implemented",
    "moe_identity_expert": ("zero-compute (identity) experts have no shardformer mapping: FusedExperts1D "
                            "runs only experts with weights"),
}


def resolve_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's full plan, {path pattern: style}: transformers' resolved
    `model._tp_plan` when it has one, else the class's `_tp_plan` plus
    `config.base_model_tp_plan` prefixed by the base model's attribute."""
    resolved = getattr(model, "_tp_plan", None)
    if isinstance(resolved, dict) and resolved:
        return dict(resolved)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    if base_plan:
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        lead = f"{prefix}." if isinstance(base, nn.Module) else ""
        plan.update({f"{lead}{k}": v for k, v in base_plan.items()})
    return plan


def has_tp_plan(model: nn.Module) -> bool:
    return bool(resolve_tp_plan(model))


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in key.split(".")) + "$")


class _NoConfig:
    """The config of a model that has none (a plain nn.Module given a plan
    dict): every attribute is absent, so the plan's styles that need none
    (colwise / rowwise outside attentions, embeddings, ...) work, and an
    attention's heads come from the attention module's own attributes."""


def _text_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        return _NoConfig()
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


#: Children of an MLA attention that the plan leaves whole: the low-rank
#: path, on replicated activations before the split layers (their gradients
#: are full once the column layers' input copies have summed theirs), and
#: DeepSeek Sparse Attention's indexer, which scores tokens from the
#: replicated hidden states and query latent and hands back token indices
#: (the same on every rank, no gradient through them).
_MLA_LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm", "indexer")
_MLA = "mla_kv_a_proj"
#: Our styles that split by attention heads (their module's attributes follow).
_HEAD_STYLES = ("colwise_heads", "colwise_kv_heads", "colwise_per_head", "rowwise_heads")


class DerivedPolicy(SplitAttentionPolicy, Policy):
    """The policy of a model without a built-in one, from its tensor-parallel
    plan (`plan`: {path pattern: style}; default resolve_tp_plan(model)).
    `strict` (a plan the user wrote: optimize(model, plan=...)): an entry
    matching no module or parameter of the model is refused (a misspelt
    path would otherwise leave its modules replicated); transformers' own
    plans name modules some configurations lack, which are skipped."""

    def __init__(self, plan: dict[str, str] | None = None, strict: bool = False) -> None:
        super().__init__()
        self.plan = dict(plan) if plan is not None else None
        self.strict = strict

    def capabilities(self) -> Capabilities:
        """What this policy can do with the bound model, as the spec's data
        (translate() puts it in the PolicySpec; the accessors below read it).
        Everything splits around the layer list (layer_stack): split_gather,
        all_to_all / ring_attn on that ModuleList (position_ids cut to this
        rank's rows for layers that read positions themselves: Ministral 3's
        attention scale; the rotary cos / sin most pass are cut by the split
        itself), and the pipeline's StageSplit (the base model's children
        after the list run on the last stage, those before it with
        parameters on the first).  Without one layer list: none of them,
        each refusal saying why (no_layer_list).  No overlap, no recompute."""
        from .pipeline.stages import StageSplit

        stack, why = self._stack_and_reason()
        if stack is None:
            return Capabilities(pipeline_refusal=why, sp_refusal=f"{why}: sequence parallelism splits around the "
                                                                 f"layer list")
        base, after, layers = stack
        owner = type(base).__name__
        return Capabilities(sp_modes=("split_gather",), split_attention_at=(owner, layers),
                            split_attention_options=(("row_kwargs", ("position_ids",)),),
                            pipeline_split=StageSplit(owner, layers, last=after))

    # The Policy capability fields, answered from capabilities() (no state kept on the policy).

    @property
    def sp_modes(self) -> tuple[str, ...]:
        return self.capabilities().sp_modes

    @property
    def split_attention_at(self) -> tuple[str, str] | None:
        return self.capabilities().split_attention_at

    @property
    def split_attention_options(self) -> dict:
        return dict(self.capabilities().split_attention_options)

    @property
    def pipeline_split(self):
        return self.capabilities().pipeline_split

    @property
    def pipeline_refusal(self) -> str:
        return self.capabilities().pipeline_refusal

    def sequence_parallel_refusal(self, mode: str) -> str:
        return self.capabilities().sp_refusal

    def layer_stack(self) -> tuple[nn.Module, tuple[str, ...], str] | None:
        """(the base model, its children that run after the layers, the
        attribute of its ModuleList of layers), or None (no_layer_list says why).

        The config's `base_model_pp_plan` names the base model's children in
        forward order; the one that is a ModuleList is the layer list.  A
        config without a usable one (OLMoE, NanoChat): the layer list is the
        ModuleList under the base model that the plan's per-layer entries
        index ("model.layers.*.self_attn.q_proj" -> "layers"), and the children
        registered after it that hold parameters (the final norm) run after."""
        return self._stack_and_reason()[0]

    def no_layer_list(self) -> str:
        """Why layer_stack() is None ("" when it is not)."""
        return self._stack_and_reason()[1]

    def _stack_and_reason(self):
        model = getattr(self, "model", None)
        if model is None:
            return None, "no model"
        base = getattr(model, "base_model", model)
        pp_plan = getattr(_text_config(model), "base_model_pp_plan", None) or {}
        names = list(pp_plan)
        lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
        if len(lists) == 1 and all(hasattr(base, n) for n in names):
            return (base, tuple(names[names.index(lists[0]) + 1:]), lists[0]), ""
        return self._layer_list_from_plan(base)

    def _layer_list_from_plan(self, base: nn.Module):
        """The layer list the plan's per-layer entries index, under `base`."""
        name = type(self.model).__name__
        lead = next((p for p, m in self.model.named_modules() if m is base), "")
        lead = f"{lead}." if lead else ""
        indexed = sorted({key.split(".*.")[0] for key in self.full_plan() if ".*." in key})
        inside = [k[len(lead):] for k in indexed if k.startswith(lead)]
        if not inside:
            return None, (f"{name}'s config names no layer list (no base_model_pp_plan with exactly one "
                          f"ModuleList) and its tensor-parallel plan indexes none under {type(base).__name__}")
        if len(inside) > 1:
            return None, (f"{name}'s config names no layer list (no base_model_pp_plan with exactly one "
                          f"ModuleList) and its tensor-parallel plan indexes several under "
                          f"{type(base).__name__}: {[lead + k for k in inside]} (ambiguous: which one runs "
                          f"as the layer stack, and in what order, is not known)")
        attr = inside[0]
        if "." in attr or not isinstance(getattr(base, attr, None), nn.ModuleList):
            return None, (f"{name}'s config names no layer list (no base_model_pp_plan) and the layers its "
                          f"tensor-parallel plan indexes, {lead + attr}, are not a ModuleList child of "
                          f"{type(base).__name__}")
        children = [n for n, _ in base.named_children()]
        after = tuple(n for n in children[children.index(attr) + 1:]
                      if any(True for _ in getattr(base, n).parameters()))
        return (base, after, attr), ""

    def full_plan(self) -> dict[str, str]:
        """The plan in force: the one given, else the model's own
        (resolve_tp_plan) with latent_attention_supplement added."""
        if self.plan is not None:
            return self.plan
        plan = resolve_tp_plan(self.model)
        return {**plan, **latent_attention_supplement(self.model, plan)}

    # ---- what the plan says, module by module ----

    def _fail(self, style: str, path: str, why: str) -> PlanError:
        name = type(self.model).__name__
        return PlanError(f"{name}: tensor-parallel plan style {style!r} at {path!r} of {name} "
                         f"cannot be honoured: {why}")

    def matched(self) -> dict[str, tuple[str, nn.Module]]:
        """{module path: (style, module)} for every module the plan names
        (a module named by two patterns takes the exact one)."""
        patterns = [(key, style, _pattern(key)) for key, style in self.full_plan().items()]
        out = {}
        for path, module in self.model.named_modules():
            if not path:
                continue
            hits = [(key, style) for key, style, rx in patterns if rx.match(path)]
            if hits:
                exact = [h for h in hits if h[0] == path]
                out[path] = (exact or hits)[0][1], module
        return out

    def _check_every_entry_matches(self) -> None:
        """Refuse (strict plans) an entry that names no module or parameter."""
        paths = [p for p, _ in self.model.named_modules() if p] + [p for p, _ in self.model.named_parameters()]
        for key, style in self.plan.items():
            rx = _pattern(key)
            if not any(rx.match(p) for p in paths):
                raise self._fail(style, key, f"the plan's path matches no module or parameter of "
                                 f"{type(self.model).__name__}")

    def config_sanity_check(self) -> None:
        name = type(self.model).__name__
        if self.strict and self.plan is not None:
            self._check_every_entry_matches()
        matched = self.matched()
        ep = self.shard_config.expert_parallel_process_group is not None
        for path, (style, _) in matched.items():
            if style not in SUPPORTED_STYLES and not (style == "ep_router" and ep):
                why = _WHY.get(style, "unknown style (shardformer maps: " + ", ".join(SUPPORTED_STYLES) + ")")
                raise self._fail(style, path, why)
        cfg = _text_config(self.model)
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"{name}: pretraining_tp={cfg.pretraining_tp} is not supported (set it to 1)")
        self._check_sequence_parallelism()
        if (self.tensor_parallel or ep) and any(s == "moe_tp_experts" for s, _ in matched.values()):
            jitter = getattr(cfg, "router_jitter_noise", 0.0)
            if jitter:
                raise ValueError(f"{name}: router_jitter_noise={jitter} is not supported: each rank would "
                                 "draw its own noise and route tokens differently (set it to 0)")

    # ---- heads ----

    def heads_of(self, attention: nn.Module) -> Heads:
        """The attention's heads: from the model's config, or for a model
        without one from the attention module's num_heads /
        num_attention_heads, num_key_value_heads / num_kv_heads, head_dim."""
        cfg = _text_config(self.model)
        if isinstance(cfg, _NoConfig):
            cfg = attention
        n = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "num_heads", None)
        if not n:
            raise ValueError(f"{type(self.model).__name__} has no config (config.num_attention_heads) and "
                             f"{type(attention).__name__} no num_heads attribute naming its heads")
        kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or n
        head_dim = (getattr(attention, "head_dim", None) or getattr(attention, "head_size", None)
                    or getattr(cfg, "head_dim", None) or cfg.hidden_size // n)
        return Heads(n, kv, int(head_dim))

    # ---- the policy ----

    def module_policy(self) -> dict:
        """translate() run through shardformer.plan.interpret, the one
        interpreter of every spec (tensor parallelism and its split-gather
        regions, keyed by the model's class), plus all_to_all / ring_attn
        on the layer list."""
        policy = {}
        if self.tensor_parallel:
            described = interpret(self.translate(), self.model, self.shard_config, self.state, self)
            policy = {type(self.model): described[type(self.model).__name__]}
        return merge_policies(policy, self.split_attention_policy())

    def translate(self) -> PolicySpec:
        """The plan in force (full_plan) as a PolicySpec: one ModuleSpec for
        the model's class, an Entry per module the plan splits (its style of
        shardformer.plan chosen by the rules of shardformer.derived_rules:
        head styles inside an attention, the vocabulary LM head, ...), with
        each attention's Heads on its entries and head-count Attribute rows,
        and the LM head's tie to the input embeddings; under split-gather
        sequence parallelism its regions (split_gather_spec) and the entries
        inside them with their SP kwargs; the capabilities (capabilities()).
        Refuses, naming the style, path and model, what it cannot honour
        (before anything changes)."""
        matched = self.matched()
        named = set(matched)
        entries, attrs = [], []
        parents: dict[str, list[str]] = {}
        for path in matched:
            parents.setdefault(path.rpartition(".")[0], []).append(path)
        experts = {p for p, (s, _) in matched.items() if s == "moe_tp_experts"}
        done = set()
        for path, (style, module) in matched.items():
            if path in done or any(path.startswith(e + ".") for e in experts):
                continue
            if style == "ep_router":     # the router stays replicated: ExpertParallelExperts dispatches
                continue
            if style == "moe_tp_experts":
                entries.append(self._experts(path, module, matched))
            elif style == "replicated_with_grad_allreduce":
                if not any(True for _ in module.parameters()):
                    raise self._fail(style, path, f"{type(module).__name__} has no parameters")
                entries.append(Entry(path, style))
            elif isinstance(module, nn.Embedding):
                entries.append(self._embedding(path, style, module))
            elif style in _COL or style in _ROW or style == _MLA:
                parent_path = path.rpartition(".")[0]
                if parent_path in done:
                    continue
                siblings = {p: matched[p] for p in parents[parent_path] if matched[p][0] in _COL + _ROW + (_MLA,)
                            and not isinstance(matched[p][1], nn.Embedding)}
                parent = self.model.get_submodule(parent_path) if parent_path else self.model
                e, a = self._linears(parent_path, parent, siblings, named)
                entries += e
                attrs += a
                done.add(parent_path)
                done.update(siblings)
            elif style == "grouped_gemm":
                raise self._fail(style, path, f"grouped_gemm names the 3-D expert parameters of a moe_tp_experts "
                                 f"module; {type(module).__name__} is not inside one")
            else:
                raise self._fail(style, path, f"{style} needs an nn.Embedding, {type(module).__name__} is not one")
        tied, ties = self._tied_embedding(matched, entries)
        entries, name, caps = entries + tied, type(self.model).__name__, self.capabilities()
        split_gather = None
        if self.tensor_parallel and self.shard_config.sequence_parallel:
            if "split_gather" not in caps.sp_modes:
                raise self._refused(name, caps.sp_refusal)
            entries, split_gather = self.split_gather_spec(entries)
        return PolicySpec(f"{name} (derived from its tensor-parallel plan)",
                          (ModuleSpec(name, tuple(entries), tuple(attrs), sp_linear=""),),
                          split_gather=split_gather, ties=ties, capabilities=caps)

    def _embedding(self, path: str, style: str, module: nn.Embedding) -> Entry:
        if style not in ("embedding_rowwise", "rowwise", "rowwise_split_input", "rowwise_rep"):
            raise self._fail(style, path, "an nn.Embedding is split only by vocabulary (embedding_rowwise)")
        return self._vocab_embedding(path, module)

    def _vocab_embedding(self, path: str, module: nn.Module) -> Entry:
        """embedding_rowwise at `path`, keeping the module's embed scale."""
        scale = getattr(module, "scalar_embed_scale", None)
        if scale is None and getattr(module, "embed_scale", None) is not None:
            scale = float(module.embed_scale)
        return Entry(path, "embedding_rowwise", kwargs=() if scale is None else (("embed_scale", float(scale)),))

    def _tied_embedding(self, matched: dict, entries: list[Entry]) -> tuple[list[Entry], tuple]:
        """(entries, ties): an LM head split by vocabulary that HF tied to the
        input embeddings keeps the tie: the embeddings are split by vocabulary
        too, and the spec records the tie (the engine keeps it: shardformer.ties)."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        inputs = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        if head is None or inputs is None or head.weight is not inputs.weight:
            return [], ()
        paths = {id(m): p for p, m in self.model.named_modules()}
        head_path, in_path = paths.get(id(head)), paths.get(id(inputs))
        by_path = {e.suffix: e for e in entries}
        head_entry = by_path.get(head_path)
        if head_entry is None:
            return [], ()
        if head_entry.style != "vocab_lm_head":
            raise self._fail(matched[head_path][0], head_path,
                             "the LM head is tied to the input embeddings and can only be split by vocabulary")
        ties = ((in_path, head_path),)        # checked by Policy.postprocess
        if in_path in by_path:
            return [], ties
        return [self._vocab_embedding(in_path, inputs)], ties

    def _experts(self, path: str, module: nn.Module, matched: dict) -> Entry:
        inner = {p[len(path) + 1:]: s for p, (s, _) in matched.items() if p.startswith(path + ".")}
        generic = _generic(path)
        for key, style in self.full_plan().items():          # parameter entries (experts.gate_up_proj: packed_colwise)
            if key.startswith(generic + ".") or key.startswith(path + "."):
                inner[key.rsplit(".", 1)[-1]] = style
        want = {"gate_up_proj": ("packed_colwise", "grouped_gemm"), "down_proj": ("rowwise", "grouped_gemm")}
        if any(inner.get(k) not in v for k, v in want.items()) or set(inner) - set(want):
            raise self._fail("moe_tp_experts", path, "only gate_up_proj: packed_colwise or grouped_gemm with "
                             "down_proj: rowwise or grouped_gemm is mapped (FusedExperts1D, intermediate "
                             f"features split); the plan says {inner}")
        if not (isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
                and isinstance(getattr(module, "down_proj", None), nn.Parameter)):
            raise self._fail("moe_tp_experts", path, f"{type(module).__name__} does not hold fused "
                             "[E, 2I, H] gate_up_proj and [E, H, I] down_proj parameters")
        ep = self.shard_config.expert_parallel_process_group
        return Entry(path, "moe_tp_experts" if ep is None else "moe_ep_experts")

    def _linears(self, parent_path: str, parent: nn.Module, siblings: dict,
                 named: set[str]) -> tuple[list[Entry], list[Attribute]]:
        """The entries of the Linear layers of one module (an attention or
        MLP block) and the Attribute rows its forward needs per rank
        (`named`: the module paths the plan names)."""
        subs, attrs = [], []
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        attention = is_attention(parent) and parent is not self.model
        heads = None
        split_heads = False
        mla = [p for p, (st, _) in siblings.items() if st == _MLA]
        if mla:
            heads = self._mla_heads(parent_path, parent, mla[0])
        elif attention:
            try:
                heads = self.heads_of(parent)
            except (AttributeError, ValueError, TypeError) as e:
                style, _ = next(iter(siblings.values()))
                raise self._fail(style, parent_path, f"cannot find the attention's head counts ({e})")
            widths = [m.weight.shape[0] for st, m in siblings.values() if st == "colwise" and hasattr(m, "weight")]
            n, kv, hd = heads.num_heads, heads.kv_heads, heads.head_dim
            if kv != n and widths and kv * hd not in widths:     # the config's KV heads are not this module's
                heads = Heads(n, n, hd)
        if any(style in ("colwise", "packed_colwise") for style, _ in siblings.values()):
            own = [name for name, _ in parent.named_parameters(recurse=False)]
            if own and parent is not self.model:
                style = next(st for st, _ in siblings.values() if st in ("colwise", "packed_colwise"))
                raise self._fail(style, f"{parent_path}.{own[0]}",
                                 f"{type(parent).__name__} holds parameter(s) {own} beside its split layers "
                                 "and the plan does not say how to split them")
        for path, (style, module) in siblings.items():
            if not isinstance(module, nn.Linear):
                raise self._fail(style, path, f"{type(module).__name__} is not an nn.Linear")
            ours, own, extra = self._linear_style(path, style, module, parent, heads, head)
            split_heads = split_heads or ours in _HEAD_STYLES
            subs.append(Entry(path, ours, heads=own, kwargs=tuple((extra or {}).items())))
        if mla and not split_heads:
            raise self._fail(_MLA, mla[0], "its attention's projections are not split by heads (the plan "
                             "names no colwise q_b_proj / kv_b_proj)")
        if split_heads and not mla and is_mla(parent):
            raise self._fail("colwise", parent_path, f"{type(parent).__name__} is multi-head latent attention "
                             "split by heads, but the plan does not name its kv_a_proj_with_mqa mla_kv_a_proj "
                             "(the shared rotary key's gradient would stay partial)")
        if split_heads:
            attrs += [Attribute(name, kind, heads=heads)
                      for name, kind in attention_counts(parent_path, parent, heads, widths=not mla).items()]
        if any(style in ("colwise", "packed_colwise") for style, _ in siblings.values()):
            subs += self._between_split_layers(parent_path, parent, named, mla=bool(mla), siblings=siblings)
        return subs, attrs

    def _linear_style(self, path: str, style: str, module: nn.Linear, parent: nn.Module, heads: Heads | None,
                      head: nn.Module | None) -> tuple[str, Heads | None, dict | None]:
        """(our style (shardformer.plan), the heads it splits by, extra kwargs) of one
        Linear the plan names `style`: a colwise / rowwise inside an
        attention becomes the head style its width says (query heads, KV
        heads, or whole heads of a fused per-head layout); the output
        embeddings' gathered style becomes the vocabulary-parallel LM head."""
        if style == _MLA:
            return "mla_kv_a_proj", heads, {"rope_dim": parent.qk_rope_head_dim}
        if style in ("packed_colwise", "packed_rowwise"):
            return style, heads, None
        if style in ("colwise_gather_output", "colwise_rep"):
            return ("vocab_lm_head" if module is head else "colwise_gather_output"), heads, None
        if style in ("rowwise_split_input", "rowwise_rep"):
            return "rowwise_split_input", heads, None
        if heads is None:
            return style, heads, None
        out_f, in_f = module.weight.shape
        width = out_f if style == "colwise" else in_f
        n, kv, hd = heads.num_heads, heads.kv_heads, heads.head_dim
        if width == n * hd:
            return ("colwise_heads" if style == "colwise" else "rowwise_heads"), heads, None
        if width == kv * hd:
            if style == "rowwise" and kv != n:
                raise self._fail(style, path, "a row-parallel input split by KV heads is not supported")
            return ("colwise_kv_heads" if style == "colwise" else "rowwise_heads"), heads, None
        if n == kv and width == 3 * n * hd and style == "colwise":     # [q_h k_h v_h] per head (GPT-NeoX)
            return "colwise_per_head", heads, None
        if n == kv and width % n == 0:       # other per-head blocks: whole blocks of width / n
            block = Heads(n, n, width // n)
            return ("colwise_heads" if style == "colwise" else "rowwise_heads"), block, None
        raise self._fail(style, path, f"{width} features are not a whole number of the attention's heads ({heads})")

    def _mla_heads(self, parent_path: str, parent: nn.Module, kv_a_path: str) -> Heads:
        """The heads of a multi-head latent attention: every head has its own
        keys and values ([k_nope | v] blocks of kv_b_proj), so the KV heads
        are the query heads; a head of q_b_proj / q_proj is qk_nope + qk_rope
        features wide."""
        need = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
        missing = [a for a in need if not isinstance(getattr(parent, a, None), int)]
        if missing:
            raise self._fail(_MLA, kv_a_path, f"{type(parent).__name__} at {parent_path!r} has no integer "
                             f"{missing} (a DeepSeek-V2-style latent attention keeps them as attributes)")
        kv_heads = getattr(_text_config(self.model), "num_key_value_heads", None) or parent.num_heads
        if kv_heads != parent.num_heads:
            raise self._fail(_MLA, kv_a_path, f"num_key_value_heads={kv_heads} differs from num_heads="
                             f"{parent.num_heads}: latent attention expands the keys to every query head")
        return Heads(parent.num_heads, parent.num_heads, parent.qk_nope_head_dim + parent.qk_rope_head_dim)

    def _between_split_layers(self, parent_path: str, parent: nn.Module, named: set[str], mla: bool = False,
                              siblings: dict | None = None) -> list[Entry]:
        """The other parameterized children of a module whose column layers
        leave their output split (an activation with parameters, a per-head
        norm the plan does not name): they act on this rank's features, so
        their gradients are partial and get all-reduced, as
        replicated_with_grad_allreduce does.  In a latent attention (`mla`)
        they run before the split instead, on replicated activations
        (_MLA_LATENT): they stay as they are, and any other child is refused."""
        lead = f"{parent_path}." if parent_path else ""
        rest = [child for child, module in parent.named_children()
                if lead + child not in named and any(True for _ in module.parameters())]
        if mla:        # latent attention: the low-rank path stays whole; anything else is unknown
            unknown = [c for c in rest if c not in _MLA_LATENT]
            if unknown:
                raise self._fail(_MLA, f"{lead}{unknown[0]}", f"{type(parent).__name__} has parameterized "
                                 f"children {unknown} beside its latent path {_MLA_LATENT} that the plan "
                                 "does not name (their inputs may be split by heads)")
            return []
        if not is_attention(parent) and siblings:
            rest = [c for c in rest if not self._runs_outside_split(lead + c, getattr(parent, c), siblings)]
        return [Entry(lead + child, "replicated_with_grad_allreduce") for child in rest]

    def _runs_outside_split(self, path: str, child: nn.Module, siblings: dict) -> bool:
        """Whether a child of a block (not an attention) that holds split
        layers runs outside them, on the replicated activations (its gradient
        is then whole and must not be all-reduced): an attention, or a norm
        over the column layers' input width (a pre-norm block written with
        its linears as direct children).  A norm as wide as both their input
        and output cannot be placed: refused."""
        if is_attention(child):
            return True
        cols = [(st, m) for st, m in siblings.values() if st in ("colwise", "packed_colwise")]
        side = side_of_norm(child, {m.weight.shape[1] for _, m in cols}, {m.weight.shape[0] for _, m in cols})
        if side == "ambiguous":
            raise self._fail(cols[0][0], path, f"{type(child).__name__} is as wide as the split layers' input and "
                             f"output ({child.weight.shape[-1]}), so whether it runs on split features cannot be "
                             f"told; put the split layers in a module of their own (an MLP block)")
        return side == "outside"

    # ---- sequence parallelism ----
    #
    # The layers are the ModuleList of layer_stack().
    # all_to_all / ring_attn: SequenceAttentionParallel on that list, every
    # attention module in it switched through transformers' AttentionInterface
    # (shardformer.layer.sequence_attention).  split_gather: each child of a
    # layer that holds layers the plan splits is one tensor-parallel region
    # (shardformer.layer.sequence): its input all-gathered along the sequence
    # (backward: reduce-scatter), its column / row layers take
    # sequence_parallel=True, and either
    #   BLOCK   the row layers return partial sums and the region's
    #           output is reduce-scattered (backward: all-gathered), or
    #   ENTER   where a row layer has a bias: the row layers
    #           reduce-scatter themselves and add the bias on this
    #           rank's rows;
    # a MoE block's experts return partial sums (FusedExperts1D
    # sequence_parallel=True), so its router's gradients are partial and get
    # all-reduced (RouterInSequenceParallel).  The layer's other parameterized
    # children (its norms) run on this rank's rows: gradients all-reduced.
    # The first layer splits its input, the last gathers its output.

    def layers_path(self) -> str:
        """The dotted path of the layer ModuleList in the model."""
        base, _, layers = self.layer_stack()
        lead = next(path for path, m in self.model.named_modules() if m is base)
        return f"{lead}.{layers}" if lead else layers

    def _refused(self, path: str, why: str) -> NotImplementedError:
        return sequence_mode_refused(type(self.model).__name__, path, self.shard_config.sequence_parallelism_mode, why)

    def _check_sequence_parallelism(self) -> None:
        """Refuse, before anything changes, layers the sequence split cannot
        run: layer types other than (sliding-window) attention, convolutions
        along the sequence, and under all_to_all / ring_attn what
        _check_split_attention names (split_gather's refusals come while
        planning: split_gather_spec)."""
        if not self.shard_config.enable_sequence_parallelism or self.layer_stack() is None:
            return
        path = self.layers_path()
        layers = self.model.get_submodule(path)
        kinds = getattr(_text_config(self.model), "layer_types", None) or ()
        for i, kind in enumerate(kinds):
            if kind not in ("full_attention", "sliding_attention"):
                raise self._refused(f"{path}.{i}", f"its layer type is {kind!r}: only attention layers can run "
                                    f"on a split sequence (a recurrent or linear-attention mixer would see only "
                                    f"this rank's rows)")
        for i, layer in enumerate(layers):
            conv = next((n for n, m in layer.named_modules() if isinstance(m, nn.Conv1d)), None)
            if conv is not None:
                raise self._refused(f"{path}.{i}.{conv}", "a convolution along the sequence would see only this "
                                    "rank's rows")
        if self.shard_config.split_attention_mode:
            self._check_split_attention(path, layers)

    def _check_split_attention(self, path: str, layers: nn.ModuleList) -> None:
        from .attention import uses_registry

        mode = self.shard_config.split_attention_mode
        for i, layer in enumerate(layers):
            users = [n for n, m in layer.named_modules() if uses_registry(m)]
            if not users:
                found = sorted({type(m).__name__ for m in layer.modules() if is_attention(m)})
                raise self._refused(f"{path}.{i}", f"{type(layer).__name__}'s attention ({found}) does not go "
                                    f"through transformers' AttentionInterface, where the split attention runs")
            sinks = next((f"{path}.{i}.{n}" for n, _ in layer.named_parameters() if n.endswith("sinks")), None)
            if sinks is not None:
                why = ("the ring's log-sum-exp merge has no term for them" if mode == "ring_attn" else
                       "the model's attention reads them for all its heads, while each rank attends over its "
                       "own heads after the exchange")
                raise self._refused(sinks, f"attention sinks (a learned logit per head in every softmax): {why}")

    def split_gather_spec(self, entries: list[Entry]) -> tuple[list[Entry], SplitGatherSpec]:
        """Split-gather sequence parallelism of the layer list as spec data:
        (`entries` with the SP kwargs of those inside a region, the
        SplitGatherSpec).  Each child of a layer that holds layers the plan
        splits is a Region (its layouts: _sp_block), every other child with
        parameters a norm Region (layouts None: this rank's rows, gradients
        all-reduced; anything else with parameters is refused).  Paths run
        from the model through each layer (the spec's `layer` is the
        model's class), since the layers may differ (dense and MoE layers,
        row layers with and without a bias)."""
        path = self.layers_path()
        layers = self.model.get_submodule(path)
        planned = {e.suffix for e in entries}
        sp = {}                                   # suffix -> its SP kwargs (shardformer.spec.SP_KWARGS)
        regions, norms, beside = [], [], []
        for i, layer in enumerate(layers):
            for child, module in layer.named_children():
                where = f"{path}.{i}.{child}"
                inside = [e for e in entries if e.suffix == where or e.suffix.startswith(where + ".")]
                if any(_layer_name(e.style) in _SPLIT_LAYERS for e in inside):
                    layouts, rows_scatter, found = self._sp_block(where, module, inside, planned)
                    regions.append(Region(where, layouts))
                    sp.update({e.suffix: "row" if rows_scatter and _layer_name(e.style) == "Linear1D_Row" else "col"
                               for e in inside if _layer_name(e.style) in _SPLIT_LAYERS})
                    beside += found
                elif where not in planned and any(True for _ in module.parameters()):
                    if not norm_like(module):
                        raise self._refused(where, f"{type(module).__name__} holds parameters the plan does not "
                                            f"split and is not a norm: on this rank's rows it would see part of "
                                            f"the sequence")
                    norms.append(Region(where))
        name = type(self.model).__name__
        entries = [replace(e, sp=sp[e.suffix]) if e.suffix in sp else e for e in entries]
        return entries, SplitGatherSpec(name, path, name, tuple(regions + norms), overlap=False, beside=tuple(beside))

    def _sp_block(self, where: str, module: nn.Module, inside: list[Entry],
                  planned: set) -> tuple[object, bool, list[Entry]]:
        """(the layouts of one child of a layer holding split layers: BLOCK,
        or ENTER where its row layers have a bias and reduce-scatter
        themselves; whether they do; the Entry rows of the replicated modules
        inside it that run beside the split ones: a MoE block's router, whose
        gradients are partial beside experts returning partial sums, and a
        module whose output the block adds to the experts' (a shared expert))."""
        latent = [e.suffix for e in inside if _layer_name(e.style) == "SharedRopeKeyProjection"]
        if latent:
            raise self._refused(latent[0], "the latent attention's shared projection (mla_kv_a_proj) is kept whole "
                                "on every rank: on the gathered sequence its input gradient, already the full "
                                "one on every rank, would be summed again by the block's reduce-scatter")
        rows = [e for e in inside if _layer_name(e.style) == "Linear1D_Row"]
        experts = [e for e in inside if _layer_name(e.style) == "FusedExperts1D"]
        biased = [e.suffix for e in rows if getattr(self.model.get_submodule(e.suffix), "bias", None) is not None]
        if biased and experts:
            raise self._refused(where, f"row layers with a bias ({biased}) beside experts returning partial sums")
        out = []
        routers = {f"{e.suffix.rpartition('.')[0]}.{child}" for e in experts
                   for child, m in self.model.get_submodule(e.suffix.rpartition(".")[0]).named_children()
                   if any(True for _ in m.parameters(recurse=False))}      # a router's own matrix
        added = {f"{block}.{child}" for block in {e.suffix.rpartition(".")[0] for e in experts}
                 for child in added_children(self.model.get_submodule(block))}
        seen: list[str] = []                   # replicated subtrees classified whole
        for path, m in module.named_modules(prefix=where):
            if any(path == p or path.startswith(p + ".") for p in seen + [e.suffix for e in inside]):
                continue
            if any(e.suffix.startswith(path + ".") for e in inside) or not any(True for _ in m.parameters()):
                continue                           # holds split layers (look inside), or nothing to train
            seen.append(path)
            if path in routers and path not in planned:    # beside the experts: partial gradients
                out.append(Entry(path, "moe_router_sequence_parallel"))
            elif path in added and path not in planned:     # output added to the experts' partial sums
                out.append(Entry(path, "moe_shared_expert_sequence_parallel"))
            elif not norm_like(m):
                raise self._refused(path, f"{type(m).__name__} holds parameters the plan leaves replicated inside "
                                    f"a tensor-parallel block: its full output would be summed over the ranks by "
                                    f"the block's reduce-scatter (only a router, a norm, or a module beside the "
                                    f"experts whose output the block's forward adds to theirs, `... + "
                                    f"self.<name>(...)`, run there)")
        return (ENTER if biased else BLOCK), bool(biased), out

    # ---- after the swaps ----

    def postprocess(self) -> nn.Module:
        return record_hidden_states(self, super().postprocess())


_SPLIT_LAYERS = ("Linear1D_Col", "Linear1D_Row", "FusedExperts1D")


def _layer_name(style: str) -> str:
    """The layer class name a style of shardformer.plan becomes ("" where it is chosen per config)."""
    layer = style_of(style).layer
    return layer if isinstance(layer, str) else ""


def _generic(path: str) -> str:
    """`path` with its layer indices as the plan writes them ("layers.0.x" -> "layers.*.x")."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", path)


#: The entries DeepSeek-V2's own plan gives its latent attention (relative to
#: the attention module), which latent_attention_supplement adds where a plan
#: leaves such an attention out.
MLA_ENTRIES = {"q_proj": "colwise", "q_b_proj": "colwise", "kv_a_proj_with_mqa": _MLA, "kv_b_proj": "colwise",
               "o_proj": "rowwise"}


def latent_attention_supplement(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Entries that split by heads the multi-head latent attentions a plan
    leaves out (DeepSeek-V3's, Mistral 4's, Kimi Linear's plans replicate
    them while DeepSeek-V2's splits them).  A latent attention is found by
    its shape, not its class: a joint KV down-projection kv_a_proj_with_mqa
    (an nn.Linear), a kv_b_proj and a q_b_proj or q_proj (nn.Linear), an o_proj,
    and a qk_rope_head_dim.  One that no entry of `plan` reaches into gets
    MLA_ENTRIES under its own path (not a layer pattern: Kimi Linear's
    linear-attention layers have an o_proj too): q / kv_b split by whole heads, o_proj
    by the same heads, the shared rotary key's gradient all-reduced."""
    added: dict[str, str] = {}
    patterns = [_pattern(k) for k in plan]
    for path, module in model.named_modules():
        if not (is_mla(module) and isinstance(getattr(module, "kv_b_proj", None), nn.Linear)
                and isinstance(getattr(module, "o_proj", None), nn.Linear)
                and any(isinstance(getattr(module, q, None), nn.Linear) for q in ("q_b_proj", "q_proj"))):
            continue
        inner = [f"{path}.{child}" for child, _ in module.named_modules() if child]
        if any(rx.match(p) for p in inner for rx in patterns):
            continue                     # the plan says something about this attention: it stands
        added.update({f"{path}.{child}": style for child, style in MLA_ENTRIES.items()   # (exact paths: the
                      if isinstance(getattr(module, child, None), nn.Linear)})    # other layers may differ)
    return added
