"""Rank-side checks of ShardConfig.enable_skinny_linear: decode steps of a
sharded model through the C kernel ops.skinny_linear, against the unsharded
model, with the kernel's calls counted against the layer calls that qualify."""
from __future__ import annotations

import copy

import torch

from shardformer import ShardConfig, ShardFormer, ops
from shardformer.layer.linear import SKINNY_MAX_ROWS, SKINNY_MIN_ROWS, _LinearShard

import zoo

from . import parity


def _count_qualifying(model) -> tuple[dict, list]:
    """A forward pre-hook on every linear layer of ours that has the kernel
    switched on, counting the float32 calls of SKINNY_MIN_ROWS to
    SKINNY_MAX_ROWS rows made without gradients (the ones the kernel must take)."""
    seen = {"qualifying": 0, "layers_on": 0}
    handles = []

    def hook(module, args):
        x = args[0]
        rows = x.numel() // max(x.shape[-1], 1)
        if x.dtype == torch.float32 and SKINNY_MIN_ROWS <= rows <= SKINNY_MAX_ROWS and not torch.is_grad_enabled():
            seen["qualifying"] += 1

    for m in model.modules():
        if isinstance(m, _LinearShard) and m.skinny_rows:
            seen["layers_on"] += 1
            handles.append(m.register_forward_pre_hook(hook))
    return seen, handles


def generate_with_kernel(ctx, name: str, dtype: str = "float32", new_tokens: int = 5, p: float = 0.2) -> dict:
    """Greedy generate() of `name` (every dropout p, eval mode) sharded with
    enable_skinny_linear equals the unsharded model's, and every layer call
    of a decode step (2 sequences: 2 rows) ran the kernel."""
    torch.manual_seed(0)
    model = zoo.build_with_dropout(name, p).to(getattr(torch, dtype)).eval()
    ref = copy.deepcopy(model)
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, enable_skinny_linear=True)
    ShardFormer(shard_config=cfg).optimize(model)
    seen, handles = _count_qualifying(model)
    before = ops.CALLS["skinny_linear"]
    tokens = parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, new_tokens)
    calls = ops.CALLS["skinny_linear"] - before
    for h in handles:
        h.remove()
    assert seen["layers_on"] > 0, f"{name}: no layer has the skinny kernel switched on"
    assert calls == seen["qualifying"] > 0, (f"{name}: the kernel ran {calls} times, "
                                             f"for {seen['qualifying']} qualifying layer calls")
    return {"tokens": tokens.tolist(), "calls": calls, "layers": seen["layers_on"]}


def decode_logits_match(ctx, name: str, dtype: str = "float32") -> dict:
    """One cached decode step (one new token for each of 2 sequences): the
    sharded model's logits with the kernel equal the unsharded model's within
    the parity tolerance of the dtype."""
    torch.manual_seed(0)
    model = zoo.build(name).to(getattr(torch, dtype)).eval()
    ref = copy.deepcopy(model)
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, enable_skinny_linear=True)
    ShardFormer(shard_config=cfg).optimize(model)
    prompt = parity.prompt_ids()
    nxt = torch.tensor([[7], [11]])
    with torch.no_grad():
        past = model(prompt, use_cache=True).past_key_values
        before = ops.CALLS["skinny_linear"]
        got = model(nxt, past_key_values=past, use_cache=True).logits
        calls = ops.CALLS["skinny_linear"] - before
        ref_past = ref(prompt, use_cache=True).past_key_values
        exp = ref(nxt, past_key_values=ref_past, use_cache=True).logits
    if dtype == "float32":
        assert calls > 0, f"{name}: the decode step did not run the kernel"
    else:   # bfloat16 stays with torch (shardformer.layer.linear.SKINNY_MIN_ROWS: measured slower there)
        assert calls == 0, f"{name}: the kernel ran {calls} times on {dtype}"
    parity.assert_close(f"{name} decode-step logits ({dtype})", got, exp, parity.TOL[getattr(torch, dtype)])
    return {"calls": calls}


def training_untouched(ctx, name: str) -> dict:
    """With the switch on, a training step (gradients needed) never runs the
    kernel, and matches the unsharded model (parity.check_sharded)."""
    before = ops.CALLS["skinny_linear"]
    report = parity.check_sharded(ctx, lambda: zoo.build(name), zoo.make_inputs(name), name,
                                  config={"enable_skinny_linear": True})
    report["calls"] = ops.CALLS["skinny_linear"] - before
    assert report["calls"] == 0, f"{name}: the kernel ran {report['calls']} times in a training step"
    return report
