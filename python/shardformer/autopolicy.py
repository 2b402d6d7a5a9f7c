"""The policy registry: model class -> policy, imported lazily.

Keys are the model class's full qualified name ("module.QualName"), or a bare
class name for models outside transformers (remote code: the class's module
is a dynamic one that varies per checkpoint).  Values name the policy file in
shardformer.policies and the class in it, so importing shardformer never
imports transformers or any policy.
"""
from __future__ import annotations

import importlib

from ._versions import check_transformers_version
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
_add("mistral", "mistral.modeling_mistral", {
    "MistralModel": "MistralModelPolicy",
    "MistralForCausalLM": "MistralForCausalLMPolicy",
    "MistralForSequenceClassification": "MistralForSequenceClassificationPolicy",
    "MistralForTokenClassification": "MistralForTokenClassificationPolicy",
    "MistralForQuestionAnswering": "MistralForQuestionAnsweringPolicy",
})
_add("qwen2", "qwen2.modeling_qwen2", {
    "Qwen2Model": "Qwen2ModelPolicy",
    "Qwen2ForCausalLM": "Qwen2ForCausalLMPolicy",
    "Qwen2ForSequenceClassification": "Qwen2ForSequenceClassificationPolicy",
    "Qwen2ForTokenClassification": "Qwen2ForTokenClassificationPolicy",
    "Qwen2ForQuestionAnswering": "Qwen2ForQuestionAnsweringPolicy",
})
_add("qwen3", "qwen3.modeling_qwen3", {
    "Qwen3Model": "Qwen3ModelPolicy",
    "Qwen3ForCausalLM": "Qwen3ForCausalLMPolicy",
    "Qwen3ForSequenceClassification": "Qwen3ForSequenceClassificationPolicy",
    "Qwen3ForTokenClassification": "Qwen3ForTokenClassificationPolicy",
    "Qwen3ForQuestionAnswering": "Qwen3ForQuestionAnsweringPolicy",
})
_add("gemma", "gemma.modeling_gemma", {
    "GemmaModel": "GemmaModelPolicy",
    "GemmaForCausalLM": "GemmaForCausalLMPolicy",
    "GemmaForSequenceClassification": "GemmaForSequenceClassificationPolicy",
    "GemmaForTokenClassification": "GemmaForTokenClassificationPolicy",
})
_add("gemma2", "gemma2.modeling_gemma2", {
    "Gemma2Model": "Gemma2ModelPolicy",
    "Gemma2ForCausalLM": "Gemma2ForCausalLMPolicy",
    "Gemma2ForSequenceClassification": "Gemma2ForSequenceClassificationPolicy",
    "Gemma2ForTokenClassification": "Gemma2ForTokenClassificationPolicy",
})
_add("gemma3", "gemma3.modeling_gemma3", {
    "Gemma3TextModel": "Gemma3TextModelPolicy",
    "Gemma3ForCausalLM": "Gemma3ForCausalLMPolicy",
    "Gemma3TextForSequenceClassification": "Gemma3TextForSequenceClassificationPolicy",
    "Gemma3Model": "Gemma3ModelPolicy",
    "Gemma3ForConditionalGeneration": "Gemma3ForConditionalGenerationPolicy",
    "Gemma3ForSequenceClassification": "Gemma3ForSequenceClassificationPolicy",
})
_add("phi3", "phi3.modeling_phi3", {
    "Phi3Model": "Phi3ModelPolicy",
    "Phi3ForCausalLM": "Phi3ForCausalLMPolicy",
    "Phi3ForSequenceClassification": "Phi3ForSequenceClassificationPolicy",
    "Phi3ForTokenClassification": "Phi3ForTokenClassificationPolicy",
})
_add("mixtral", "mixtral.modeling_mixtral", {
    "MixtralModel": "MixtralModelPolicy",
    "MixtralForCausalLM": "MixtralForCausalLMPolicy",
    "MixtralForSequenceClassification": "MixtralForSequenceClassificationPolicy",
    "MixtralForTokenClassification": "MixtralForTokenClassificationPolicy",
    "MixtralForQuestionAnswering": "MixtralForQuestionAnsweringPolicy",
})
_add("glm", "glm.modeling_glm", {
    "GlmModel": "GlmModelPolicy",
    "GlmForCausalLM": "GlmForCausalLMPolicy",
    "GlmForSequenceClassification": "GlmForSequenceClassificationPolicy",
    "GlmForTokenClassification": "GlmForTokenClassificationPolicy",
})
_add("opt", "opt.modeling_opt", {
    "OPTModel": "OPTModelPolicy",
    "OPTForCausalLM": "OPTForCausalLMPolicy",
    "OPTForSequenceClassification": "OPTForSequenceClassificationPolicy",
    "OPTForQuestionAnswering": "OPTForQuestionAnsweringPolicy",
})
_add("gpt_neo", "gpt_neo.modeling_gpt_neo", {
    "GPTNeoModel": "GPTNeoModelPolicy",
    "GPTNeoForCausalLM": "GPTNeoForCausalLMPolicy",
    "GPTNeoForSequenceClassification": "GPTNeoForSequenceClassificationPolicy",
    "GPTNeoForTokenClassification": "GPTNeoForTokenClassificationPolicy",
    "GPTNeoForQuestionAnswering": "GPTNeoForQuestionAnsweringPolicy",
})
_add("gptj", "gptj.modeling_gptj", {
    "GPTJModel": "GPTJModelPolicy",
    "GPTJForCausalLM": "GPTJForCausalLMPolicy",
    "GPTJForSequenceClassification": "GPTJForSequenceClassificationPolicy",
    "GPTJForQuestionAnswering": "GPTJForQuestionAnsweringPolicy",
})
_add("bloom", "bloom.modeling_bloom", {
    "BloomModel": "BloomModelPolicy",
    "BloomForCausalLM": "BloomForCausalLMPolicy",
    "BloomForSequenceClassification": "BloomForSequenceClassificationPolicy",
    "BloomForTokenClassification": "BloomForTokenClassificationPolicy",
    "BloomForQuestionAnswering": "BloomForQuestionAnsweringPolicy",
})
_add("falcon", "falcon.modeling_falcon", {
    "FalconModel": "FalconModelPolicy",
    "FalconForCausalLM": "FalconForCausalLMPolicy",
    "FalconForSequenceClassification": "FalconForSequenceClassificationPolicy",
    "FalconForTokenClassification": "FalconForTokenClassificationPolicy",
    "FalconForQuestionAnswering": "FalconForQuestionAnsweringPolicy",
})
# (end of decoder-only families)

