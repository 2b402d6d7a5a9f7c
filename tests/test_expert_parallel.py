"""Expert parallelism (shardformer.layer.expert_parallel) on 4 ranks: the
experts of Mixtral (built-in family) and OLMoE (derived plan with
transformers' ep_router entries) split over an EP group inside the DP group,
tokens dispatched by all_to_all; one training step with
shardformer.data_parallel equal to the unsharded model on the concatenated
batch (loss, every gradient, the clipped norm, the weights after the step,
the state dict gathered over TP and EP),
uneven expert counts, EP = DP and EP < DP, and the refusals."""
from __future__ import annotations

import pytest

import transformers

from checks import expert_parallel as check

# OLMoE's expert-parallel plan (ep_router and the grouped_gemm experts), where this transformers has one
OLMOE_EP = pytest.mark.skipif(not getattr(getattr(transformers, "OlmoeConfig", None), "base_model_ep_plan", None),
                              reason=f"transformers {transformers.__version__}: OlmoeConfig has no base_model_ep_plan")
CASES = [
    # arch, dp, tp, ep, experts
    ("mixtral", 2, 2, 2, None),      # 3 experts over 2 EP ranks: 2 and 1, each split over TP=2
    ("mixtral", 4, 1, 4, 5),         # 5 experts over 4: 2, 1, 1, 1
    ("mixtral", 4, 1, 2, 5),         # EP < DP: expert gradients summed over expert_dp
    pytest.param("olmoe", 2, 2, 2, 5, marks=OLMOE_EP),
    pytest.param("olmoe", 4, 1, 4, 4, marks=OLMOE_EP),
]


@pytest.mark.parametrize("arch, dp, tp, ep, experts", CASES)
def test_training_step(pool, tmp_path, arch, dp, tp, ep, experts):
    """One step per layout (checks.expert_parallel.training), then save_pretrained, which plain
    transformers loads back equal to the unsharded model after the same step."""
    reports = pool.run(check.training, 4, arch, dp, tp, ep, experts, save_to=str(tmp_path / "saved"))
    assert all(r["exchanges"] > 0 for r in reports)
    # every EP group (4 / ep of them: one per TP rank and expert_dp replica) holds each expert once
    assert sum(r["experts_here"] for r in reports) == (experts or 3) * 4 // ep, reports


def test_eval_mode_with_dropout_adamw_rank0_gather(pool):
    pool.run(check.training, 4, "mixtral", 2, 2, 2, 5, mode="eval", optimizer="adamw", rank0_only=True)


@pytest.mark.parametrize("dp, tp, ep", [(4, 1, 2), (2, 2, 2)])
def test_average_gradients_with_mesh(pool, dp, tp, ep):
    """Without DDP: average_gradients(model, mesh) gives the same gradients."""
    pool.run(check.training, 4, "mixtral", dp, tp, ep, 5, via="average")


@OLMOE_EP
def test_data_parallel_with_the_dp_group(pool):
    """EP = the whole DP group: data_parallel(model, mesh.dp) needs no mesh."""
    pool.run(check.training, 4, "olmoe", 4, 1, 4, 5, via="ddp_group")


@pytest.mark.parametrize("dp, tp, ep", [(2, 2, 2), (4, 1, 4)])
def test_lazy_init_equals_eager(pool, dp, tp, ep):
    pool.run(check.lazy_equals_eager, 4, dp, tp, ep, 5)


def test_refusals(pool):
    messages = pool.run(check.refusals, 4)[0]
    assert any("pipeline_stage_manager" in m and "expert_parallel_process_group" in m and "share ranks [0, 1, 2, 3]"
               in m for m in messages), messages
    assert any("sequence parallelism" in m for m in messages), messages


def test_average_gradients_plain_group_refused(pool):
    pool.run(check.plain_group_needs_mesh, 4)


@pytest.mark.parametrize("dp, tp, ep", [(4, 1, 2), (4, 1, 4), (2, 2, 2), (2, 2, 1)])
def test_mesh_groups(pool, dp, tp, ep):
    pool.run(check.mesh_groups, 4, dp, tp, ep)
