"""Tied parameters survive sharding (shardformer.ties): a parameter object
reachable under several names (a projection or a norm shared by two layers,
a whole module under two parents) is one parameter on every rank after
optimize(), eager and lazy, with the plain ShardConfig() (the world's group)
and explicit groups, at TP=2 and TP=4; the model trains like the unsharded
one.  A tie the plan would split two ways is refused by name."""
import pytest

from checks import ties


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(ties.TIES))
def test_ties_train_like_unsharded_tp2(pool, name, lazy):
    pool.run(ties.trains_like_unsharded, 2, name, lazy, False)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(ties.TIES))
def test_ties_train_like_unsharded_tp4_default_group(pool, name, lazy):
    pool.run(ties.trains_like_unsharded, 4, name, lazy, True)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_ties_train_like_unsharded_tp2_default_group(pool2, lazy):
    pool2.run(ties.trains_like_unsharded, 2, "LlamaForCausalLM", lazy, True)


# (Qwen3's ties are on modules the plan keeps, so they were one object before this check existed;
# its test is the gradient's, above.)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "MistralForCausalLM"])
def test_tied_lazy_equals_eager(pool, name):
    pool.run(ties.lazy_equals_eager_tied, 2, name)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dst, src", [
    ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"),   # column vs row
    ("model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"),            # (transposed shapes)
])
def test_tie_split_two_ways_is_refused(pool, dst, src, tp):
    messages = pool.run(ties.different_styles_refused, tp, dst, src)
    assert all("tied" in m for m in messages[:tp]), messages


def test_pipeline_ties_within_a_stage(pool):
    pool.run(ties.pipelined_ties_within_a_stage, 4, 2)


def test_pipeline_tie_across_stages_is_refused(pool):
    messages = pool.run(ties.pipelined_tie_across_stages_refused, 4)
    assert all("tied" in m for m in messages), messages
