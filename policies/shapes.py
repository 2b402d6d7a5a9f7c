"""Shapes shared by several families: how each kind of body is split.

A shape is a FamilyPolicy subclass whose `body_policy()` reads the family's
options (class attributes set from `Family.options`) and the model's config.
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
    mlp.experts (mlp="moe")            FusedExperts1D (the router mlp.gate stays replicated)
    <base>.embed_tokens                VocabParallelEmbedding1D (scaled by sqrt(hidden) with embed_scale)

HF's attention infers its head count from the projection width, so only
num_key_value_groups changes per rank.

Sequence parallelism (split_gather, not with mlp="moe"): the Linear layers
above take sequence_parallel=True; self_attn and mlp become sequence-parallel
blocks, the first layer splits its input along the sequence and the last
gathers its output, and the layer's norms get their gradients all-reduced
(shardformer.layer.sequence).

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
docstrings.  gpt_heads() names the head classes of these families (their
token classifier is `classifier`).
"""
from __future__ import annotations

from dataclasses import replace

from shardformer.family import FamilyPolicy
from shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layer import DropoutForParallelInput, DropoutForReplicatedInput
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Fused, Heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class DecoderShape(FamilyPolicy):
    prefix = ""
    base_model = "Model"
    mlp = "split"
    fused_qkv = False
    qk_norm = False
    embed_scale = False

    def heads_layout(self) -> Heads:
        cfg = text_config(self.model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return Heads(cfg.num_attention_heads, kv, head_dim)

    def attention_attributes(self, heads: Heads) -> dict:
        """{dotted attribute under the decoder layer: per-rank value}."""
        return {"self_attn.num_key_value_groups": heads.local_groups()}

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        return () if self.mlp == "moe" else ("split_gather",)

    @property
    def sp(self) -> dict:
        """The kwargs that put a Linear layer in sequence-parallel mode (or none)."""
        return {"sequence_parallel": True} if self.shard_config.sequence_parallel else {}

    def attention_replacements(self, heads: Heads) -> list[Sub]:
        sp = self.sp
        if self.fused_qkv:
            qkv = [Sub("self_attn.qkv_proj", Linear1D_Col, kwargs={"split": heads.qkv, **sp})]
        else:
            qkv = [Sub("self_attn.q_proj", Linear1D_Col, kwargs={"split": heads.q, **sp}),
                   Sub("self_attn.k_proj", Linear1D_Col, kwargs={"split": heads.kv, **sp}),
                   Sub("self_attn.v_proj", Linear1D_Col, kwargs={"split": heads.kv, **sp})]
        norms = []
        if self.qk_norm:
            from shardformer.layer.replicated import ReplicatedInParallelRegion

            norms = [Sub("self_attn.q_norm", ReplicatedInParallelRegion),
                     Sub("self_attn.k_norm", ReplicatedInParallelRegion)]
        return qkv + norms + [Sub("self_attn.o_proj", Linear1D_Row, kwargs={"split": heads.q, **sp})]

    def mlp_replacements(self) -> list[Sub]:
        if self.mlp == "moe":
            from shardformer.layer.moe import FusedExperts1D

            return [Sub("mlp.experts", FusedExperts1D)]
        sp = self.sp
        if self.mlp == "fused":
            up = [Sub("mlp.gate_up_proj", Linear1D_Col, kwargs={"split": Fused.equal(2), **sp})]
        else:
            up = [Sub("mlp.gate_proj", Linear1D_Col, kwargs=sp), Sub("mlp.up_proj", Linear1D_Col, kwargs=sp)]
        return up + [Sub("mlp.down_proj", Linear1D_Row, kwargs=sp)]

    def sequence_parallel_replacements(self) -> tuple[list[Sub], list[Sub]]:
        """(decoder-layer subs, base-model subs) of split-gather sequence
        parallelism: the blocks, the layer's other parameters (norms: used on
        this rank's rows, gradients all-reduced), the split and the gather."""
        from shardformer.layer.replicated import ReplicatedInParallelRegion
        from shardformer.layer.sequence import SequenceParallelRegion, SequenceState

        state = SequenceState()
        base = self.model.get_submodule(self.base_prefix()) if self.base_prefix() else self.model
        layers = base.layers
        first = layers[0]
        block = {"role": "block", "state": state}
        subs = [Sub("self_attn", SequenceParallelRegion, kwargs=block),
                Sub("mlp", SequenceParallelRegion, kwargs=block)]
        subs += [Sub(child, ReplicatedInParallelRegion) for child, module in first.named_children()
                 if child not in ("self_attn", "mlp") and any(True for _ in module.parameters())]
        last = len(layers) - 1
        ends = [Sub("layers.0", SequenceParallelRegion, kwargs={"role": "split", "state": state}),
                Sub(f"layers.{last}", SequenceParallelRegion, kwargs={"role": "gather", "state": state})]
        if last == 0:
            ends = [Sub("layers.0", SequenceParallelRegion, kwargs={"role": ("split", "gather"), "state": state})]
        return subs, ends

    def base_prefix(self) -> str:
        """The attribute path of the base model inside self.model ("" when it is the base model)."""
        for name, module in self.model.named_modules():
            if type(module).__name__ == f"{self.prefix}{self.base_model}":
                return name
        raise ValueError(f"{type(self.model).__name__}: no {self.prefix}{self.base_model} module")

    def config_sanity_check(self):
        cfg = text_config(self.model)
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"{type(self.model).__name__}: pretraining_tp={cfg.pretraining_tp} is not supported "
                             "(set it to 1)")

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        heads = self.heads_layout()
        embed_kwargs = self.vocab_kwargs()
        if self.embed_scale:
            native = self.model.get_input_embeddings()
            embed_kwargs["embed_scale"] = float(getattr(native, "scalar_embed_scale",
                                                        text_config(self.model).hidden_size ** 0.5))
        layer_subs = self.attention_replacements(heads) + self.mlp_replacements()
        base_subs = [Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=embed_kwargs)]
        if self.shard_config.sequence_parallel:
            sp_layer, sp_base = self.sequence_parallel_replacements()
            layer_subs, base_subs = layer_subs + sp_layer, base_subs + sp_base
        return {
            f"{self.prefix}DecoderLayer": ModulePolicyDescription(
                attribute_replacement=self.attention_attributes(heads),
                sub_module_replacement=layer_subs,
            ),
            f"{self.prefix}{self.base_model}": ModulePolicyDescription(sub_module_replacement=base_subs),
        }


