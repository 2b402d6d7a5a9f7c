"""Mistral, and the shared policy of Llama-shaped decoders.

DecoderPolicy describes a decoder whose layers hold `self_attn` (q/k/v/o or a
fused qkv_proj) and `mlp` (gate/up/down, a fused gate_up_proj, or sparse
experts); the families that share this shape (qwen2, qwen3, gemma, gemma2,
gemma3, glm, phi3, mixtral) set a few class attributes in their own files.

    self_attn.q_proj, k_proj, v_proj   Linear1D_Col  (per head; KV heads
                                                      replicated when fewer than ranks)
    self_attn.qkv_proj (fused)         Linear1D_Col, split Fused(q, kv, kv)
    self_attn.q_norm, k_norm           replicated, gradients all-reduced (Qwen3, Gemma3)
    self_attn.o_proj                   Linear1D_Row
    mlp.gate_proj, mlp.up_proj         Linear1D_Col
    mlp.gate_up_proj (fused)           Linear1D_Col, split Fused(gate, up)
    mlp.down_proj                      Linear1D_Row
    mlp.experts (fused 3-D experts)    FusedExperts1D (router mlp.gate replicated)
    <base>.embed_tokens                VocabParallelEmbedding1D (scaled for Gemma)
    lm_head                            VocabParallelLMHead1D (tied when the config ties)
    score / qa_outputs                 Linear1D_Col, gathered (any label count)

HF's attention infers the head count from the projection width, so only
num_key_value_groups changes per rank.
"""
from __future__ import annotations

import importlib

