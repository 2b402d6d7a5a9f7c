"""Shapes shared by several families: how each kind of body is split.

A shape is a FamilyPolicy subclass reading the family's options (class
attributes set from `Family.options`).  Every shape here is a spec factory
(shardformer.family.SpecPolicy): `build_spec()` makes the family's
PolicySpec (shardformer.spec: styles per suffix, head attributes,
split-gather regions in typed layouts, capabilities, refusals), and
shardformer.plan.interpret, the one interpreter, turns it into
replacements.  DecoderShape, EncoderShape and GPTBlockShape build it from
the options alone; FusedQKVShape, VisionShape and StageShape also read the
bound model's config (Falcon's fused layout, BEiT's layer scales, Swin's
stages); so do the bespoke families OPT, ALBERT, T5 and Whisper
(policies/opt.py, albert.py, t5.py, whisper.py).  ChatGLM2, SAM, BLIP-2 and
Gemma 3's multimodal model still write `body_policy()` in code with the plan
functions (realize, attention_by_heads, split_gather_layer, ...); the tables
below name the layers the styles become.
Families only name their shape, options and head classes (policies/<family>.py);
heads, the registry and the optimizations (fused norms, fused MLP
activations, flash attention: applied by the sharder by module type, see
shardformer.optimizations) come from elsewhere.

DecoderShape, a Llama-shaped decoder (Llama, Mistral, Qwen2/3, Gemma 1-3,
GLM, Phi-3, Mixtral).  Per layer (`<prefix>DecoderLayer`):

    self_attn.q_proj, k_proj, v_proj   Linear1D_Col  (per head; KV heads
                                                      replicated when fewer than ranks)
    self_attn.qkv_proj (fused_qkv)     Linear1D_Col, split Fused(q, kv, kv)
    self_attn.q_norm, k_norm (qk_norm) replicated, gradients all-reduced
    self_attn.o_proj                   Linear1D_Row  (input split by the same heads)
    mlp.gate_proj, mlp.up_proj         Linear1D_Col
    mlp.gate_up_proj (mlp="fused")     Linear1D_Col, split Fused(gate, up)
    mlp.down_proj                      Linear1D_Row
    mlp.experts (mlp="moe")            FusedExperts1D (the router mlp.gate stays replicated);
                                       ExpertParallelExperts with ShardConfig.expert_parallel_process_group
    <base>.embed_tokens                VocabParallelEmbedding1D (scaled by sqrt(hidden) with embed_scale)

HF's attention infers its head count from the projection width, so only
num_key_value_groups changes per rank.

Sequence parallelism (split_gather; with mlp="moe" the MoE block is the
mlp region, see policies/mixtral.py): the Linear layers
above take sequence_parallel=True; self_attn and mlp become sequence-parallel
blocks, the first layer splits its input along the sequence and the last
gathers its output, and the layer's norms get their gradients all-reduced
(shardformer.layer.sequence).  With enable_sequence_overlap, each block's
one input all-gather runs while its column layers (q/k/v or qkv, gate/up or
gate_up) multiply this rank's rows (shardformer.layer.sequence.gather_block_input,
which says why the attention's projections cannot gather inside).
output_hidden_states=True records full-sequence states (record_hidden_states).

Sequence parallelism all_to_all / ring_attn (every DecoderShape family,
with or without TP over a separate group): the base model's `layers` take
SequenceAttentionParallel (shardformer.layer.sequence_attention).

Options: prefix (class-name prefix, "Mistral"), base_model ("Model";
Gemma 3 text: "TextModel"), mlp ("split" | "fused" | "moe"), fused_qkv,
qk_norm, embed_scale.

EncoderShape, a BERT-shaped encoder (BERT, RoBERTa, ERNIE; ALBERT overrides
its layer).  Per layer (`<prefix>Layer`) and on `<prefix>Embeddings`:

    attention.self.{query,key,value}        Linear1D_Col  (per head)
    attention.self.dropout                  DropoutForParallelInput (attention probabilities)
    attention.output.dense                  Linear1D_Row  (input split by the same heads)
    crossattention.* (add_cross_attention)  the same
    intermediate.dense / output.dense       Linear1D_Col / Linear1D_Row
    *.output.dropout, embeddings.dropout    DropoutForReplicatedInput
    embeddings.word_embeddings              VocabParallelEmbedding1D

The self-attention infers its head count from the projection width; its
num_attention_heads and all_head_size become this rank's values.
Sequence parallelism (split_gather): see EncoderShape and the layout above
sp_linear_kwargs; ALBERT (shared layers): policies/albert.py.
Options: prefix ("Bert").

VisionShape, ViT-style layers (ViT; BEiT adds its bias tables), one head
count for every `<prefix>Layer`:

    attention.{q,k,v}_proj     Linear1D_Col  (per head)
    attention.o_proj           Linear1D_Row  (input split by the same heads)
    mlp.fc1 / mlp.fc2          Linear1D_Col / Linear1D_Row
    dropout                    DropoutForReplicatedInput

StageShape, Swin-style stages (Swin; Swinv2 overrides its block): stage i
has num_heads[i] heads of width embed_dim * 2^i / num_heads[i], so one set
of replacements per stage is keyed on `<prefix>Encoder`, at
layers.i.blocks.*; a relative position bias table [distances, heads] is
split by columns with the heads (`bias_table_split`).

Both vision shapes split a `classifier` head only where the model has one
(HF makes it an nn.Identity with num_labels=0).  Options: prefix ("ViT").

GPTBlockShape, a GPT-style decoder (GPT-Neo, GPT-J; GPT-2 overrides its
attention and MLP), and FusedQKVShape, a BLOOM-shaped decoder with one fused
query_key_value (BLOOM; Falcon overrides its qkv layout): see their
docstrings.  These, EncoderShape, OPT and Whisper take split-gather
sequence parallelism with row layers that reduce-scatter themselves (their
biases and residual dropouts sit inside the attention / MLP modules): the
layout is described above sp_linear_kwargs.  gpt_heads() names the head
classes of these families (their token classifier is `classifier`).
"""
from __future__ import annotations

