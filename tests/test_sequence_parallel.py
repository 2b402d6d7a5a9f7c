"""Split-gather sequence parallelism (ShardConfig(enable_sequence_parallelism=True)):
the Llama-shaped decoders, GPT-2, GPT-Neo, GPT-J, OPT, BLOOM, Falcon and the
BERT-shaped encoders (BERT, RoBERTa with and without cross attention, ERNIE)
equal the unsharded model (forward, loss, every gradient, after an optimizer
step) at TP=2 and 4, with sequence lengths that do not divide the group
(padded inside); activations between blocks hold 1/tp of the rows; eval()
with dropout > 0 equal too, and in training the dropouts on split rows draw
a mask per rank; generate() and gradient checkpointing unchanged;
enable_sequence_overlap (collectives in flight during the matmuls) equal as
well; the modes, families and configurations not available are refused by
name."""
import pytest
import torch

from checks import sequence

FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma3ForCausalLM", "GlmForCausalLM",
            "LlamaForSequenceClassification", "LlamaModel", "Qwen2ForTokenClassification", "MistralForQuestionAnswering",
            # row layers with a bias and residual dropouts inside the blocks: the row layer reduce-scatters
            "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification", "GPT2DoubleHeadsModel",
            "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification", "BertModel",
            "BertLMHeadModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "ErnieForMaskedLM",
            "RobertaForCausalLM/cross", "ErnieModel", "GPTNeoForCausalLM", "GPTNeoForTokenClassification",
            "GPTJForCausalLM", "OPTForCausalLM", "OPTForSequenceClassification", "OPTForQuestionAnswering",
            "BloomForCausalLM", "BloomForTokenClassification", "FalconForCausalLM",
            "GPT2Model", "GPT2ForQuestionAnswering", "BertForPreTraining", "BertForMultipleChoice",
            "BertForQuestionAnswering", "RobertaForTokenClassification", "GPTJForSequenceClassification",
            "BloomForQuestionAnswering", "FalconForSequenceClassification", "OPTModel"]

# (model, config overrides): the other layouts of the families above
VARIANTS = [
    # ln_attn / ln_mlp
    ("FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2, multi_query=False)),
    # sequential attention and MLP, with biases
    ("FalconForCausalLM", dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=6, bias=True,
                               parallel_attn=False)),
    ("OPTForCausalLM", dict(do_layer_norm_before=False, word_embed_proj_dim=48)),      # OPT-350m: post-norm
    ("BloomForCausalLM", dict(apply_residual_connection_post_layernorm=True)),
    ("GPT2LMHeadModel", dict(n_layer=1)),                                             # split and gather on one block
    ("BertForMaskedLM", dict(num_hidden_layers=3)),
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_sp_equals_unsharded(pool, name, tp):
    reports = pool.run(sequence.sp_equals_unsharded, tp, name, 7)      # 7 tokens: padded to 8 inside
    assert all(r["seq"] == 7 for r in reports), reports   # multiple choice's [batch, choices, S] too


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,overrides", VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)])
def test_sp_variants_equal_unsharded(pool, name, overrides, tp):
    pool.run(sequence.sp_equals_unsharded, tp, name, 7, None, overrides)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["ViTForImageClassification", "ViTModel", "ViTForMaskedImageModeling"])
def test_sp_vision_equals_unsharded(pool, name, tp):
    pool.run(sequence.sp_equals_unsharded, tp, name)      # the patch tokens and [CLS]: padded inside


@pytest.mark.parametrize("seq", [2, 3, 5, 6])   # 2, 3 < 4 ranks: some hold only padding
def test_sp_odd_lengths(pool, seq):
    pool.run(sequence.sp_equals_unsharded, 4, "LlamaForCausalLM", seq)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "BloomForCausalLM",
                                  "OPTForCausalLM"])
def test_sp_with_all_optimizations(pool, name):
    pool.run(sequence.sp_equals_unsharded, 2, name, None, {"enable_all_optimization": True})


# one of each kind of block: partial sums out of the block (Llama), row layers that
# reduce-scatter themselves in a decoder (GPT-2, GPT-J's parallel block) and in an encoder (BERT)
# and in OPT (whose MLP rows are flattened: fc1 gathers them itself) and BLOOM (dropout_add moved into the row layers)
KINDS = ["LlamaForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM", "BertForMaskedLM", "OPTForCausalLM",
         "BloomForCausalLM"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", KINDS)
def test_sp_activations_are_split(pool, name, tp):
    pool.run(sequence.sp_activations_are_split, tp, name)


@pytest.mark.parametrize("seq", [3, 5])   # 3 < 4 ranks: one holds only padding
@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForMaskedLM"])
def test_sp_odd_lengths_biased_rows(pool, name, seq):
    pool.run(sequence.sp_equals_unsharded, 4, name, seq)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForSequenceClassification", "RobertaForMaskedLM",
                                  "GPTNeoForCausalLM", "OPTForCausalLM", "BloomForCausalLM",
                                  "ViTForImageClassification"])
