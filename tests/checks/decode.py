"""Rank-side checks of the decode fast path (shardformer.decode): generate()
of the sharded model against the unsharded HF model from the same seed."""
from __future__ import annotations

import copy

import torch

import zoo
from checks.parity import TOL, assert_close, prompt_ids
from shardformer import ShardConfig, ShardFormer, decode

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, top_p=1.0),
}


def _generate(model, prompt, mask, kwargs):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **kwargs)


def _build(name: str, window: int | None = None):
    torch.manual_seed(0)
    model = zoo.build(name).eval()
    if window is not None:                   # shared by every module's config: HF's masks and caches follow
        model.config.sliding_window = window
    return model, copy.deepcopy(model)


def generate_equals_hf(ctx, name: str, mode: str = "greedy", default_group: bool = False,
                       padded: bool = False, window: int | None = None) -> dict:
    """generate() of the sharded model (rank i seeded 100 + i) returns the
    tokens and every step's logits of the unsharded model's (seeded 100),
    with every decode step run by the fast path (stats counted).  padded:
    row 0 left-padded by 2; window: a sliding window (5 + 6 tokens outgrow 7)."""
    model, ref = _build(name, window)
    config = ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)
    ShardFormer(config).optimize(model)
    prompt = prompt_ids()
    mask = torch.ones_like(prompt)
    if padded:                               # left padding: row 0 starts two tokens late
        prompt[0, :2] = 0
        mask[0, :2] = 0
    kwargs = MODES[mode]
    decode.reset_stats(model)
    torch.manual_seed(100 + ctx.rank)
    got = _generate(model, prompt, mask, kwargs)
    torch.manual_seed(100)
    exp = _generate(ref, prompt, mask, kwargs)
    assert torch.equal(got.sequences, exp.sequences), \
        f"{name} {mode}: rank {ctx.rank} decoded\n{got.sequences}\nHF\n{exp.sequences}"
    for step, (a, b) in enumerate(zip(got.logits, exp.logits)):
        assert_close(f"{name} {mode} logits of step {step}", a, b, TOL[torch.float32])
    stats = decode.stats(model)
    steps = len(exp.logits) - 1              # the first is the prefill, HF's forward
    assert stats["off"] is None, f"{name}: fast path off: {stats['off']}"
    assert stats["fast"] == steps, f"{name}: {stats['fast']} of {steps} decode steps took the fast path: {stats}"
    assert sum(stats["fallback"].values()) == 1, f"{name}: {stats}"
    return {"tokens": got.sequences.tolist(), "fast": stats["fast"]}


def explore(ctx, name):
    torch.manual_seed(0)
    model = zoo.build(name).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    orig = model.forward
    def spy(*a, **k):
        if ctx.rank == 0:
            print({kk: (tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for kk, v in k.items()})
        return orig(*a, **k)
    model.__dict__["forward"] = spy
    with torch.no_grad():
        model.generate(prompt_ids(), attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=3, pad_token_id=0)
    model.__dict__["forward"] = orig
    return decode.stats(model)


def fallback_equals_hf(ctx, name: str, how: str) -> dict:
    """Where the step does not apply, generate() still equals HF's through
    HF's forward, and stats() says why: "hidden" -- output_hidden_states
    (every call HF's, counted per call); "fused" -- fused norms (not HF's
    RMSNorm modules): the model off, named by module path; "disabled" --
    ShardConfig(enable_fast_decode=False): not installed."""
    model, ref = _build(name)
    options = {"fused": dict(enable_fused_normalization=True), "disabled": dict(enable_fast_decode=False)}
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **options.get(how, {}))).optimize(model)
    prompt = prompt_ids()
    extra = dict(MODES["greedy"], output_hidden_states=how == "hidden")
    got = _generate(model, prompt, torch.ones_like(prompt), extra)
    exp = _generate(ref, prompt, torch.ones_like(prompt), extra)
    assert torch.equal(got.sequences, exp.sequences), f"{name} {how}:\n{got.sequences}\nHF\n{exp.sequences}"
    for step, (a, b) in enumerate(zip(got.logits, exp.logits)):
        assert_close(f"{name} {how} logits of step {step}", a, b, TOL[torch.float32])
    return decode.stats(model)