# The head classes of a Llama-shaped decoder, by what transformers defines for it.
def decoder_heads(prefix: str, *, base: str = "Model", qa: bool = True, token: bool = True) -> dict:
    """{class name: heads}: the base model, ForCausalLM (vocabulary-parallel LM head),
    ForSequenceClassification / ForTokenClassification ("score") and
    ForQuestionAnswering ("qa_outputs"), gathered."""
    from shardformer.family import gathered, lm

    heads = {f"{prefix}{base}": (), f"{prefix}ForCausalLM": lm("lm_head"),
             f"{prefix}ForSequenceClassification": gathered("score")}
    if token:
        heads[f"{prefix}ForTokenClassification"] = gathered("score")
    if qa:
        heads[f"{prefix}ForQuestionAnswering"] = gathered("qa_outputs")
    return heads


# ---- EncoderShape: BERT-shaped encoders ----

def bert_attention(prefix: str, heads: Heads) -> tuple[dict, list[Sub]]:
    """(attributes, sub-module replacements) of one BERT-style attention block
    at `prefix` (`attention` or `crossattention`): Q/K/V column-parallel by
    head, output dense row-parallel (all-reduce forward)."""
    attrs = {f"{prefix}.self.num_attention_heads": heads.local_heads(),
             f"{prefix}.self.all_head_size": heads.local_width(heads.head_dim)}
    subs = [Sub(f"{prefix}.self.{p}", Linear1D_Col, kwargs={"split": heads.q}) for p in ("query", "key", "value")]
    subs += [Sub(f"{prefix}.self.dropout", DropoutForParallelInput),
             Sub(f"{prefix}.output.dense", Linear1D_Row, kwargs={"split": heads.q}),
             Sub(f"{prefix}.output.dropout", DropoutForReplicatedInput)]
    return attrs, subs


