"""Tensor-parallel plans: one style vocabulary and its interpreter.

A plan is data, {module suffix: style}: the built-in shapes write one per
module class they split (shardformer.policies.shapes: DecoderShape's layer
plan is {"self_attn.q_proj": "colwise_heads", ..., "mlp.down_proj":
"rowwise"}), and DerivedPolicy reads transformers' own plans
({"model.layers.*.self_attn.q_proj": "colwise", ...}) and turns each entry
into a style of this vocabulary once it has looked at the module (its
width, whether it sits in an attention, whether it is the LM head).
`realize()` turns a plan into SubModuleReplacementDescriptions; both
kinds of policy go through it, so a style means the same layer and split
everywhere.  With W a Linear weight [out, in] and X [.., in]:

  style                   layer                        what is split (forward / backward collectives)
  colwise                 Linear1D_Col                 W's rows (out) evenly; Y left split.  copy X fwd,
                                                       all-reduce dX bwd
  colwise_heads           Linear1D_Col, Heads.q        W's rows by whole query heads
  colwise_kv_heads        Linear1D_Col, Heads.kv       W's rows by whole KV heads; a KV head is replicated
                                                       on tp / kv ranks when there are fewer than ranks (GQA)
  colwise_qkv             Linear1D_Col, Heads.qkv      a fused [q | k | v] projection: each part by its heads
  colwise_per_head        Linear1D_Col, Heads(n, n,    a fused per-head projection, rows [q_h k_h v_h] per head
                          3 * head_dim).q              (BLOOM, GPT-NeoX): whole 3 * head_dim blocks
  colwise_grouped_qkv     Linear1D_Col, Heads.       a fused projection grouped per KV head, rows
                          grouped_qkv                  [q_1 .. q_g | k | v] per group (Falcon's new
                                                       architecture): whole groups
  packed_colwise          Linear1D_Col, Fused.equal(2) a packed [gate | up] projection: each rank keeps its
                                                       part of both halves
  colwise_gather_output   Linear1D_Col(gather_output)  W's rows split, Y all-gathered along features fwd
                                                       (bwd: this rank's slice): small classifiers
  vocab_lm_head           VocabParallelLMHead1D        the vocabulary (W's rows), padded; logits gathered
                                                       unless ShardConfig(parallel_output=True)
  rowwise                 Linear1D_Row                 W's columns (in) evenly; X arrives split; partial Y
                                                       all-reduced fwd (bwd: identity)
  rowwise_heads           Linear1D_Row, Heads.q        W's columns by the same query heads as its siblings
  packed_rowwise          Linear1D_Row, Fused.equal(2) W's columns, each half split
  rowwise_split_input     Linear1D_Row(input not       X arrives whole and is split here (bwd: all-gather dX)
                          parallel)
  embedding_rowwise       VocabParallelEmbedding1D     the vocabulary (rows of the table), padded; partial
                                                       lookups all-reduced fwd
  replicated_with_grad_   ReplicatedInParallelRegion   nothing: the module runs on this rank's features or
    allreduce                                          rows, its parameter gradients all-reduced bwd
  moe_tp_experts          FusedExperts1D               every expert's intermediate features; partial outputs
                                                       all-reduced fwd; the router stays replicated
  moe_ep_experts          ExpertParallelExperts        whole experts over ShardConfig's expert-parallel
                                                       group (tokens exchanged all-to-all), each split
                                                       over TP inside (shardformer.layer.expert_parallel)
  mla_kv_a_proj           SharedRopeKeyProjection      nothing: latent attention's joint KV down-projection,
                                                       the shared rotary key's gradient all-reduced bwd
  moe_router_sequence_    RouterInSequenceParallel     nothing: a MoE router on the gathered tokens under
    parallel                                           split-gather SP, gradients all-reduced, its logits'
                                                       gradient 1/p (shardformer.layer.moe)
  moe_shared_expert_      SharedExpertInSequenceParallel  nothing: a replicated module whose output a MoE
    sequence_parallel                                  block adds to its experts' partial sums under
                                                       split-gather SP: output / p, gradients all-reduced
  conv1d_colwise_qkv      GPT2FusedLinearConv1D_Col    HF's transposed Conv1D [in, out] with a fused [q | k | v]
                                                       output: each part by its heads (GPT-2's c_attn)
  conv1d_rowwise_heads    GPT2FusedLinearConv1D_Row    a Conv1D's input rows by the same query heads
  conv1d_colwise /        GPT2FusedLinearConv1D_Col /  a Conv1D's output / input features evenly
    conv1d_rowwise          _Row
  dropout_parallel        DropoutForParallelInput      a mask per rank (on this rank's heads or rows)
  dropout_replicated      DropoutForReplicatedInput    one mask on every rank (replicated activations)
  dropout_residual        either of the two above      after a row layer: replicated under TP, this
                                                       rank's rows (a mask per rank) under split-gather SP

Every style except the dropouts has a transformers name (`Style.hf`), so a
built-in policy's plan can be written in transformers' notation
(FamilyPolicy.tp_plan) and compared with the model's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .layer.dropout import DropoutForParallelInput, DropoutForReplicatedInput
from .layer.replicated import ReplicatedInParallelRegion
from .layer.sequence import (FullLengthKwarg, SequenceParallelRegion, SequenceState, mark_layer_rows,
                             record_full_hidden_states, refuse_recorded_hidden_states)
from .layer.sequence_layout import BLOCK, GATHER, GATHER_INPUT, MARK_ROWS, SPLIT, SPLIT_OUTPUT, SequenceLayouts
from .layer.window_overlap import WindowedGatherOverlap
from .layout import Fused, Heads, Split
from .policy import ModulePolicyDescription, Policy
from .spec import GATHER_ORDER, SP_LINEAR, Attribute, Hook, Method, MethodSite, Region, Setting, Stack
from .policy import SubModuleReplacementDescription as Sub


class PlanError(ValueError):
    """A tensor-parallel plan that cannot be honoured."""


@dataclass
class PlanContext:
    """What the styles read besides the module suffix: the policy (its
    shard config, vocabulary and LM-head kwargs), the attention's heads
    (shardformer.layout.Heads) for the head styles, and the input
    embedding's scale (Gemma: sqrt(hidden)) for embedding_rowwise."""

    policy: Any
    heads: Any = None
    embed_scale: float | None = None