from dataclasses import replace

from shardformer.family import SpecPolicy, gathered, lm, spec_capabilities
from shardformer.layer.sequence_layout import BLOCK, ENTER, ENTER_OUTPUT, LEAVE, SUM_GRAD
from shardformer.layer.sequence import SequenceState
from shardformer.layout import Heads
from shardformer.pipeline.stages import StageSplit
from shardformer.plan import (PlanContext, interpret, realize,
                              split_gather_layer, split_gather_subs)
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub
from shardformer.spec import (Attribute, Capabilities, Entry, HeadsFrom, ModuleSpec, PolicySpec, Refusal, Region,
                              Setting, SplitGatherSpec, Stack, WindowOverlap)


def refuse_replaced_hooks(cls: type, replaced: dict[str, str]) -> None:
    """A subclass defining a method its shape no longer reads (it returned
    replacement descriptions; the shape is a spec factory now) is refused
    when the class is made, naming the method that replaces it."""
    for old, new in replaced.items():
        if old in cls.__dict__:
            raise TypeError(f"{cls.__qualname__}.{old}() is no longer read by {cls.__mro__[1].__name__}'s spec "
                            f"factory: override {new} instead (docs/writing-policies.md)")


class DecoderShape(SpecPolicy):
    """A spec factory: build_spec() is the family's PolicySpec, made from
    its options (class attributes set from Family.options) alone; the one
    interpreter (shardformer.plan.interpret) turns it into replacements."""

    prefix = ""
    base_model = "Model"
    mlp = "split"
    fused_qkv = False
    qk_norm = False
    embed_scale = False

    #: {dotted attribute under the decoder layer: what it holds} (Heads.attributes)
    head_attributes = {"self_attn.num_key_value_groups": "groups"}

    split_attention_at = ("{prefix}{base_model}", "layers")
    pipeline_split = StageSplit("{prefix}{base_model}", "layers", last=("norm",))

    sp_modes = ("split_gather",)

    #: enable_sequence_overlap with split_gather: the blocks' input gathers
    #: overlap their column layers' matmuls (the spec's SplitGatherSpec.overlap);
    #: not for MoE, whose router needs the gathered tokens before any expert runs.
    sequence_overlap = True
    sequence_overlap_why = ("layers.*.mlp is a mixture of experts: its router picks each token's experts from the "
                            "gathered sequence, so no column matmul on this rank's rows can run while the block's "
                            "input is gathered")
    #: sequence_parallel_recompute="selective": the split-gather layers open a recompute scope.
    sequence_recompute = True

    def attention_plan(self) -> dict[str, str]:
        """{suffix under the decoder layer: style} of the attention (shardformer.plan)."""
        if self.fused_qkv:
            plan = {"self_attn.qkv_proj": "colwise_qkv"}
        else:
            plan = {"self_attn.q_proj": "colwise_heads", "self_attn.k_proj": "colwise_kv_heads",
                    "self_attn.v_proj": "colwise_kv_heads"}
        if self.qk_norm:
            plan.update({"self_attn.q_norm": "replicated_with_grad_allreduce",
                         "self_attn.k_norm": "replicated_with_grad_allreduce"})
        return {**plan, "self_attn.o_proj": "rowwise_heads"}

    def mlp_plan(self) -> dict[str, str]:
        """{suffix under the decoder layer: style} of the MLP (shardformer.plan)."""
        if self.mlp == "moe":
            return {"mlp.experts": "moe_tp_experts"}
        up = {"mlp.gate_up_proj": "packed_colwise"} if self.mlp == "fused" else \
            {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise"}
        return {**up, "mlp.down_proj": "rowwise"}

    def mlp_entries(self) -> tuple[Entry, ...]:
        """The MLP's entries: the plan, or with mlp="moe" the experts split by
        TP (sequence_parallel=True under SP, the router then
        RouterInSequenceParallel) or, with an expert-parallel group, by experts."""
        if self.mlp != "moe":
            return tuple(Entry(k, v) for k, v in self.mlp_plan().items())
        return (Entry("mlp.experts", self.mlp_plan()["mlp.experts"], when=("no_expert_parallel",), sp="col"),
                Entry("mlp.experts", "moe_ep_experts", when=("expert_parallel",)),
                Entry("mlp.gate", "moe_router_sequence_parallel", when=("sequence_parallel", "no_expert_parallel")))

    def build_spec(self) -> PolicySpec:
        layer, base = f"{self.prefix}DecoderLayer", f"{self.prefix}{self.base_model}"
        moe = self.mlp == "moe"
        refusals = (Refusal("pretraining_tp", allowed=(None, 1), default=1,
                            message="{model}: pretraining_tp={value} is not supported (set it to 1)"),)
        if moe:
            refusals += (Refusal("router_jitter_noise", allowed=(0, None), default=0.0,
                                 when=("tensor_or_expert_parallel",),
                                 message="{model}: router_jitter_noise={value} is not supported: each rank would "
                                         "draw its own noise and route tokens differently (set it to 0)"),)
        capabilities = replace(spec_capabilities(self), sequence_overlap=self.sequence_overlap and not moe)
        return PolicySpec(
            name=self.family.name if self.family is not None else layer,
            modules=(ModuleSpec(layer, tuple(Entry(k, v) for k, v in self.attention_plan().items())
                                + self.mlp_entries(), attributes=tuple(self.head_attributes.items())),
                     ModuleSpec(base, (Entry("embed_tokens", "embedding_rowwise"),), embed_scale=self.embed_scale)),
            heads=HeadsFrom(),
            split_gather=SplitGatherSpec(base, "layers", layer, (("self_attn", BLOCK), ("mlp", BLOCK)),
                                         overlap=True, skip=("self_attn", "mlp")),
            capabilities=capabilities,
            refusals=refusals,
        )

    def sequence_parallel_replacements(self) -> tuple[list[Sub], list[Sub]]:
        """(decoder-layer subs, base-model subs) of split-gather SP: the
        spec's (shardformer.plan.split_gather_subs).  A subclass that
        overrides this (a policy written before the specs) has its own
        subs used instead (body_policy)."""
        sg = self.build_spec().split_gather
        subs = split_gather_subs(self.build_spec(), self.model, self.shard_config, self.state)
        return subs[sg.layer], subs[sg.owner]

    def body_policy(self) -> dict:
        if type(self).sequence_parallel_replacements is DecoderShape.sequence_parallel_replacements:
            return super().body_policy()
        spec = self.build_spec()                 # the spec's split-gather replaced by the override's subs
        policy = interpret(replace(spec, split_gather=None), self.model, self.shard_config, self.state, self)
        if policy and self.shard_config.sequence_parallel:
            layer_subs, base_subs = self.sequence_parallel_replacements()
            policy[spec.split_gather.layer].sub_module_replacement.extend(layer_subs)
            policy[spec.split_gather.owner].sub_module_replacement.extend(base_subs)
        return policy

# The head classes of a Llama-shaped decoder, by what transformers defines for it.
def decoder_heads(prefix: str, *, base: str = "Model", qa: bool = True, token: bool = True) -> dict:
    """{class name: heads}: the base model, ForCausalLM (vocabulary-parallel LM head),
    ForSequenceClassification / ForTokenClassification ("score") and
    ForQuestionAnswering ("qa_outputs"), gathered."""
    heads = {f"{prefix}{base}": (), f"{prefix}ForCausalLM": lm("lm_head"),
             f"{prefix}ForSequenceClassification": gathered("score")}
    if token:
        heads[f"{prefix}ForTokenClassification"] = gathered("score")
    if qa:
        heads[f"{prefix}ForQuestionAnswering"] = gathered("qa_outputs")
    return heads


# ---- Split-gather sequence parallelism of blocks whose row layers have a bias ----
#
# GPT-2, BERT, GPT-Neo, GPT-J, BLOOM: the row layer's output passes a bias and
# a residual dropout (and, in BERT, the residual add and the post-norm)
# inside the attention / MLP module, so the sum over ranks has to happen at
# the row layer, not at the module's output (DecoderShape's BLOCK).
# Megatron's layout (shardformer.layer.sequence, ENTER):
#
#   between layers          hidden states split along the sequence: this rank's rows
#   attention / MLP module  ENTER: input all-gathered along S (backward:
#                           reduce-scatter of dX), saved as local rows, re-gathered once
#   column layers           sequence_parallel=True: no copy_to_tp_region
#   row layers              reduce_scatter=True: reduce-scatter of the partial sums
#                           along S (backward: all-gather), then the bias on this
#                           rank's rows, its gradient all-reduced
#   residual dropouts       on this rank's rows: a different mask per rank
#   norms                   on this rank's rows: gradients all-reduced
#   first / last layer      split the input (backward: all-gather) / gather the
#                           output (backward: this rank's rows)


def sp_linear_kwargs(shard_config) -> tuple[dict, dict]:
    """(column kwargs, row kwargs) of the Linear layers in a block: with
    split-gather SP the column layers read the gathered input
    (sequence_parallel=True) and the row layers reduce-scatter and add their
    bias themselves (reduce_scatter=True); without SP, none."""
    if not shard_config.sequence_parallel:
        return {}, {}
    return {"sequence_parallel": True}, {"sequence_parallel": True, "reduce_scatter": True}


def sp_overlap(shard_config) -> bool:
    """ShardConfig.enable_sequence_overlap with split-gather SP: the MLP's up
    projection (and GPT-2's c_attn) gathers its own input rows, overlapping
    the all-gather with its matmul and, backward, the reduce-scatter of dX
    with dW (Linear1D_Col gather_input=True, overlap=True) instead of the
    module's ENTER gather.  DecoderShape: every block's gather, shared by
    its column layers (SequenceParallelRegion overlap=True)."""
    return bool(shard_config.sequence_parallel and getattr(shard_config, "enable_sequence_overlap", False))


def sp_gathering(col: dict, state=None) -> dict:
    """The kwargs of a column layer that gathers its input rows itself, with
    overlap; `state`: drop the padding (exact sequence, for an attention)."""
    return {**col, "gather_input": True, "overlap": True, **({"sequence_state": state} if state is not None else {})}


def sp_layer_subs(entered, norms, state) -> list[Sub]:
    """The SP hooks inside one layer whose row layers reduce-scatter
    themselves: the modules at `entered` are ENTERed (input all-gathered
    along S), the modules at `norms` (used on this rank's rows) get their
    parameter gradients all-reduced (shardformer.plan.split_gather_layer)."""
    return split_gather_layer(dict.fromkeys(entered, ENTER), norms, state)


def parameterized_children(module, skip=()) -> list[str]:
    """Names of `module`'s children that hold parameters, except `skip`."""
    return [name for name, child in module.named_children()
            if name not in skip and any(True for _ in child.parameters())]


def new_sequence_state():
    """A fresh SequenceState (the sequence length of one split-gather stack,
    shared by its regions and the layers that drop its padding)."""
    return SequenceState()


# ---- EncoderShape: BERT-shaped encoders ----

def bert_attention_spec(prefix: str, when: tuple[str, ...] = (), attributes: bool = False) -> tuple:
    """bert_attention as spec rows: the Entry rows of the attention at
    `prefix` (a cross attention's key / value, reading the replicated
    encoder states, take no SP kwargs), or with `attributes` its Attribute
    rows; each under the conditions `when`."""
    if attributes:
        return (Attribute(f"{prefix}.self.num_attention_heads", "heads", when),
                Attribute(f"{prefix}.self.all_head_size", "width", when))
    kv = "" if prefix == "crossattention" else None
    return (Entry(f"{prefix}.self.query", "colwise_heads", when),
            Entry(f"{prefix}.self.key", "colwise_heads", when, kv),
            Entry(f"{prefix}.self.value", "colwise_heads", when, kv),
            Entry(f"{prefix}.self.dropout", "dropout_parallel", when),
            Entry(f"{prefix}.output.dense", "rowwise_heads", when),
            Entry(f"{prefix}.output.dropout", "dropout_residual", when))


class EncoderShape(SpecPolicy):
    """Split-gather sequence parallelism (the layout above sp_linear_kwargs):
    the hidden states are split at the first `<prefix>Layer` (the embeddings,
    with their positions, token types and dropout, run before it on the full
    sequence) and gathered after the last one (pooler and heads see the full
    sequence).  In each layer attention.self and intermediate take layouts
    ENTER (the attention mask is bidirectional: the gathered sequence is
    the whole one); attention.output.dense and output.dense reduce-scatter
    and add their bias on this rank's rows; their dropouts draw a mask per
    rank; the post-norms attention.output.LayerNorm and output.LayerNorm run
    on this rank's rows and get their gradients all-reduced.  A cross
    attention (add_cross_attention) gathers its query input the same way,
    while its key / value read the replicated encoder states as under TP.
    With enable_sequence_overlap, intermediate.dense gathers its input rows
    itself, the all-gather overlapping its matmul (sp_overlap).
    Refused with chunk_size_feed_forward (HF would chunk this rank's rows).
    A spec factory (build_spec(), interpreted by shardformer.plan.interpret)."""

    prefix = ""
    records_hidden_states = True       # split_gather_ends marks the layers' rows
    #: {suffix under `<prefix>Layer`: style} after the attention (bert_attention)
    MLP_PLAN = {"intermediate.dense": "colwise", "output.dense": "rowwise", "output.dropout": "dropout_residual"}
    #: {suffix under `<prefix>Embeddings`: style}
    EMBEDDINGS_PLAN = {"word_embeddings": "embedding_rowwise", "dropout": "dropout_replicated"}

    split_attention_at = ("{prefix}Encoder", "layer")
    pipeline_split = StageSplit("{prefix}Model", "encoder.layer", last=("pooler",))

    sp_modes = ("split_gather",)
    sequence_overlap = True            # intermediate.dense gathers its own rows (Entry sp="gather")

    def heads_layout(self) -> Heads:
        cfg = self.model.config
        return Heads(cfg.num_attention_heads, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads)

    def embeddings_description(self) -> ModulePolicyDescription:
        return ModulePolicyDescription(sub_module_replacement=realize(self.EMBEDDINGS_PLAN, PlanContext(self)))

    def build_spec(self) -> PolicySpec:
        layer, p = f"{self.prefix}Layer", self.prefix
        cross = ("config:add_cross_attention",)
        entries, attributes = bert_attention_spec("attention"), bert_attention_spec("attention", attributes=True)
        entries += bert_attention_spec("crossattention", when=cross)
        attributes += bert_attention_spec("crossattention", when=cross, attributes=True)
        entries += tuple(Entry(k, v, sp="gather" if k == "intermediate.dense" else None)
                         for k, v in self.MLP_PLAN.items())
        regions = (Region("attention.self", ENTER), Region("crossattention.self", ENTER, cross),
                   Region("intermediate", ENTER, ("no_overlap",)), Region("attention.output.LayerNorm"),
                   Region("crossattention.output.LayerNorm", when=cross), Region("output.LayerNorm"))
        return PolicySpec(
            name=self.family.name if self.family is not None else layer,
            modules=(ModuleSpec(layer, entries, attributes, sp_linear="rows"),
                     ModuleSpec(f"{p}Embeddings", tuple(Entry(k, v) for k, v in self.EMBEDDINGS_PLAN.items()))),
            heads=HeadsFrom(kv_heads=None, head_dim=None),
            split_gather=SplitGatherSpec(f"{p}Encoder", "layer", layer, regions, overlap=False),
            capabilities=spec_capabilities(self),
            refusals=self.refusals(),
        )

    def refusals(self) -> tuple[Refusal, ...]:
        """chunk_size_feed_forward under split-gather SP (HF would chunk this rank's rows)."""
        return (Refusal("chunk_size_feed_forward", allowed=(0, None), default=0, when=("sequence_parallel",),
                        error="NotImplementedError",
                        message="{model}: sequence parallelism (split_gather) with chunk_size_feed_forward="
                                "{value} is not available (set it to 0)"),)


# ---- VisionShape / StageShape: ViT-style layers, Swin-style stages ----

def attention_by_heads(prefix: str, heads: Heads, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj",
                       o: str = "o_proj", col: dict | None = None, row: dict | None = None) -> list[Sub]:
    """An attention whose q/k/v projections (at `prefix`.q, .k, .v) are split by
    heads, column-parallel, and whose output projection `prefix`.o is split by
    the same heads on its input, row-parallel (all-reduce forward).  `col` /
    `row`: extra kwargs of the column / row layers (sp_linear_kwargs)."""
    at = f"{prefix}." if prefix else ""
    plan = {f"{at}{q}": "colwise_heads", f"{at}{k}": "colwise_heads", f"{at}{v}": "colwise_heads",
            f"{at}{o}": "rowwise_heads"}
    return realize(plan, PlanContext(None, heads), col=col, row=row)


def stage_heads(cfg) -> list[Heads]:
    """One Heads spec per Swin stage (head_dim from the stage width)."""
    out = []
    for i, n in enumerate(cfg.num_heads):
        width = int(cfg.embed_dim * 2 ** i)
        if width % n:
            raise ValueError(f"stage {i}: width {width} is not a multiple of num_heads={n}")
        out.append(Heads(n, n, width // n))
    return out


class VisionShape(SpecPolicy):
    """Split-gather sequence parallelism (the layout above sp_linear_kwargs;
    ViT, not BEiT or the Swin stages): the patch tokens (with [CLS]) are
    split along the sequence from layers.0 to the last layer (embeddings,
    final norm, pooler and heads see the whole sequence); attention and mlp
    all-gather their input (bidirectional attention over the whole
    sequence); o_proj and fc2 reduce-scatter and add their bias on this
    rank's rows; the layer's dropout then draws a mask per rank and
    layernorm_before / layernorm_after get their gradients all-reduced.
    With enable_sequence_overlap, mlp.fc1 gathers its input rows itself.

    A spec factory (build_spec()): the layer's entries (layer_entries(),
    split by heads_layout()), the norms sp_norms() names, the regions."""

    prefix = ""
    records_hidden_states = True       # split_gather_ends marks the layers' rows (Swin: the stages' outputs are full)

    split_attention_at = ("{prefix}Model", "layers")
    pipeline_split = StageSplit("{prefix}Model", "layers", last=("layernorm", "pooler"))

    sp_modes = ("split_gather",)
    sequence_overlap = True            # mlp.fc1 gathers its own rows (Entry sp="gather")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        refuse_replaced_hooks(cls, {"layer_replacements": "layer_entries()", "sp_layer_extras": "layer_params()",
                                    "block_replacements": "block_entries()", "stage_sp_subs": "stage_stack()"})

    def heads_layout(self) -> Heads:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim)

    def layer_entries(self) -> tuple[Entry, ...]:
        """The entries under one `<prefix>Layer`: q/k/v by heads, o_proj by the
        same heads, the MLP, the residual dropout."""
        return (Entry("attention.q_proj", "colwise_heads"), Entry("attention.k_proj", "colwise_heads"),
                Entry("attention.v_proj", "colwise_heads"), Entry("attention.o_proj", "rowwise_heads"),
                Entry("mlp.fc1", "colwise", sp="gather"), Entry("mlp.fc2", "rowwise"),
                Entry("dropout", "dropout_residual"))

    def sp_norms(self, layer) -> list[str]:
        """The children of one `<prefix>Layer` used on this rank's rows whose
        gradients are all-reduced under split-gather SP: its norms."""
        return parameterized_children(layer, skip=("attention", "mlp"))

    def model_entries(self) -> tuple[Entry, ...]:
        """Entries on `<prefix>Model` (none here)."""
        return ()

    def layer_params(self) -> tuple[str, ...]:
        """Parameters of each layer used on this rank's rows under split-gather
        SP besides the norms (SplitGatherSpec.params; none here)."""
        return ()

    def capabilities(self) -> Capabilities:
        return spec_capabilities(self)

    def build_spec(self) -> PolicySpec:
        layer, model = f"{self.prefix}Layer", f"{self.prefix}Model"
        heads = self.heads_layout()
        first = next(m for m in self.model.modules() if type(m).__name__ == layer)
        regions = ((Region("attention", ENTER), Region("mlp", ENTER, ("no_overlap",)))
                   + tuple(Region(name) for name in self.sp_norms(first)))
        def headed(e):                           # an Entry without heads takes the layer's (a Hook row: none)
            return replace(e, heads=e.heads or heads) if isinstance(e, Entry) else e

        modules = (ModuleSpec(layer, tuple(map(headed, self.layer_entries())), sp_linear="rows"),)
        if self.model_entries():
            modules += (ModuleSpec(model, tuple(map(headed, self.model_entries()))),)
        return PolicySpec(
            name=self.family.name if self.family is not None else layer,
            modules=modules,
            split_gather=SplitGatherSpec(model, "layers", layer, regions, overlap=False, params=self.layer_params()),
            capabilities=self.capabilities(),
        )

    def active_heads(self):
        # num_labels=0: HF's classifier is an nn.Identity, nothing to split.
        if getattr(self.model.config, "num_labels", 1) > 0:
            return self.heads
        return tuple(h for h in self.heads if h.suffix != "classifier")


