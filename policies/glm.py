"""GLM (transformers' GlmModel): the Llama-shaped decoder with biased q/k/v and a
fused mlp.gate_up_proj ([gate | up] rows), split as Fused(Split, Split) so each
rank keeps its slice of both halves; see policies/mistral.py.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class GlmPolicy(DecoderPolicy):
    hf_module, prefix = "glm.modeling_glm", "Glm"
    mlp = "fused"


class GlmModelPolicy(GlmPolicy):
    pass


class GlmForCausalLMPolicy(GlmPolicy):
    model_class, head = "GlmForCausalLM", "lm_head"


class GlmForSequenceClassificationPolicy(GlmPolicy):
    model_class, head = "GlmForSequenceClassification", "score"


class GlmForTokenClassificationPolicy(GlmPolicy):
    model_class, head = "GlmForTokenClassification", "score"
