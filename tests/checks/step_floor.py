"""Rank-side checks of benchmarks/step_floor.py (tests/test_step_floor.py): the
matmuls recorded from one profiled training step of the tiny Llama are exactly
the rank's linear layers' products, the replay does those products on operands
of the recorded shapes and strides, and the ledger accounts for the whole step.

Per linear layer y = x W^T over T tokens (W: out x in), a step does three
products of 2 T in out FLOPs each (y, dX = dY W, dW = dY^T X); the only other
matmul of a Llama step is the rotary embedding's inv_freq x positions bmm
(2 T' d/2 FLOPs, T' the positions of one sequence batch).  So every rank must
record 6 T sum(in * out) over its own (sharded) linears plus that bmm, and the
sharded step under the profiler must still give the unsharded model's loss and
gradients."""
from __future__ import annotations

import copy
import math
import os
import sys

import torch

import shardformer
import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer

NAME = "LlamaForCausalLM"
TOL = parity.TOL[torch.float32]


def _step_floor():
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import step_floor
    return step_floor


def _linears(model) -> list:
    """The model's linear layers, torch's or shardformer's parallel ones: every
    module with a 2-D weight that is not an embedding."""
    return [m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 2 and "Embedding" not in type(m).__name__]


def _linear_flops(model, tokens: int) -> int:
    return sum(6 * tokens * m.weight.numel() for m in _linears(model))


def _check(sf, prof: dict, model, tokens: int, what: str) -> None:
    recs = prof["matmuls"]
    lin = [r for r in recs if r["op"] in ("aten::mm", "aten::addmm")]
    lin_flops = sum(sf.matmul_flops(r) for r in lin)
    want = _linear_flops(model, tokens)
    assert lin_flops == want, f"{what}: recorded linear matmuls {lin_flops} FLOPs, the layers' {want}"
    n_lin = len(_linears(model))
    assert len(lin) == 3 * n_lin, f"{what}: {len(lin)} mm/addmm recorded for {n_lin} linear layers (expected 3 each)"
    others = {r["op"] for r in recs} - {"aten::mm", "aten::addmm"}
    assert others <= {"aten::bmm"}, f"{what}: unexpected matmul ops {others}"
    # transposes are kept: a weight-gradient product reads its left operand transposed
    assert any(r["inputs"][-2][1][0] < r["inputs"][-2][1][1] for r in lin), f"{what}: no transposed operand recorded"
    led, wall = prof["ledger_s"], prof["wall_s"]
    assert set(led) == set(sf.CATEGORIES) and all(v >= 0 for v in led.values()), (what, led)
    assert math.isclose(sum(led.values()), wall, rel_tol=1e-9), f"{what}: ledger sums to {sum(led.values())}, step {wall}"
    assert led["matmul"] > 0, (what, led)
    replay = sf.FloorReplay(recs)
    assert len(replay.calls) == len(recs) and replay.flops == prof["matmul_flops"], what
    for (fn, args), r in zip(replay.calls, recs):
        got = [(tuple(a.shape), tuple(a.stride())) for a in args]
        assert got == [x[:2] for x in r["inputs"] if x is not None], (what, r, got)
    assert replay.run() > 0


def floor_records(ctx, default_group: bool = False) -> dict:
    """Profile one step of the unsharded tiny Llama and of its TP shard on this
    rank; check both recordings against the layers' FLOPs, the sharded step's
    loss and gradients against the unsharded model's, and the collectives'
    time in the ledger against shardformer.comm_stats()."""
    sf = _step_floor()
    torch.manual_seed(0)
    ref = zoo.build(NAME)
    model = copy.deepcopy(ref)
    cfg = ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)
    model, _ = ShardFormer(shard_config=cfg).optimize(model)
    x = zoo.make_inputs(NAME)
    tokens = x["input_ids"].numel()
    box = {}

    def ref_step():
        box["ref"] = ref(**x)
        box["ref"].loss.backward()

    def tp_step():
        box["out"] = model(**x)
        box["out"].loss.backward()

    tp_step()                                 # the first forward's one-off checks, outside the profile
    model.zero_grad(set_to_none=True)
    p_ref = sf.profile_step(ref_step)
    p_tp = sf.profile_step(tp_step, shardformer.comm_stats)
    _check(sf, p_ref, ref, tokens, f"{NAME} unsharded")
    _check(sf, p_tp, model, tokens, f"{NAME} tp={ctx.tp_size} rank {ctx.rank}")
    parity.assert_close(f"{NAME} tp={ctx.tp_size} loss under the profiler", box["out"].loss, box["ref"].loss, TOL)
    parity.compare_grads(model, ref, f"{NAME} tp={ctx.tp_size} under the profiler", TOL)
    assert p_tp["ledger_s"]["collectives"] > 0, p_tp["ledger_s"]
    assert p_tp["matmul_flops"] < p_ref["matmul_flops"], (p_tp["matmul_flops"], p_ref["matmul_flops"])
    return {"flops": p_tp["matmul_flops"], "ref_flops": p_ref["matmul_flops"]}
