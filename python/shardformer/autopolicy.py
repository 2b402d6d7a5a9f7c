"""The policy registry: model class -> policy, imported lazily.

Keys are the model class's full qualified name ("module.QualName"), or a bare
class name for models outside transformers (remote code: the class's module
is a dynamic one that varies per checkpoint).  Values name the policy file in
shardformer.policies and the class in it, so importing shardformer never
imports transformers or any policy.
"""
from __future__ import annotations

import importlib

from .policy import Policy

_T = "transformers.models"

_REGISTRY: dict[str, tuple[str, str]] = {}


def _add(family: str, hf_module: str, classes: dict[str, str]) -> None:
    for model_cls, policy_cls in classes.items():
        _REGISTRY[f"{_T}.{hf_module}.{model_cls}"] = (family, policy_cls)


_add("llama", "llama.modeling_llama", {
    "LlamaModel": "LlamaModelPolicy",
    "LlamaForCausalLM": "LlamaForCausalLMPolicy",
    "LlamaForSequenceClassification": "LlamaForSequenceClassificationPolicy",
    "LlamaForQuestionAnswering": "LlamaForQuestionAnsweringPolicy",
    "LlamaForTokenClassification": "LlamaForTokenClassificationPolicy",
})
_add("gpt2", "gpt2.modeling_gpt2", {
    "GPT2Model": "GPT2ModelPolicy",
    "GPT2LMHeadModel": "GPT2LMHeadModelPolicy",
    "GPT2DoubleHeadsModel": "GPT2DoubleHeadsModelPolicy",
    "GPT2ForSequenceClassification": "GPT2ForSequenceClassificationPolicy",
    "GPT2ForTokenClassification": "GPT2ForTokenClassificationPolicy",
    "GPT2ForQuestionAnswering": "GPT2ForQuestionAnsweringPolicy",
})
_add("bert", "bert.modeling_bert", {
    "BertModel": "BertModelPolicy",
    "BertForPreTraining": "BertForPreTrainingPolicy",
    "BertLMHeadModel": "BertLMHeadModelPolicy",
    "BertForMaskedLM": "BertForMaskedLMPolicy",
    "BertForSequenceClassification": "BertForSequenceClassificationPolicy",
    "BertForTokenClassification": "BertForTokenClassificationPolicy",
    "BertForNextSentencePrediction": "BertForNextSentencePredictionPolicy",
    "BertForMultipleChoice": "BertForMultipleChoicePolicy",
    "BertForQuestionAnswering": "BertForQuestionAnsweringPolicy",
})

# --- decoder-only language-model families (opt, bloom, falcon, mistral, ...) ---
# (end of decoder-only families)

# --- encoder and encoder-decoder text/audio families (roberta, t5, whisper, ...) ---
# (end of encoder and encoder-decoder families)

# --- vision and multimodal families (vit, beit, swin, sam, blip2) ---
# (end of vision and multimodal families)


def register_policy(key: str, family: str, policy_class: str) -> None:
    """Register shardformer.policies.<family>.<policy_class> for model class `key`
    ("module.QualName", or a bare class name for remote code)."""
    _REGISTRY[key] = (family, policy_class)


def supported_models() -> list[str]:
    return sorted(_REGISTRY)


def _key_of(model) -> tuple[str, str]:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__


def get_autopolicy(model) -> Policy:
    """A fresh policy instance for `model`, found by its class."""
    full, bare = _key_of(model)
    found = _REGISTRY.get(full) or _REGISTRY.get(bare)
    if found is None:
        names = "\n  ".join(k.rsplit(".", 1)[-1] for k in supported_models())
        raise ValueError(
            f"{bare}: no built-in policy for {full}.\nSupported model classes:\n  {names}\n"
            "For another model, write a shardformer.Policy subclass and pass it as "
            "ShardFormer(shard_config).optimize(model, policy=MyPolicy())."
        )
    family, policy_cls = found
    module = importlib.import_module(f"shardformer.policies.{family}")
    return getattr(module, policy_cls)()
