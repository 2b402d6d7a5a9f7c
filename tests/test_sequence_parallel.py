"""Split-gather sequence parallelism (ShardConfig(enable_sequence_parallelism=True)):
the Llama-shaped decoder families equal the unsharded model (forward, loss,
every gradient, after an optimizer step) at TP=2 and 4, with sequence lengths
that do not divide the group (padded inside); activations between blocks hold
1/tp of the rows; generate() unchanged; the modes and families not available
are refused by name."""
import pytest

from checks import sequence

FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma3ForCausalLM", "GlmForCausalLM",
            "LlamaForSequenceClassification", "LlamaModel", "Qwen2ForTokenClassification", "MistralForQuestionAnswering"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_sp_equals_unsharded(pool, name, tp):
    pool.run(sequence.sp_equals_unsharded, tp, name, 7)      # 7 tokens: padded to 8 inside


@pytest.mark.parametrize("seq", [2, 3, 5, 6])   # 2, 3 < 4 ranks: some hold only padding
def test_sp_odd_lengths(pool, seq):
    pool.run(sequence.sp_equals_unsharded, 4, "LlamaForCausalLM", seq)


def test_sp_with_all_optimizations(pool):
    pool.run(sequence.sp_equals_unsharded, 2, "LlamaForCausalLM", None, {"enable_all_optimization": True})


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_activations_are_split(pool, tp):
    pool.run(sequence.sp_activations_are_split, tp, "LlamaForCausalLM")


def test_sp_generate(pool):
    pool.run(sequence.sp_generate_matches, 2, "LlamaForCausalLM")


def test_sp_refused_where_not_implemented():
    import zoo
    from shardformer import ShardConfig, ShardFormer

    for name in ("MixtralForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"):
        model = zoo.build(name)
        with pytest.raises(NotImplementedError, match="split_gather.*not available for"):
            ShardFormer(ShardConfig(enable_sequence_parallelism=True)).optimize(model)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_saves_rows_and_regathers_once_per_block(pool, tp):
    pool.run(sequence.sp_regathers_in_backward, tp, "LlamaForCausalLM")