class StageShape(VisionShape):
    """Swin-style stages.  Split-gather sequence parallelism, stage by stage:
    stage i's H_i * W_i patch tokens are split along the sequence (padded to
    a multiple of p) at blocks.0's input and gathered at its last block's
    output, so patch merging (which reads the 2x2 neighbours of the full
    (H_i, W_i) map), the reshaped hidden states and the heads run on the
    full sequence.  In each block (shortcut and norms on this rank's rows):

        layernorm_before   on this rank's rows; output all-gathered (backward:
                           reduce-scatter), since the block views it as the
                           full (H, W) map to pad, shift and cut into windows
        attention          q/k/v column layers on the gathered windows (no
                           copy_to_tp_region: the gather's backward sums dX);
                           o_proj all-reduces (plain TP) and the attention
                           output's gradient is all-reduced too ("sum_grad")
        dropout            DropoutForParallelInput: first on the all-reduced
                           windows (each rank its own mask), then on the MLP's
                           rows of this rank
        drop_path          its input (the un-windowed [B, H*W, C] attention
                           output) cut to this rank's rows ("leave", backward
                           zeros elsewhere: the "sum_grad" all-reduce adds the
                           ranks' rows, each masked by its own rank's dropout)
        mlp                ENTER (input all-gathered); fc2 reduce-scatters
                           and adds its bias on this rank's rows
        norms              gradients all-reduced (ReplicatedInParallelRegion
                           on the stage's `blocks`, dotted parameter names)

    The attention half moves an all-gather and an all-reduce (backward: an
    all-reduce and a reduce-scatter) instead of Megatron's all-gather and
    reduce-scatter: its output leaves in window order, which the block
    reorders to the sequence only after the dropout.  all_to_all / ring_attn
    are refused (windowed attention over stages of different lengths).

    enable_sequence_overlap (sp_overlap): layernorm_before's output is
    gathered by one overlapped pass that also computes q/k/v of the whole
    map in sequence order, this rank's rows while the others' arrive; the
    windows handed to the attention get those outputs reordered by the
    block's own pad / shift / partition (layer/window_overlap.py: the
    projections act per token, the windowing only moves tokens).

    A spec factory (build_spec()): one ModuleSpec on `<prefix>Encoder`, per
    stage i the block's entries (block_entries()) at layers.i.blocks.* with
    the stage's heads, its attributes (block_attributes()) on every block,
    and its split-gather as a Stack row (stage_stack())."""

    split_attention_at = None
    # Pipeline stages split the list of Swin stages (encoder.layers: blocks, then the patch merging).
    # The encoder halves input_dimensions after each merging, so the stages before a chunk run in
    # shapes only (shaped_layers); the embeddings return (patches, (height, width)): a shaped stand-in.
    pipeline_split = StageSplit("{prefix}Model", "encoder.layers", last=("layernorm", "pooler"),
                                shaped=("embeddings",), shaped_layers=True)

    sp_modes = ("split_gather",)
    sequence_overlap = True
    #: ModuleSpec.sp_linear of the blocks: "rows" (fc2 reduce-scatters), "" (whole blocks: Swinv2)
    sp_linear = "rows"

    def sequence_parallel_refusal(self, mode: str) -> str:
        """Why `mode` is refused (the sharder's message)."""
        return (f"{self.encoder_prefix()}.layers.*.blocks.*.attention attends within windows of the "
                f"(height, width) map, reordered by shifts, and each stage has its own length; {mode} "
                f"splits one sequence's attention over the ranks, which windows do not have")

    def block_entries(self) -> tuple[Entry, ...]:
        """The entries under one block (split by the stage's heads): q/k/v
        reading the gathered windows, o_proj all-reducing, the bias table by
        heads, the MLP (fc2 reduce-scatters under SP), the dropout."""
        return (Entry("attention.q_proj", "colwise_heads"), Entry("attention.k_proj", "colwise_heads"),
                Entry("attention.v_proj", "colwise_heads"), Entry("attention.o_proj", "rowwise_heads", sp=""),
                Entry("attention.relative_position_bias", "bias_table_heads"),
                Entry("mlp.fc1", "colwise"), Entry("mlp.fc2", "rowwise"), Entry("dropout", "dropout_residual"))

    def block_attributes(self, heads: Heads) -> dict:
        """{attribute under one block: per-rank value}."""
        return {}

    def stage_stack(self, i: int, depth: int) -> Stack:
        """Split-gather SP of stage i (a Stack at layers.i.blocks): the block
        regions (module docstring), the norms' gradient all-reduce, the split
        and the gather; with overlap layernorm_before's output is gathered by
        the window-overlap pass instead of its region."""
        regions = (Region("layernorm_before", ENTER_OUTPUT, ("no_overlap",)), Region("attention", SUM_GRAD),
                   Region("drop_path", LEAVE), Region("mlp", ENTER))
        return Stack(f"layers.{i}.blocks", depth, regions, params=("layernorm_before", "layernorm_after"),
                     overlap=WindowOverlap("attention", gather_at="layernorm_before"))

    def encoder_prefix(self) -> str:
        return next(name for name, m in self.model.named_modules() if type(m).__name__ == f"{self.prefix}Encoder")

    def build_spec(self) -> PolicySpec:
        cfg = self.model.config
        rows, settings = (), ()
        for i, heads in enumerate(stage_heads(cfg)):
            at, depth = f"layers.{i}.blocks", cfg.depths[i]
            rows += tuple(replace(e, suffix=f"{at}.*.{e.suffix}", heads=e.heads or heads) for e in self.block_entries())
            rows += (self.stage_stack(i, depth),)
            block = self.block_attributes(heads)
            settings += tuple(Setting(f"{at}.{j}.{k}", v) for j in range(depth) for k, v in block.items())
        encoder = f"{self.prefix}Encoder"
        return PolicySpec(
            name=self.family.name if self.family is not None else encoder,
            modules=(ModuleSpec(encoder, rows, settings, sp_linear=self.sp_linear),),
            capabilities=self.capabilities(),
        )


