"""Rank-side checks of shardformer.verify run in place (torch.distributed
already initialized by the pool): correct layouts pass, wrong ones are
located at the module that is wrong."""
from __future__ import annotations

import torch

from shardformer import ModulePolicyDescription, Policy, ShardConfig, verify
from shardformer import SubModuleReplacementDescription as Sub
from shardformer.layer import Linear1D_Col, Linear1D_Row

import zoo

LLAMA = "LlamaForCausalLM"   # 6 query heads, 2 KV heads, 90 MLP features, vocabulary 101: uneven at TP=4


def build_llama():
    return zoo.build(LLAMA)


def llama_inputs():
    return zoo.make_inputs(LLAMA)


def _summary(report) -> dict:
    m = report.first_mismatch
    return {"ok": report.ok, "text": str(report),
            "compared": {k: c.compared for k, c in report.checks.items()},
            "first": None if m is None else {"module": m.module, "what": m.what, "max_abs": m.max_abs,
                                              "ranks": list(m.ranks), "message": m.message}}


def llama_plan() -> dict:
    """Llama's own tensor-parallel plan in transformers' notation, as a user would write it."""
    model = zoo.build(LLAMA)
    from shardformer.derived_policy import resolve_tp_plan

    return resolve_tp_plan(model)


def verify_correct(ctx, explicit_group: bool, use_plan: bool) -> dict:
    """A correct layout (the built-in policy, or Llama's plan dict) over the
    pool's first tp ranks: explicit group, or ShardConfig() over the world."""
    config = ShardConfig(tensor_parallel_process_group=ctx.group) if explicit_group else ShardConfig()
    report = verify(build_llama, llama_inputs, shard_config=config, plan=llama_plan() if use_plan else None,
                    world_size=ctx.tp_size, steps=2)
    return _summary(report)


class NoReduceRow(Linear1D_Row):
    """A row-parallel layer that forgets its all-reduce: each rank returns its partial sum X_i A_i^T + b."""

    def forward(self, x, addend=None):
        y = torch.nn.functional.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def _mlp(layer: int, down) -> list:
    p = f"model.layers.{layer}."
    return [Sub(p + "self_attn.q_proj", Linear1D_Col), Sub(p + "self_attn.k_proj", Linear1D_Col),
            Sub(p + "self_attn.v_proj", Linear1D_Col), Sub(p + "self_attn.o_proj", Linear1D_Row),
            Sub(p + "mlp.gate_proj", Linear1D_Col), Sub(p + "mlp.up_proj", Linear1D_Col),
            Sub(p + "mlp.down_proj", down)]


class _LlamaPolicy(Policy):
    """Layer 0 right; layer 1's mlp.down_proj is `WRONG`.  Heads split evenly
    (6 query / 2 KV heads over 2 ranks), so no attribute changes are needed."""

    WRONG = Linear1D_Row

    def module_policy(self):
        from transformers import LlamaForCausalLM

        return {LlamaForCausalLM: ModulePolicyDescription(
            sub_module_replacement=_mlp(0, Linear1D_Row) + _mlp(1, self.WRONG))}


class MissingAllReducePolicy(_LlamaPolicy):
    WRONG = NoReduceRow


class RowAsColumnPolicy(_LlamaPolicy):
    """Layer 1's down_proj (row-parallel: its input is split) declared column-parallel."""

    WRONG = Linear1D_Col


def verify_wrong(ctx) -> dict:
    """Each wrong policy's report; and the right one, which passes."""
    config = ShardConfig(tensor_parallel_process_group=ctx.group)
    return {cls.__name__: _summary(verify(build_llama, llama_inputs, shard_config=config, policy=cls,
                                          world_size=ctx.tp_size))
            for cls in (_LlamaPolicy, MissingAllReducePolicy, RowAsColumnPolicy)}


def verify_world_size_mismatch(ctx) -> str:
    try:
        verify(build_llama, llama_inputs, shard_config=ShardConfig(tensor_parallel_process_group=ctx.group),
               world_size=ctx.tp_size + 1)
    except ValueError as e:
        return str(e)
    raise AssertionError("verify accepted a world_size other than the group's size")


def _build_failing_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise OSError("checkpoint not found on this rank")
    return zoo.build(LLAMA)


def verify_one_rank_fails(ctx) -> str:
    """build() fails on rank 1 only: every rank gets an error naming the ranks (no hang)."""
    try:
        config = ShardConfig(tensor_parallel_process_group=ctx.group)
        verify(_build_failing_on_rank_1, llama_inputs, shard_config=config, world_size=ctx.tp_size)
    except (RuntimeError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("verify did not fail")
