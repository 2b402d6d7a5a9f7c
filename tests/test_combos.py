"""Modes combined on one world, each against the unsharded model from the same
seed (tests/checks/combos.py): loss, last-stage outputs and every gradient at
each of 2 SGD steps, then the gathered state dict.

TP=2 x SP=2 x PP=2 on 8 ranks (shardformer.mesh(pp=2, sp=2, tp=2)): all_to_all
and ring_attn attention inside pipeline stages whose weights are also split
over TP, on Llama and Qwen2 (tied embeddings across the stages, biased q/k/v),
under 1F1B and GPipe (and zero-bubble ZB-V: two chunks per stage), 3 layers
over 2 stages, 7 tokens over 2 SP ranks, 3 query heads per TP rank over 2 SP
ranks, and packed documents (restarting position_ids, no mask).

EP x PP: Mixtral's experts over the expert-parallel group and its layers over
2 stages, each pipeline on its own rows: EP=2 x PP=2 on 4 ranks (1F1B), and
EP=2 x PP=2 x TP=2 on 8 (1F1B and ZB-H1).  EP peers running other schedules
raise naming the ranks.

The 8-rank cases share one pool call: an 8-rank pool on a 2-core machine is
the expensive part, each case about a second after it."""
import pytest

from checks import combos as check

# Each family under both modes, each mode under both schedules, packed documents under each mode.
TP_SP_PP = [("LlamaForCausalLM", "all_to_all", "1f1b", None), ("LlamaForCausalLM", "ring_attn", "gpipe", None),
            ("Qwen2ForCausalLM", "all_to_all", "gpipe", None), ("Qwen2ForCausalLM", "ring_attn", "1f1b", None),
            ("LlamaForCausalLM", "all_to_all", "1f1b", "packed"), ("Qwen2ForCausalLM", "ring_attn", "1f1b", "packed"),
            ("LlamaForCausalLM", "ring_attn", "zb-v", None)]


# the 8-rank pool is the expensive part (~1 min on 2 cores); the HF code it reaches (Llama, Qwen2,
# Mixtral) runs under the older transformers in test_ep_pp and the pipeline / SP suites
@pytest.mark.compat_covered_by("test_ep_pp")
def test_tp_sp_pp_and_ep_tp_pp_on_8_ranks(world_pool):
    reports = world_pool(8).run(check.eight_ranks, 8, TP_SP_PP, ("1f1b", "zb-h1"))
    assert [r["case"] for r in reports[0]["tp_sp_pp"]] == TP_SP_PP
    assert all(r["moe_layers"] > 0 for rank in reports for r in rank["ep_tp_pp"])


def test_ep_pp(pool):
    reports = pool.run(check.ep_pp, 4, 1)
    assert [r[0]["experts_here"] for r in reports] == [2, 2, 2, 2]


def test_ep_pp_generate_and_checkpoints(pool, tmp_path):
    """EP=2 x PP=2: generate() with other rows and lengths per pipeline,
    save_sharded / load_sharded and DCP round trips equal the unsharded
    model (checks.combos.ep_pp_generate_and_checkpoints)."""
    out = pool.run(check.ep_pp_generate_and_checkpoints, 4, str(tmp_path))
    assert [len(r["greedy"]) for r in out] == [3, 2, 3, 2]            # rank = 2 * stage + pipeline
    assert [len(r["greedy"][0]) for r in out] == [9, 12, 9, 12]        # 6 + 3 and 6 + 6 tokens
    assert all("synced_gpus=False" in r["refused"] and "expert" in r["refused"] for r in out), out[0]["refused"]


def test_ep_peers_running_other_schedules_refused(pool):
    reports = pool.run(check.ep_pp_disagree, 4)
    assert all(r["seconds"] < 10 for r in reports), [r["seconds"] for r in reports]