def _need_heads(ctx: PlanContext, style: str):
    if ctx.heads is None:
        raise PlanError(f"style {style!r} splits by attention heads, but no heads were given")
    return ctx.heads


def _embedding_kwargs(ctx: PlanContext) -> dict:
    kwargs = ctx.policy.vocab_kwargs()
    if ctx.embed_scale is not None:
        kwargs["embed_scale"] = float(ctx.embed_scale)
    return kwargs


def _per_head(ctx: PlanContext):
    heads = _need_heads(ctx, "colwise_per_head")
    return Heads(heads.num_heads, heads.num_heads, 3 * heads.head_dim).q


def _fused_halves(ctx: PlanContext):
    return Fused.equal(2)


def residual_dropout(shard_config) -> type:
    """The class of a dropout after a row layer (style dropout_residual): on
    the replicated output under TP (DropoutForReplicatedInput, one mask), on
    this rank's rows under split-gather SP (DropoutForParallelInput, a mask
    per rank)."""
    return DropoutForParallelInput if shard_config.sequence_parallel else DropoutForReplicatedInput


def _residual_dropout(ctx: PlanContext) -> str:
    return residual_dropout(ctx.policy.shard_config).__name__


@dataclass(frozen=True)
class Style:
    """One style: the layer it becomes (a class name in shardformer.layer,
    or a function of the context choosing one), its kwargs (a function of
    the context), its kind ("col", "row" or "" : which per-kind extra
    kwargs realize() adds), its transformers name (None: not in
    transformers' vocabulary) and the entries transformers' notation
    writes for the module's own parameters ((parameter, style) pairs: an
    experts module's gate_up_proj and down_proj)."""

    name: str
    layer: str | Callable[[PlanContext], str]
    kwargs: Callable[[PlanContext], dict] = field(default=lambda ctx: {})
    kind: str = ""
    hf: str | None = None
    hf_params: tuple[tuple[str, str], ...] = ()

    def layer_class(self, ctx: PlanContext) -> type:
        name = self.layer(ctx) if callable(self.layer) else self.layer
        return _LAYERS[name]()


def _layer(module: str, name: str) -> Callable[[], type]:
    def load():
        import importlib

        return getattr(importlib.import_module(f"shardformer.layer{module}"), name)
    return load


_LAYERS = {
    "Linear1D_Col": _layer("", "Linear1D_Col"),
    "Linear1D_Row": _layer("", "Linear1D_Row"),
    "VocabParallelLMHead1D": _layer("", "VocabParallelLMHead1D"),
    "VocabParallelEmbedding1D": _layer("", "VocabParallelEmbedding1D"),
    "DropoutForParallelInput": _layer("", "DropoutForParallelInput"),
    "DropoutForReplicatedInput": _layer("", "DropoutForReplicatedInput"),
    "ReplicatedInParallelRegion": _layer(".replicated", "ReplicatedInParallelRegion"),
    "SharedRopeKeyProjection": _layer(".replicated", "SharedRopeKeyProjection"),
    "FusedExperts1D": _layer(".moe", "FusedExperts1D"),
    "ExpertParallelExperts": _layer(".expert_parallel", "ExpertParallelExperts"),
    "RouterInSequenceParallel": _layer(".moe", "RouterInSequenceParallel"),
    "SharedExpertInSequenceParallel": _layer(".moe", "SharedExpertInSequenceParallel"),
    "GPT2FusedLinearConv1D_Col": _layer("", "GPT2FusedLinearConv1D_Col"),
    "GPT2FusedLinearConv1D_Row": _layer("", "GPT2FusedLinearConv1D_Row"),
}

