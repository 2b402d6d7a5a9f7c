"""Sequence parallelism (split_gather, all_to_all, ring_attn) on policies
derived from a model's own tensor-parallel plan (shardformer.derived_policy):
the layer list comes from the config's base_model_pp_plan.  Each mode at
SP=2 and SP=4 on odd lengths, TP=2 x SP=2 for all_to_all on 4 ranks, eval
mode with dropout configured: outputs, loss, every gradient and the outputs
after an SGD step equal to the unsharded model, the split path's calls
counted; what the split cannot run is refused by name before the model
changes."""
from __future__ import annotations

import pytest

from checks import derived_policy as D
from checks import derived_sequence as S

MODES = ("split_gather", "all_to_all", "ring_attn")
# GQA everywhere (4 query heads over 2 KV heads); MoE: Qwen3Moe, Ernie4_5_Moe; sliding windows:
# Ministral (full + sliding layers), Cohere2, Exaone4 (with qk-norm); qk-norm: Olmo2 (over the
# whole projection), Qwen3Moe; biased row layers (role "enter"): GPTNeoX, Phi, Starcoder2
NAMES = ("Olmo2", "Qwen3Moe", "Ernie4_5_Moe", "Ministral", "Cohere2", "Exaone4", "GPTNeoX", "Phi", "Starcoder2",
         "Granite", "SmolLM3", "Cohere", "Glm4")


@pytest.mark.parametrize("sp, seq", [(2, 7), (4, 9)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_derived_sp_equals_unsharded(pool, name, mode, sp, seq):
    reports = pool.run(S.equals_unsharded, sp, name, mode, seq)
    assert all(r["split_calls"] > 0 for r in reports)


@pytest.mark.parametrize("name", ["Olmo2", "Qwen3Moe", "GPTNeoX", "Ministral"])
def test_derived_tp2_sp2_all_to_all(pool, name):
    pool.run(S.tp_sp_equals_unsharded, 4, name, "all_to_all", 2, 7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["Olmo2", "Starcoder2"])
def test_derived_sp_eval_with_dropout(pool, name, mode):
    pool.run(S.eval_with_dropout, 2, name, mode)
