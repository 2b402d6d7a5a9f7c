"""Split-gather sequence parallelism (ShardConfig(enable_sequence_parallelism=True))
for T5 (encoder and decoder stacks, relative position bias, cross attention),
Whisper (encoder after the convolutions, decoder with cross attention),
ALBERT (one shared layer applied num_hidden_layers times) and Mixtral (the
MoE block: router on the gathered tokens, experts' partial sums
reduce-scattered): every head class the zoo builds equals the unsharded
model (forward, loss, every gradient, after an optimizer step) at TP=2 and
4, with sequence lengths that do not divide the group (padded inside);
activations between the blocks hold 1/tp of the rows; eval() with dropout
> 0 equal, and in training the residual dropouts draw a mask per rank;
generate() equal for the seq2seq / causal LMs; gradient checkpointing and
enable_sequence_overlap equal too (Mixtral refuses overlap); the
configurations that cannot work refused by name.  BEiT, Swin and Swinv2
(per stage; Swinv2's post-norm blocks run whole, the states between them
split) likewise, with enable_sequence_overlap; the vision models' all_to_all / ring_attn refused.
output_hidden_states=True under every mode (split_gather, all_to_all,
ring_attn) records the unsharded model's full-sequence states."""
import pytest

from checks import sequence, sequence_more

T5 = ["T5ForConditionalGeneration", "T5ForConditionalGeneration/v1.1", "T5Model", "T5EncoderModel",
      "T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering"]
WHISPER = ["WhisperForConditionalGeneration", "WhisperModel", "WhisperForAudioClassification", "WhisperForCausalLM"]
ALBERT = ["AlbertForMaskedLM", "AlbertModel", "AlbertForPreTraining", "AlbertForSequenceClassification",
          "AlbertForTokenClassification", "AlbertForQuestionAnswering", "AlbertForMultipleChoice"]

# Mixtral (MoE): the router on the gathered tokens, the experts' partial sums reduce-scattered by the block
MIXTRAL = ["MixtralForCausalLM", "MixtralModel", "MixtralForSequenceClassification", "MixtralForTokenClassification",
           "MixtralForQuestionAnswering"]

# (name, encoder tokens, config overrides): odd lengths, padded inside
CASES = [(n, 7, None) for n in T5] + [(n, None, {"max_source_positions": 7}) for n in WHISPER] + \
    [(n, 7, None) for n in ALBERT] + [(n, 7, None) for n in MIXTRAL]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,seq,overrides", CASES, ids=[c[0] for c in CASES])
def test_sp_equals_unsharded(pool, name, seq, overrides, tp):
    pool.run(sequence_more.sp_equals_unsharded, tp, name, seq, overrides)


# T5 (both stacks), Whisper (both stacks), ALBERT (every repetition of the shared layer; also 2 groups of 2 layers)
SPLIT = [("T5ForConditionalGeneration", 7, None), ("T5EncoderModel", 7, None), ("T5ForSequenceClassification", 7, None),
         ("WhisperForConditionalGeneration", None, {"max_source_positions": 7}),
         ("WhisperForAudioClassification", None, None), ("AlbertForMaskedLM", 7, None),
         ("AlbertForMaskedLM", 7, {"num_hidden_layers": 4, "num_hidden_groups": 2, "inner_group_num": 2})]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,seq,overrides", SPLIT, ids=[f"{c[0]}-{i}" for i, c in enumerate(SPLIT)])
def test_sp_activations_are_split(pool, name, seq, overrides, tp):
    pool.run(sequence_more.sp_activations_are_split, tp, name, seq, overrides)


# the other layouts: ALBERT with several groups and inner layers, T5 with stacks of different depths
VARIANTS = [("AlbertForMaskedLM", 7, {"num_hidden_layers": 4, "num_hidden_groups": 2, "inner_group_num": 2}),
            ("AlbertForSequenceClassification", 5, {"num_hidden_layers": 3}),
            ("T5ForConditionalGeneration", 7, {"num_layers": 3, "num_decoder_layers": 1}),
            ("T5ForConditionalGeneration/v1.1", 3, {"num_layers": 1, "num_decoder_layers": 3}),
            ("WhisperForConditionalGeneration", None, {"max_source_positions": 5, "encoder_layers": 1,
                                                       "decoder_layers": 3})]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,seq,overrides", VARIANTS, ids=[f"{c[0]}-{i}" for i, c in enumerate(VARIANTS)])