STYLES: dict[str, Style] = {s.name: s for s in (
    Style("colwise", "Linear1D_Col", kind="col", hf="colwise"),
    Style("colwise_heads", "Linear1D_Col", lambda c: {"split": _need_heads(c, "colwise_heads").q}, "col", "colwise"),
    Style("colwise_kv_heads", "Linear1D_Col", lambda c: {"split": _need_heads(c, "colwise_kv_heads").kv}, "col",
          "colwise"),
    Style("colwise_qkv", "Linear1D_Col", lambda c: {"split": _need_heads(c, "colwise_qkv").qkv}, "col", "colwise"),
    Style("colwise_per_head", "Linear1D_Col", lambda c: {"split": _per_head(c)}, "col", "colwise"),
    Style("colwise_grouped_qkv", "Linear1D_Col", lambda c: {"split": _need_heads(c, "colwise_grouped_qkv").grouped_qkv},
          "col", "colwise"),
    Style("packed_colwise", "Linear1D_Col", lambda c: {"split": _fused_halves(c)}, "col", "packed_colwise"),
    Style("colwise_gather_output", "Linear1D_Col", lambda c: {"gather_output": True}, hf="colwise_gather_output"),
    Style("vocab_lm_head", "VocabParallelLMHead1D", lambda c: c.policy.lm_head_kwargs(), hf="colwise_gather_output"),
    Style("rowwise", "Linear1D_Row", kind="row", hf="rowwise"),
    Style("rowwise_heads", "Linear1D_Row", lambda c: {"split": _need_heads(c, "rowwise_heads").q}, "row", "rowwise"),
    Style("packed_rowwise", "Linear1D_Row", lambda c: {"split": _fused_halves(c)}, "row", "packed_rowwise"),
    Style("rowwise_split_input", "Linear1D_Row", lambda c: {"input_is_parallel": False}, hf="rowwise_split_input"),
    Style("embedding_rowwise", "VocabParallelEmbedding1D", _embedding_kwargs, hf="embedding_rowwise"),
    Style("replicated_with_grad_allreduce", "ReplicatedInParallelRegion", hf="replicated_with_grad_allreduce"),
    Style("moe_tp_experts", "FusedExperts1D", hf="moe_tp_experts",
          hf_params=(("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise"))),
    Style("moe_ep_experts", "ExpertParallelExperts",
          lambda c: {"expert_group": c.policy.shard_config.expert_parallel_process_group}),
    Style("mla_kv_a_proj", "SharedRopeKeyProjection", hf="mla_kv_a_proj"),
    Style("moe_router_sequence_parallel", "RouterInSequenceParallel"),
    Style("moe_shared_expert_sequence_parallel", "SharedExpertInSequenceParallel"),
    Style("conv1d_colwise_qkv", "GPT2FusedLinearConv1D_Col",
          lambda c: {"split": _need_heads(c, "conv1d_colwise_qkv").qkv}, "col"),
    Style("conv1d_rowwise_heads", "GPT2FusedLinearConv1D_Row",
          lambda c: {"split": _need_heads(c, "conv1d_rowwise_heads").q}, "row"),
    Style("conv1d_colwise", "GPT2FusedLinearConv1D_Col", lambda c: {"split": Split()}, "col"),
    Style("conv1d_rowwise", "GPT2FusedLinearConv1D_Row", lambda c: {"split": Split()}, "row"),
    Style("dropout_parallel", "DropoutForParallelInput"),
    Style("dropout_replicated", "DropoutForReplicatedInput"),
    Style("dropout_residual", _residual_dropout),
)}



# ---- per-head parameters of the vision shapes: one row per head (BEiT, Swin, Swinv2) ----

def _head_rows(ctx: PlanContext, style: str):
    """The split of a tensor with one row (or column) per head: the heads' own, head_dim 1."""
    return Heads(_need_heads(ctx, style).num_heads, head_dim=1).q


_LAYERS["ShardParams"] = _layer(".param_shard", "ShardParams")
STYLES.update({s.name: s for s in (
    # a relative position bias table [distances, heads]: columns by heads; each rank builds its heads' bias
    Style("bias_table_heads", "ShardParams",
          lambda c: {"params": {"relative_position_bias_table": (1, _head_rows(c, "bias_table_heads"))}}),
    # a per-head parameter [heads, ...] (Swinv2's logit_scale): rows by heads
    Style("logit_scale_heads", "ShardParams",
          lambda c: {"params": {"logit_scale": (0, _head_rows(c, "logit_scale_heads"))}}),
    # a Linear whose output features are the heads (Swinv2's bias MLP): rows by heads, output left split
    Style("colwise_head_rows", "Linear1D_Col",
          lambda c: {"split": _head_rows(c, "colwise_head_rows"), "gather_output": False}, "col"),
)})


# ---- fused column layers of the bespoke families (ChatGLM2) ----
#
# FusedLinear1D_Col is Linear1D_Col whose rows are several projections one
# after another: each rank keeps its slice of every segment.

_LAYERS["FusedLinear1D_Col"] = _layer("", "FusedLinear1D_Col")
STYLES.update({s.name: s for s in (
    # a fused [q | k | v] projection as FusedLinear1D_Col: each part by its heads (ChatGLM2's query_key_value)
    Style("fused_colwise_qkv", "FusedLinear1D_Col", lambda c: {"split": _need_heads(c, "fused_colwise_qkv").qkv},
          "col", "colwise"),
    # a packed [gate | up] projection as FusedLinear1D_Col: each half split (ChatGLM2's dense_h_to_4h)
    Style("fused_packed_colwise", "FusedLinear1D_Col", lambda c: {"split": _fused_halves(c)}, "col",
          "packed_colwise"),
)})


# ---- the bespoke families' rows (policies/t5.py, albert.py) ----

_LAYERS["Embedding1D"] = _layer("", "Embedding1D")
_LAYERS["EncoderEnds"] = _layer(".sequence_ends", "EncoderEnds")
_LAYERS["Segments"] = _layer(".sequence_segments", "Segments")
_LAYERS["SegmentSplit"] = _layer(".sequence_segments", "SegmentSplit")
_LAYERS["GatherOrderInput"] = _layer(".sequence_segments", "GatherOrderInput")
STYLES.update({s.name: s for s in (
    # an embedding whose columns are the heads (T5's relative position bias table [buckets, heads]): its
    # columns split by the same heads, not gathered: each rank looks up the bias of its own heads
    Style("embedding_heads", "Embedding1D",
          lambda c: {"split": Heads(_need_heads(c, "embedding_heads").num_heads).q, "gather_output": False}),
)})


def style_of(name: str) -> Style:
    """The Style called `name`; PlanError naming the known ones otherwise."""
    try:
        return STYLES[name]
    except KeyError:
        raise PlanError(f"unknown tensor-parallel style {name!r} (shardformer.plan knows: "
                        f"{', '.join(STYLES)})") from None


def replacement(suffix: str, style: str, ctx: PlanContext, extra: dict | None = None) -> Sub:
    """The replacement of the module at `suffix` split as `style`; `extra`
    kwargs are added to (and override) the style's own.  The description
    remembers its style (`Sub.style`) for export."""
    s = style_of(style)
    kwargs = {**s.kwargs(ctx), **(extra or {})}
    return Sub(suffix, s.layer_class(ctx), kwargs=kwargs, style=style)


