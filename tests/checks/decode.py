"""Rank-side checks of the decode fast path (shardformer.decode): generate()
of the sharded model against the unsharded HF model from the same seed."""
from __future__ import annotations

import copy
import gc

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import shardformer
import zoo
from checks.parity import TOL, assert_close, prompt_ids
from shardformer import ShardConfig, ShardFormer, decode
from shardformer.layer.normalization import FusedRMSNorm

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, top_p=1.0),
}


def _generate(model, prompt, mask, kwargs):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **kwargs)


def _build(name: str, window: int | None = None, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = zoo.build(name).eval().to(dtype)
    if window is not None:                   # shared by every module's config: HF's masks and caches follow
        model.config.sliding_window = window
    return model, copy.deepcopy(model)


def generate_equals_hf(ctx, name: str, mode: str = "greedy", default_group: bool = False,
                       padded: bool = False, window: int | None = None, options: dict | None = None,
                       dtype: torch.dtype = torch.float32) -> dict:
    """generate() of the sharded model (rank i seeded 100 + i) returns the
    tokens and every step's logits of the unsharded model's (seeded 100),
    with every decode step run by the fast path (stats counted).  padded:
    row 0 left-padded by 2; window: a sliding window (5 + 6 tokens outgrow 7);
    options: more ShardConfig switches (enable_all_optimization: every norm
    the optimizations replace is a FusedRMSNorm, run by the step); dtype:
    both models in it (bf16: logits within TOL[bfloat16] of HF's)."""
    model, ref = _build(name, window, dtype)
    options = options or {}
    config = ShardConfig(**options) if default_group else \
        ShardConfig(tensor_parallel_process_group=ctx.group, **options)
    ShardFormer(config).optimize(model)
    fused = sum(isinstance(m, FusedRMSNorm) for m in model.modules())
    if options.get("enable_all_optimization") or options.get("enable_fused_normalization"):
        assert fused >= 2 * model.config.num_hidden_layers + 1, f"{name}: {fused} FusedRMSNorm modules"
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
        assert_close(f"{name} {mode} {dtype} logits of step {step}", a, b, TOL[dtype])
    stats = decode.stats(model)
    steps = len(exp.logits) - 1              # the first is the prefill, HF's forward
    assert stats["off"] is None, f"{name}: fast path off: {stats['off']}"
    assert stats["fast"] == steps, f"{name}: {stats['fast']} of {steps} decode steps took the fast path: {stats}"
    assert sum(stats["fallback"].values()) == 1, f"{name}: {stats}"
    return {"tokens": got.sequences.tolist(), "fast": stats["fast"], "fused_norms": fused,
            "c_step": stats["c_step"], "python_step": stats["python_step"], "python_ends": stats["python_ends"]}


def cases_equal_hf(ctx, cases, options: dict, default_group: bool = False) -> list[dict]:
    """generate_equals_hf(name, mode, padded=, window=, options=, dtype=) for
    each case (name, mode, padded, window[, dtype]) of `cases`, in one pool call."""
    return [generate_equals_hf(ctx, *case[:2], padded=case[2], window=case[3], options=options,
                               default_group=default_group, dtype=case[4] if len(case) > 4 else torch.float32)
            for case in cases]


class _Toggle(LogitsProcessor):
    """Switches the fast path off after the first decode step and on again
    two steps later: HF's forward extends the cache in between, and the C
    step must take it from HF's cache layers."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls in (2, 4):
            decode.set_fast_decode(self.model, self.calls == 4)
        return scores


def _scale_output(module, args, output):
    return output * 1.5


def _halve_input(module, args):
    return (args[0] * 0.5,) + tuple(args[1:])


def changed_after_generate(ctx) -> dict:
    """TP=ctx.tp_size over ShardConfig() (the world): after a first
    generate() that took the fast path, each change below is made to the
    sharded model and to the unsharded one alike; the next generate() equals
    the unsharded model's (tokens and every step's logits), with the decode
    steps counted under the reason the fast path stepped aside (forward
    hook and pre-hook, a global module hook, a replaced activation), or (the
    hooks removed and a norm replaced by another RMSNorm) taken by the fast
    path, reading the modules the model holds now; hooks on the LM head and
    the embedding keep the C step for the layers, those two ends run as
    modules (counted), and in C again once the hooks are gone.  Returns
    stats per change."""
    from torch.nn.modules.module import register_module_forward_hook
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    model, ref = _build("LlamaForCausalLM")
    ShardFormer(ShardConfig()).optimize(model)
    prompt = prompt_ids()
    mask = torch.ones_like(prompt)
    steps = []

    def both(what: str, extra: dict | None = None) -> dict:
        decode.reset_stats(model)
        got = _generate(model, prompt, mask, dict(MODES["greedy"], **(extra or {})))
        exp = _generate(ref, prompt, mask, MODES["greedy"])
        assert torch.equal(got.sequences, exp.sequences), \
            f"{what}: rank {ctx.rank} decoded\n{got.sequences}\nHF\n{exp.sequences}\n{decode.stats(model)}"
        for step, (a, b) in enumerate(zip(got.logits, exp.logits)):
            assert_close(f"{what}: logits of step {step}", a, b, TOL[torch.float32])
        steps.append(len(exp.logits) - 1)
        return decode.stats(model)

    with shardformer.comm_stats() as ledger:
        out = {"first": both("first generate()")}
    out["first"]["all_reduces"] = ledger.summary().get("all_reduce", {}).get("calls", 0)
    out["first"]["all_gathers"] = ledger.summary().get("all_gather", {}).get("calls", 0)
    out["first"]["layers"] = model.config.num_hidden_layers
    pairs = [(m, m.model.layers[0]) for m in (model, ref)]
    handles = [layer.mlp.register_forward_hook(_scale_output) for _, layer in pairs]
    handles += [m.model.layers[1].post_attention_layernorm.register_forward_pre_hook(_halve_input) for m, _ in pairs]
    out["hooks"] = both("a forward hook on model.layers.0.mlp, a forward pre-hook on "
                        "model.layers.1.post_attention_layernorm")
    for h in handles:
        h.remove()
    handle = register_module_forward_hook(lambda m, a, o: o * 1.5 if isinstance(m, LlamaMLP) else None)
    try:
        out["global hook"] = both("a global module forward hook scaling the MLPs' outputs")
    finally:
        handle.remove()
    for m, layer in pairs:
        layer.mlp.act_fn = torch.nn.GELU().eval()
    out["act_fn replaced"] = both("model.layers.0.mlp.act_fn replaced by GELU")
    torch.manual_seed(3)
    norm = LlamaRMSNorm(ref.config.hidden_size, eps=ref.config.rms_norm_eps).eval()
    torch.nn.init.uniform_(norm.weight, -2.0, 2.0)
    for m, layer in pairs:
        layer.mlp.act_fn = torch.nn.SiLU().eval()
        m.model.layers[1].input_layernorm = copy.deepcopy(norm)
    out["norm replaced"] = both("hooks removed, model.layers.1.input_layernorm replaced by another LlamaRMSNorm")
    with torch.no_grad():                    # in place: same Parameter, same fingerprint, a new version
        for m in (model, ref):
            m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            m.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    out["weights written"] = both("k_proj of layer 0 and up_proj of layer 1 scaled in place")
    handles = [m.lm_head.register_forward_hook(_scale_output) for m in (model, ref)]
    handles += [m.model.embed_tokens.register_forward_hook(_scale_output) for m in (model, ref)]
    out["ends hooked"] = both("forward hooks on lm_head and model.embed_tokens: the C step runs the layers only")
    for h in handles:
        h.remove()
    out["ends back"] = both("the hooks on lm_head and model.embed_tokens removed")
    out["hf between"] = both("HF's forward for decode steps 2 and 3 (fast path off, then on again)",
                             dict(logits_processor=LogitsProcessorList([_Toggle(model)])))
    gc.collect()                             # the outputs (and their caches) are gone: so are the C step's buffers
    out["kv_buffers_left"] = len(model.__dict__["forward"].native._k)
    out["steps"] = steps
    return out


def fallback_equals_hf(ctx, name: str, how: str) -> dict:
    """Where the step does not apply, generate() still equals HF's through
    HF's forward, and stats() says why: "hidden" -- output_hidden_states
    (every call HF's, counted per call); "disabled" --
    ShardConfig(enable_fast_decode=False): not installed; "torch" -- the
    group's collectives on torch.distributed (SHARDFORMER_COMM=torch): the
    fast path's Python step, not the C loop (which calls shm from C)."""
    from checks.ring_attention import _backend

    model, ref = _build(name)
    options = {"disabled": dict(enable_fast_decode=False)}
    with _backend("torch" if how == "torch" else None):
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **options.get(how, {}))).optimize(model)
        prompt = prompt_ids()
        extra = dict(MODES["greedy"], output_hidden_states=how == "hidden")
        got = _generate(model, prompt, torch.ones_like(prompt), extra)
    exp = _generate(ref, prompt, torch.ones_like(prompt), extra)
    assert torch.equal(got.sequences, exp.sequences), f"{name} {how}:\n{got.sequences}\nHF\n{exp.sequences}"
    for step, (a, b) in enumerate(zip(got.logits, exp.logits)):
        assert_close(f"{name} {how} logits of step {step}", a, b, TOL[torch.float32])
    return decode.stats(model)


