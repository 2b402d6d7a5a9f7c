"""Policies derived from a model's own tensor-parallel plan
(shardformer.derived_policy), for transformers architectures without a
built-in policy: outputs, loss, every gradient and the outputs after an SGD
step equal to the unsharded model at TP=2 and TP=4, parameters per rank
well below the full model, greedy generate() equal, and plans that cannot
be honoured refused before the model changes."""
from __future__ import annotations

import pytest

from checks import derived_policy as D

NAMES = sorted(D.MODELS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_step(pool, name, tp):
    reports = pool.run(D.check, tp, name)
    assert all(r["tp"] == tp for r in reports)
    if tp == 2:
        assert all(r["param_fraction"] < 0.6 for r in reports), [r["param_fraction"] for r in reports]
