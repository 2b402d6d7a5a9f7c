"""Qwen2: the Llama-shaped decoder with biased q/k/v projections (each bias split with
its rows); see policies/mistral.py for the layout table.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class Qwen2Policy(DecoderPolicy):
    hf_module, prefix = "qwen2.modeling_qwen2", "Qwen2"


class Qwen2ModelPolicy(Qwen2Policy):
    pass


class Qwen2ForCausalLMPolicy(Qwen2Policy):
    model_class, head = "Qwen2ForCausalLM", "lm_head"


class Qwen2ForSequenceClassificationPolicy(Qwen2Policy):
    model_class, head = "Qwen2ForSequenceClassification", "score"


class Qwen2ForTokenClassificationPolicy(Qwen2Policy):
    model_class, head = "Qwen2ForTokenClassification", "score"


class Qwen2ForQuestionAnsweringPolicy(Qwen2Policy):
    model_class, head = "Qwen2ForQuestionAnswering", "qa_outputs"
