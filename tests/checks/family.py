"""Rank-side checks of families as data (shardformer.family): each function
runs on every rank of the pool."""
from __future__ import annotations

import zoo
from checks import parity
from shardformer.family import Family, gathered, lm
from shardformer.policies.shapes import DecoderShape


def ten_line_family(ctx, name: str) -> dict:
    """A family written as docs/writing-policies.md says a new Llama-shaped model is (Qwen2
    under another name), sharded, equals the unsharded model."""
    family = Family("qwen2-as-data", "qwen2.modeling_qwen2", DecoderShape, options={"prefix": "Qwen2"},
                    heads={"Qwen2Model": (), "Qwen2ForCausalLM": lm("lm_head"),
                           "Qwen2ForSequenceClassification": gathered("score")})
    policy = family.policy_classes()[f"{name}Policy"]()
    return parity.check_sharded(ctx, lambda: zoo.build(name), zoo.make_inputs(name), name=name, policy=policy)
