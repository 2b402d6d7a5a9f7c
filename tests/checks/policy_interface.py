"""Rank-side checks of the declared Policy interface (tests/test_policy_interface.py):
one policy instance shards two models, and a user's subclass may state its
capabilities either by overriding the accessors or by setting the declared
fields.  Each function runs on every rank of the pool."""
from __future__ import annotations

import copy

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.policies.llama import LlamaForCausalLMPolicy

NAME = "LlamaForCausalLM"
SP = {"enable_sequence_parallelism": True}
# The second model: other (uneven) sizes, its LM head tied to the input embedding.
OTHER = dict(num_attention_heads=5, num_key_value_heads=5, head_dim=12, hidden_size=60, intermediate_size=70,
             vocab_size=77, num_hidden_layers=3, tie_word_embeddings=True)


def _sharded(ctx, policy, config: dict, default_group: bool, **overrides):
    """(model `NAME` built with `overrides`, sharded with `policy` over ctx.group
    or ShardConfig()'s default group; its unsharded copy)."""
    model = zoo.build(NAME, **overrides).train()
    ref = copy.deepcopy(model)
    group = {} if default_group else {"tensor_parallel_process_group": ctx.group}
    ShardFormer(shard_config=ShardConfig(**group, **config)).optimize(model, policy=policy)
    return model, ref


def one_policy_two_models(ctx, default_group: bool) -> dict:
    """One LlamaForCausalLMPolicy instance shards model A (split-gather SP),
    then model B (other sizes, tied LM head, no SP); A then B run forward,
    backward and an SGD step like their unsharded copies, and the policy
    keeps nothing of either but `model` / `shard_config` (the seed's API)."""
    policy = LlamaForCausalLMPolicy()
    a, a_ref = _sharded(ctx, policy, SP, default_group)
    kept_after_a = sorted(set(vars(policy)) - {"model", "shard_config"})
    b, b_ref = _sharded(ctx, policy, {}, default_group, **OTHER)
    kept = sorted(set(vars(policy)) - {"model", "shard_config"})
    assert not kept_after_a and not kept, f"the policy kept per-optimize state: {kept_after_a} / {kept}"
    assert policy.model is b
    assert b.get_output_embeddings().weight is b.get_input_embeddings().weight, "B's LM head was not re-tied"
    inputs_b = {k: v % OTHER["vocab_size"] if k in ("input_ids", "labels") else v
                for k, v in zoo.make_inputs(NAME).items()}
    report_a = parity.compare_sharded(a, a_ref, zoo.make_inputs(NAME), f"{NAME} A (SP)")
    report_b = parity.compare_sharded(b, b_ref, inputs_b, f"{NAME} B (tied, uneven)")
    return {"A": report_a, "B": report_b}


class OldStyle(LlamaForCausalLMPolicy):
    """A user's subclass written against the accessors."""

    def sequence_parallel_modes(self):
        return ("split_gather",)

    def sequence_parallel_refusal(self, mode):
        return f"OldStyle keeps {mode} off"

    def supports_sequence_overlap(self):
        return False

    def sequence_overlap_refusal(self):
        return "OldStyle keeps the overlap off"

    def supports_sequence_recompute(self):
        return False


class NewStyle(LlamaForCausalLMPolicy):
    """The same user policy written as the declared fields."""

    sp_modes = ("split_gather",)
    split_attention_at = None
    sequence_overlap = False
    sequence_overlap_why = "NewStyle keeps the overlap off"
    sequence_recompute = False

    def sequence_parallel_refusal(self, mode):
        return f"NewStyle keeps {mode} off"


def user_policy_capabilities(ctx) -> dict:
    """Both subclasses: all_to_all, enable_sequence_overlap and
    sequence_parallel_recompute are refused naming the policy and its reason
    before the model changes; split_gather shards like the unsharded model."""
    out = {}
    for cls in (OldStyle, NewStyle):
        who = cls.__name__
        for config, names in ((dict(SP, sequence_parallelism_mode="all_to_all", enable_tensor_parallelism=False),
                               ("all_to_all", f"{who} keeps")),
                              (dict(SP, enable_sequence_overlap=True), (who, f"{who} keeps the overlap off")),
                              (dict(SP, sequence_parallel_recompute="selective"), (who, "selective"))):
            model = zoo.build(NAME)
            cfg = ShardConfig(tensor_parallel_process_group=ctx.group, **config)
            parity.refused_unchanged(model, lambda: ShardFormer(cfg).optimize(model, policy=cls()),
                                     f"{who} {config}", error=NotImplementedError, structure=True, names=names)
        out[who] = parity.check_sharded(ctx, lambda: zoo.build(NAME), zoo.make_inputs(NAME), name=f"{NAME}/{who}",
                                        config=SP, policy=cls())
    return out


def role_spelled_user_policy(ctx, default_group: bool) -> dict:
    """A user's policy written before the typed layouts (issue 33): its
    split-gather regions spelled with role strings ("block", ("split",
    "rows"), "rows", "gather") still shard Llama like the unsharded model
    (forward, loss, gradients, an SGD step; 7 tokens: uneven rows), and each
    role warns once, naming the layouts constant to write instead."""
    import warnings

    from checks.sequence import cut_sequence
    from shardformer.layer.replicated import ReplicatedInParallelRegion
    from shardformer.layer.sequence import SequenceParallelRegion, SequenceState
    from shardformer.policy import SubModuleReplacementDescription as Sub

    class RoleSpelled(LlamaForCausalLMPolicy):
        def sequence_parallel_replacements(self):
            state = SequenceState()
            block = {"role": "block", "state": state}
            layer = [Sub("self_attn", SequenceParallelRegion, kwargs=block),
                     Sub("mlp", SequenceParallelRegion, kwargs=block),
                     Sub("input_layernorm", ReplicatedInParallelRegion),
                     Sub("post_attention_layernorm", ReplicatedInParallelRegion)]
            n = len(self.model.model.layers)
            ends = ([Sub("layers.0", SequenceParallelRegion, kwargs={"role": ("split", "rows"), "state": state})]
                    + [Sub(f"layers.{i}", SequenceParallelRegion, kwargs={"role": "rows", "state": state})
                       for i in range(1, n - 1)]
                    + [Sub(f"layers.{n - 1}", SequenceParallelRegion, kwargs={"role": "gather", "state": state})])
            return layer, ends

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        model, ref = _sharded(ctx, RoleSpelled(), SP, default_group, num_hidden_layers=3)
    said = sorted({str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)})
    for role, constant in (("'block'", "BLOCK"), ("('split', 'rows')", "SPLIT | MARK_ROWS"), ("'rows'", "MARK_ROWS"),
                           ("'gather'", "GATHER")):
        assert any(f"role={role}) is deprecated: write layouts={constant} " in m and "docs/sequence-layouts.md" in m
                   for m in said), (role, said)
    report = parity.compare_sharded(model, ref, cut_sequence(zoo.make_inputs(NAME), 7), f"{NAME} (role strings)")
    return {**report, "warnings": len(said)}