def realize(plan: dict[str, str], ctx: PlanContext, col: dict | None = None, row: dict | None = None,
            extra: dict[str, dict] | None = None) -> list[Sub]:
    """The replacements of `plan` ({suffix: style}) in its order.  `col` /
    `row`: kwargs added to every style of that kind (sequence parallelism's
    sequence_parallel=True, say); `extra`: {suffix: kwargs} for one entry
    (applied last)."""
    by_kind = {"col": col or {}, "row": row or {}}
    extra = extra or {}
    return [replacement(suffix, style, ctx, {**by_kind.get(style_of(style).kind, {}), **extra.get(suffix, {})})
            for suffix, style in plan.items()]


def hf_entries(path: str, style: str) -> dict[str, str]:
    """`style` at `path` in transformers' notation: {path: its name} plus
    the entries of the module's parameters; {} for our dropout styles."""
    s = style_of(style)
    if s.hf is None:
        return {}
    return {path: s.hf, **{f"{path}.{param}": hf for param, hf in s.hf_params}}


# ---- split-gather sequence parallelism: the regions of a layer stack ----
#
# Every policy (the built-in shapes and DerivedPolicy) writes its split-gather
# sequence parallelism with the two functions below, in typed layouts
# (shardformer.layer.sequence_layout, docs/sequence-layouts.md).  With S the
# sequence, p the group size and a layer stack `layers.0 .. layers.{n-1}`:
#
#   layers.0 input            FULL -> ROWS   (SPLIT: pad S to a multiple of p, keep S/p rows)
#   layers.i output, i < n-1  ROWS -> ROWS   (MARK_ROWS: marked for output_hidden_states)
#   layers.{n-1} output       ROWS -> FULL   (GATHER: all-gather, padding dropped)
#   a region in a layer       its SequenceLayouts, e.g. BLOCK: input ROWS -> FULL_PARTIAL_GRAD
#                             (all-gather; backward reduce-scatter), output PARTIAL_SUM -> ROWS
#                             (reduce-scatter of the row layers' partial sums)
#   a replicated module       runs on this rank's rows: sum_r dW_r all-reduced in backward
#                             (ReplicatedInParallelRegion)


def sequence_region(path: str, layouts: SequenceLayouts, state, overlap: bool = False) -> Sub:
    """The module at `path` moved by `layouts` (SequenceParallelRegion) in the
    model's SequenceState `state`; `overlap`: a BLOCK's input gather overlaps
    its column layers' matmuls."""
    kwargs = {"layouts": layouts, "state": state}
    return Sub(path, SequenceParallelRegion, kwargs={**kwargs, "overlap": True} if overlap else kwargs)


def split_gather_layer(regions: dict[str, SequenceLayouts], replicated, state, overlap: bool = False) -> list[Sub]:
    """The split-gather substitutions inside one layer: each `regions` path
    moved by its layouts (`overlap` on the BLOCKs), then each `replicated`
    path (a norm on this rank's rows) with its gradients all-reduced."""
    return ([sequence_region(path, layouts, state, overlap and layouts == BLOCK) for path, layouts in regions.items()]
            + [Sub(path, ReplicatedInParallelRegion) for path in replicated])


def split_gather_ends(layers: str, count: int, state, mark: bool = True) -> list[Sub]:
    """The split at `layers`.0's input and the gather at the last layer's
    output (both on one module when there is one layer); with `mark`, the
    layers before the last mark their outputs, this rank's rows, for
    output_hidden_states (a spec whose capabilities say
    records_hidden_states=False marks none: those states are refused)."""
    if count == 1:
        return [sequence_region(f"{layers}.0", SPLIT | GATHER, state)]
    if not mark:
        return [sequence_region(f"{layers}.0", SPLIT, state), sequence_region(f"{layers}.{count - 1}", GATHER, state)]
    return ([sequence_region(f"{layers}.0", SPLIT | MARK_ROWS, state)]
            + [sequence_region(f"{layers}.{i}", MARK_ROWS, state) for i in range(1, count - 1)]
            + [sequence_region(f"{layers}.{count - 1}", GATHER, state)])


def record_hidden_states(policy, model):
    """After substitution, output_hidden_states=True under sequence parallelism:
    split_gather (TP group of 2 or more) records full-sequence hidden states
    where the policy marks its layers' rows (`records_hidden_states`:
    split_gather_ends marks them) and refuses them by name elsewhere;
    all_to_all / ring_attn (shardformer.layer.sequence_attention marks the
    rows of every split layer) always record them full.  See
    shardformer.layer.sequence.mark_rows."""
    cfg = policy.shard_config
    split_gather = policy.tensor_parallel and cfg.sequence_parallel and policy.tp_size > 1
    if cfg.split_attention_mode or (split_gather and policy.records_hidden_states):
        record_full_hidden_states(model)
    elif split_gather:
        refuse_recorded_hidden_states(model, type(model).__name__)
    return model


# ---- the interpreter of a PolicySpec (shardformer.spec) ----
#
# interpret() is the one place a spec becomes replacements.  Per ModuleSpec
# (one module class): its entries whose conditions hold, realized by their
# styles (column / row styles with sequence_parallel=True under split-gather
# SP when the module says sp_linear, an entry with sp_always whatever its
# kind); its attributes, this rank's head counts (Heads.attributes); then
# the spec's split-gather regions: the layer class's regions and replicated
# norms (split_gather_layer), the owner's split and gather (split_gather_ends).