from shardformer.layer import (
    FusedRMSNorm,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Fused, Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


class DecoderPolicy(Policy):
    """A Llama-shaped decoder, described by class attributes:

    hf_module    transformers.models.<hf_module> ("mistral.modeling_mistral")
    prefix       class-name prefix ("Mistral" -> MistralDecoderLayer, MistralModel)
    base_model   base model class suffix ("Model"; Gemma3 text: "TextModel")
    mlp          "split" (gate_proj, up_proj), "fused" (gate_up_proj) or "moe"
    fused_qkv    the attention has one qkv_proj ([q | k | v] rows)
    qk_norm      self_attn.q_norm / k_norm act per head on this rank's heads: kept
                 replicated, their gradients all-reduced (ReplicatedInParallelRegion)
    embed_scale  the embedding is multiplied by sqrt(hidden_size) (Gemma)
    model_class, head   for head policies: the model class and its head
                 ("lm_head": vocabulary-parallel; "score" / "qa_outputs": gathered)
    tie_source   the input embedding an LM head is tied to
    """

    hf_module = "mistral.modeling_mistral"
    prefix = "Mistral"
    base_model = "Model"
    mlp = "split"
    fused_qkv = False
    qk_norm = False
    embed_scale = False
    model_class = ""
    head = ""
    tie_source = "model.embed_tokens"

    def hf(self):
        return importlib.import_module(f"transformers.models.{self.hf_module}")

    def text_config(self):
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def heads(self) -> Heads:
        cfg = self.text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return Heads(cfg.num_attention_heads, kv, head_dim)

    def attention_attributes(self, heads: Heads) -> dict:
        """{dotted attribute under the decoder layer: per-rank value}."""
        return {"self_attn.num_key_value_groups": heads.local_groups()}

    def attention_replacements(self, heads: Heads) -> list[Sub]:
        if self.fused_qkv:
            qkv = [Sub("self_attn.qkv_proj", Linear1D_Col, kwargs={"split": heads.qkv})]
        else:
            qkv = [Sub("self_attn.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                   Sub("self_attn.k_proj", Linear1D_Col, kwargs={"split": heads.kv}),
                   Sub("self_attn.v_proj", Linear1D_Col, kwargs={"split": heads.kv})]
        norms = []
        if self.qk_norm:
            from shardformer.layer.replicated import ReplicatedInParallelRegion

            norms = [Sub("self_attn.q_norm", ReplicatedInParallelRegion),
                     Sub("self_attn.k_norm", ReplicatedInParallelRegion)]
        return qkv + norms + [Sub("self_attn.o_proj", Linear1D_Row, kwargs={"split": heads.q})]

    def mlp_replacements(self) -> list[Sub]:
        if self.mlp == "moe":
            from shardformer.layer.moe import FusedExperts1D

            return [Sub("mlp.experts", FusedExperts1D)]
        if self.mlp == "fused":
            up = [Sub("mlp.gate_up_proj", Linear1D_Col, kwargs={"split": Fused.equal(2)})]
        else:
            up = [Sub("mlp.gate_proj", Linear1D_Col), Sub("mlp.up_proj", Linear1D_Col)]
        return up + [Sub("mlp.down_proj", Linear1D_Row)]

    def config_sanity_check(self):
        cfg = self.text_config()
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"{type(self.model).__name__}: pretraining_tp={cfg.pretraining_tp} is not supported "
                             "(set it to 1)")

    def module_policy(self):
        hf = self.hf()
        layer_cls = getattr(hf, f"{self.prefix}DecoderLayer")
        base_cls = getattr(hf, f"{self.prefix}{self.base_model}")
        heads = self.heads()
        policy = {}
        if self.tensor_parallel:
            policy[layer_cls] = ModulePolicyDescription(
                attribute_replacement=self.attention_attributes(heads),
                sub_module_replacement=self.attention_replacements(heads) + self.mlp_replacements(),
            )
            embed_kwargs = self.vocab_kwargs()
            if self.embed_scale:
                native = self.model.get_input_embeddings()
                embed_kwargs["embed_scale"] = float(getattr(native, "scalar_embed_scale",
                                                            self.text_config().hidden_size ** 0.5))
            policy[base_cls] = ModulePolicyDescription(
                sub_module_replacement=[Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=embed_kwargs)]
            )
            self.add_head(policy, hf)
        if self.shard_config.enable_fused_normalization and self.fused_norm_ok():
            self.append_or_create_submodule_replacement(
                [Sub("input_layernorm", FusedRMSNorm), Sub("post_attention_layernorm", FusedRMSNorm)],
                policy, layer_cls)
            self.append_or_create_submodule_replacement(Sub("norm", FusedRMSNorm), policy, base_cls)
        return policy

    def add_head(self, policy: dict, hf) -> None:
        """The head of `model_class`: the LM head split by vocabulary, any
        other (classifier, QA) split by outputs and gathered."""
        if not self.tensor_parallel or not self.head:
            return
        if self.head == "lm_head":
            sub = Sub("lm_head", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs())
        else:
            sub = Sub(self.head, Linear1D_Col, kwargs={"gather_output": True})
        self.append_or_create_submodule_replacement(sub, policy, getattr(hf, self.model_class))

    def fused_norm_ok(self) -> bool:
        """Gemma's RMSNorm scales by (1 + weight), which FusedRMSNorm does not."""
        return True

    def postprocess(self):
        if self.tensor_parallel and self.head == "lm_head" and self.ties_word_embeddings():
            self.tie_weight(self.tie_source, "lm_head")
        return self.model


class MistralPolicy(DecoderPolicy):
    hf_module, prefix = "mistral.modeling_mistral", "Mistral"


class MistralModelPolicy(MistralPolicy):
    pass


class MistralForCausalLMPolicy(MistralPolicy):
    model_class, head = "MistralForCausalLM", "lm_head"


class MistralForSequenceClassificationPolicy(MistralPolicy):
    model_class, head = "MistralForSequenceClassification", "score"


class MistralForTokenClassificationPolicy(MistralPolicy):
    model_class, head = "MistralForTokenClassification", "score"


class MistralForQuestionAnsweringPolicy(MistralPolicy):
    model_class, head = "MistralForQuestionAnswering", "qa_outputs"
