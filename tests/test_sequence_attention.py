"""Sequence parallelism whose attention crosses the split: all_to_all
(Ulysses) and ring_attn (zigzag ring over the C flash kernel's LSE), for the
Llama-shaped decoder families, GPT-2, the BERT-style encoders, OPT, ViT,
ALBERT (shared layer groups), T5 (relative position bias, cross-attention),
Whisper (encoder and decoder), and the families whose attention is outside
transformers' registry (GPT-Neo, GPT-J, BLOOM, Falcon: split at a seam;
ChatGLM2's seam: tests/test_sequence_parallel_mm.py):
equal to the unsharded model (forward, loss, every gradient, after an
optimizer step) at SP=2 and 4 with TP off, and at TP=2 x SP=2 on 4 ranks;
odd lengths (padded inside), padded batches, eval with dropout, per-rank
dropout masks in training, generate(); refusals by name."""
import pytest
from zoo.decoders import FALCON_NEW_ARCH, FALCON_PER_HEAD

from checks import sequence_attention as check

MODES = ["all_to_all", "ring_attn"]
FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
            "GlmForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
            "LlamaForSequenceClassification", "Qwen2ForTokenClassification", "LlamaModel", "Gemma3ForCausalLM",
            "Gemma2ForCausalLM"]
# Logit soft-capping (Gemma 2): the model's own attention after the all-to-all, the C kernel's softcap in each
# ring block.  Sliding-window layers (Gemma 3) run in both modes.
# Beyond the Llama-shaped decoders: GPT-2, the BERT-style encoders (bidirectional: padded keys masked inside), OPT, ViT.
OTHER_FAMILIES = ["GPT2LMHeadModel", "GPT2ForSequenceClassification", "BertForMaskedLM", "BertForTokenClassification",
                  "RobertaForMaskedLM", "ErnieForMaskedLM", "OPTForCausalLM", "ViTForImageClassification"]
# ALBERT: one shared layer group run num_hidden_layers times (split at its first entry, gathered after the encoder).
ALBERT = ["AlbertForMaskedLM", "AlbertForSequenceClassification", "AlbertForTokenClassification",
          "AlbertForQuestionAnswering", "AlbertModel", "AlbertForPreTraining", "AlbertForMultipleChoice"]
# Whisper: encoder (bidirectional, after the conv front end) and decoder (causal; cross-attention rows attend to
# the whole encoder output), both modes.
WHISPER = ["WhisperForConditionalGeneration", "WhisperModel", "WhisperForAudioClassification", "WhisperForCausalLM"]
# T5: the relative position bias built for the whole padded sequence; all_to_all: each rank adds its heads' slice,
# ring_attn: each block of the ring its (query rows, key columns).
T5 = ["T5ForConditionalGeneration", "T5ForConditionalGeneration/v1.1", "T5EncoderModel", "T5Model",
      "T5ForTokenClassification", "T5ForSequenceClassification", "T5ForQuestionAnswering"]
# Attention outside transformers' registry, split at a seam the family names (AttentionSeam): GPT-Neo (global and
# local-window layers), GPT-J (rotary from position_ids), Falcon (rotary; multi-query, parallel attention).
SEAM_FAMILIES = ["GPTNeoForCausalLM", "GPTNeoForSequenceClassification", "GPTNeoForTokenClassification",
                 "GPTNeoForQuestionAnswering", "GPTJForCausalLM", "GPTJForSequenceClassification",
                 "GPTJForQuestionAnswering", "FalconForCausalLM", "FalconForSequenceClassification",
                 "FalconForTokenClassification", "FalconForQuestionAnswering", "GPTNeoModel", "GPTJModel",
                 "FalconModel"]
# ALiBi (BLOOM): the per-head bias over absolute key positions, this rank's heads after the all-to-all; each ring
# block adds it at its key columns (the ring kernel's bias).
ALIBI_FAMILIES = ["BloomForCausalLM", "BloomForSequenceClassification", "BloomForTokenClassification",
                  "BloomForQuestionAnswering", "BloomModel"]