def conditions(shard_config, model=None) -> frozenset[str]:
    """The spec conditions (shardformer.spec.CONDITIONS) that hold under
    `shard_config`; with `model`, "config:<attribute>" for every attribute
    of its text config a spec names (a truthy value)."""
    tp = bool(shard_config.enable_tensor_parallelism)
    ep = shard_config.expert_parallel_process_group is not None
    sp = bool(tp and shard_config.sequence_parallel)
    overlap = sp and bool(getattr(shard_config, "enable_sequence_overlap", False))
    manager = getattr(shard_config, "pipeline_stage_manager", None)
    any_sp = bool(getattr(shard_config, "enable_sequence_parallelism", False))
    mode = getattr(shard_config, "sequence_parallelism_mode", None)
    pp = manager is not None and manager.num_stages > 1
    held = {"pipeline_parallel": pp, "tensor_parallel_ranks": tp and shard_config.tensor_parallel_size > 1,
            "tensor_parallel": tp, "sequence_parallel": sp, "expert_parallel": ep, "no_expert_parallel": not ep,
            "tensor_or_expert_parallel": tp or ep, "overlap": overlap, "no_overlap": sp and not overlap,
            "no_sequence_parallel": tp and not sp, "pipeline_stages": manager is not None,
            "any_sequence_parallel": any_sp, "split_attention": any_sp and mode in ("all_to_all", "ring_attn")}
    names = {name for name, on in held.items() if on}
    if any_sp:
        names.add(f"mode:{mode}")
    if model is not None:                            # the config / model attributes the conditions may name,
        names.add(_ConfigOf(text_config(model) if getattr(model, "config", None) is not None else None, model))
    return frozenset(names)                          # read on demand (a plan dict's model may have no config)


class _ConfigOf:
    """The model and its config among the held conditions: holds() reads a
    "config:<attribute>" condition from the config, "model:<attribute>" from the model."""

    def __init__(self, cfg, model=None):
        self.cfg = cfg
        self.model = model


def spec_conditions(spec, model, shard_config) -> frozenset:
    """conditions() of `model` under `shard_config`, and "composed" (the model
    has one of spec.compose's models) or "not_composed"."""
    composed = any(has_module(model, path) for path in spec.compose)
    return conditions(shard_config, model) | {"composed" if composed else "not_composed"}


def has_module(model, path: str) -> bool:
    """Whether `model` has a module at the dotted `path`."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def holds(when, held: frozenset) -> bool:
    """Whether every condition of `when` is in `held` (conditions(); a
    "config:<attribute>" condition: that attribute of the model's config is truthy)."""
    of = next((c for c in held if isinstance(c, _ConfigOf)), _ConfigOf(None))
    return all(bool(getattr(of.cfg, c[7:], False)) if c.startswith("config:") else
               hasattr(of.model, c[6:]) if c.startswith("model:") else c in held for c in when)


def sp_kwargs(name: str, held: frozenset[str], state=None) -> dict:
    """The kwargs of shardformer.spec.SP_KWARGS entry `name` under the
    conditions `held`; `state`: the SequenceState a "gather_exact" layer
    drops the padding by."""
    if "sequence_parallel" not in held or not name:
        return {}
    kwargs = {"sequence_parallel": True}
    if name == "row":
        kwargs["reduce_scatter"] = True
    if name in ("gather", "gather_exact") and "overlap" in held:
        kwargs.update(gather_input=True, overlap=True)
        if name == "gather_exact":
            kwargs["sequence_state"] = state
    if name == "gather_rows":
        kwargs.update(gather_input=True, overlap="overlap" in held)
    return kwargs


class ShardView:
    """What the styles read of a policy (PlanContext.policy) when a spec is
    interpreted without one: the shard config and its vocabulary kwargs."""

    def __init__(self, shard_config):
        self.shard_config = shard_config

    vocab_kwargs = Policy.vocab_kwargs
    lm_head_kwargs = Policy.lm_head_kwargs


def text_config(model):
    """The model's text config (a multimodal config's get_text_config(), else its config)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def spec_heads(spec, model) -> Heads | None:
    """The attention's Heads, read from the (text) config where spec.heads says; None without."""
    where = spec.heads
    if where is None:
        return None
    cfg = text_config(model)
    n = getattr(cfg, where.num_heads)
    kv = (getattr(cfg, where.kv_heads, None) if where.kv_heads else None) or n
    dim = (getattr(cfg, where.head_dim, None) if where.head_dim else None) or getattr(cfg, where.hidden) // n
    return Heads(n, kv, dim)


def refuse(spec, model, shard_config) -> None:
    """Raise the first of spec.refusals that applies (before anything changes):
    its error type with its message, the model class, attribute and value
    filled in; parallel_output=True under TP where the spec's capabilities
    say its LM heads do not honour it."""
    held = spec_conditions(spec, model, shard_config)
    if "tensor_parallel" in held and shard_config.parallel_output and not spec.capabilities.parallel_output:
        raise NotImplementedError(f"{type(model).__name__}: parallel_output=True is not available for policy spec "
                                  f"{spec.name!r} (its capabilities say parallel_output=False); see "
                                  f"docs/writing-policies.md")
    cfg = text_config(model)
    for r in spec.refusals:
        values = {name: getattr(cfg, name, r.default) for name in (r.attribute, *r.also) if name}
        if holds(r.when, held) and (not r.attribute or any(v not in r.allowed for v in values.values())):
            error = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}[r.error]
            raise error(r.message.format(**values, model=type(model).__name__, attribute=r.attribute,
                                         value=values.get(r.attribute), mode=shard_config.sequence_parallelism_mode))


def _embed_scale(module_spec, model) -> float | None:
    if not module_spec.embed_scale:
        return None
    native = model.get_input_embeddings()
    return float(getattr(native, "scalar_embed_scale", text_config(model).hidden_size ** 0.5))


def _find(model, class_name: str, spec) -> list:
    found = [m for m in model.modules() if type(m).__name__ == class_name]
    if not found:
        raise PlanError(f"{type(model).__name__}: policy spec {spec.name!r} names {class_name}, which the model "
                        f"does not have")
    return found


def _parameterized_children(module, skip) -> tuple[str, ...]:
    return tuple(name for name, child in module.named_children()
                 if name not in skip and any(True for _ in child.parameters()))


