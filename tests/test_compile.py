"""torch.compile of sharded models (docs/compile.md): the C kernels and the
collectives as custom ops, so dynamo traces through them.  Compiled with
backend="aot_eager" (the fake implementations and registered autograd are
exercised as under inductor, without building C++), against the unsharded
HF model from the same seed."""
import pytest

from checks import compile as checks

# graphs of the whole model: the input-agreement hook (torch.compiler.disable'd:
# a first-forward collective check, input_check.py) splits the forward in two
MAX_GRAPHS = 3  # at most 2 graph breaks


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "all_optimizations"])
def test_compiled_model_default_group_tp2(pool2, fused):
    config = {"enable_all_optimization": True} if fused else {}
    reports = pool2.run(checks.whole_model, 2, True, config)
    assert all(r["graphs"] <= MAX_GRAPHS for r in reports), reports


@pytest.mark.parametrize("tp", [2, 4])
def test_decoder_layer_fullgraph(pool, tp):
    """At TP=4: 6 query heads split unevenly, the 2 KV heads replicated (their gradients summed)."""
    reports = pool.run(checks.decoder_layer_fullgraph, tp, {"enable_all_optimization": True})
    assert all(r["graphs"] == 1 for r in reports), reports
