"""The decode fast path (shardformer.decode, docs/decode.md): generate() of a
tensor-parallel Llama-shaped model runs each decode step as one lean loop
over the shards; tokens and every step's logits equal the unsharded HF
model's generate() (fp32), at TP=2 and 4, greedy and sampled (each rank
seeded differently), with GQA (KV heads fewer than ranks: Qwen3's 1, Llama's
2 at TP=4), uneven heads and vocabulary (101), left padding, q/k/v biases
and tied embeddings (Qwen2), per-head q/k norms (Qwen3) and a sliding window
the sequence outgrows (Mistral); every decode step counted as the fast
path's, so a silent fallback fails.  Where it does not apply, HF's forward
runs, counted with its reason."""
from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("tp", [2, 4])
def test_fast_decode_default_group(world_pool, tp):
    out = world_pool(tp).run(check.generate_equals_hf, tp, "LlamaForCausalLM", "sample", default_group=True)
    assert all(o == out[0] for o in out)


def test_fast_decode_falls_back_counted(pool):
    hidden = pool.run(check.fallback_equals_hf, 2, "LlamaForCausalLM", "hidden")[0]
    assert hidden["fast"] == 0 and hidden["fallback"] == {"output_attentions / output_hidden_states": 6}, hidden
    fused = pool.run(check.fallback_equals_hf, 2, "LlamaForCausalLM", "fused")[0]
    assert fused["fast"] == 0 and "model.layers.0.input_layernorm is FusedRMSNorm" in fused["off"], fused
    off = pool.run(check.fallback_equals_hf, 2, "LlamaForCausalLM", "disabled")[0]
    assert off["fast"] == 0 and "enable_fast_decode=False" in off["off"], off
