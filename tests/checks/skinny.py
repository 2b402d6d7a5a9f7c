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


def bf16_on_kernel() -> bool:
    """bfloat16 calls go to the kernel here: its bf16 path is AVX512-BF16
    (shardformer.layer.linear.skinny_min_rows; on other CPUs they stay with torch)."""
    return ops.skinny_linear_path(torch.bfloat16) == "avx512_bf16"


def _count_qualifying(model) -> tuple[dict, list]:
    """A forward pre-hook on every linear layer of ours that has the kernel
    switched on, counting the calls made without gradients that the kernel
    must take: float32 of SKINNY_MIN_ROWS to SKINNY_MAX_ROWS rows, bfloat16
    of 1 to SKINNY_MAX_ROWS where bf16_on_kernel(); and of those, the ones on
    a weight that is a strided view ("strided")."""
    seen = {"qualifying": 0, "layers_on": 0, "strided": 0}
    handles = []
    low = {torch.float32: SKINNY_MIN_ROWS, torch.bfloat16: 1 if bf16_on_kernel() else None}

    def hook(module, args):
        x = args[0]
        rows = x.numel() // max(x.shape[-1], 1)
        first = low.get(x.dtype)
        if first is not None and first <= rows <= SKINNY_MAX_ROWS and not torch.is_grad_enabled():
            seen["qualifying"] += 1
            seen["strided"] += not module.weight.is_contiguous()

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
    if dtype == "float32" or bf16_on_kernel():
        assert calls > 0, f"{name}: the {dtype} decode step did not run the kernel"
    else:   # bfloat16 without AVX512-BF16 stays with torch (shardformer.layer.linear.skinny_min_rows)
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


def bf16_batch1_decode(ctx, name: str, default_group: bool) -> dict:
    """Batch-1 greedy decoding in bfloat16 (one row per layer call), sharded
    with the kernel (the plain ShardConfig() or the explicit group): the
    tokens equal the unsharded model's, every qualifying layer call ran the
    kernel (none where the CPU lacks AVX512-BF16), and one cached decode
    step's logits equal the unsharded model's within bf16's parity tolerance."""
    torch.manual_seed(0)
    model = zoo.build(name).to(torch.bfloat16).eval()
    ref = copy.deepcopy(model)
    cfg = ShardConfig(enable_skinny_linear=True) if default_group else \
        ShardConfig(tensor_parallel_process_group=ctx.group, enable_skinny_linear=True)
    ShardFormer(shard_config=cfg).optimize(model)
    seen, handles = _count_qualifying(model)
    before = ops.CALLS["skinny_linear"]
    prompt = parity.prompt_ids()[:1]
    tokens = parity.greedy_matches(model, ref, {"input_ids": prompt}, name, 4)
    with torch.no_grad():
        got = model(tokens[:, -1:], past_key_values=model(tokens[:, :-1], use_cache=True).past_key_values).logits
        exp = ref(tokens[:, -1:], past_key_values=ref(tokens[:, :-1], use_cache=True).past_key_values).logits
    calls = ops.CALLS["skinny_linear"] - before
    for h in handles:
        h.remove()
    assert calls == seen["qualifying"], f"{name}: the kernel ran {calls} times for {seen['qualifying']} qualifying calls"
    assert (calls > 0) == bf16_on_kernel(), f"{name}: {calls} kernel calls in bf16 (AVX512-BF16: {bf16_on_kernel()})"
    parity.assert_close(f"{name} bf16 decode-step logits", got, exp, parity.TOL[torch.bfloat16])
    return {"tokens": tokens.tolist(), "calls": calls}


def mapped_column_shards_decode(ctx, directory: str) -> dict:
    """A Llama checkpoint loaded by ShardFormer.from_pretrained(mmap=True)
    with the kernel on (plain ShardConfig()): the column shards of o_proj and
    down_proj are strided views of the mapped tensors, and a decode step of
    2 sequences runs every qualifying call through the kernel, those on the
    strided views read in place (counted: no fallback to F.linear, no copy);
    the logits equal the unsharded model's."""
    import transformers

    from .load_pretrained import _save_hf

    name = "LlamaForCausalLM"
    _save_hf(ctx, name, directory)
    model, _ = ShardFormer(ShardConfig(enable_skinny_linear=True)).from_pretrained(
        transformers.LlamaForCausalLM, directory, attn_implementation="eager", mmap=True)
    model.eval()
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj").weight
    assert not o_proj.is_contiguous() and o_proj.stride()[1] == 1, (
        f"{name}: o_proj's column shard {tuple(o_proj.shape)} should be a strided view, strides {o_proj.stride()}")
    ref = zoo.build(name).eval()
    seen, handles = _count_qualifying(model)
    prompt, nxt = parity.prompt_ids(), torch.tensor([[7], [11]])
    with torch.no_grad():
        past = model(prompt, use_cache=True).past_key_values
        before, strided = ops.CALLS["skinny_linear"], ops.CALLS["skinny_linear_strided"]
        got = model(nxt, past_key_values=past, use_cache=True).logits
        calls, strided = ops.CALLS["skinny_linear"] - before, ops.CALLS["skinny_linear_strided"] - strided
        exp = ref(nxt, past_key_values=ref(prompt, use_cache=True).past_key_values, use_cache=True).logits
    for h in handles:
        h.remove()
    assert calls == seen["qualifying"] > 0, f"{name}: the kernel ran {calls} times for {seen['qualifying']} calls"
    assert strided == seen["strided"] > 0, (f"{name}: {strided} kernel calls on strided weights, "
                                            f"{seen['strided']} layer calls had one")
    parity.assert_close(f"{name} mapped decode-step logits", got, exp, parity.TOL[torch.float32])
    return {"calls": calls, "strided": strided}
