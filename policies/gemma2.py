"""Gemma 2: as Gemma (scaled embeddings, (1 + weight) RMSNorms), plus attention
logit soft-capping and pre/post feed-forward norms, which act per head or on
the full hidden state and need no change; see policies/mistral.py.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class Gemma2Policy(DecoderPolicy):
    hf_module, prefix = "gemma2.modeling_gemma2", "Gemma2"
    embed_scale = True

    def fused_norm_ok(self):
        return False


class Gemma2ModelPolicy(Gemma2Policy):
    pass


class Gemma2ForCausalLMPolicy(Gemma2Policy):
    model_class, head = "Gemma2ForCausalLM", "lm_head"


class Gemma2ForSequenceClassificationPolicy(Gemma2Policy):
    model_class, head = "Gemma2ForSequenceClassification", "score"


class Gemma2ForTokenClassificationPolicy(Gemma2Policy):
    model_class, head = "Gemma2ForTokenClassification", "score"