# One test function per mode: docs/supported-models.md's support matrix has a column per function (scripts/support_matrix.py).
@pytest.mark.parametrize("name", FAMILIES + OTHER_FAMILIES + ALBERT + WHISPER + T5 + SEAM_FAMILIES + ALIBI_FAMILIES)
def test_all_to_all_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 2, name, "all_to_all", 7)       # 7 tokens: padded inside


@pytest.mark.parametrize("name", FAMILIES + OTHER_FAMILIES + ALBERT + WHISPER + T5 + SEAM_FAMILIES + ALIBI_FAMILIES)
def test_ring_attn_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 2, name, "ring_attn", 7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp, seq, window, padded", [(2, 7, 3, False), (4, 8, 3, False), (2, 8, 5, True),
                                                     (4, 7, 2, True)])
def test_sliding_window(pool, mode, sp, seq, window, padded):
    """Mistral with sliding_window shorter than the sequence equals the unsharded model."""
    pool.run(check.sliding_window_equals_unsharded, sp, "MistralForCausalLM", mode, window, seq, padded)


@pytest.mark.parametrize("seq, window", [(8, 2), (7, 1), (5, 2)])
def test_sliding_window_ring_skips_hops(pool, seq, window):
    """SP=4, a window within one chunk's reach (chunks of 1 row): K/V of the ranks out of every local
    query's window never travel (fewer messages than the plain ring's p-1 per forward and 2p-1 per
    backward), and the model still equals the unsharded one."""
    p = 4
    for r in pool.run(check.sliding_window_equals_unsharded, p, "MistralForCausalLM", "ring_attn", window, seq):
        passes = r["ring_passes"]
        plain = passes["forward"] * (p - 1) + passes["backward"] * (2 * p - 1)
        assert r["ring_unvisited"] > 0 and r["ring_messages"] < plain, r


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq", [3, 6, 7])                   # 3 < 4 ranks; 6, 7 not multiples of 4 or 8
def test_sp4_odd_lengths(pool, mode, seq):
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", mode, seq)


def test_padded_batch_every_row(pool):
    # all_to_all runs the model's own attention: even the padding rows are equal
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", "all_to_all", 7, None, True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp", [2, 4])
def test_padded_batch(pool, mode, sp):
    pool.run(check.padded_batch_real_rows, sp, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "T5ForConditionalGeneration", "WhisperForConditionalGeneration",
                                  "AlbertForMaskedLM"])
def test_with_all_optimizations(pool, mode, name):
    pool.run(check.equals_unsharded, 2, name, mode, 7, {"enable_all_optimization": True})


