"""generate() under pipeline parallelism (shardformer.pipeline.generate):
HF's loop on every rank, each step's forward through the stages.  Greedy
(KV cache on and off), sampling with top-k / top-p / temperature (each rank
seeded differently) and eos stopping give, on every rank, the unsharded
model's tokens on left-padded prompts; at PP=2 (two pipelines, 5 layers:
uneven stages), PP=4 over the default group, and TP=2 x PP=2 from
shardformer.mesh.  Options the pipeline cannot run are refused by name
before any step."""
import pytest

from checks import pipeline_generate as check


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_pp2(pool, name):
    pool.run(check.generate_equals_unsharded, 4, name, 2, 1, "groups", 5)


def test_pp4_default_group(pool):
    pool.run(check.generate_equals_unsharded, 4, "LlamaForCausalLM", 4, 1, "default", 4)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_tp2_pp2(pool, name):
    pool.run(check.generate_equals_unsharded, 4, name, 2, 2, "mesh", 4)


def test_refusals(pool):
    msgs = pool.run(check.refusals, 4)
    assert all(m == msgs[0] for m in msgs)          # every rank, the same message