def test_sp_variants_equal_unsharded(pool, name, seq, overrides, tp):
    pool.run(sequence_more.sp_equals_unsharded, tp, name, seq, overrides)


@pytest.mark.parametrize("seq", [3, 5])      # 3 < 4 ranks: one holds only padding
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "AlbertForMaskedLM"])
def test_sp_odd_lengths(pool, name, seq):
    pool.run(sequence_more.sp_equals_unsharded, 4, name, seq)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "T5ForQuestionAnswering"])
def test_sp_t5_position_bias_full_length(pool, name, tp):
    shapes = pool.run(sequence_more.t5_position_bias_full_length, tp, name, 7)
    assert all(s["self0"][-2:] == (7, 7) for s in shapes)           # the encoder's bias: full length both ways
    assert all(s["cross1"][-1] == 7 for s in shapes)                # the cross attention's keys: the encoder's


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "T5ForSequenceClassification",
                                  "WhisperForConditionalGeneration", "WhisperForAudioClassification",
                                  "AlbertForMaskedLM", "AlbertForPreTraining"])
def test_sp_eval_with_dropout(pool, name, tp):
    pool.run(sequence_more.sp_eval_with_dropout, tp, name)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "T5ForConditionalGeneration/v1.1",
                                  "WhisperForConditionalGeneration", "WhisperForCausalLM"])
def test_sp_generate(pool, name, tp):
    tokens = pool.run(sequence_more.sp_generate_matches, tp, name)
    assert all(t == tokens[0] for t in tokens)





@pytest.mark.parametrize("name,overrides,what", [
    ("WhisperForConditionalGeneration", {"encoder_layerdrop": 0.1}, "encoder_layerdrop"),
    ("WhisperForConditionalGeneration", {"decoder_layerdrop": 0.1}, "decoder_layerdrop"),
    ("AlbertForMaskedLM", {"chunk_size_feed_forward": 4}, "chunk_size_feed_forward"),
])
def test_sp_refused_by_config(pool, name, overrides, what):
    pool.run(sequence_more.sp_refused_by_config, 2, name, overrides, what)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
def test_sp_gradient_checkpointing(pool, name, use_reentrant):
    pool.run(sequence_more.sp_checkpointing_matches, 2, name, use_reentrant)


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration", "AlbertForMaskedLM"])
def test_sp_training_dropout_masks_differ_per_rank(pool, name):
    pool.run(sequence_more.sp_dropout_masks_differ, 4, name)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "T5EncoderModel", "WhisperForConditionalGeneration",
                                  "AlbertForMaskedLM"])
def test_sp_saves_rows_and_regathers_once_per_block(pool, name, tp):
    pool.run(sequence_more.sp_regathers_in_backward, tp, name)


# enable_sequence_overlap: Whisper's fc1 and ALBERT's ffn gather their rows themselves, in flight;
# T5's blocks gather once for their column layers (q/k/v, wi / wi_0, wi_1), in flight
# (name, config overrides, encoder tokens): odd lengths (Whisper's through max_source_positions), padded inside
OVERLAP = [(n, {"max_source_positions": 7}, None) for n in WHISPER] + [("WhisperForAudioClassification", None, None)] + \
    [(n, None, 7) for n in T5 + ALBERT]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,overrides,seq", OVERLAP, ids=[f"{c[0]}-{i}" for i, c in enumerate(OVERLAP)])
def test_sp_overlap_equals_unsharded(pool, name, overrides, seq, tp):
    results = pool.run(sequence_more.sp_overlap_equals_unsharded, tp, name, overrides, seq)
    assert all(r["overlapped"] > 0 for r in results) or results[0]["backend"] != "shm"


# Mixtral (MoE): test_sp_equals_unsharded above; the load-balancing loss, splits, re-gathers, generate() here

# the load-balancing loss (router logits of the gathered tokens, replicated) in the loss too
@pytest.mark.parametrize("tp", [2, 4])
def test_sp_moe_router_aux_loss(pool, tp):
    pool.run(sequence_more.sp_equals_unsharded, tp, "MixtralForCausalLM", 7,
             {"output_router_logits": True, "router_aux_loss_coef": 0.5})


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_moe_activations_are_split(pool, tp):
    pool.run(sequence.sp_activations_are_split, tp, "MixtralForCausalLM")


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_moe_regathers_once_per_block(pool, tp):
    pool.run(sequence.sp_regathers_in_backward, tp, "MixtralForCausalLM")


