"""Rank-side checks that optimize() refuses ranks holding different models,
and that broadcast_weights makes rank 0's weights everyone's (the same-seed
rule, checked instead of assumed; tests/test_replicas.py)."""
from __future__ import annotations

import copy

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.layer.parallel_module import ParallelModule

NAME = "LlamaForCausalLM"


def _refused(ctx, model, **extra) -> str:
    before = dict(model.named_parameters())
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, extra_kwargs=extra)).optimize(model)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("optimize() sharded ranks that hold different models")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), "model changed"
    assert not any(isinstance(m, ParallelModule) for m in model.modules())
    return msg


def different_seed_refused(ctx) -> str:
    return _refused(ctx, zoo.build(NAME, seed=ctx.rank))


def one_element_refused(ctx, odd_rank: int) -> str:
    model = zoo.build(NAME)
    if ctx.rank == odd_rank:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-6
    return _refused(ctx, model)


def different_config_refused(ctx) -> str:
    return _refused(ctx, zoo.build(NAME, num_hidden_layers=2 + (ctx.rank == 1)))


def unchecked_when_asked(ctx) -> int:
    model = zoo.build(NAME, seed=ctx.rank)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group,
                            extra_kwargs={"check_replicas": False})).optimize(model)
    return sum(isinstance(m, ParallelModule) for m in model.modules())


def broadcast_from_rank0(ctx) -> float:
    """Every rank builds from its own seed; with broadcast_weights the sharded
    model equals rank 0's unsharded model (seed 0)."""
    model = zoo.build(NAME, seed=100 + ctx.rank).eval()
    ref = zoo.build(NAME, seed=100).eval()
    inputs = zoo.make_inputs(NAME)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group,
                            extra_kwargs={"broadcast_weights": True})).optimize(model)
    with torch.no_grad():
        errs = parity.check_outputs(NAME, model(**inputs), ref(**inputs), parity.TOL[torch.float32])
    return max(errs.values())


def same_model_accepted(ctx) -> int:
    model = zoo.build(NAME)
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    return sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in ref.parameters())
