"""Tiny configurations, builders and inputs for the encoder and
encoder-decoder families (RoBERTa, ALBERT, ERNIE, T5, Whisper) and the local
ChatGLM2 model.  Heads, MLP features, vocabularies and label counts do not
divide 2 or 4 evenly where the model allows it; every dropout is 0 and
attention is "eager", as in every zoo module."""
from __future__ import annotations

import torch

from .labels import add_labels

BATCH, SEQ, CHOICES = 2, 8, 3
DEC_SEQ = 5

ROBERTA = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=2, intermediate_size=90, vocab_size=99,
               max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, classifier_dropout=0.0, pad_token_id=1)
ERNIE = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=2, intermediate_size=90, vocab_size=99,
             max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, use_task_id=True,
             task_type_vocab_size=3, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
# ALBERT: embedding_size != hidden_size, 2 layers sharing one layer group.
ALBERT = dict(embedding_size=20, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, num_hidden_groups=1,
              inner_group_num=1, intermediate_size=90, vocab_size=99, max_position_embeddings=64, num_labels=3,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
T5 = dict(d_model=40, d_kv=8, num_heads=6, d_ff=90, num_layers=2, num_decoder_layers=2, vocab_size=99,
          relative_attention_num_buckets=10, relative_attention_max_distance=20, dropout_rate=0.0,
          classifier_dropout=0.0, num_labels=3, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
# T5 v1.1: gated-GELU feed-forward, untied LM head (no d_model**-0.5 scaling).
T5_V11 = dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
WHISPER = dict(d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=6,
               decoder_attention_heads=6, encoder_ffn_dim=90, decoder_ffn_dim=90, vocab_size=99, num_mel_bins=10,
               max_source_positions=8, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, num_labels=3, classifier_proj_size=21, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
# ChatGLM2 (zoo.chatglm2, a local model): 6 query heads over 2 multi-query KV groups.
CHATGLM2 = dict(hidden_size=48, num_attention_heads=6, kv_channels=8, multi_query_attention=True,
                multi_query_group_num=2, ffn_hidden_size=45, num_layers=2, padded_vocab_size=99)

# name -> (model class, config class, config kwargs, input kind)
MODELS = {
    "RobertaModel": ("RobertaModel", "RobertaConfig", ROBERTA, "base"),
    "RobertaForMaskedLM": ("RobertaForMaskedLM", "RobertaConfig", ROBERTA, "mlm"),
    "RobertaForCausalLM": ("RobertaForCausalLM", "RobertaConfig", dict(ROBERTA, is_decoder=True), "causal_lm"),
    "RobertaForCausalLM/cross": ("RobertaForCausalLM", "RobertaConfig",
                                 dict(ROBERTA, is_decoder=True, add_cross_attention=True), "causal_lm_cross"),
    "RobertaForSequenceClassification": ("RobertaForSequenceClassification", "RobertaConfig", ROBERTA, "seq_cls"),
    "RobertaForTokenClassification": ("RobertaForTokenClassification", "RobertaConfig", ROBERTA, "token_cls"),
    "RobertaForQuestionAnswering": ("RobertaForQuestionAnswering", "RobertaConfig", dict(ROBERTA, num_labels=2), "qa"),
    "RobertaForMultipleChoice": ("RobertaForMultipleChoice", "RobertaConfig", ROBERTA, "multiple_choice"),
    "AlbertModel": ("AlbertModel", "AlbertConfig", ALBERT, "base"),
    "AlbertForPreTraining": ("AlbertForPreTraining", "AlbertConfig", dict(ALBERT, num_labels=2), "sop"),
    "AlbertForMaskedLM": ("AlbertForMaskedLM", "AlbertConfig", ALBERT, "mlm"),
    "AlbertForSequenceClassification": ("AlbertForSequenceClassification", "AlbertConfig", ALBERT, "seq_cls"),
    "AlbertForTokenClassification": ("AlbertForTokenClassification", "AlbertConfig", ALBERT, "token_cls"),
    "AlbertForQuestionAnswering": ("AlbertForQuestionAnswering", "AlbertConfig", dict(ALBERT, num_labels=2), "qa"),
    "AlbertForMultipleChoice": ("AlbertForMultipleChoice", "AlbertConfig", ALBERT, "multiple_choice"),
    "T5Model": ("T5Model", "T5Config", T5, "seq2seq"),
    "T5ForConditionalGeneration": ("T5ForConditionalGeneration", "T5Config", T5, "seq2seq_lm"),
    "T5ForConditionalGeneration/v1.1": ("T5ForConditionalGeneration", "T5Config", T5_V11, "seq2seq_lm"),
    "T5EncoderModel": ("T5EncoderModel", "T5Config", T5, "base"),
    "T5ForSequenceClassification": ("T5ForSequenceClassification", "T5Config", T5, "seq2seq_cls"),
    "T5ForTokenClassification": ("T5ForTokenClassification", "T5Config", T5, "token_cls"),
    "T5ForQuestionAnswering": ("T5ForQuestionAnswering", "T5Config", dict(T5_V11, num_labels=2), "seq2seq_qa"),
    "WhisperModel": ("WhisperModel", "WhisperConfig", WHISPER, "audio_s2s_base"),
    "WhisperForConditionalGeneration": ("WhisperForConditionalGeneration", "WhisperConfig", WHISPER, "audio_s2s"),
    "WhisperForCausalLM": ("WhisperForCausalLM", "WhisperConfig", WHISPER, "causal_lm"),
    "WhisperForAudioClassification": ("WhisperForAudioClassification", "WhisperConfig", WHISPER, "audio_cls"),
    "ChatGLMModel": ("ChatGLMModel", "local", CHATGLM2, "base"),
    "ChatGLMForConditionalGeneration": ("ChatGLMForConditionalGeneration", "local", CHATGLM2, "causal_lm"),
    "ChatGLMForConditionalGeneration/mha": ("ChatGLMForConditionalGeneration", "local",
                                            dict(CHATGLM2, multi_query_attention=False), "causal_lm"),
    "ErnieModel": ("ErnieModel", "ErnieConfig", ERNIE, "ernie"),
    "ErnieForPreTraining": ("ErnieForPreTraining", "ErnieConfig", ERNIE, "pretraining"),
    "ErnieForCausalLM": ("ErnieForCausalLM", "ErnieConfig", dict(ERNIE, is_decoder=True), "causal_lm"),
    "ErnieForMaskedLM": ("ErnieForMaskedLM", "ErnieConfig", ERNIE, "mlm"),
    "ErnieForNextSentencePrediction": ("ErnieForNextSentencePrediction", "ErnieConfig", ERNIE, "nsp"),
    "ErnieForSequenceClassification": ("ErnieForSequenceClassification", "ErnieConfig", ERNIE, "seq_cls"),
    "ErnieForMultipleChoice": ("ErnieForMultipleChoice", "ErnieConfig", ERNIE, "multiple_choice"),
    "ErnieForTokenClassification": ("ErnieForTokenClassification", "ErnieConfig", ERNIE, "token_cls"),
    "ErnieForQuestionAnswering": ("ErnieForQuestionAnswering", "ErnieConfig", dict(ERNIE, num_labels=2), "qa"),
}


def build(name: str, dtype=torch.float32, seed: int = 0, **overrides):
    """The unsharded HF model `name`, built from `seed`."""
    import transformers

    model_cls, cfg_name, cfg_kwargs, _ = MODELS[name]
    if cfg_name == "local":
        from zoo import chatglm2

        cfg = chatglm2.chatglm2_config(**dict(cfg_kwargs, **overrides))
        torch.manual_seed(seed)
        return getattr(chatglm2, model_cls)(cfg).to(dtype)
    cfg = getattr(transformers, cfg_name)(**dict(cfg_kwargs, **overrides))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    return model.to(dtype)


def make_inputs(name: str, seed: int = 1) -> dict:
    _, _, cfg, kind = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    vocab, labels = cfg.get("vocab_size", cfg.get("padded_vocab_size", 99)), cfg.get("num_labels", 3)

    def ids(*shape):
        return torch.randint(3, vocab, shape, generator=g)

    if kind == "multiple_choice":
        return {"input_ids": ids(BATCH, CHOICES, SEQ), "labels": torch.randint(0, CHOICES, (BATCH,), generator=g)}
    if kind.startswith("audio"):
        x = {"input_features": torch.randn(BATCH, cfg["num_mel_bins"], 2 * cfg["max_source_positions"],
                                           generator=g)}
        if kind == "audio_cls":
            x["labels"] = torch.randint(0, labels, (BATCH,), generator=g)
        else:
            x["decoder_input_ids"] = ids(BATCH, DEC_SEQ)
            if kind == "audio_s2s":
                x["labels"] = ids(BATCH, DEC_SEQ)
        return x
    x = {"input_ids": ids(BATCH, SEQ)}
    if kind in ("seq2seq", "seq2seq_lm", "seq2seq_cls", "seq2seq_qa"):
        x["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        x["attention_mask"][1, -2:] = 0
        if kind != "seq2seq_cls":  # classification pools the decoder at the input's EOS
            x["decoder_input_ids"] = ids(BATCH, DEC_SEQ)
        if kind == "seq2seq_lm":
            x["labels"] = ids(BATCH, DEC_SEQ)
        elif kind == "seq2seq_cls":
            x["input_ids"][:, -1] = cfg["eos_token_id"]  # one EOS per row: the pooled position
            x["labels"] = torch.randint(0, labels, (BATCH,), generator=g)
        elif kind == "seq2seq_qa":  # spans index the decoder's positions
            x["start_positions"] = torch.randint(0, DEC_SEQ, (BATCH,), generator=g)
            x["end_positions"] = torch.randint(0, DEC_SEQ, (BATCH,), generator=g)
        return x
    if kind == "ernie":
        x["task_type_ids"] = torch.randint(0, 3, (BATCH, SEQ), generator=g)
    if kind == "causal_lm_cross":  # a decoder attending to some encoder's states
        x["encoder_hidden_states"] = torch.randn(BATCH, SEQ - 2, cfg["hidden_size"], generator=g)
        kind = "causal_lm"
    return add_labels(x, kind, labels, g, BATCH, SEQ)