def stack_states(spec, held: frozenset, shard_config, state) -> list:
    """(SplitGatherSpec, its state) of the spec's split-gather stacks whose
    conditions hold (none when its split-gather SP is off): the first's
    SequenceState is the optimize()'s `state.sequence_state` (made here),
    each further stack has its own; a segmented stack (ends="segments") a
    shardformer.layer.sequence_segments.Segments, the whole sequence's state
    the optimize()'s when it is the first."""
    if not split_gather_on(spec, held):
        return []
    out = []
    for sg in (spec.split_gather,) + tuple(s for s in spec.stacks if holds(s.when, held)):
        if sg.ends == "segments":
            seq = _LAYERS["Segments"]()(sg.segments)
        else:
            seq = SequenceState(sg.dim, recompute=shard_config.sequence_parallel_recompute)
        if not out:
            state.sequence_state = seq.whole if sg.ends == "segments" else seq
        out.append((sg, seq))
    return out


def region_state(sg, seq, segment: str | None):
    """The SequenceState a Region of stack `sg` (its state `seq`) moves by:
    the stack's own, or in a segmented stack its `segment`'s (None: the whole
    sequence); PlanError naming the stack's segments otherwise."""
    if sg.ends != "segments":
        if segment is not None:
            raise PlanError(f"{sg.owner}.{sg.layers}: a region names segment {segment!r}, but the stack is not "
                            f"segmented (SplitGatherSpec.segments)")
        return seq
    if segment is None:
        return seq.whole
    if segment not in sg.segments:
        raise PlanError(f"{sg.owner}.{sg.layers}: a region names segment {segment!r}, not one of the stack's "
                        f"segments {sg.segments}")
    return seq[segment]


def region_sub(region, seq) -> Sub:
    """The replacement of one Region in the SequenceState `seq`: moved by its
    layouts, put in gather order (GATHER_ORDER) or, without layouts, run on
    this rank's rows with its gradients all-reduced."""
    if region.layouts is None:
        sub = Sub(region.path, ReplicatedInParallelRegion)
    elif region.layouts == GATHER_ORDER:
        sub = Sub(region.path, _LAYERS["GatherOrderInput"](), kwargs={"state": seq})
    else:
        sub = sequence_region(region.path, region.layouts, seq)
    if region.optional:
        sub.ignore_if_not_exist = True
    return sub


def split_gather_subs(spec, model, shard_config, state, sg=None, seq=None) -> dict[str, list[Sub]]:
    """{class name: subs} of one split-gather stack `sg` (default
    spec.split_gather) in its state `seq` (stack_states; default the
    optimize()'s `state.sequence_state`, made when there is none): the
    layer's regions, replicated norms and the modules beside the split
    layers; the owner's split and gather (one list where the layer's class
    is the owner's; a segmented stack: each layer split segment by segment)."""
    held = conditions(shard_config, model)
    if sg is None:
        sg = spec.split_gather
    if seq is None:
        if state.sequence_state is None:
            state.sequence_state = SequenceState(sg.dim, recompute=shard_config.sequence_parallel_recompute)
        seq = state.sequence_state
    owner = _find(model, sg.owner, spec)[0]
    layers = owner.get_submodule(sg.layers)
    regions = [r for r in sg.regions if holds(r.when, held)]
    norms = (tuple(r.path for r in regions if r.layouts is None) if sg.skip is None
             else _parameterized_children(layers[0], sg.skip))
    moved = {r.path: r.layouts for r in regions if r.layouts is not None}
    whole = region_state(sg, seq, None)
    out = {sg.layer: split_gather_layer(moved, norms, whole, sg.overlap and "overlap" in held)
           + _beside_subs(sg.beside, held, shard_config)}
    if sg.ends == "layers":
        ends = split_gather_ends(sg.layers, len(layers), seq, sg.marks)
    elif sg.ends == "module":
        ends = [Sub(sg.layers, _LAYERS["EncoderEnds"](), kwargs={"state": seq})]
    else:
        n = len(layers)
        ends = [Sub(f"{sg.layers}.{i}", _LAYERS["SegmentSplit"](),
                    kwargs={"segments": seq, "first": i == 0, "last": i == n - 1}) for i in range(n)]
    out.setdefault(sg.owner, []).extend(ends + replicated_params(layers, sg.layers, sg.params))
    return out


def _beside_subs(entries, held: frozenset, shard_config) -> list[Sub]:
    """The replacements of SplitGatherSpec.beside whose conditions hold."""
    ctx = PlanContext(ShardView(shard_config))
    return [replacement(e.suffix, e.style, ctx, dict(e.kwargs)) for e in entries if holds(e.when, held)]


def replicated_params(stack, path: str, names: tuple[str, ...]) -> list[Sub]:
    """A layer list's parameters used on this rank's rows: those of `stack`
    (the ModuleList at `path`) whose name under a layer is, or starts with a
    child in, `names` (dotted, "0.lambda_1", "1.layernorm_before.weight"),
    their gradients all-reduced by one ReplicatedInParallelRegion on the
    list; none when no layer has one."""
    found = tuple(name for name, _ in stack.named_parameters() if name.split(".")[1] in names) if names else ()
    return [Sub(path, ReplicatedInParallelRegion, kwargs={"params": found})] if found else []


