"""Wrappers no policy understands are refused, never passed through unsharded
(shardformer.wrappers: PEFT models and LoRA layers, torch.compile, DDP,
nn.DataParallel), at TP=2 and DP=2 x TP=2; the no-policy error leads with the
fix and the class list moved to shardformer.supported_models(); plan dicts
shard a model of one's own that has no HF config (TP=2 and 4, uneven)."""
import os
import re

import pytest
from torch import nn

import doclinks
import shardformer
from checks import wrappers as check
from shardformer import ShardConfig, ShardFormer


@pytest.mark.parametrize("kind", ["peft_ia3", "lora_inside", "compiled", "compiled_child", "ddp", "data_parallel"])
def test_wrapper_refused_tp2(pool, kind):
    pytest.importorskip("peft")
    messages = pool.run(check.wrapper_refused, 2, kind)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("kind", ["peft_ia3", "lora_inside", "compiled"])
def test_wrapper_refused_dp_tp(pool, kind):
    pytest.importorskip("peft")
    pool.run(check.wrapper_refused, 4, kind, "dp_tp")


def test_supported_predicate_bypasses_the_refusal():
    """The LoRA work's way in: a SUPPORTED predicate claims the modules it shards itself."""
    import torch

    from shardformer import wrappers

    compiled = torch.compile(nn.Linear(2, 2))
    assert [p for p, _, _ in wrappers.unsupported_wrappers(compiled)] == [""]
    wrappers.SUPPORTED.append(lambda path, module: type(module).__name__ == "OptimizedModule")
    try:
        assert wrappers.unsupported_wrappers(compiled) == []
    finally:
        wrappers.SUPPORTED.pop()


def test_no_policy_error_leads_with_the_fix():
    class MyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    with pytest.raises(ValueError) as info:
        ShardFormer(ShardConfig()).optimize(MyNet())
    message = str(info.value)
    lines = message.splitlines()
    assert len(lines) <= 5, message
    assert "plan={" in lines[1] and "policy=MyPolicy()" in lines[2], message
    assert "shardformer.supported_models()" in lines[-1], message
    assert "LlamaForCausalLM" not in message
    page = os.path.join(doclinks.ROOT, "docs", "writing-policies.md")
    cited = re.findall(r"docs/writing-policies\.md#([\w\-]+)", message)
    assert len(cited) == 2 and set(cited) <= doclinks.anchors(page), (cited, sorted(doclinks.anchors(page)))


def test_supported_models_public():
    names = shardformer.supported_models()
    assert "transformers.models.llama.modeling_llama.LlamaForCausalLM" in names
    assert names == sorted(names) and len(names) > 100


@pytest.mark.parametrize("tp", [2, 4])
def test_plan_dict_on_a_model_without_config(pool, tp):
    reports = pool.run(check.plain_plan, tp)
    assert all(r["param_fraction"] < 1 for r in reports)


@pytest.mark.parametrize("tp", [2, 4])
def test_plan_dict_linears_beside_norm_and_attention(pool, tp):
    """The split linears are direct children of a pre-norm block beside its attention: the norm and the
    attention run on replicated activations and keep their own (whole) gradients."""
    pool.run(check.toy_mlp_plan, tp)


def test_plan_dict_attention_without_head_counts_refused(pool):
    pool.run(check.toy_plan_attention_refused, 2)