# The head classes of a GPT-style decoder (GPT-Neo, GPT-J, OPT, BLOOM, Falcon).
def gpt_heads(prefix: str, *, token: bool = True) -> dict:
    """{class name: heads}: the base model, ForCausalLM (vocabulary-parallel LM head),
    ForSequenceClassification ("score"), ForTokenClassification ("classifier") and
    ForQuestionAnswering ("qa_outputs"), gathered."""
    heads = {f"{prefix}Model": (), f"{prefix}ForCausalLM": lm("lm_head"),
             f"{prefix}ForSequenceClassification": gathered("score")}
    if token:
        heads[f"{prefix}ForTokenClassification"] = gathered("classifier")
    heads[f"{prefix}ForQuestionAnswering"] = gathered("qa_outputs")
    return heads


class GPTBlockShape(SpecPolicy):
    """A GPT-style decoder (GPT-Neo, GPT-J; GPT-2 by subclass, policies/gpt2.py).
    Per block (`<prefix>Block`, h.*), with <attn> the attention module:

        <attn>.q_proj, k_proj, v_proj   Linear1D_Col (per head)
        <attn>.out_proj                 Linear1D_Row (input split by the same heads)
        <attn>.attn_dropout             DropoutForParallelInput (on this rank's heads)
        <attn>.resid_dropout            DropoutForReplicatedInput
        mlp.<up> / mlp.<down>           Linear1D_Col / Linear1D_Row
        mlp.dropout                     DropoutForReplicatedInput
        <prefix>Model.wte               VocabParallelEmbedding1D
        <prefix>Model.drop              DropoutForReplicatedInput

    The attention splits and merges heads with one head-count attribute, which
    becomes this rank's count.

    Split-gather sequence parallelism (the layout above sp_linear_kwargs):
    the hidden states are split at h.0 (after the embeddings and their
    dropout, on the full sequence) and gathered after the last block (ln_f
    and the heads see the full sequence).  <attn> and mlp take layouts ENTER
    (input all-gathered: the causal attention sees the whole sequence, the
    KV cache holds it); the row layers (out_proj, mlp.<down>) reduce-scatter
    and add their bias on this rank's rows; resid_dropout and mlp.dropout
    then draw a mask per rank; the block's norms (ln_1, ln_2) run on this
    rank's rows, gradients all-reduced.  GPT-J's parallel attention and MLP
    read the same ln_1 output and gather it once each.  With
    enable_sequence_overlap, mlp.<up> gathers its input rows itself, the
    all-gather overlapping its matmul (sp_overlap).

    Options: prefix ("GPTNeo"), attention (path of the attention module under
    the block: "attn.attention"), heads_attribute ("num_heads"), mlp_names
    ((up, down): ("c_fc", "c_proj")).  A spec factory (build_spec(); GPT-2
    overrides its attention and MLP rows).
    """

    prefix = ""
    pipeline_split = StageSplit("{prefix}Model", "h", last=("ln_f",))
    attention = "attn"
    heads_attribute = "num_heads"
    mlp_names = ("c_fc", "c_proj")

    sp_modes = ("split_gather",)
    sequence_overlap = True            # mlp.<up> gathers its own rows (Entry sp="gather")

    def attention_entries(self) -> tuple[Entry, ...]:
        """The attention's projections: q / k / v by heads, out_proj by the same heads."""
        a = self.attention
        return (Entry(f"{a}.q_proj", "colwise_heads"), Entry(f"{a}.k_proj", "colwise_heads"),
                Entry(f"{a}.v_proj", "colwise_heads"), Entry(f"{a}.out_proj", "rowwise_heads"))

    def mlp_entries(self) -> tuple[Entry, ...]:
        """The MLP's up (gathering its own rows with overlap) and down projections."""
        up, down = self.mlp_names
        return Entry(f"mlp.{up}", "colwise", sp="gather"), Entry(f"mlp.{down}", "rowwise")

    def attention_attribute_rows(self) -> tuple[Attribute, ...]:
        return (Attribute(f"{self.attention}.{self.heads_attribute}", "heads"),)

    def entered(self) -> tuple[Region, ...]:
        """The modules that gather their input (ENTER) under split-gather SP:
        with overlap, the MLP's up projection gathers its rows itself."""
        return Region(self.attention, ENTER), Region("mlp", ENTER, ("no_overlap",))

    def build_spec(self) -> PolicySpec:
        a, block, model = self.attention, f"{self.prefix}Block", f"{self.prefix}Model"
        entries = (self.attention_entries() + (Entry(f"{a}.attn_dropout", "dropout_parallel"),
                                               Entry(f"{a}.resid_dropout", "dropout_residual"))
                   + self.mlp_entries() + (Entry("mlp.dropout", "dropout_residual"),))
        return PolicySpec(
            name=self.family.name if self.family is not None else block,
            modules=(ModuleSpec(block, entries, self.attention_attribute_rows(), sp_linear="rows"),
                     ModuleSpec(model, (Entry("wte", "embedding_rowwise"), Entry("drop", "dropout_replicated")))),
            heads=HeadsFrom(kv_heads=None, head_dim=None),
            split_gather=SplitGatherSpec(model, "h", block, self.entered(), overlap=False,
                                         skip=(a.split(".")[0], "mlp")),
            capabilities=spec_capabilities(self),
            refusals=self.refusals(),
        )

    def refusals(self) -> tuple[Refusal, ...]:
        """The configurations the family refuses (none here)."""
        return ()