@pytest.mark.parametrize("mode", MODES)
def test_tp2_sp2(pool, mode):
    pool.run(check.tp_sp_equals_unsharded, 4, "LlamaForCausalLM", mode, 2, 7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp", [2, 4])
def test_rows_are_split(pool, mode, sp):
    pool.run(check.rows_are_split, sp, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
def test_eval_with_dropout(pool, mode):
    pool.run(check.eval_with_dropout, 2, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_generate(pool, mode, name):
    pool.run(check.generate_matches, 2, name, mode)


def test_gemma2_ring_eval_with_dropout(pool):
    pool.run(check.eval_with_dropout, 2, "Gemma2ForCausalLM", "ring_attn")


def test_cached_training_forward_refused(pool):
    pool.run(check.cached_training_forward_refused, 2, "LlamaForCausalLM", "all_to_all")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp, seq", [(2, 7), (4, 7), (4, 8)])
def test_softcap_in_force(pool, mode, sp, seq):
    """Gemma 2 with a cap that binds (0.05: the zoo's 50 never does on a tiny model) equals the unsharded model."""
    pool.run(check.softcap_equals_unsharded, sp, "Gemma2ForCausalLM", mode, 0.05, seq)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_ring_attention_dropout_training(pool, name, sp):
    """attention_dropout > 0 in training: the ring draws the kernel's mask of the whole sequence."""
    pool.run(check.ring_dropout_matches_kernel, sp, name)


def test_ring_refusals(pool):
    # a 4-D mask of another pattern: the ring covers causal attention with key padding, windows and packed
    # documents (tests/test_packed_sequences.py)
    pool.run(check.ring_other_mask_refused, 2, "LlamaForCausalLM")


def test_split_attention_refused_by_name():
    # attention the split cannot reach (SAM's decomposed relative positions inside its own attention)
    import zoo
    from shardformer import ShardConfig, ShardFormer

    for name in ("SamVisionModel",):
        for mode in MODES:
            model = zoo.build(name)
            with pytest.raises(NotImplementedError, match=f"{mode}.*not available for"):
                ShardFormer(ShardConfig(**check.sp_config(mode))).optimize(model)


# output_attentions: ring_attn builds no weights; all_to_all returns them from eager attention only
@pytest.mark.parametrize("mode,inner", [("ring_attn", "eager"), ("all_to_all", "sdpa")])
def test_recorded_outputs_refused_when_split(pool, mode, inner):
    pool.run(check.recorded_outputs_refused, 2, "LlamaForCausalLM", mode, inner)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("default_group", [False, True], ids=["group", "default_group"])
def test_accumulated_forwards(pool, mode, default_group):
    # default_group: ShardConfig names no group (the world); the gradient sync must still run
    pool.run(check.accumulated_forwards, 4, "LlamaForCausalLM", mode, default_group)


@pytest.mark.parametrize("mode", MODES)
def test_sp_group_replicas_checked(pool, mode):
    pool.run(check.sp_group_replicas_checked, 4, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
def test_split_attention_refuses_cross_attention_and_layerdrop(mode):
    import transformers

    from shardformer import ShardConfig, ShardFormer

    small = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40, vocab_size=50)
    decoder = transformers.RobertaForCausalLM(transformers.RobertaConfig(**small, is_decoder=True,
                                                                         add_cross_attention=True))
    with pytest.raises(NotImplementedError, match=f"RobertaForCausalLM.*{mode}.*cross-attention"):
        ShardFormer(ShardConfig(**check.sp_config(mode))).optimize(decoder)
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(hidden_size=32, num_attention_heads=2, ffn_dim=40,
                                                             num_hidden_layers=2, vocab_size=50, layerdrop=0.1,
                                                             word_embed_proj_dim=32))
    with pytest.raises(NotImplementedError, match=f"OPTForCausalLM.*{mode}.*layerdrop"):
        ShardFormer(ShardConfig(**check.sp_config(mode))).optimize(opt)


# ---- encoder-decoders and shared layers: ALBERT, T5, Whisper ------------------------

ENC_DEC_CASES = [(n, m) for n in ALBERT[:1] + WHISPER[:1] + T5[:1] for m in MODES]


@pytest.mark.parametrize("name, mode", ENC_DEC_CASES + [("T5EncoderModel", "all_to_all"), ("T5EncoderModel", "ring_attn"),
                                                        ("WhisperForAudioClassification", "ring_attn")])
@pytest.mark.parametrize("sp", [2, 4])
def test_encoder_decoder_paths_ran(pool, name, mode, sp):
    """Split attention once per layer application, cross-attention per decoder layer, T5's bias sliced."""
    pool.run(check.paths_ran, sp, name, mode, 7)


@pytest.mark.parametrize("name, mode", ENC_DEC_CASES)
@pytest.mark.parametrize("seq", [3, 7])                      # T5: 3 encoder tokens < 4 ranks; decoders keep 5
def test_encoder_decoder_sp4_odd_lengths(pool, name, mode, seq):
    pool.run(check.equals_unsharded, 4, name, mode, seq)


@pytest.mark.parametrize("name, mode", [("T5ForConditionalGeneration", "all_to_all"),
                                        ("T5ForConditionalGeneration", "ring_attn"),
                                        ("WhisperForConditionalGeneration", "ring_attn")])
def test_encoder_decoder_tp2_sp2(pool, name, mode):
    # T5: 6 heads, 3 per TP rank, not dividing SP=2: zero heads appended to q/k/v and the bias
    pool.run(check.tp_sp_equals_unsharded, 4, name, mode, 2, 7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp", [2, 4])
def test_albert_padded_batch(pool, mode, sp):
    # bidirectional: a left-padded row's padding queries still see real keys, so every row is compared
    pool.run(check.equals_unsharded, sp, "AlbertForMaskedLM", mode, 7, None, True)


@pytest.mark.parametrize("name, mode", ENC_DEC_CASES)
def test_encoder_decoder_eval_with_dropout(pool, name, mode):
    pool.run(check.eval_with_dropout, 2, name, mode)


@pytest.mark.parametrize("mode", MODES)
def test_albert_shared_layer_hooked_once(pool, mode):
    pool.run(check.shared_layer_hooks_once, 2, "AlbertForMaskedLM", mode)


@pytest.mark.parametrize("name, mode", [(n, m) for n in ("T5ForConditionalGeneration", "WhisperForConditionalGeneration")
                                        for m in MODES])
def test_encoder_decoder_generate(pool, name, mode):
    pool.run(check.seq2seq_generate_matches, 2, name, mode)


@pytest.mark.parametrize("name, mode, match, overrides", [
    ("WhisperForAudioClassification", "all_to_all", "use_weighted_layer_sum", {"use_weighted_layer_sum": True}),
    ("WhisperForAudioClassification", "ring_attn", "use_weighted_layer_sum", {"use_weighted_layer_sum": True}),
    ("WhisperForConditionalGeneration", "all_to_all", "decoder_layerdrop", {"decoder_layerdrop": 0.1}),
    ("WhisperForConditionalGeneration", "ring_attn", "encoder_layerdrop", {"encoder_layerdrop": 0.1}),
])
def test_encoder_decoder_refusals(pool, name, mode, match, overrides):
    pool.run(check.refused_model_unchanged, 2, name, mode, match, **overrides)


# other layouts: ALBERT with 2 groups of 2 inner layers, T5 stacks of different depths, Whisper's encoder of odd length
VARIANTS = [("AlbertForMaskedLM", 7, {"num_hidden_layers": 4, "num_hidden_groups": 2, "inner_group_num": 2}, MODES),
            ("AlbertForSequenceClassification", 5, {"num_hidden_layers": 3}, MODES),
            ("T5ForConditionalGeneration", 7, {"num_layers": 3, "num_decoder_layers": 1}, MODES),
            ("T5ForConditionalGeneration/v1.1", 3, {"num_layers": 1, "num_decoder_layers": 3}, MODES),
            ("WhisperForConditionalGeneration", None, {"max_source_positions": 7}, MODES),
            ("WhisperForConditionalGeneration", None, {"max_source_positions": 5, "encoder_layers": 1,
                                                       "decoder_layers": 3}, MODES)]


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name, seq, overrides, mode", [(n, s, o, m) for n, s, o, modes in VARIANTS for m in modes])
def test_encoder_decoder_variants(pool, name, seq, overrides, mode, sp):
    pool.run(check.variant_equals_unsharded, sp, name, mode, seq, overrides)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name, mode", [("T5ForConditionalGeneration", "all_to_all"),
                                        ("WhisperForConditionalGeneration", "ring_attn"),
                                        ("T5ForConditionalGeneration", "ring_attn"),
                                        ("LlamaForCausalLM", "all_to_all")])
def test_gradient_checkpointing(pool, name, mode, use_reentrant):
    # the layers recomputed in backward run their split hooks again, on the same input (ALBERT: HF has no
    # gradient checkpointing)
    pool.run(check.checkpointing_equals_unsharded, 2, name, mode, use_reentrant)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp", [2, 4])
def test_encoder_decoder_padded_decoder(pool, mode, sp):
    # T5: the encoder's padded row (zoo inputs) and a decoder row padded at the end
    pool.run(check.decoder_padding_equals_unsharded, sp, "T5ForConditionalGeneration", mode)


@pytest.mark.parametrize("name, mode", ENC_DEC_CASES)
def test_encoder_decoder_accumulated_forwards(pool, name, mode):
    # two forwards of 7 and 5 encoder tokens (Whisper: two batches) before one backward, at SP=4
    pool.run(check.accumulated_forwards, 4, name, mode)
# ---- attention outside transformers' registry, split at the family's seam (AttentionSeam) -----------------------
SEAM_LMS = [("GPTNeoForCausalLM", "all_to_all"), ("GPTNeoForCausalLM", "ring_attn"), ("GPTJForCausalLM", "all_to_all"),
            ("GPTJForCausalLM", "ring_attn"), ("FalconForCausalLM", "all_to_all"), ("FalconForCausalLM", "ring_attn"),
            ("BloomForCausalLM", "all_to_all"), ("BloomForCausalLM", "ring_attn")]
# The zoo's Falcon is multi-query, parallel attention, rotary; its other fused layouts, and ALiBi.
FALCON_VARIANTS = {"new_arch": FALCON_NEW_ARCH, "per_head": FALCON_PER_HEAD, "alibi": {"alibi": True},
                   "alibi_per_head": dict(FALCON_PER_HEAD, alibi=True), "sdpa": {"attn_implementation": "sdpa"},
                   "alibi_sdpa": {"alibi": True, "attn_implementation": "sdpa"}}


@pytest.mark.parametrize("variant, mode", [("new_arch", "all_to_all"), ("new_arch", "ring_attn"),
                                           ("per_head", "all_to_all"), ("per_head", "ring_attn"),
                                           ("alibi", "all_to_all"), ("alibi_per_head", "all_to_all"),
                                           ("sdpa", "all_to_all"), ("sdpa", "ring_attn"), ("alibi_sdpa", "all_to_all"),
                                           ("alibi", "ring_attn"), ("alibi_per_head", "ring_attn"),
                                           ("alibi_sdpa", "ring_attn")])
@pytest.mark.parametrize("sp", [2, 4])
def test_falcon_variants(pool, variant, mode, sp):
    pool.run(check.equals_unsharded, sp, "FalconForCausalLM", mode, 7, None, False, FALCON_VARIANTS[variant])


@pytest.mark.parametrize("name, mode", SEAM_LMS)
@pytest.mark.parametrize("seq", [3, 7])
def test_seam_sp4_odd_lengths(pool, name, mode, seq):
    pool.run(check.equals_unsharded, 4, name, mode, seq)


@pytest.mark.parametrize("name, mode", SEAM_LMS)
def test_seam_padded_batch(pool, name, mode):
    pool.run(check.padded_batch_real_rows, 2, name, mode)


@pytest.mark.parametrize("name", ["GPTNeoForCausalLM", "GPTJForCausalLM", "FalconForCausalLM", "BloomForCausalLM"])
def test_seam_padded_batch_every_row(pool, name):
    # all_to_all runs the model's own attention math: even the padding rows are equal
    pool.run(check.equals_unsharded, 4, name, "all_to_all", 7, None, True)


@pytest.mark.parametrize("name, mode", [("GPTJForCausalLM", "all_to_all"), ("GPTJForCausalLM", "ring_attn"),
                                        ("GPTNeoForCausalLM", "ring_attn"), ("BloomForCausalLM", "all_to_all"),
                                        ("BloomForCausalLM", "ring_attn"), ("FalconForCausalLM", "all_to_all")])
def test_seam_tp2_sp2(pool, name, mode):
    pool.run(check.tp_sp_equals_unsharded, 4, name, mode, 2, 7)


@pytest.mark.parametrize("name, mode", SEAM_LMS)
def test_seam_eval_with_dropout(pool, name, mode):
    pool.run(check.eval_with_dropout, 2, name, mode)


@pytest.mark.parametrize("name, mode", SEAM_LMS)
def test_seam_with_all_optimizations(pool, name, mode):
    # the split forwards with the seam's kernel installed, and generate()'s unsplit steps through that kernel
    pool.run(check.equals_unsharded, 2, name, mode, 7, {"enable_all_optimization": True})
    pool.run(check.seam_generate_with_kernel, 2, name, mode)


@pytest.mark.parametrize("name, mode", SEAM_LMS)
def test_seam_generate(pool, name, mode):
    pool.run(check.generate_matches, 2, name, mode)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name, overrides", [("BloomForCausalLM", None), ("BloomForSequenceClassification", None),
                                             ("FalconForCausalLM", {"alibi": True}),
                                             ("FalconForCausalLM", {"alibi": True, "multi_query": False})])