class EncoderShape(FamilyPolicy):
    prefix = ""

    def heads_layout(self) -> Heads:
        cfg = self.model.config
        return Heads(cfg.num_attention_heads, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads)

    def layer_description(self, heads: Heads) -> ModulePolicyDescription:
        attrs, subs = bert_attention("attention", heads)
        if getattr(self.model.config, "add_cross_attention", False):
            cross_attrs, cross_subs = bert_attention("crossattention", heads)
            attrs.update(cross_attrs)
            subs += cross_subs
        subs += [Sub("intermediate.dense", Linear1D_Col), Sub("output.dense", Linear1D_Row),
                 Sub("output.dropout", DropoutForReplicatedInput)]
        return ModulePolicyDescription(attribute_replacement=attrs, sub_module_replacement=subs)

    def embeddings_description(self) -> ModulePolicyDescription:
        return ModulePolicyDescription(sub_module_replacement=[
            Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
            Sub("dropout", DropoutForReplicatedInput)])

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        return {f"{self.prefix}Layer": self.layer_description(self.heads_layout()),
                f"{self.prefix}Embeddings": self.embeddings_description()}


# ---- VisionShape / StageShape: ViT-style layers, Swin-style stages ----

def attention_by_heads(prefix: str, heads: Heads, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj",
                       o: str = "o_proj") -> list[Sub]:
    """An attention whose q/k/v projections (at `prefix`.q, .k, .v) are split by
    heads, column-parallel, and whose output projection `prefix`.o is split by
    the same heads on its input, row-parallel (all-reduce forward)."""
    at = f"{prefix}." if prefix else ""
    return [Sub(f"{at}{name}", Linear1D_Col, kwargs={"split": heads.q}) for name in (q, k, v)] + [
        Sub(f"{at}{o}", Linear1D_Row, kwargs={"split": heads.q})]


def bias_table_split(num_heads: int) -> dict:
    """ShardParams kwargs: a relative position bias table [distances, heads]
    split by columns with the heads; each rank builds the bias of its own heads."""
    return {"params": {"relative_position_bias_table": (1, Heads(num_heads, head_dim=1).q)}}


