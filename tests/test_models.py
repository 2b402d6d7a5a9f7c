"""Every built-in policy class, sharded at TP=2 and TP=4, against the
unsharded HuggingFace model from the same seed (fp32; bf16 forward)."""
import pytest

import model_check
import model_zoo

NAMES = sorted(model_zoo.MODELS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_backward_step(pool, name, tp):
    reports = pool.run(model_check.check_model, tp, name)
    assert all(r["tp"] == tp for r in reports)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_bf16_forward(pool, name):
    pool.run(model_check.check_model, 2, name, "bfloat16")


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_fused_normalization(pool, name):
    pool.run(model_check.check_model, 2, name, config={"enable_fused_normalization": True})