def test_alibi_ring_adds_the_bias(pool, name, overrides, sp):
    # every ring call adds ALiBi through the kernel's bias input; without the bias the logits differ
    pool.run(check.alibi_ring_bias_ran, sp, name, overrides)


# ring_attn draws attention dropout with the kernel (test_seam_ring_attention_dropout), not torch's masks
@pytest.mark.parametrize("name, mode", [m for m in SEAM_LMS if m[1] == "all_to_all" or m[0] == "FalconForCausalLM"])
def test_seam_training_dropout_masks(pool, name, mode):
    pool.run(check.training_dropout_masks, 2, name, mode)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name, dropout_key, overrides", [
    ("GPTNeoForCausalLM", "attention_dropout", None), ("GPTJForCausalLM", "attn_pdrop", None),
    ("BloomForCausalLM", "attention_dropout", None), ("FalconForCausalLM", "attention_dropout", {"alibi": True})])
def test_seam_ring_attention_dropout(pool, name, dropout_key, overrides, sp):
    """attention dropout > 0 in training at a seam (with ALiBi for BLOOM and Falcon): the ring draws the
    kernel's mask of the whole sequence, as the family's seam kernel draws it unsharded."""
    pool.run(check.ring_dropout_matches_kernel, sp, name, 0.3, dropout_key, overrides)


