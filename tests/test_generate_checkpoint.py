"""generate() on sharded decoders, and full state dicts across TP sizes."""
import pytest

import rank_checks


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_generate_matches_unsharded(pool, name, tp):
    results = pool.run(rank_checks.generate_matches, tp, name)
    assert all(r["tokens"] == results[0]["tokens"] for r in results)
    assert results[0]["local_kv_heads"] < (2 if name.startswith("Llama") else 6) or tp == 4


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForPreTraining"])
def test_state_dict_round_trip(pool, name, tp):
    pool.run(rank_checks.state_dict_round_trip, tp, name)


@pytest.mark.parametrize("save_tp, load_tp", [(2, 4), (4, 2), (4, 1)])
def test_load_across_tp_sizes(pool, save_tp, load_tp):
    full = pool.run(rank_checks.gathered_state, save_tp, "LlamaForCausalLM")[0]
    pool.run(rank_checks.load_into, load_tp, "LlamaForCausalLM", full)
