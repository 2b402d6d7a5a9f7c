"""Tiny configurations and inputs for Llama, GPT-2 and BERT: every class of
their policies.  Sizes are chosen so that heads, KV heads, MLP features, vocabularies
and label counts do not divide 2 or 4 evenly where the model allows it."""
from __future__ import annotations

import torch

from .labels import add_labels

BATCH, SEQ, CHOICES = 2, 8, 3

LLAMA = dict(hidden_size=96, intermediate_size=90, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=64,
             num_labels=3, pad_token_id=0, tie_word_embeddings=False, classifier_dropout=0.0)
GPT2 = dict(n_embd=48, n_head=6, n_layer=2, n_inner=90, vocab_size=99, n_positions=64, num_labels=3,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, classifier_dropout=0.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
BERT = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=2, intermediate_size=90, vocab_size=99,
            max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)

# (model class, config class, config kwargs, input kind)
MODELS = {
    "LlamaModel": ("LlamaConfig", LLAMA, "base"),
    "LlamaForCausalLM": ("LlamaConfig", LLAMA, "causal_lm"),
    "LlamaForSequenceClassification": ("LlamaConfig", LLAMA, "seq_cls"),
    "LlamaForQuestionAnswering": ("LlamaConfig", LLAMA, "qa"),
    "LlamaForTokenClassification": ("LlamaConfig", LLAMA, "token_cls"),
    "GPT2Model": ("GPT2Config", GPT2, "base"),
    "GPT2LMHeadModel": ("GPT2Config", GPT2, "causal_lm"),
    "GPT2DoubleHeadsModel": ("GPT2Config", GPT2, "double_heads"),
    "GPT2ForSequenceClassification": ("GPT2Config", GPT2, "seq_cls"),
    "GPT2ForTokenClassification": ("GPT2Config", GPT2, "token_cls"),
    "GPT2ForQuestionAnswering": ("GPT2Config", GPT2, "qa"),
    "BertModel": ("BertConfig", BERT, "base"),
    "BertForPreTraining": ("BertConfig", BERT, "pretraining"),
    "BertLMHeadModel": ("BertConfig", dict(BERT, is_decoder=True), "causal_lm"),
    "BertForMaskedLM": ("BertConfig", BERT, "mlm"),
    "BertForSequenceClassification": ("BertConfig", BERT, "seq_cls"),
    "BertForTokenClassification": ("BertConfig", BERT, "token_cls"),
    "BertForNextSentencePrediction": ("BertConfig", BERT, "nsp"),
    "BertForMultipleChoice": ("BertConfig", BERT, "multiple_choice"),
    "BertForQuestionAnswering": ("BertConfig", dict(BERT, num_labels=2), "qa"),
}


def build(name: str, dtype=torch.float32, seed: int = 0, **overrides):
    """The unsharded HF model `name`, built from `seed`."""
    import transformers

    cfg_name, cfg_kwargs, _ = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**dict(cfg_kwargs, **overrides))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, name)(cfg)
    return model.to(dtype)


def make_inputs(name: str, seed: int = 1) -> dict:
    _, cfg, kind = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    vocab, labels = cfg["vocab_size"], cfg["num_labels"]

    def ids(*shape):
        return torch.randint(3, vocab, shape, generator=g)

    if kind in ("multiple_choice", "double_heads"):
        x = {"input_ids": ids(BATCH, CHOICES, SEQ)}
        if kind == "multiple_choice":
            x["labels"] = torch.randint(0, CHOICES, (BATCH,), generator=g)
        else:
            x["labels"] = x["input_ids"].clone()
            x["mc_token_ids"] = torch.full((BATCH, CHOICES), SEQ - 1)
            x["mc_labels"] = torch.randint(0, CHOICES, (BATCH,), generator=g)
        return x
    x = {"input_ids": ids(BATCH, SEQ)}
    return add_labels(x, kind, labels, g, BATCH, SEQ)