def test_sp_eval_with_dropout(pool, name, tp):
    pool.run(sequence.sp_eval_with_dropout, tp, name)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForMaskedLM", "OPTForCausalLM", "BloomForCausalLM",
                                  "ViTForImageClassification"])
def test_sp_training_dropout_masks_differ_per_rank(pool, name):
    pool.run(sequence.sp_dropout_masks_differ, 4, name)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "GPTNeoForCausalLM", "GPTJForCausalLM",
                                  "BertLMHeadModel", "OPTForCausalLM", "BloomForCausalLM", "FalconForCausalLM"])
def test_sp_generate(pool, name):
    pool.run(sequence.sp_generate_matches, 2, name)


def test_sp_refused_where_not_implemented():
    import zoo
    from shardformer import ShardConfig, ShardFormer

    # T5, Whisper, ALBERT, Mixtral, BEiT, Swin, Swinv2: tests/test_sequence_parallel_more.py.  Swinv2's
    # windowed blocks take split_gather (and its overlap: test_sp_window_overlap_equals_unsharded), not
    # the modes that split attention
    for name in ("Swinv2ForImageClassification",):
        model = zoo.build(name)
        with pytest.raises(NotImplementedError, match="'all_to_all' is not available for.*windows"):
            ShardFormer(ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all",
                                    enable_tensor_parallelism=False)).optimize(model)


