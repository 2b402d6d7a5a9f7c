"""Rank-side checks of the sharder (tests/test_sharder.py): custom policies on a
user's model, and a failed optimize() leaving the model as it was.  Each
function runs on every rank of the pool."""
from __future__ import annotations

import torch

import zoo
from checks import parity
from shardformer import ModulePolicyDescription, Policy, ShardConfig, ShardFormer
from shardformer import SubModuleReplacementDescription as Sub
from shardformer.layer import Linear1D_Col
from zoo import custom


def custom_policy(ctx, which: str):
    policy = {"block": custom.ToyPolicy, "star": custom.ToyStarPolicy}[which]()
    return parity.check_sharded(ctx, lambda: custom.ToyModel(), custom.toy_inputs(),
                                name=f"ToyModel/{which}", policy=policy)


def _snapshot(model):
    return repr(model), {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, snap, inputs, ref_out):
    text, state = snap
    assert repr(model) == text, "module tree changed after a failed optimize()"
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), f"{k} changed after a failed optimize()"
    assert not getattr(model, "_shardformer_sharded", False)
    out = model(**inputs)
    assert torch.equal(out.logits, ref_out), "model output changed after a failed optimize()"


def bad_shard_leaves_model_unchanged(ctx, name: str, overrides: dict, policy_name: str | None = None):
    """optimize() must raise before changing anything; returns the message."""
    model = zoo.build(name, **overrides)
    inputs = {"input_ids": torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        ref_out = model(**inputs).logits.clone()
    snap = _snapshot(model)
    policy = None
    if policy_name == "missing_suffix":
        policy = MissingSuffixPolicy()
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model, policy=policy)
    except (ValueError, TypeError) as e:
        message = str(e)
    else:
        raise AssertionError("optimize() did not raise")
    with torch.no_grad():
        _assert_unchanged(model, snap, inputs, ref_out)
    return message


class MissingSuffixPolicy(Policy):
    """A valid replacement followed by one naming a sub-module that does not exist."""

    def module_policy(self):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

        return {
            LlamaModel: ModulePolicyDescription(sub_module_replacement=[Sub("embed_tokens.missing", Linear1D_Col)]),
            LlamaDecoderLayer: ModulePolicyDescription(
                sub_module_replacement=[Sub("mlp.gate_proj", Linear1D_Col), Sub("mlp.gate_projj", Linear1D_Col)]
            ),
        }