def stack_subs(row, model, owner: str, held: frozenset, state) -> list[Sub]:
    """The split-gather substitutions of one shardformer.spec.Stack (paths
    under its ModuleSpec's module, at `owner` in `model`) under the
    conditions `held`: its regions on every block, its norms' gradient
    all-reduce, its ends; under enable_sequence_overlap the blocks of its
    WindowOverlap listed in the optimize()'s `state.window_overlaps` (hooked
    in after substitution: install_window_overlaps).  One SequenceState per
    stack: each has its own length."""
    seq, blocks = SequenceState(), row.path
    where = f"{owner}.{blocks}" if owner else blocks
    overlapped = row.overlap is not None and "overlap" in held
    if overlapped:
        state.window_overlaps.update({f"{where}.{j}": (seq, row.overlap.gather_at, row.overlap.attention)
                                      for j in range(row.overlap.first, row.depth)})
    subs = split_gather_layer({f"{blocks}.*.{r.path}": r.layouts for r in row.regions if holds(r.when, held)}, (), seq)
    subs += replicated_params(model.get_submodule(where), blocks, row.params)
    if row.ends == "split_gather":
        return subs + split_gather_ends(blocks, row.depth, seq)
    if row.depth == 1:                       # rows_between: nothing lies between blocks
        return subs
    gather = None if overlapped else GATHER_INPUT        # the overlapped pass gathers blocks 1..d-1's input
    inner = SPLIT_OUTPUT if gather is None else gather | SPLIT_OUTPUT
    layouts = [SPLIT_OUTPUT] + [inner] * (row.depth - 2) + [gather]
    return subs + [sequence_region(f"{blocks}.{j}", lay, seq) for j, lay in enumerate(layouts) if lay is not None]


def install_window_overlaps(model, shard_config, state) -> None:
    """After substitution: the WindowedGatherOverlap hooks of the blocks a
    Stack's WindowOverlap listed (OptimizeState.window_overlaps: {block path:
    (SequenceState, gather_at, attention)}), once: the list is consumed."""
    group = shard_config.tensor_parallel_process_group
    overlaps, state.window_overlaps = state.window_overlaps, {}        # consumed: installed once
    for path, (seq, gather_at, attention) in overlaps.items():
        WindowedGatherOverlap.from_native_module(model.get_submodule(path), group, state=seq, gather_at=gather_at,
                                                 attention=attention)


def _mark_layer_rows(module, group, state):
    return mark_layer_rows(module, state, group)


def _full_length_kwarg(module, group, state, name: str):
    return FullLengthKwarg.from_native_module(module, group, name=name, state=state)


#: The hooks of shardformer.spec.Hook rows: name -> install(module, group, state, **kwargs).
HOOKS: dict[str, Callable] = {"mark_layer_rows": _mark_layer_rows, "full_length_kwarg": _full_length_kwarg}


def hook_rows(spec, m, e, model, stacks, state) -> list:
    """Record a Hook row `e` of ModuleSpec `m` in state.hooks, one per module
    of the class, in the SequenceState of the split-gather stack whose layer
    class it is (none where that stack is off); no substitutions."""
    seqs = [region_state(sg, seq, None) for sg, seq in stacks if sg.layer == m.key][:1]
    state.hooks += [(module, e, seq) for seq in seqs for module in _find(model, m.key, spec)]
    return []


def install_hooks(model, shard_config, state) -> None:
    """After substitution: the hooks state.hooks recorded (hook_rows), each on
    what now sits at its row's path under its module (a replacement
    included); an optional row's missing module is skipped.  Consumed: a
    second call installs nothing."""
    group = shard_config.tensor_parallel_process_group
    rows, state.hooks = state.hooks, []
    for module, row, seq in rows:
        try:
            target = module.get_submodule(row.path) if row.path else module
        except AttributeError:
            if row.optional:
                continue
            raise PlanError(f"{type(model).__name__}: a Hook row names {row.path!r} under {type(module).__name__}, "
                            f"which has no such module") from None
        HOOKS[row.hook](target, group, seq, **dict(row.kwargs))


def stage_split(split, model):
    """The StageSplit that Capabilities.pipeline_split gives `model`: itself,
    or of a tuple of shardformer.spec.SplitWhen rows the split of the first
    whose classes the model holds (None: no row holds, or no model)."""
    if not isinstance(split, tuple):
        return split
    if model is None:
        return None
    classes = {type(m).__name__ for m in model.modules()}
    return next((row.split for row in split if set(row.has) <= classes and not classes & set(row.lacks)), None)


def _module_path(model, class_name: str, spec) -> str:
    """The path of the (first) module of class `class_name` in `model`."""
    for path, m in model.named_modules():
        if type(m).__name__ == class_name:
            return path
    _find(model, class_name, spec)          # raises, naming the class


def _entry_subs(spec, m, e, model, held, state, ctx: PlanContext, by_kind: dict, stacks) -> list[Sub]:
    """The substitutions of one row of a ModuleSpec's entries: an Entry's
    replacement (skipped where the model lacks an optional module: ignore_if_not_exist),
    a Stack's split-gather substitutions, or a Region of the split-gather
    stack whose layer class is the module's (`stacks`: stack_states; none
    where that stack is off)."""
    if isinstance(e, Stack):
        return stack_subs(e, model, _module_path(model, m.key, spec), held, state)
    if isinstance(e, Region):
        return [region_sub(e, region_state(sg, seq, e.segment)) for sg, seq in stacks if sg.layer == m.key][:1]
    if isinstance(e, Hook):
        return hook_rows(spec, m, e, model, stacks, state)
    sub = replacement(e.suffix, e.style, ctx, {**sp_kwargs(e.sp if e.sp is not None else
                                                         by_kind.get(style_of(e.style).kind, ""),
                                                         held, state.sequence_state), **dict(e.kwargs)})
    if e.optional:
        sub.ignore_if_not_exist = True
    return [sub]


def split_gather_on(spec, held: frozenset) -> bool:
    """Whether the spec's split-gather SP applies under the conditions `held`
    (split-gather SP on, the SplitGatherSpec's own conditions holding)."""
    sg = spec.split_gather
    return sg is not None and "sequence_parallel" in held and holds(sg.when, held)


