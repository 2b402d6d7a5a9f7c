"""ShardConfig(sequence_parallel_recompute="selective") with split-gather
sequence parallelism: the Llama-shaped decoders keep fewer activations for
backward (the norms' x_hat and outputs, the gated MLP's activation and
product are recomputed there from tensors saved anyway) and give bit-for-bit
the same outputs, gradients and state after one optimizer step as without it
(and so equal the unsharded model) at TP=2 and 4, odd lengths, eval() with
dropout > 0 and train() with dropout; the recipes are saved and rerun (counted),
and the heap kept from forward to backward drops by what they leave out;
gradient checkpointing takes precedence; other policies and modes refuse it."""
import pytest

from checks import sequence, sequence_recompute

DECODERS = ["LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GlmForCausalLM",
            "MixtralForCausalLM", "LlamaForSequenceClassification"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", DECODERS)
def test_sp_recompute_bit_exact(pool, name, tp):
    result = pool.run(sequence_recompute.recompute_bit_exact, tp, name, 7)[0]
    if name.startswith("Llama"):     # per layer: both norms' x_hat, the SiLU output, the SwiGLU product
        assert result["packed"] == 4 * result["layers"], result


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("seq", [5, 9, 13])
def test_sp_recompute_odd_lengths(pool, tp, seq):
    pool.run(sequence_recompute.recompute_bit_exact, tp, "LlamaForCausalLM", seq)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("train", [False, True])
def test_sp_recompute_with_dropout(pool, tp, train):
    pool.run(sequence_recompute.recompute_bit_exact, tp, "LlamaForCausalLM", 7, 0.3, train)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM"])
def test_sp_recompute_overlap_bit_exact(pool, name, tp):
    pool.run(sequence_recompute.recompute_bit_exact, tp, name, 7, 0.0, True, None, True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_sp_recompute_equals_unsharded(pool, name, tp):
    pool.run(sequence.sp_equals_unsharded, tp, name, 7, {"sequence_parallel_recompute": "selective"})


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_recompute_saves_memory(pool, tp):
    pool.run(sequence_recompute.recompute_saves_memory, tp)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_sp_recompute_under_checkpointing(pool, use_reentrant):
    pool.run(sequence_recompute.recompute_off_under_checkpointing, 2, "LlamaForCausalLM", use_reentrant)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForMaskedLM", "T5ForConditionalGeneration",
                                  "Blip2ForConditionalGeneration", "Gemma3ForConditionalGeneration"])
def test_sp_recompute_refused_by_policy(pool, name):
    pool.run(sequence_recompute.recompute_refused, 2, name)


@pytest.mark.parametrize("overrides,what", [
    (dict(), "applies to split_gather"),
    (dict(enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all", enable_tensor_parallelism=False),
     "applies to split_gather"),
    (dict(enable_sequence_parallelism=True, sequence_parallel_recompute="full"), "one of"),
])
def test_sp_recompute_refused_by_config(overrides, what):
    from shardformer import ShardConfig

    kwargs = {"sequence_parallel_recompute": "selective", **overrides}
    with pytest.raises(ValueError, match=what):
        ShardConfig(**kwargs)
