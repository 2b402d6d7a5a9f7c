"""Gemma 3 text models: as Gemma 2, with per-head q/k RMSNorms (replicated, they
act on head_dim) and sliding/full attention layers; see policies/mistral.py.
The multimodal Gemma3ForConditionalGeneration is not covered here.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class Gemma3Policy(DecoderPolicy):
    hf_module, prefix = "gemma3.modeling_gemma3", "Gemma3"
    base_model = "TextModel"
    qk_norm = True
    embed_scale = True

    def fused_norm_ok(self):
        return False


class Gemma3TextModelPolicy(Gemma3Policy):
    pass


class Gemma3ForCausalLMPolicy(Gemma3Policy):
    model_class, head = "Gemma3ForCausalLM", "lm_head"


class Gemma3TextForSequenceClassificationPolicy(Gemma3Policy):
    model_class, head = "Gemma3TextForSequenceClassification", "score"