@pytest.mark.parametrize("name, seam_class", [("GPTNeoForCausalLM", "GPTNeoSelfAttention"),
                                              ("GPTJForCausalLM", "GPTJAttention"),
                                              ("BloomForCausalLM", "BloomAttention"),
                                              ("FalconForCausalLM", "FalconAttention")])
@pytest.mark.parametrize("mode", MODES)
def test_seam_other_implementation_refused(pool, name, seam_class, mode):
    pool.run(check.other_implementation_refused, 2, name, mode, seam_class)


@pytest.mark.parametrize("name, mode", [("GPTNeoForCausalLM", "all_to_all"), ("FalconForCausalLM", "ring_attn"),
                                        ("BloomForCausalLM", "all_to_all"), ("BloomForCausalLM", "ring_attn")])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_seam_checkpointed_training_dropout(pool, name, mode, use_reentrant):
    pool.run(check.checkpointed_dropout_matches, 2, name, mode, use_reentrant)


@pytest.mark.parametrize("name, mode", [("LlamaForCausalLM", "all_to_all"), ("GPTNeoForCausalLM", "ring_attn"),
                                        ("FalconForCausalLM", "all_to_all")])
def test_no_dropout_keeps_generator(pool, name, mode):
    pool.run(check.no_dropout_keeps_generator, 2, name, mode)
