"""Hybrid parallelism on 4 ranks: shardformer.mesh's groups and rank order,
DP=2 x TP=2 training with torch's DDP (and ZeRO-1) equal to the unsharded
model for three AdamW steps, two simulated hosts (TP on shared memory, DP
through torch.distributed), and clip_grad_norm_ equal to torch's on the
unsharded model at TP=2 and 4 and TP=2 x PP=2."""
import math

import pytest

from checks import hybrid as check


@pytest.mark.parametrize("dp, pp, tp, sp", [(2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2), (2, 2, 1, 1), (4, 1, 1, 1),
                                            (1, 1, 4, 1)])
def test_mesh_layout(pool, dp, pp, tp, sp):
    pool.run(check.layout, 4, dp, pp, tp, sp)


def test_mesh_refusals(pool):
    messages = pool.run(check.refusals, 4)[0]
    assert "does not divide the world size 4" in messages[0] or "world has 4" in messages[0], messages
    assert any("tp must be an int >= 1" in m for m in messages), messages


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_dp_tp_ddp(pool, name, optimizer):
    pool.run(check.dp_tp_training, 4, name, optimizer=optimizer)


def test_dp_tp_zero1_clipped(pool):
    reports = pool.run(check.dp_tp_training, 4, "LlamaForCausalLM", True, 0.5)
    assert all(r["zero_state_params"] > 0 for r in reports)


def test_two_simulated_hosts(pool):
    reports = pool.run(check.dp_tp_training, 4, "LlamaForCausalLM", False, None, 2, True)
    assert all(r["backends"] == {"tp": "shm", "dp": "torch"} for r in reports)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "MixtralForCausalLM"])
def test_clip_grad_norm_tp(pool, name, tp, norm_type):
    pool.run(check.norm_equals_torch, tp, name, norm_type)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "LlamaForCausalLM", "T5ForConditionalGeneration",
                                  "WhisperForConditionalGeneration"])
def test_clip_grad_norm_tp_pp(pool, name):
    pool.run(check.norm_tp_pp, 4, name)


def test_clip_grad_norm_pp4_tied_over_three_stages(pool):
    """T5 at PP=4: shared (stage 0), decoder.embed_tokens (stage 2) and lm_head (stage 3) are one Parameter."""
    pool.run(check.norm_tp_pp, 4, "T5ForConditionalGeneration", 4, 1)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_autocast_bf16(pool, name):
    pool.run(check.autocast_bf16, 2, name)


def test_fp16_scaler_skips_on_every_rank(pool):
    scales = [r["scale"] for r in pool.run(check.scaler_skips_together, 2)]
    assert scales[0] == scales[1] < 1024.0, scales


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_dp_pp_average_gradients(pool, name):
    """A pipelined model (no DDP: the schedule drives it) averaged over DP by average_gradients."""
    pool.run(check.dp_pp_training, 4, name)


def test_dp_sp_ddp(pool):
    """DP=2 x SP=2 (all_to_all): the SP layers sum their gradients over .sp, DDP averages over .dp."""
    pool.run(check.dp_tp_training, 4, "LlamaForCausalLM", optimizer="sgd", sp=2)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_dp_tp(pool):
    pool.run(check.fsdp2_dp_tp, 4)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_tp_pp_three_steps(pool, name, optimizer):
    pool.run(check.tp_pp_training, 4, name, optimizer=optimizer)
