"""optimize() checks that every rank of the group holds the same model
(names, shapes, dtypes, then a fingerprint of every tensor) and refuses, before
changing anything, when they differ; broadcast_weights uses rank 0's."""
import pytest
import torch

from checks import replicas
from shardformer import ShardConfig, _C
from shardformer.replicas import fingerprint


@pytest.mark.parametrize("tp", [2, 4])
def test_different_seeds_refused(pool, tp):
    msgs = pool.run(replicas.different_seed_refused, tp)
    assert all(m == msgs[0] for m in msgs), "ranks raised different errors"
    assert "LlamaForCausalLM" in msgs[0] and "different weights" in msgs[0]
    assert f"ranks {list(range(1, tp))}" in msgs[0] and "manual_seed" in msgs[0], msgs[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_one_element_on_one_rank_refused(pool, tp):
    msg = pool.run(replicas.one_element_refused, tp, tp - 1)[0]
    assert "1 of " in msg and f"model.layers.1.mlp.up_proj.weight (ranks [{tp - 1}])" in msg, msg


@pytest.mark.parametrize("tp", [2, 4])
def test_different_configs_refused(pool, tp):
    msg = pool.run(replicas.different_config_refused, tp)[0]
    assert "built different models" in msg and "rank 1" in msg and "layers.2" in msg, msg


def test_check_can_be_switched_off(pool):
    assert all(n > 0 for n in pool.run(replicas.unchecked_when_asked, 2))


@pytest.mark.parametrize("tp", [2, 4])
def test_broadcast_weights_uses_rank0(pool, tp):
    pool.run(replicas.broadcast_from_rank0, tp)


def test_same_model_accepted(pool):
    assert all(pool.run(replicas.same_model_accepted, 4))


def test_extra_kwargs_validated():
    with pytest.raises(TypeError, match="broadcast_weights"):
        ShardConfig(extra_kwargs={"broadcast_weights": 1})


def test_fingerprint_of_any_layout():
    t = torch.randn(100, 37)
    assert fingerprint(t) == _C.fingerprint(t)
    assert fingerprint(t.t()) == _C.fingerprint(t.t().contiguous())   # layouts are made contiguous
    assert fingerprint(t.requires_grad_()) == _C.fingerprint(t.detach())
    assert fingerprint(torch.ones(3, device="meta")) == 0