def test_sp_moe_generate(pool):
    pool.run(sequence.sp_generate_matches, 4, "MixtralForCausalLM")


def test_sp_moe_eval_with_dropout(pool):
    pool.run(sequence_more.sp_eval_with_dropout, 4, "MixtralForCausalLM")


# (model, a fragment of the policy's reason): MoE routes the gathered tokens
OVERLAP_REFUSED = [("MixtralForCausalLM", "router picks each token's experts"),
                   ("MixtralModel", "router picks each token's experts")]


@pytest.mark.parametrize("name,reason", OVERLAP_REFUSED, ids=[n for n, _ in OVERLAP_REFUSED])
def test_sp_overlap_refused(pool, name, reason):
    pool.run(sequence_more.sp_overlap_refused, 2, name, reason)


@pytest.mark.parametrize("name,seq,overrides", [("T5ForConditionalGeneration", 7, None),
                                                ("WhisperForConditionalGeneration", None, {"max_source_positions": 7}),
                                                ("AlbertForMaskedLM", 7, None), ("MixtralForCausalLM", 7, None)])
def test_sp_bf16_forward(pool, name, seq, overrides):
    pool.run(sequence_more.sp_equals_unsharded, 4, name, seq, overrides, None, "bfloat16")


def test_sp_moe_router_aux_loss_hooks_installed_first(pool):
    pool.run(sequence_more.sp_moe_aux_loss_after_a_forward, 4)


# ---- BEiT, Swin, Swinv2: split-gather over the patch tokens ----

BEIT = ["BeitForImageClassification", "BeitModel", "BeitModel/shared_bias", "BeitForMaskedImageModeling"]
SWIN = ["SwinForImageClassification", "SwinModel", "SwinForMaskedImageModeling"]
# BEiT: 16 patches + [CLS] = 17 tokens at 32 pixels.  Swin at 36 pixels: 9 x 9 = 81 tokens, then 5 x 5 = 25
# after patch merging (odd, padded inside; the 2 x 2 windows padded by Swin itself); its masked image
# modeling reconstructs from one stage (9 x 9 x stride 4 = 36 pixels).
SWIN_ODD = {"SwinForMaskedImageModeling": {"depths": [2], "num_heads": [5], "encoder_stride": 4},
            "Swinv2ForMaskedImageModeling": {"depths": [2], "num_heads": [5], "encoder_stride": 4}}
# Swinv2: the blocks run whole; between them each rank keeps its rows of the 81 (then 25) tokens.  Swinv2Model
# at the zoo's 32 pixels (64, then 16 tokens): at 36 its plain TP=4 gradient of logit_scale is itself 1.3e-5 off
SWINV2 = ["Swinv2ForImageClassification", "Swinv2ForMaskedImageModeling"]
VISION = [(n, None, None) for n in BEIT + ["Swinv2Model"]] + [(n, 36, SWIN_ODD.get(n)) for n in SWIN + SWINV2] + [
    ("SwinForImageClassification", 36, {"depths": [1, 3]}),           # a stage of one block: split and gather
    ("Swinv2ForImageClassification", 36, {"depths": [3, 1]}),         # a middle block; a stage of one (plain TP)
    ("BeitForImageClassification", None, {"layer_scale_init_value": 0.0, "num_hidden_layers": 1})]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,image,overrides", VISION, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(VISION)])
def test_sp_vision_windows_and_bias_equal_unsharded(pool, name, image, overrides, tp):
    reports = pool.run(sequence_more.sp_vision_equals_unsharded, tp, name, image, overrides)
    assert reports[0]["rows"] != reports[0]["tokens"]          # the blocks ran on rows


# enable_sequence_overlap on the windowed blocks (layer/window_overlap.py): q/k/v of the whole map computed
# while its rows are gathered, then cut into the block's (padded, shifted) windows.  Swin gathers every
# block's layernorm_before output, Swinv2 the input of every block but a stage's first (post-norm, whole
# blocks); each gather is one overlapped pass per forward (two) and backward (one).  36 pixels: 81 then
# 25 tokens, uneven over 2 and 4 ranks, padded to 2 x 2 windows inside the blocks; 5 / 10 heads.
WINDOW_OVERLAP = [(n, 36, SWIN_ODD.get(n)) for n in SWIN + SWINV2] + [("Swinv2Model", None, None)]