def _continue(model, out, **kwargs) -> object:
    """generate() continued from `out`'s sequences and the cache `kwargs` gives
    (default: `out`'s own past_key_values)."""
    kwargs.setdefault("past_key_values", out.past_key_values)
    seq = out.sequences
    return _generate(model, seq, torch.ones_like(seq), dict(MODES["greedy"], **kwargs))


def kept_caches_equal_hf(ctx, default_group: bool = False) -> dict:
    """Caches the caller keeps stay its own (Llama, batch 2, row 0 left
    padded): generate() A keeps its past_key_values; a fresh prompt is
    generated, a deep copy of A's cache continued (HF's prefix-reuse
    pattern), and A continued last.  Every result equals the unsharded model's doing the same,
    and A's cache tensors after all that equal what they were (the fast
    path's KV buffers of one cache are never written by another's steps)."""
    model, ref = _build("LlamaForCausalLM")
    config = ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)
    ShardFormer(config).optimize(model)
    prompt, other = prompt_ids(), prompt_ids(7)
    mask = torch.ones_like(prompt)
    prompt[0, :2] = 0
    mask[0, :2] = 0
    decode.reset_stats(model)
    runs = {}
    for tag, m in (("sharded", model), ("hf", ref)):
        a = _generate(m, prompt, mask, MODES["greedy"])
        kept = [(layer.keys.clone(), layer.values.clone()) for layer in a.past_key_values.layers]
        runs[tag] = dict(a=a, fresh=_generate(m, other, torch.ones_like(other), MODES["greedy"]))
        runs[tag]["copy"] = _continue(m, a, past_key_values=copy.deepcopy(a.past_key_values))
        for n, (layer, (k, v)) in enumerate(zip(a.past_key_values.layers, kept)):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v), \
                f"{tag}: rank {ctx.rank}: layer {n} of a kept past_key_values changed by later generate() calls"
        runs[tag]["continued"] = _continue(m, a)
    for what in ("a", "copy", "fresh", "continued"):
        got, exp = runs["sharded"][what], runs["hf"][what]
        assert torch.equal(got.sequences, exp.sequences), \
            f"kept caches, {what}: rank {ctx.rank} decoded\n{got.sequences}\nHF\n{exp.sequences}"
        for step, (x, y) in enumerate(zip(got.logits, exp.logits)):
            assert_close(f"kept caches, {what}: logits of step {step}", x, y, TOL[torch.float32])
    return decode.stats(model)