@pytest.mark.parametrize("name,overrides,what", [
    ("BertForMaskedLM", dict(chunk_size_feed_forward=4), "chunk_size_feed_forward"),
    ("OPTForCausalLM", dict(layerdrop=0.1), "layerdrop"),
    ("FalconForCausalLM", dict(hidden_dropout=0.1), "hidden_dropout"),
])
def test_sp_refused_by_config(name, overrides, what):
    import zoo
    from shardformer import ShardConfig, ShardFormer

    model = zoo.build(name, **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotImplementedError, match=f"{name}.*split_gather.*{what}"):
        ShardFormer(ShardConfig(enable_sequence_parallelism=True)).optimize(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", KINDS + ["RobertaForCausalLM/cross"])
def test_sp_saves_rows_and_regathers_once_per_block(pool, name, tp):
    pool.run(sequence.sp_regathers_in_backward, tp, name)


# enable_sequence_overlap: the MLP's up projection (and GPT-2's c_attn) gathers its rows itself,
# all-gather in flight during the local rows' matmul, reduce-scatter of dX during dW
OVERLAP = ["GPT2LMHeadModel", "BertForMaskedLM", "OPTForCausalLM", "BloomForCausalLM", "GPTNeoForCausalLM",
           "FalconForCausalLM", "RobertaForCausalLM/cross", "RobertaForMaskedLM", "ErnieForMaskedLM",
           "GPTJForCausalLM", "BertModel", "BertForSequenceClassification", "BertLMHeadModel",
           "RobertaForSequenceClassification", "ErnieModel", "GPT2ForSequenceClassification",
           "GPTJForSequenceClassification", "OPTForSequenceClassification", "BloomForTokenClassification",
           "GPTNeoForTokenClassification", "FalconForSequenceClassification",
           "BertForNextSentencePrediction", "BertForPreTraining", "BertForQuestionAnswering", "BertForTokenClassification",
           "ErnieForCausalLM", "ErnieForNextSentencePrediction", "ErnieForPreTraining", "ErnieForQuestionAnswering",
           "ErnieForSequenceClassification", "ErnieForTokenClassification", "RobertaForQuestionAnswering",
           "RobertaForTokenClassification", "RobertaModel", "GPT2ForQuestionAnswering", "GPT2ForTokenClassification",
           "GPT2Model", "GPTNeoForQuestionAnswering", "GPTNeoForSequenceClassification", "GPTNeoModel",
           "GPTJForQuestionAnswering", "GPTJModel", "OPTForQuestionAnswering", "OPTModel", "BloomForQuestionAnswering",
           "BloomForSequenceClassification", "BloomModel", "FalconForQuestionAnswering", "FalconForTokenClassification",
           "FalconModel", "RobertaForCausalLM", "BertForMultipleChoice", "ErnieForMultipleChoice",
           "RobertaForMultipleChoice", "GPT2DoubleHeadsModel"]
# the vision encoders (their mlp's up projection gathers): the patch tokens and [CLS], padded inside.
# (BeitForSemanticSegmentation's decode head reads hidden_states[i - 1] for i in out_indices = [1..4], not the
# last layer's output: the check counts that layer's two forwards and no backward, as in the unsharded model)
OVERLAP_VISION = ["ViTForImageClassification", "ViTForMaskedImageModeling", "ViTModel", "BeitForImageClassification",
                  "BeitModel", "BeitForMaskedImageModeling", "BeitForSemanticSegmentation"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", OVERLAP + OVERLAP_VISION)
def test_sp_overlap_equals_unsharded(pool, name, tp):
    results = pool.run(sequence.sp_overlap_equals_unsharded, tp, name, None if name in OVERLAP_VISION else 7)
    assert all(r["overlapped"] > 0 for r in results) or results[0]["backend"] != "shm"


@pytest.mark.parametrize("seq", [3, 5])
def test_sp_overlap_odd_lengths(pool, seq):
    pool.run(sequence.sp_overlap_equals_unsharded, 4, "GPT2LMHeadModel", seq)


# Llama-shaped: each block's pre-hook gathers the input once, overlapped with the q/k/v (gate/up, or the
# fused qkv / gate_up) matmuls of this rank's rows, and hands the module the gathered sequence
OVERLAP_DECODERS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "GlmForCausalLM",
                    "Gemma3ForCausalLM", "LlamaForSequenceClassification", "Qwen2ForTokenClassification",
                    "GemmaForSequenceClassification", "Qwen3ForSequenceClassification", "Phi3ForTokenClassification",
                    "MistralForTokenClassification", "Gemma2ForSequenceClassification", "GlmForTokenClassification",
                    "Gemma3TextModel", "LlamaModel", "LlamaForQuestionAnswering", "LlamaForTokenClassification",
                    "Qwen2Model", "Qwen2ForQuestionAnswering", "Qwen2ForSequenceClassification", "Qwen3Model",
                    "Qwen3ForQuestionAnswering", "Qwen3ForTokenClassification", "GemmaModel", "GemmaForTokenClassification",
                    "Gemma2Model", "Gemma2ForTokenClassification", "GlmModel", "GlmForSequenceClassification", "Phi3Model",
                    "Phi3ForSequenceClassification", "MistralModel", "MistralForQuestionAnswering",
                    "MistralForSequenceClassification", "Gemma3TextForSequenceClassification"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", OVERLAP_DECODERS)
def test_sp_overlap_decoders_equal_unsharded(pool, name, tp):
    results = pool.run(sequence.sp_overlap_equals_unsharded, tp, name, 7, 2)
    assert all(r["overlapped"] > 0 for r in results) or results[0]["backend"] != "shm"


@pytest.mark.parametrize("seq", [3, 5])
def test_sp_overlap_decoder_odd_lengths(pool, seq):
    pool.run(sequence.sp_overlap_equals_unsharded, 4, "LlamaForCausalLM", seq, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_overlap_decoder_regathers_once_per_block(pool, tp):
    pool.run(sequence.sp_regathers_in_backward, tp, "LlamaForCausalLM", True)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "OPTForCausalLM", "LlamaForCausalLM", "Phi3ForCausalLM"])
def test_sp_overlap_generate(pool, name):
    pool.run(sequence.sp_generate_matches, 4, name, True)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "OPTForCausalLM"])
def test_sp_gradient_checkpointing(pool, name, use_reentrant):
    pool.run(sequence.sp_checkpointing_matches, 2, name, use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_sp_overlap_decoder_gradient_checkpointing(pool, use_reentrant):
    pool.run(sequence.sp_checkpointing_matches, 2, "LlamaForCausalLM", use_reentrant, 0.2, True)


# every family records full hidden states (tests/test_sequence_parallel_more.py); a policy that does not
# mark its layers' rows refuses them, in the call and in the config
@pytest.mark.parametrize("name", ["BertForMaskedLM", "LlamaForCausalLM"])
def test_sp_hidden_states_refused(pool, name):
    pool.run(sequence.sp_hidden_states_refused, 2, name)


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("tp,seq", [(2, 7), (4, 7), (4, 3), (4, 8)])
def test_sp_linear_layers(pool, tp, seq, overlap, conv1d):
    pool.run(sequence.sp_linear_layers, tp, seq, overlap, conv1d)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "OPTForCausalLM",
                                  "BloomForCausalLM"])
def test_sp_bf16_forward(pool, name):
    pool.run(sequence.sp_equals_unsharded, 4, name, 7, None, None, "bfloat16")
