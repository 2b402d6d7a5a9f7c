"""The decode fast path (shardformer.decode, docs/decode.md): generate() of a
tensor-parallel Llama-shaped model runs each decode step as one lean loop
over the shards; tokens and every step's logits equal the unsharded HF
model's generate() (fp32), at TP=2 and 4, greedy and sampled (each rank
seeded differently), with GQA (KV heads fewer than ranks: Qwen3's 1, Llama's
2 at TP=4), uneven heads and vocabulary (101), left padding, q/k/v biases
and tied embeddings (Qwen2), per-head q/k norms (Qwen3) and a sliding window
the sequence outgrows (Mistral); every decode step counted as the fast
path's, so a silent fallback fails; the same with enable_all_optimization
(FusedRMSNorm norms, run by the step through their own forward).  Where it
does not apply, HF's forward runs, counted with its reason, and the check
holds for every generate() call: hooks (per module or global) added and a
submodule replaced after a first generate() send the steps to HF's forward,
counted; a norm replaced by another of its kind is read afresh.  The fast
steps run the C layer loop (shardformer.decode_native; stats count it):
weights written in place are read afresh, a cache extended by HF's forward
between two fast steps is taken back, the all-reduces made from C are in
shardformer.comm_stats(); bf16 models run the C step too (tokens equal, logits
within bf16's tolerance of the unsharded bf16 model's)."""
from __future__ import annotations

import pytest
import torch

from checks import decode as check