def stage_heads(cfg) -> list[Heads]:
    """One Heads spec per Swin stage (head_dim from the stage width)."""
    out = []
    for i, n in enumerate(cfg.num_heads):
        width = int(cfg.embed_dim * 2 ** i)
        if width % n:
            raise ValueError(f"stage {i}: width {width} is not a multiple of num_heads={n}")
        out.append(Heads(n, n, width // n))
    return out


class VisionShape(FamilyPolicy):
    prefix = ""

    def heads_layout(self) -> Heads:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim)

    def layer_replacements(self, heads: Heads) -> list[Sub]:
        return attention_by_heads("attention", heads) + [
            Sub("mlp.fc1", Linear1D_Col), Sub("mlp.fc2", Linear1D_Row), Sub("dropout", DropoutForReplicatedInput)]

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        return {f"{self.prefix}Layer": ModulePolicyDescription(
            sub_module_replacement=self.layer_replacements(self.heads_layout()))}

    def active_heads(self):
        # num_labels=0: HF's classifier is an nn.Identity, nothing to split.
        if getattr(self.model.config, "num_labels", 1) > 0:
            return self.heads
        return tuple(h for h in self.heads if h.suffix != "classifier")


class StageShape(VisionShape):
    def block_replacements(self, heads: Heads) -> list[Sub]:
        """Replacements of one block of a stage with `heads` (paths under the block)."""
        return attention_by_heads("attention", heads) + [
            Sub("attention.relative_position_bias", ShardParams, kwargs=bias_table_split(heads.num_heads)),
            Sub("mlp.fc1", Linear1D_Col), Sub("mlp.fc2", Linear1D_Row), Sub("dropout", DropoutForReplicatedInput)]

    def block_attributes(self, heads: Heads) -> dict:
        """{attribute under one block: per-rank value}."""
        return {}

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        subs, attrs = [], {}
        for i, heads in enumerate(stage_heads(cfg)):
            subs += [replace(s, suffix=f"layers.{i}.blocks.*.{s.suffix}") for s in self.block_replacements(heads)]
            block_attrs = self.block_attributes(heads)
            for j in range(cfg.depths[i]):
                attrs.update({f"layers.{i}.blocks.{j}.{k}": v for k, v in block_attrs.items()})
        return {f"{self.prefix}Encoder": ModulePolicyDescription(attribute_replacement=attrs,
                                                                 sub_module_replacement=subs)}


# The head classes of a GPT-style decoder (GPT-Neo, GPT-J, OPT, BLOOM, Falcon).
def gpt_heads(prefix: str, *, token: bool = True) -> dict:
    """{class name: heads}: the base model, ForCausalLM (vocabulary-parallel LM head),
    ForSequenceClassification ("score"), ForTokenClassification ("classifier") and
    ForQuestionAnswering ("qa_outputs"), gathered."""
    from shardformer.family import gathered, lm

    heads = {f"{prefix}Model": (), f"{prefix}ForCausalLM": lm("lm_head"),
             f"{prefix}ForSequenceClassification": gathered("score")}
    if token:
        heads[f"{prefix}ForTokenClassification"] = gathered("classifier")
    heads[f"{prefix}ForQuestionAnswering"] = gathered("qa_outputs")
    return heads


class GPTBlockShape(FamilyPolicy):
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

    Options: prefix ("GPTNeo"), attention (path of the attention module under
    the block: "attn.attention"), heads_attribute ("num_heads"), mlp_names
    ((up, down): ("c_fc", "c_proj")).
    """

    prefix = ""
    attention = "attn"
    heads_attribute = "num_heads"
    mlp_names = ("c_fc", "c_proj")

    def heads_layout(self) -> Heads:
        cfg = self.model.config
        n = cfg.num_attention_heads
        return Heads(n, n, cfg.hidden_size // n)

    def attention_attributes(self, heads: Heads) -> dict:
        return {f"{self.attention}.{self.heads_attribute}": heads.local_heads()}

    def attention_replacements(self, heads: Heads) -> list[Sub]:
        a = self.attention
        return [Sub(f"{a}.{p}", Linear1D_Col, kwargs={"split": heads.q}) for p in ("q_proj", "k_proj", "v_proj")] + \
            [Sub(f"{a}.out_proj", Linear1D_Row, kwargs={"split": heads.q})]

    def mlp_replacements(self) -> list[Sub]:
        up, down = self.mlp_names
        return [Sub(f"mlp.{up}", Linear1D_Col), Sub(f"mlp.{down}", Linear1D_Row)]

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        heads, a = self.heads_layout(), self.attention
        return {
            f"{self.prefix}Block": ModulePolicyDescription(
                attribute_replacement=self.attention_attributes(heads),
                sub_module_replacement=self.attention_replacements(heads) + [
                    Sub(f"{a}.attn_dropout", DropoutForParallelInput),
                    Sub(f"{a}.resid_dropout", DropoutForReplicatedInput),
                ] + self.mlp_replacements() + [Sub("mlp.dropout", DropoutForReplicatedInput)],
            ),
            f"{self.prefix}Model": ModulePolicyDescription(sub_module_replacement=[
                Sub("wte", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                Sub("drop", DropoutForReplicatedInput),
            ]),
        }


class FusedQKVShape(FamilyPolicy):
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

    Options: prefix ("Bloom"), layer (layer class suffix: "Block", "DecoderLayer").
    """

    prefix = ""
    layer = "Block"

    def qkv_layout(self) -> tuple[Heads, object, dict]:
        """(heads, split of query_key_value's rows, {attention attribute: per-rank value})."""
        cfg = self.model.config
        n = cfg.num_attention_heads
        head_dim = cfg.hidden_size // n
        heads = Heads(n, n, head_dim)
        return heads, Heads(n, n, 3 * head_dim).q, {"self_attention.num_heads": heads.local_heads()}

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        heads, qkv, attributes = self.qkv_layout()
        return {
            f"{self.prefix}{self.layer}": ModulePolicyDescription(
                attribute_replacement=attributes,
                sub_module_replacement=[
                    Sub("self_attention.query_key_value", Linear1D_Col, kwargs={"split": qkv}),
                    Sub("self_attention.dense", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("self_attention.attention_dropout", DropoutForParallelInput),
                    Sub("mlp.dense_h_to_4h", Linear1D_Col),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row),
                ],
            ),
            f"{self.prefix}Model": ModulePolicyDescription(sub_module_replacement=[
                Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())]),
        }