def _methods(rows, spec, model, shard_config, state, heads, held) -> dict:
    """{method: replacement} of a ModuleSpec's Method rows (shardformer.spec.Method)
    whose conditions hold, each made by its `make` from a MethodSite."""
    rows = [a for a in rows if isinstance(a, Method)]
    if not rows:
        return {}
    site = MethodSite(shard_config, shard_config.tensor_parallel_process_group, shard_config.tensor_parallel_size,
                      shard_config.tensor_parallel_rank, model, heads,
                      state.sequence_state if split_gather_on(spec, held) else None, held)
    return {a.name: a.make(site) for a in rows}


def _settings(rows) -> dict:
    """{attribute: value} of a ModuleSpec's Setting rows (shardformer.spec.Setting)."""
    return {a.name: a.value for a in rows if isinstance(a, Setting)}


def _attributes(spec, module_spec, rows, heads, model) -> dict:
    """{attribute: this rank's value} of the Attribute rows of one ModuleSpec:
    the rows without heads follow the spec's heads (a "config" row copies the
    model's text config); those with their own heads follow them, one group
    per module holding them (a "config" row copies the config that module
    holds now, found on the first module of the class)."""
    groups: dict = {}
    for a in rows:
        key = (None, "") if a.heads is None else (a.heads, a.name.rpartition(".")[0])
        groups.setdefault(key, {})[a.name] = a.kind
    out = {}
    for (own, holder), counts in groups.items():
        if own is None:
            if heads is None:
                raise PlanError(f"policy spec {spec.name!r}: {module_spec.key} sets head attributes but the spec "
                                f"reads no heads")
            out.update(heads.attributes(counts, text_config(model)))
            continue
        config = None
        if "config" in counts.values():
            first = _find(model, module_spec.key, spec)[0]
            config = getattr(first.get_submodule(holder) if holder else first, "config", None)
        out.update(own.attributes(counts, config))
    return out


def interpret(spec, model, shard_config, state, policy=None) -> dict:
    """{class name: ModulePolicyDescription} of `spec` (shardformer.spec.PolicySpec)
    on `model` under `shard_config`; `state` (the optimize()'s OptimizeState)
    receives the SequenceState of split-gather SP and the spec's ties.
    `policy`: what the styles read (vocabulary kwargs; default a ShardView of
    the shard config).  Nothing when tensor parallelism is off."""
    held = conditions(shard_config, model)
    if "tensor_parallel" not in held:
        return {}
    view = policy if policy is not None else ShardView(shard_config)
    heads = spec_heads(spec, model)
    stacks = stack_states(spec, held, shard_config, state)          # this call's sequence states
    out = {}
    for m in spec.modules:
        if not holds(m.when, held):
            continue
        scale = _embed_scale(m, model)
        entries = {}                       # by suffix, as a plan dict: a later entry replaces an earlier one
        for e in m.entries:
            if holds(e.when, held):
                entries[e.suffix] = e
        by_kind = dict(zip(("col", "row"), SP_LINEAR[m.sp_linear]))
        subs = [sub for e in entries.values() for sub in _entry_subs(
            spec, m, e, model, held, state, PlanContext(view, heads if getattr(e, "heads", None) is None else e.heads,
                                                        scale), by_kind, stacks)]
        rows = [a for a in m.attributes if holds(a.when, held)]
        attributes = _attributes(spec, m, [a for a in rows if isinstance(a, Attribute)], heads, model)
        out[m.key] = ModulePolicyDescription(attribute_replacement={**attributes, **_settings(rows)},
                                             sub_module_replacement=subs,
                                             method_replacement=_methods(rows, spec, model, shard_config, state,
                                                                         heads, held))
    for sg, seq in stacks:
        for key, subs in split_gather_subs(spec, model, shard_config, state, sg, seq).items():
            out.setdefault(key, ModulePolicyDescription()).sub_module_replacement.extend(subs)
    record_ties(state, model, spec.ties, f"policy spec {spec.name!r}")
    return out


# ---- ties: the one way a policy's ties are recorded ----
#
# A tie (source, target) says: after substitution, the target module's
# `weight` is still the source's Parameter.  The engine keeps it (every
# Parameter held under several names is bound as one in the replacements,
# shardformer.ties); Policy.postprocess checks state.ties.  Every policy
# records its ties through record_ties: the spec's ties (interpret;
# DerivedPolicy.translate writes the LM head's, T5's factory its shared
# embeddings'), the LM heads of a family (FamilyPolicy.preprocess).  A tie is
# taken from the model itself: recorded only when the model holds the two
# weights as one Parameter before substitution (transformers' tie_weights()
# made them one, as the model's _tied_weights_keys and config declare: an LM
# head with tie_word_embeddings=False stays untied), and once.


def held_ties(model, pairs, owner: str = "") -> list[tuple[str, str]]:
    """The (source, target) module paths of `pairs` whose `weight` `model`
    holds as one Parameter now (its own ties).  A path that names no module
    of the model is refused (PlanError naming `owner`, the path and the
    model), before anything changes."""
    held = []
    for source, target in pairs:
        modules = []
        for path in (source, target):
            try:
                modules.append(model.get_submodule(path))
            except AttributeError:
                raise PlanError(f"{type(model).__name__}: {owner or 'a policy'} ties {target!r} to {source!r}, but "
                                f"{path!r} is not a module of {type(model).__name__}") from None
        weight = getattr(modules[0], "weight", None)
        if weight is not None and getattr(modules[1], "weight", None) is weight:
            held.append((source, target))
    return held


def record_ties(state, model, pairs, owner: str = "") -> None:
    """Add to state.ties (checked by Policy.postprocess) each pair of `pairs`
    that the model ties now (held_ties), unless it is recorded already."""
    state.ties += [tie for tie in dict.fromkeys(held_ties(model, pairs, owner)) if tie not in state.ties]