# --- encoder and encoder-decoder text/audio families (roberta, t5, whisper, ...) ---
_add("roberta", "roberta.modeling_roberta", {
    f"Roberta{c}": f"Roberta{c}Policy" for c in (
        "Model", "ForMaskedLM", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
        "ForQuestionAnswering", "ForMultipleChoice")
})
_add("albert", "albert.modeling_albert", {
    f"Albert{c}": f"Albert{c}Policy" for c in (
        "Model", "ForPreTraining", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
        "ForQuestionAnswering", "ForMultipleChoice")
})
_add("ernie", "ernie.modeling_ernie", {
    f"Ernie{c}": f"Ernie{c}Policy" for c in (
        "Model", "ForPreTraining", "ForCausalLM", "ForMaskedLM", "ForNextSentencePrediction",
        "ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification", "ForQuestionAnswering")
})
_add("t5", "t5.modeling_t5", {
    f"T5{c}": f"T5{c}Policy" for c in (
        "Model", "ForConditionalGeneration", "EncoderModel", "ForSequenceClassification",
        "ForTokenClassification", "ForQuestionAnswering")
})
_add("whisper", "whisper.modeling_whisper", {
    f"Whisper{c}": f"Whisper{c}Policy" for c in (
        "Model", "ForConditionalGeneration", "ForCausalLM", "ForAudioClassification")
})
# ChatGLM2 ships as remote code: bare class names match its dynamic modules.
_REGISTRY.update({c: ("chatglm2", f"{c}Policy") for c in ("ChatGLMModel", "ChatGLMForConditionalGeneration")})
# (end of encoder and encoder-decoder families)

# --- vision and multimodal families (vit, beit, swin, sam, blip2) ---
_add("vit", "vit.modeling_vit", {
    "ViTModel": "ViTModelPolicy",
    "ViTForImageClassification": "ViTForImageClassificationPolicy",
    "ViTForMaskedImageModeling": "ViTForMaskedImageModelingPolicy",
})
_add("beit", "beit.modeling_beit", {
    "BeitModel": "BeitModelPolicy",
    "BeitForImageClassification": "BeitForImageClassificationPolicy",
    "BeitForMaskedImageModeling": "BeitForMaskedImageModelingPolicy",
    "BeitForSemanticSegmentation": "BeitForSemanticSegmentationPolicy",
})
_add("swin", "swin.modeling_swin", {
    "SwinModel": "SwinModelPolicy",
    "SwinForImageClassification": "SwinForImageClassificationPolicy",
    "SwinForMaskedImageModeling": "SwinForMaskedImageModelingPolicy",
})
_add("swinv2", "swinv2.modeling_swinv2", {
    "Swinv2Model": "Swinv2ModelPolicy",
    "Swinv2ForImageClassification": "Swinv2ForImageClassificationPolicy",
    "Swinv2ForMaskedImageModeling": "Swinv2ForMaskedImageModelingPolicy",
})
_add("sam", "sam.modeling_sam", {
    "SamModel": "SamModelPolicy",
    "SamVisionModel": "SamVisionModelPolicy",
})
_add("blip2", "blip_2.modeling_blip_2", {
    f"Blip2{c}": f"Blip2{c}Policy" for c in (
        "Model", "ForConditionalGeneration", "ForImageTextRetrieval", "VisionModel", "QFormerModel",
        "TextModelWithProjection", "VisionModelWithProjection")
})
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
    check_transformers_version()
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