# (model, decoding, left padding, sliding window)
CASES = [
    ("LlamaForCausalLM", "greedy", False, None),
    ("LlamaForCausalLM", "sample", True, None),
    ("Qwen2ForCausalLM", "greedy", True, None),
    ("Qwen3ForCausalLM", "sample", False, None),
    ("MistralForCausalLM", "greedy", True, 7),
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,mode,padded,window", CASES)
def test_fast_decode_equals_hf(pool, name, mode, padded, window, tp):
    out = pool.run(check.generate_equals_hf, tp, name, mode, padded=padded, window=window)
    assert all(o == out[0] for o in out)
    _assert_c_step(out[0], window)


def _assert_c_step(case: dict, window) -> None:
    """Every fast step ran the C layer loop, or (a sliding-window cache) the
    Python step, counted with its reason."""
    if window is None:
        assert case["c_step"] == case["fast"] and not case["python_step"], case
        assert not case["python_ends"], case         # the embedding, final norm and LM head in C too
    else:
        assert case["c_step"] == 0, case
        assert case["python_step"] == {"cache layer DynamicSlidingWindowLayer (the C step keeps full caches)":
                                       case["fast"]}, case


@pytest.mark.parametrize("tp", [2, 4])
def test_fast_decode_default_group(world_pool, tp):
    """Plain ShardConfig(): Llama fp32 (sampled), and a bf16 and an fp16
    model through the C step, embedding and head included (TP=2: Llama,
    greedy, left padded; TP=4: Qwen2, q/k/v biases, tied head; vocabulary
    101 over 2 or 4 ranks, padded), tokens equal and logits within the
    16-bit type's tolerance of the unsharded model's in that type."""
    half = ("LlamaForCausalLM", "greedy", True, None) if tp == 2 else ("Qwen2ForCausalLM", "greedy", False, None)
    cases = [("LlamaForCausalLM", "sample", False, None), half + (torch.bfloat16,), half + (torch.float16,)]
    out = world_pool(tp).run(check.cases_equal_hf, tp, cases, {}, default_group=True)
    assert all(o == out[0] for o in out)
    for case in out[0]:
        _assert_c_step(case, None)
    kept = world_pool(tp).run(check.kept_caches_equal_hf, tp, default_group=True)[0]
    # 5 decode steps for each prompt, 6 for each continuation (its one uncached token is a decode step too)
    assert kept["c_step"] == kept["fast"] == 22, kept


def test_fast_decode_kept_caches_explicit_group(pool):
    """Two groups of 2 on 4 ranks: a kept past_key_values is not written by
    later generate() calls (checks.decode.kept_caches_equal_hf)."""
    kept = pool.run(check.kept_caches_equal_hf, 2)[0]
    # 5 decode steps for each prompt, 6 for each continuation (its one uncached token is a decode step too)
    assert kept["c_step"] == kept["fast"] == 22, kept


def test_fast_decode_falls_back_counted(pool):
    hidden = pool.run(check.fallback_equals_hf, 2, "LlamaForCausalLM", "hidden")[0]
    assert hidden["fast"] == 0 and hidden["fallback"] == {"output_attentions / output_hidden_states": 6}, hidden
    off = pool.run(check.fallback_equals_hf, 2, "LlamaForCausalLM", "disabled")[0]
    assert off["fast"] == 0 and "enable_fast_decode=False" in off["off"], off
    torch_comm = pool.run(check.fallback_equals_hf, 2, "LlamaForCausalLM", "torch")[0]
    assert torch_comm["fast"] == 5 and torch_comm["c_step"] == 0, torch_comm
    assert list(torch_comm["python_step"].values()) == [5], torch_comm
    assert "not the shm backend" in next(iter(torch_comm["python_step"])), torch_comm


@pytest.mark.parametrize("tp", [2, 4])
def test_fast_decode_all_optimization(pool, tp):
    """enable_all_optimization's FusedRMSNorm (and flash attention, fused
    SwiGLU, skinny linear) keep the fast path: Llama (sampled, padded) and
    Qwen3 (per-head q/k norms)."""
    cases = [("LlamaForCausalLM", "sample", True, None), ("Qwen3ForCausalLM", "greedy", False, None)]
    out = pool.run(check.cases_equal_hf, tp, cases, dict(enable_all_optimization=True))
    assert all(o == out[0] for o in out)
    assert all(case["fast"] == 5 and case["fused_norms"] > 0 for case in out[0]), out[0]
    for case in out[0]:
        _assert_c_step(case, None)


def test_fast_decode_rechecked_each_generate(world_pool):
    """TP=2, plain ShardConfig(): changes after a first generate() are seen
    by the next one (checks.decode.changed_after_generate)."""
    out = world_pool(2).run(check.changed_after_generate, 2)
    stats = out[0]
    assert all(s == 5 for s in stats["steps"]), stats["steps"]
    for case in ("first", "norm replaced", "weights written", "ends hooked", "ends back"):
        assert stats[case]["off"] is None and stats[case]["fast"] == 5, (case, stats[case])
        assert stats[case]["c_step"] == 5, (case, stats[case])
        if case != "ends hooked":
            assert stats[case]["python_ends"] == {}, (case, stats[case])
    # hooked ends run as modules (HF's hooks see them), counted per C step
    assert stats["ends hooked"]["python_ends"] == {"forward hooks on model.model.embed_tokens": 5,
                                                  "forward hooks on model.lm_head": 5}, stats["ends hooked"]
    # two of the five decode steps ran HF's forward (uncounted); the C step took the cache back from HF
    assert stats["hf between"]["fast"] == 3 and stats["hf between"]["c_step"] == 3, stats["hf between"]
    assert stats["kv_buffers_left"] == 0, stats
    # the C step's all-reduces are in the ledger: 2 per layer per step (besides the embedding's and the prefill's)
    assert stats["first"]["all_reduces"] >= (2 * stats["first"]["layers"] + 1) * 5, stats["first"]
    assert stats["first"]["all_gathers"] >= 5, stats["first"]     # the logits' gather, made from C
    expected = {"hooks": "forward hooks on ['model.layers.0.mlp', 'model.layers.1.post_attention_layernorm']",
                "global hook": "global module forward hooks",
                "act_fn replaced": "model.layers.0.mlp.act_fn is GELU, not SiLU"}
    for case, reason in expected.items():
        s = stats[case]
        assert s["fast"] == 0 and reason in s["off"], (case, s)
        assert list(s["fallback"].values()) == [6] and reason in next(iter(s["fallback"])), (case, s)