def _gathers(name: str, overrides) -> int:
    depths = (overrides or {}).get("depths", [2, 2])
    return sum(depths) if name.startswith("Swin") and not name.startswith("Swinv2") else sum(d - 1 for d in depths)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,image,overrides", WINDOW_OVERLAP, ids=[c[0] for c in WINDOW_OVERLAP])
def test_sp_window_overlap_equals_unsharded(pool, name, image, overrides, tp):
    reports = pool.run(sequence_more.sp_vision_equals_unsharded, tp, name, image, overrides, None, True)
    for r in reports:
        assert r["unused"] == 0, (name, r)
        if r["backend"] == "shm":
            assert r["overlapped"] == 3 * _gathers(name, overrides), (name, r)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_vision_beit_interpolated_bias(pool, tp):
    # 40 pixels: 25 patches + [CLS]; the 4 x 4 tables interpolated to 5 x 5, the bias to the full 26 tokens
    pool.run(sequence_more.sp_vision_equals_unsharded, tp, "BeitForImageClassification", 40, {"image_size": 32},
             {"interpolate_pos_encoding": True})


@pytest.mark.parametrize("name,mode,overlap", [
    ("BeitForImageClassification", "all_to_all", False), ("BeitForImageClassification", "ring_attn", False),
    ("SwinForImageClassification", "all_to_all", False), ("SwinForImageClassification", "ring_attn", False),
    # enable_sequence_overlap on Swin / Swinv2: test_sp_window_overlap_equals_unsharded
    ("Swinv2ForMaskedImageModeling", "all_to_all", False), ("Swinv2ForImageClassification", "ring_attn", False)])
def test_sp_vision_modes_refused(pool, name, mode, overlap):
    pool.run(sequence_more.sp_mode_refused_unchanged, 2, name, mode, overlap)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["BeitForMaskedImageModeling", "SwinForImageClassification",
                                  "Swinv2ForImageClassification"])
def test_sp_vision_eval_with_dropout(pool, name, tp):
    pool.run(sequence_more.sp_eval_with_dropout, tp, name)


# ---- output_hidden_states=True under every mode: the full-sequence states of the unsharded model ----

