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


@pytest.mark.parametrize("tp,default_group", [(2, False), (4, True)])
def test_role_strings_still_shard_with_a_deprecation(pool, tp, default_group):
    """A user's policy spelling split-gather regions with role strings: same results as the unsharded
    model and a DeprecationWarning per role naming its layouts constant (TP=2 explicit group, TP=4 the
    plain ShardConfig())."""
    reports = pool.run(policy_interface.role_spelled_user_policy, tp, default_group)
    assert all(r["warnings"] == 4 for r in reports)


#: zoo models whose built-in policies set head attributes in every way they are set (a kind per
#: attribute: heads, kv_heads, groups, width, config), and the one DerivedPolicy reads from Llama
ATTRIBUTE_MODELS = ("LlamaForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "FalconForCausalLM")


def test_head_attributes_made_one_way(monkeypatch):
    """Every per-rank head attribute a built-in policy or DerivedPolicy writes comes out of
    Heads.attributes (the one builder), with this rank's counts: Llama's 6 query / 2 KV heads over 4
    ranks (uneven: 2, 1, 2, 1 query heads), Phi-3's per-rank config; bad kinds refused by name."""
    from shardformer import ShardConfig
    from shardformer.autopolicy import get_autopolicy
    from shardformer.derived_policy import DerivedPolicy
    from shardformer.layout import Heads, PerRank

    made = {}
    builder = Heads.attributes

    def spy(self, counts, config=None):
        out = builder(self, counts, config)
        made.update({id(v): (self, counts[k]) for k, v in out.items()})
        return out

    monkeypatch.setattr(Heads, "attributes", spy)
    seen = {}
    for name, derived in [(n, False) for n in ATTRIBUTE_MODELS] + [("LlamaForCausalLM", True)]:
        import zoo

        model = zoo.build(name)
        policy = DerivedPolicy() if derived else get_autopolicy(model)
        policy.set_model(model)
        policy.set_shard_config(ShardConfig())
        attrs = {k: v for d in policy.module_policy().values() for k, v in d.attribute_replacement.items()
                 if isinstance(v, PerRank)}
        assert attrs, name
        stray = [k for k, v in attrs.items() if id(v) not in made]
        assert not stray, f"{name}{' (derived)' * derived}: head attributes made outside Heads.attributes: {stray}"
        seen.update({f"{name}{'/derived' * derived}:{k}": made[id(v)] for k, v in attrs.items()})
    kinds = {kind for _, kind in seen.values()}
    assert kinds == set(Heads.COUNTS), kinds
    groups = {k: heads for k, (heads, kind) in seen.items() if kind == "groups" and k.startswith("LlamaFor")}
    assert any("/derived" in k for k in groups) and any("/derived" not in k for k in groups)
    heads = Heads(6, 2, 16)
    vals = heads.attributes({"q": "heads", "kv": "kv_heads", "g": "groups", "w": "width"})
    got = [tuple(vals[k].resolve(4, r) for k in ("q", "kv", "g", "w")) for r in range(4)]
    assert got == [(2, 1, 2, 32), (1, 1, 1, 16), (2, 1, 2, 32), (1, 1, 1, 16)], got
    with pytest.raises(ValueError, match=r"\{'self_attn.n': 'query'\} is not one of"):
        heads.attributes({"self_attn.n": "query"})
    with pytest.raises(ValueError, match=r"\['c'\] needs the config"):
        heads.attributes({"c": "config"})
