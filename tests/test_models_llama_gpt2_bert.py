"""Llama, GPT-2 and BERT (the models of zoo.llama_gpt2_bert): every class
sharded at TP=2 and TP=4 against the unsharded HuggingFace model from the
same seed (fp32; bf16 forward; fused normalization), greedy generate()
equality with the KV cache holding this rank's heads, and the full state dict
round trip."""
import pytest

from checks import checkpoints, parity
from zoo import llama_gpt2_bert

NAMES = sorted(llama_gpt2_bert.MODELS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_backward_step(pool, name, tp):
    reports = pool.run(parity.check_model, tp, name)
    assert all(r["tp"] == tp for r in reports)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_bf16_forward(pool, name):
    pool.run(parity.check_model, 2, name, "bfloat16")


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_fused_normalization(pool, name):
    pool.run(parity.check_model, 2, name, config={"enable_fused_normalization": True})


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_generate_matches_unsharded(pool, name, tp):
    results = pool.run(parity.generate_matches, tp, name)
    assert all(r["tokens"] == results[0]["tokens"] for r in results)
    assert results[0]["local_kv_heads"] < (2 if name.startswith("Llama") else 6) or tp == 4


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForPreTraining"])
def test_state_dict_round_trip(pool, name, tp):
    pool.run(checkpoints.state_dict_round_trip, tp, name)