HIDDEN = [("LlamaForCausalLM", 7), ("BertForMaskedLM", 7), ("ViTForImageClassification", None)]
SP_MODES = ["split_gather", "all_to_all", "ring_attn"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", SP_MODES)
@pytest.mark.parametrize("name,seq", HIDDEN, ids=[c[0] for c in HIDDEN])
def test_sp_recorded_hidden_states_equal_unsharded(pool, name, seq, mode, tp):
    pool.run(sequence_more.recorded_hidden_states_equal, tp, name, mode, seq)


@pytest.mark.parametrize("mode", SP_MODES)
def test_sp_recorded_hidden_states_tuple_output(pool, mode):
    pool.run(sequence_more.recorded_hidden_states_equal, 4, "LlamaForCausalLM", mode, 5, False)


# all_to_all / ring_attn with shared layers (ALBERT: every application recorded) and both stacks of an
# encoder-decoder (T5, Whisper: encoder_hidden_states and decoder_hidden_states)
HIDDEN_ENC_DEC = [("AlbertForMaskedLM", 7), ("T5ForConditionalGeneration", 7), ("WhisperForConditionalGeneration", None)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
@pytest.mark.parametrize("name,seq", HIDDEN_ENC_DEC, ids=[c[0] for c in HIDDEN_ENC_DEC])
def test_sp_recorded_hidden_states_encoder_decoder(pool, name, seq, mode, tp):
    pool.run(sequence_more.recorded_hidden_states_equal, tp, name, mode, seq)


# split_gather in the other layouts: row layers that reduce-scatter themselves (GPT-2, GPT-J, OPT, BLOOM,
# Falcon), both stacks of T5 and Whisper (encoder_hidden_states and decoder_hidden_states), ALBERT's
# shared layers (every call recorded; also 2 groups of 2 layers)
HIDDEN_SPLIT_GATHER = [("GPT2LMHeadModel", 7, None), ("GPTJForCausalLM", 7, None), ("OPTForCausalLM", 7, None),
                       ("BloomForCausalLM", 7, None), ("FalconForCausalLM", 7, None),
                       ("T5ForConditionalGeneration", 7, None), ("MixtralForCausalLM", 7, None),
                       ("AlbertForMaskedLM", 7, None),
                       ("AlbertForPreTraining", 7, {"num_hidden_layers": 4, "num_hidden_groups": 2,
                                                    "inner_group_num": 2}),
                       ("WhisperForConditionalGeneration", None, {"max_source_positions": 7})]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,seq,overrides", HIDDEN_SPLIT_GATHER, ids=[c[0] for c in HIDDEN_SPLIT_GATHER])
def test_sp_recorded_hidden_states_split_gather_layouts(pool, name, seq, overrides, tp):
    pool.run(sequence_more.recorded_hidden_states_equal, tp, name, "split_gather", seq, True, overrides)


# the vision models' recorded states: BEiT's layers (semantic segmentation reads four of them), Swin's stages
# (full between stages) and its reshaped_hidden_states, at odd token counts
HIDDEN_VISION = [("BeitForImageClassification", None), ("SwinForImageClassification", None), ("SwinModel", None)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,overrides", HIDDEN_VISION, ids=[c[0] for c in HIDDEN_VISION])
def test_sp_recorded_hidden_states_vision(pool, name, overrides, tp):
    pool.run(sequence_more.recorded_hidden_states_equal, tp, name, "split_gather", None, True, overrides)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_beit_segmentation_reads_recorded_states(pool, tp):
    pool.run(sequence.sp_equals_unsharded, tp, "BeitForSemanticSegmentation")


@pytest.mark.parametrize("name", ["BeitForImageClassification", "SwinForImageClassification"])
def test_sp_vision_with_all_optimizations(pool, name):
    pool.run(sequence.sp_equals_unsharded, 2, name, None, {"enable_all_optimization": True})


# output_attentions under all_to_all (eager): the weights of every head over the whole sequence
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name,seq", HIDDEN, ids=[c[0] for c in HIDDEN])
def test_sp_all_to_all_recorded_attentions_equal_unsharded(pool, name, seq, sp):
    pool.run(sequence_more.recorded_attentions_equal, sp, name, seq)


# training with live dropout: the dropouts on rows (and Swin's on the all-reduced windows) draw a mask per rank
@pytest.mark.parametrize("name", ["BeitForImageClassification", "SwinForImageClassification"])
def test_sp_vision_training_dropout_masks_differ_per_rank(pool, name):
    pool.run(sequence.sp_dropout_masks_differ, 4, name)


# without live dropout: BeitLayer and SwinLayer call their one `dropout` module twice per forward, and the
# seeded dropouts replay recomputed masks most recent first (shardformer.layer.dropout), so live dropout
# under checkpointing would swap the two masks of a layer (with or without SP)
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", ["BeitForImageClassification", "SwinForImageClassification"])
def test_sp_vision_gradient_checkpointing(pool, name, use_reentrant):
    pool.run(sequence.sp_checkpointing_matches, 2, name, use_reentrant, 0.0)


# padded batches (every mode), enable_sequence_overlap (split_gather), generate() (split_gather: one-token steps)
@pytest.mark.parametrize("mode", SP_MODES)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM"])
def test_sp_recorded_hidden_states_padded_batch(pool, name, mode):
    pool.run(sequence_more.recorded_hidden_states_equal, 4, name, mode, 7, True, None, True)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM", "GPT2LMHeadModel"])
def test_sp_recorded_hidden_states_with_overlap(pool, name):
    pool.run(sequence_more.recorded_hidden_states_equal, 4, name, "split_gather", 7, True, None, False, True)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_generate_recorded_hidden_states(pool, tp):
    pool.run(sequence_more.generate_hidden_states_equal, tp, "LlamaForCausalLM")


# Whisper's audio classification with use_weighted_layer_sum: the weighted sum of the encoder's recorded
# (gathered) hidden states
@pytest.mark.parametrize("tp", [2, 4])
def test_sp_whisper_weighted_layer_sum(pool, tp):
    pool.run(sequence_more.sp_equals_unsharded, tp, "WhisperForAudioClassification", None,
             {"use_weighted_layer_sum": True, "max_source_positions": 7})
