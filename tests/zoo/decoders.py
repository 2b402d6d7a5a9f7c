"""Tiny configurations and inputs for the decoder-only language-model families
other than Llama and GPT-2 (Mistral, Qwen2/3, Gemma 1-3, Phi-3, Mixtral, GLM,
OPT, GPT-Neo, GPT-J, BLOOM, Falcon).  Head counts, KV heads, MLP features,
vocabularies and label counts are chosen not to divide 2 or 4 where the model
allows it; every dropout is 0 and attention is "eager", as in every zoo module."""
from __future__ import annotations

import torch

from .labels import add_labels

BATCH, SEQ = 2, 8

# GQA: 6 query heads over 2 KV heads, so at TP=4 each KV head is replicated on two ranks.
LLAMA_LIKE = dict(hidden_size=48, intermediate_size=90, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=8, vocab_size=101, max_position_embeddings=64,
                  num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  attention_dropout=0.0, classifier_dropout=0.0)
MISTRAL = dict(LLAMA_LIKE, sliding_window=None)
# Tied embeddings, biased q/k/v.
QWEN2 = dict(LLAMA_LIKE, tie_word_embeddings=True)
# Multi-query: one KV head, replicated on every rank; head_dim not hidden / heads.
QWEN3 = dict(LLAMA_LIKE, hidden_size=40, num_attention_heads=5, num_key_value_heads=1, head_dim=12)
GEMMA = dict(LLAMA_LIKE, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")
GEMMA2 = dict(GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=8)
GEMMA3 = dict(GEMMA, query_pre_attn_scalar=8, sliding_window=4)
PHI3 = dict(LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=64)
MIXTRAL = dict(MISTRAL, intermediate_size=30, num_local_experts=3, num_experts_per_tok=2, router_jitter_noise=0.0)
GLM = dict(LLAMA_LIKE)
# Embedding width 40 != hidden 48: project_in / project_out stay replicated.
OPT = dict(hidden_size=48, num_attention_heads=6, ffn_dim=90, num_hidden_layers=2, vocab_size=101,
           word_embed_proj_dim=40, max_position_embeddings=64, num_labels=3, dropout=0.0, attention_dropout=0.0,
           layerdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT_NEO = dict(hidden_size=48, num_heads=6, num_layers=2, attention_types=[[["global", "local"], 1]], window_size=4,
               intermediate_size=90, vocab_size=101, max_position_embeddings=64, num_labels=3, embed_dropout=0.0,
               attention_dropout=0.0, resid_dropout=0.0, classifier_dropout=0.0, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
GPTJ = dict(n_embd=48, n_head=6, n_layer=2, n_inner=90, rotary_dim=4, vocab_size=101, n_positions=64, num_labels=3,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)

BLOOM = dict(hidden_size=48, n_head=6, n_layer=2, vocab_size=101, num_labels=3, hidden_dropout=0.0,
             attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# multi_query: [q | k | v] with one KV head replicated on every rank.
FALCON = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=2, ffn_hidden_size=90, vocab_size=101,
              num_labels=3, multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
              alibi=False, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Rows grouped per KV head, 2 KV heads (< TP=4: each replicated on two ranks).
FALCON_NEW_ARCH = dict(new_decoder_architecture=True, num_kv_heads=2, multi_query=False)
# Neither: per-head interleaved [q_h k_h v_h], with biases, sequential attention / MLP.
FALCON_PER_HEAD = dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=6, bias=True,
                       parallel_attn=False)

# model class -> (config class, config kwargs, input kind)
MODELS: dict[str, tuple[str, dict, str]] = {}


def _family(prefix: str, config: str, kwargs: dict, classes: dict[str, str]) -> None:
    for suffix, kind in classes.items():
        MODELS[prefix + suffix] = (config, kwargs, kind)


_ALL_HEADS = {"Model": "base", "ForCausalLM": "causal_lm", "ForSequenceClassification": "seq_cls",
              "ForTokenClassification": "token_cls", "ForQuestionAnswering": "qa"}
_NO_QA = {k: v for k, v in _ALL_HEADS.items() if k != "ForQuestionAnswering"}

_family("Mistral", "MistralConfig", MISTRAL, _ALL_HEADS)
_family("Qwen2", "Qwen2Config", QWEN2, _ALL_HEADS)
_family("Qwen3", "Qwen3Config", QWEN3, _ALL_HEADS)
_family("Gemma", "GemmaConfig", GEMMA, _NO_QA)
_family("Gemma2", "Gemma2Config", GEMMA2, _NO_QA)
_family("Gemma3", "Gemma3TextConfig", GEMMA3, {"TextModel": "base", "ForCausalLM": "causal_lm",
                                               "TextForSequenceClassification": "seq_cls"})
_family("Phi3", "Phi3Config", PHI3, _NO_QA)
_family("Mixtral", "MixtralConfig", MIXTRAL, _ALL_HEADS)
_family("Glm", "GlmConfig", GLM, _NO_QA)
_family("OPT", "OPTConfig", OPT, {k: v for k, v in _ALL_HEADS.items() if k != "ForTokenClassification"})
_family("GPTNeo", "GPTNeoConfig", GPT_NEO, _ALL_HEADS)
_family("GPTJ", "GPTJConfig", GPTJ, {k: v for k, v in _ALL_HEADS.items() if k != "ForTokenClassification"})
_family("Bloom", "BloomConfig", BLOOM, _ALL_HEADS)
_family("Falcon", "FalconConfig", FALCON, _ALL_HEADS)
MODELS["GPTJForQuestionAnswering"] = ("GPTJConfig", dict(GPTJ, num_labels=2), "qa")  # its head has num_labels outputs

# One causal LM per family, for generate().
CAUSAL_LMS = sorted(name for name, (_, _, kind) in MODELS.items() if kind == "causal_lm")


def config_of(name: str, **overrides):
    import transformers

    cfg_name, cfg_kwargs, _ = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**dict(cfg_kwargs, **overrides))
    cfg._attn_implementation = "eager"
    if "num_local_experts" in cfg_kwargs:
        cfg._experts_implementation = "eager"  # HF's grouped_mm path needs 16-byte strides on CPU
    return cfg


def build(name: str, dtype=torch.float32, seed: int = 0, **overrides):
    """The unsharded HF model `name`, built from `seed`."""
    import transformers

    cfg = config_of(name, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, name)(cfg)
    return model.to(dtype)


def make_inputs(name: str, seed: int = 1) -> dict:
    _, cfg, kind = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    x = {"input_ids": torch.randint(3, cfg["vocab_size"], (BATCH, SEQ), generator=g)}
    labels = cfg["num_labels"]
    return add_labels(x, kind, labels, g, BATCH, SEQ)
