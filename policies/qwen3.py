"""Qwen3: the Llama-shaped decoder with per-head RMSNorms on q and k (q_norm /
k_norm act on head_dim, so they stay replicated); see policies/mistral.py.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class Qwen3Policy(DecoderPolicy):
    hf_module, prefix = "qwen3.modeling_qwen3", "Qwen3"
    qk_norm = True


class Qwen3ModelPolicy(Qwen3Policy):
    pass


class Qwen3ForCausalLMPolicy(Qwen3Policy):
    model_class, head = "Qwen3ForCausalLM", "lm_head"


class Qwen3ForSequenceClassificationPolicy(Qwen3Policy):
    model_class, head = "Qwen3ForSequenceClassification", "score"


class Qwen3ForTokenClassificationPolicy(Qwen3Policy):
    model_class, head = "Qwen3ForTokenClassification", "score"


class Qwen3ForQuestionAnsweringPolicy(Qwen3Policy):
    model_class, head = "Qwen3ForQuestionAnswering", "qa_outputs"
