"""Gemma: the Llama-shaped decoder whose embedding output is scaled by
sqrt(hidden_size) (VocabParallelEmbedding1D(embed_scale=...) applies it after
the all-reduce) and whose RMSNorm multiplies by (1 + weight), so the norms are
left as HF's; see policies/mistral.py.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class GemmaPolicy(DecoderPolicy):
    hf_module, prefix = "gemma.modeling_gemma", "Gemma"
    embed_scale = True

    def fused_norm_ok(self):
        return False


class GemmaModelPolicy(GemmaPolicy):
    pass


class GemmaForCausalLMPolicy(GemmaPolicy):
    model_class, head = "GemmaForCausalLM", "lm_head"


class GemmaForSequenceClassificationPolicy(GemmaPolicy):
    model_class, head = "GemmaForSequenceClassification", "score"


class GemmaForTokenClassificationPolicy(GemmaPolicy):
    model_class, head = "GemmaForTokenClassification", "score"