class FusedQKVShape(SpecPolicy):
    """A BLOOM-shaped decoder (BLOOM; Falcon by subclass, policies/falcon.py).
    Per layer (`<prefix><layer>`, h.*):

        self_attention.query_key_value    Linear1D_Col, split by qkv_layout(): by
                                          default rows interleaved per head
                                          [q_h k_h v_h], one head a block of
                                          3 * head_dim rows
        self_attention.dense              Linear1D_Row (input split by query heads)
        self_attention.attention_dropout  DropoutForParallelInput (on this rank's heads)
        mlp.dense_h_to_4h / dense_4h_to_h Linear1D_Col / Linear1D_Row
        <prefix>Model.word_embeddings     VocabParallelEmbedding1D

    Split-gather sequence parallelism (the layout above sp_linear_kwargs):
    the hidden states are split at h.0 and gathered after the last layer;
    self_attention and mlp take layouts ENTER (the ALiBi bias and the causal
    mask are built by the model for the whole sequence, which the gathered
    attention input is); query_key_value and dense_h_to_4h read the gathered
    input; dense and dense_4h_to_h reduce-scatter and add their bias on this
    rank's rows; the layer norms run on this rank's rows (gradients
    all-reduced).  The residual dropouts are functional calls
    (dropout_add(x, residual, p)) with the probability in the attributes
    named by `residual_dropouts()`: those become 0 and p moves into the row
    layers (Linear1D_Row dropout=p: a mask per rank, on its rows).  With
    enable_sequence_overlap, dense_h_to_4h gathers its input rows itself,
    the all-gather overlapping its matmul (sp_overlap).

    all_to_all / ring_attn: where a subclass names the layers
    (split_attention_at) and its attention's seam (attention_seam:
    BLOOM's and Falcon's attention forward, see their policy files).

    Options: prefix ("Bloom"), layer (layer class suffix: "Block", "DecoderLayer").
    A spec factory (build_spec(), interpreted by shardformer.plan.interpret):
    the fused projection's split and the attention's per-rank attributes
    come from qkv_layout(), the moved dropout from residual_dropouts(), both
    read from the bound model's config (a subclass overrides either).
    """

    prefix = ""
    layer = "Block"
    pipeline_split = StageSplit("{prefix}Model", "h", last=("ln_f",))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        refuse_replaced_hooks(cls, {"sequence_parallel_description": "qkv_layout() / residual_dropouts()"})

    sp_modes = ("split_gather",)
    sequence_overlap = True            # mlp.dense_h_to_4h gathers its own rows (Entry sp="gather")

    def residual_dropouts(self) -> tuple[float, tuple[str, ...]]:
        """(p, attributes under the layer holding p) of the functional residual
        dropouts after the row layers."""
        return float(self.model.config.hidden_dropout), ("self_attention.hidden_dropout", "mlp.hidden_dropout")

    def qkv_layout(self) -> tuple[Heads, str, dict]:
        """(heads, plan style of query_key_value (shardformer.plan), {attention
        attribute: per-rank value})."""
        cfg = self.model.config
        n = cfg.num_attention_heads
        heads = Heads(n, n, cfg.hidden_size // n)
        return heads, "colwise_per_head", heads.attributes({"self_attention.num_heads": "heads"})

    def build_spec(self) -> PolicySpec:
        """The layer's entries (the fused projection split as qkv_layout()
        says, dense by the same heads), its attributes (qkv_layout()'s, and
        under split-gather SP residual_dropouts()' set to 0 while the row
        layers draw p on their rows), the embedding, the split-gather regions."""
        layer, model = f"{self.prefix}{self.layer}", f"{self.prefix}Model"
        heads, qkv, attributes = self.qkv_layout()
        p, dropouts = self.residual_dropouts()
        entries = (Entry("self_attention.query_key_value", qkv, heads=heads),
                   Entry("self_attention.dense", "rowwise_heads", heads=heads),
                   Entry("self_attention.attention_dropout", "dropout_parallel"),
                   Entry("mlp.dense_h_to_4h", "colwise", sp="gather"), Entry("mlp.dense_4h_to_h", "rowwise"))
        if p:            # under split-gather SP the row layers draw the residual dropout (these replace the two above)
            sp, drop = ("sequence_parallel",), (("dropout", p),)
            entries += (Entry("self_attention.dense", "rowwise_heads", sp, heads=heads, kwargs=drop),
                        Entry("mlp.dense_4h_to_h", "rowwise", sp, kwargs=drop))
        settings = (tuple(Setting(name, value) for name, value in attributes.items())
                    + tuple(Setting(name, 0.0, ("sequence_parallel",)) for name in dropouts))
        return PolicySpec(
            name=self.family.name if self.family is not None else layer,
            modules=(ModuleSpec(layer, entries, settings, sp_linear="rows"),
                     ModuleSpec(model, (Entry("word_embeddings", "embedding_rowwise"),))),
            split_gather=SplitGatherSpec(model, "h", layer, (Region("self_attention", ENTER),
                                                             Region("mlp", ENTER, ("no_overlap",))),
                                         overlap=False, skip=("self_attention", "mlp")),
            capabilities=spec_capabilities(self),
            refusals=self.refusals(),
        )

    def refusals(self) -> tuple[Refusal, ...]:
        """The configurations the family refuses (none here)."""
        return ()
