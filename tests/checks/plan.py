"""Rank-side checks of plans a user passes to optimize(model, plan={...}):
a transformers model whose config carries no tensor-parallel plan
(Nemotron), sharded by the plan dict alone, against the unsharded model
from the same seed (checks.parity)."""
from __future__ import annotations

import torch
import transformers

from checks import parity
from checks.optimizations import counting_calls
from shardformer import ShardConfig, ShardFormer

#: Nemotron has no base_model_tp_plan: the plan a user would write for it.
NEMOTRON_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
# 4 query heads over 2 KV heads (replicated at TP=4), 90 MLP features and a
# vocabulary of 101 (neither divides 4), odd sequence length
CONFIG = dict(hidden_size=64, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
BATCH, SEQ = 2, 7


def build(seed: int = 0, **overrides):
    config = transformers.NemotronConfig(**dict(CONFIG, **overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.NemotronForCausalLM(config)


def make_inputs(seed: int = 1) -> dict:
    ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def counting_plan_layers():
    """Count the forwards of the layers the plan's styles map to."""
    from shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D, VocabParallelLMHead1D

    return counting_calls({"col": (Linear1D_Col, "forward"), "row": (Linear1D_Row, "forward"),
                           "embedding": (VocabParallelEmbedding1D, "forward"),
                           "lm_head": (VocabParallelLMHead1D, "forward")})


def user_plan(ctx) -> dict:
    """Forward, loss, every gradient and the state after one SGD step of
    Nemotron sharded by NEMOTRON_PLAN, against the unsharded model; with the
    calls of each parallel layer counted and the swapped classes listed."""
    with counting_plan_layers() as calls:
        report = parity.check_sharded(ctx, build, make_inputs(), name="NemotronForCausalLM", plan=NEMOTRON_PLAN)
    report["calls"] = dict(calls)
    return report


def swapped(ctx) -> dict:
    """{path: class name} of the modules optimize(plan=...) swapped."""
    model = build()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model, plan=NEMOTRON_PLAN)
    return {n: type(m).__name__ for n, m in model.named_modules() if type(m).__module__.startswith("shardformer")}


def eval_with_dropout(ctx, p: float = 0.3) -> float:
    """Eval mode with attention dropout p configured: sharded logits equal the unsharded model's."""
    model = build(attention_dropout=p).eval()
    ref = build(attention_dropout=p).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model, plan=NEMOTRON_PLAN)
    ids = make_inputs()["input_ids"]
    with torch.no_grad():
        got, exp = model(input_ids=ids).logits, ref(input_ids=ids).logits
    return parity.assert_close(f"Nemotron eval logits (dropout {p})", got, exp, parity.TOL[torch.float32])


def refused(ctx, plan: dict, expect: tuple[str, ...], error: str = "ValueError", policy: bool = False) -> str:
    """optimize(model, plan=plan) is refused before the model changes, the
    message naming each of `expect` (`policy`: a policy passed as well)."""
    from shardformer.derived_policy import DerivedPolicy

    model = build()
    shard_config = ShardConfig(tensor_parallel_process_group=ctx.group)
    extra = {"policy": DerivedPolicy()} if policy else {}
    message = parity.refused_unchanged(model, lambda: ShardFormer(shard_config).optimize(model, plan=plan, **extra),
                                       "user plan", error={"ValueError": ValueError, "TypeError": TypeError}[error],
                                       structure=True, names=tuple(expect))
    return message


def exported_plan_round_trip(ctx, name: str) -> int:
    """The built-in policy's split of zoo model `name` written in transformers'
    notation (Family.tp_plan) and given back to optimize(plan=...) yields
    the same local shards (every state-dict tensor equal) and the same
    outputs; returns the number of tensors compared."""
    import zoo
    from shardformer.autopolicy import families, get_autopolicy

    family = next(f for f in families() if name in f.heads)
    plan = family.tp_plan(zoo.build(name), policy_of=get_autopolicy)
    builtin, derived = zoo.build(name).eval(), zoo.build(name).eval()
    shard_config = ShardConfig(tensor_parallel_process_group=ctx.group)
    ShardFormer(shard_config).optimize(builtin)
    ShardFormer(shard_config).optimize(derived, plan=plan)
    a, b = builtin.state_dict(), derived.state_dict()
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key
    inputs = {k: v for k, v in zoo.make_inputs(name).items() if k != "labels"}
    with torch.no_grad():
        parity.assert_close(f"{name} built-in vs exported plan", derived(**inputs).logits, builtin(**inputs).logits,
                            parity.TOL[torch.float32])
    return len(a)
