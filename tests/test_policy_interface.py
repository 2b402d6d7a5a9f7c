"""The Policy interface as declared (shardformer.policy.Policy): no per-optimize
state kept on a policy, and a user's subclass stating its capabilities either
way (accessor overrides or declared fields)."""
from __future__ import annotations

import pytest

from checks import policy_interface
from shardformer import Policy
from shardformer.policies.llama import LlamaForCausalLMPolicy


@pytest.mark.parametrize("tp,default_group", [(2, False), (4, True)])
def test_one_policy_instance_shards_two_models(pool, tp, default_group):
    """TP=2 over an explicit group; TP=4 with the plain ShardConfig() (default group = the world)."""
    reports = pool.run(policy_interface.one_policy_two_models, tp, default_group)
    assert len(reports) == tp


def test_user_subclass_accessors_or_fields(pool):
    reports = pool.run(policy_interface.user_policy_capabilities, 2)
    assert all(set(r) == {"OldStyle", "NewStyle"} for r in reports)


def test_capabilities_are_declared_data():
    """Every capability the sharder reads is declared on Policy with a default,
    read through one accessor; a built-in shape states them as fields."""
    for field in ("sp_modes", "sequence_overlap", "sequence_overlap_why", "sequence_recompute", "pipeline_split",
                  "pipeline_refusal", "prefix", "base_model", "heads", "lm_loss", "attention_seam"):
        assert hasattr(Policy, field), field
    assert LlamaForCausalLMPolicy.sp_modes == ("split_gather",)
    assert "sequence_parallel_modes" not in vars(LlamaForCausalLMPolicy.__mro__[1])
