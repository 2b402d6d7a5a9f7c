"""Decoder-only language-model families other than Llama and GPT-2 (the
models of decoders.decoders): every class sharded at TP=2
and TP=4 against the unsharded HF model from the same seed (outputs, loss,
every gradient, outputs after an SGD step), greedy generate() equality, and
the family-specific parts (GQA/MQA replication, fused qkv / gate_up,
sparse experts, scaled embeddings, tied embeddings)."""
from __future__ import annotations


import pytest
import torch

from checks import parity
from shardformer import ShardConfig, ShardFormer
from zoo import decoders

NAMES = sorted(decoders.MODELS)


# ---- rank functions (run on every rank of the pool) ----

def check(ctx, name: str, overrides: dict | None = None):
    overrides = overrides or {}
    return parity.check_sharded(ctx, lambda: decoders.build(name, **overrides), decoders.make_inputs(name),
                                name=f"{name}{overrides or ''}")


def _sharded_pair(ctx, name, seed=0, **overrides):
    return parity.sharded_pair(ctx, decoders.build(name, seed=seed, **overrides))


def generate_matches(ctx, name: str, overrides: dict | None = None, new_tokens: int = 5):
    model, ref = _sharded_pair(ctx, name, **(overrides or {}))
    return parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, new_tokens).tolist()


def local_shapes(ctx, name: str, overrides: dict | None = None):
    """{parameter name: local shape} of the sharded model, and its tied-ness."""
    model, ref = _sharded_pair(ctx, name, **(overrides or {}))
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    tied = ref_tied = None
    if hasattr(model, "lm_head"):
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        ref_tied = ref.lm_head.weight is ref.get_input_embeddings().weight
    return {"shapes": shapes, "tied": tied, "ref_tied": ref_tied}


def scaled_embedding_matches(ctx, name: str):
    """Gemma's embedding output (scaled by sqrt(hidden)) equals HF's."""
    model, ref = _sharded_pair(ctx, name)
    ids = decoders.make_inputs(name)["input_ids"]
    with torch.no_grad():
        got, exp = model.get_input_embeddings()(ids), ref.get_input_embeddings()(ids)
        plain = torch.nn.functional.embedding(ids, ref.get_input_embeddings().weight)
    assert not torch.allclose(exp, plain), "the reference embedding is not scaled"
    parity.assert_close(f"{name} embedding", got, exp, parity.TOL[torch.float32])
    return True


# ---- tests ----

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_backward_step(pool, name, tp):
    reports = pool.run(check, tp, name)
    assert all(r["tp"] == tp and r["param_fraction"] < 1 for r in reports)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", decoders.CAUSAL_LMS)
def test_generate_matches_unsharded(pool, name, tp):
    tokens = pool.run(generate_matches, tp, name)
    assert all(t == tokens[0] for t in tokens)


def test_gqa_kv_heads_replicated_at_tp4(pool):
    """Mistral: 6 query heads over 2 KV heads at TP=4 -> each rank 1 KV head
    (replicated on 2 ranks) and 2 or 1 query heads (uneven)."""
    res = pool.run(local_shapes, 4, "MistralForCausalLM")
    q = [r["shapes"]["model.layers.0.self_attn.q_proj.weight"][0] for r in res]
    k = [r["shapes"]["model.layers.0.self_attn.k_proj.weight"][0] for r in res]
    assert q == [16, 8, 16, 8] and k == [8, 8, 8, 8], (q, k)
    vocab = [r["shapes"]["lm_head.weight"][0] for r in res]
    assert len(set(vocab)) == 1 and vocab[0] * 4 >= 101


def test_mqa_single_kv_head(pool):
    """Qwen3 with one KV head: every rank holds it, query heads 5 -> 2,1,1,1."""
    res = pool.run(local_shapes, 4, "Qwen3ForCausalLM")
    q = [r["shapes"]["model.layers.0.self_attn.q_proj.weight"][0] // 12 for r in res]
    k = [r["shapes"]["model.layers.0.self_attn.k_proj.weight"][0] // 12 for r in res]
    assert q == [2, 1, 1, 1] and k == [1, 1, 1, 1], (q, k)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_tied_embeddings(pool, tp):
    res = pool.run(local_shapes, tp, "Qwen2ForCausalLM")
    assert all(r["tied"] is True for r in res)
    res = pool.run(local_shapes, tp, "Qwen2ForCausalLM", {"tie_word_embeddings": False})
    assert all(r["tied"] is False for r in res)
    pool.run(check, tp, "Qwen2ForCausalLM", {"tie_word_embeddings": False})


@pytest.mark.parametrize("name", decoders.CAUSAL_LMS)
def test_lm_head_tied_as_in_hf(pool, name):
    """The sharded LM head is tied to the sharded embedding exactly when HF ties them."""
    res = pool.run(local_shapes, 2, name)
    assert all(r["tied"] == r["ref_tied"] for r in res), (name, res[0]["tied"], res[0]["ref_tied"])


@pytest.mark.parametrize("name", ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_scaled_embedding(pool, name):
    pool.run(scaled_embedding_matches, 2, name)


def test_phi3_fused_qkv_and_gate_up(pool):
    """qkv_proj rows per rank at TP=4: q heads 2,1,2,1 + one KV head each for k and v;
    gate_up_proj rows: this rank's slice of gate and of up (90 -> 23,23,22,22)."""
    res = pool.run(local_shapes, 4, "Phi3ForCausalLM")
    qkv = [r["shapes"]["model.layers.0.self_attn.qkv_proj.weight"][0] // 8 for r in res]
    gate_up = [r["shapes"]["model.layers.0.mlp.gate_up_proj.weight"][0] for r in res]
    assert qkv == [4, 3, 4, 3], qkv
    assert gate_up == [46, 46, 44, 44], gate_up


def test_mixtral_experts_split(pool):
    """Every expert's intermediate features (30) split 8,8,7,7; the router replicated."""
    res = pool.run(local_shapes, 4, "MixtralForCausalLM")
    for r, inter in zip(res, [8, 8, 7, 7]):
        s = r["shapes"]
        assert s["model.layers.0.mlp.experts.gate_up_proj"] == (3, 2 * inter, 48), s
        assert s["model.layers.0.mlp.experts.down_proj"] == (3, 48, inter), s
        assert s["model.layers.0.mlp.gate.weight"] == (3, 48), s


def check_padded(ctx, name: str, overrides: dict | None = None):
    """check_sharded with left padding in the batch (ALiBi positions and masks)."""
    overrides = overrides or {}
    inputs = decoders.make_inputs(name)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :3] = 0
    inputs["attention_mask"] = mask
    return parity.check_sharded(ctx, lambda: decoders.build(name, **overrides), inputs, name=f"{name} padded")


def local_alibi(ctx):
    """This rank's ALiBi rows [batch * local_heads, 1, seq] and head count."""
    model, _ = _sharded_pair(ctx, "BloomModel")
    mask = torch.ones(2, 7)
    mask[1, :2] = 0
    alibi = model.build_alibi_tensor(mask, model.num_heads, torch.float32)
    heads = model.h[0].self_attention.num_heads
    return alibi.view(2, heads, 1, 7).numpy(), heads


def refused_unchanged(ctx, name: str, overrides: dict):
    """optimize() raises ValueError and leaves the model as it was; returns the message."""
    model = decoders.build(name, **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    text = repr(model)
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name}{overrides}: optimize() did not raise")
    assert repr(model) == text, "module tree changed after a failed optimize()"
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "weights changed after a failed optimize()"
    return message


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", ["new_arch", "per_head"])
def test_falcon_qkv_layouts(pool, layout, tp):
    overrides = decoders.FALCON_NEW_ARCH if layout == "new_arch" else decoders.FALCON_PER_HEAD
    pool.run(check, tp, "FalconForCausalLM", overrides)
    pool.run(check, tp, "FalconForSequenceClassification", overrides)
    tokens = pool.run(generate_matches, tp, "FalconForCausalLM", overrides)
    assert all(t == tokens[0] for t in tokens)


def test_falcon_new_arch_groups_at_tp4(pool):
    """6 query heads in 2 KV groups at TP=4: ranks hold 2,1,2,1 query heads and
    one (replicated) KV head each: query_key_value rows (q + 2) * head_dim."""
    res = pool.run(local_shapes, 4, "FalconForCausalLM", decoders.FALCON_NEW_ARCH)
    rows = [r["shapes"]["transformer.h.0.self_attention.query_key_value.weight"][0] // 8 for r in res]
    assert rows == [4, 3, 4, 3], rows


@pytest.mark.parametrize("tp", [2, 4])
def test_bloom_alibi_follows_heads(pool, tp):
    """Every rank's ALiBi rows are the full model's rows of its own heads, in order."""
    import numpy as np
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    res = pool.run(local_alibi, tp)
    assert sum(h for _, h in res) == 6 and all(h >= 1 for _, h in res)
    got = np.concatenate([a for a, _ in res], axis=1)
    mask = torch.ones(2, 7)
    mask[1, :2] = 0
    full = build_alibi_tensor(mask, 6, torch.float32).view(2, 6, 1, 7).numpy()
    assert np.array_equal(got, full)
    pool.run(check_padded, tp, "BloomForCausalLM")


def test_falcon_alibi_refused(pool):
    message = pool.run(refused_unchanged, 2, "FalconForCausalLM", {"alibi": True})[0]
    assert "FalconForCausalLM" in message and "alibi" in message


def test_uneven_kv_split(pool):
    """3 KV heads over 2 ranks: 2 + 1 KV heads with their 4 + 2 query heads."""
    res = pool.run(local_shapes, 2, "MistralForCausalLM", {"num_key_value_heads": 3})
    k = [r["shapes"]["model.layers.0.self_attn.k_proj.weight"][0] // 8 for r in res]
    assert k == [2, 1], k
    pool.run(check, 2, "MistralForCausalLM", {"num_key_value_heads": 3})


def test_mixtral_jitter_refused(pool):
    message = pool.run(refused_unchanged, 2, "MixtralForCausalLM", {"router_jitter_noise": 0.1})[0]
    assert "MixtralForCausalLM" in message and "router_jitter_noise=0.1" in message, message


def test_bad_kv_split_refused(pool):
    """3 KV heads cannot be replicated evenly over 4 ranks: a clear error naming
    the model, the module and the numbers, before any change."""
    message = pool.run(refused_unchanged, 4, "MistralForCausalLM", {"num_key_value_heads": 3})[0]
    assert "MistralForCausalLM" in message and "num_key_value_heads=3" in message, message
    assert "tensor_parallel_size=4" in message, message


def state_dict_round_trip(ctx, name: str, overrides: dict | None = None):
    """gather_full_state_dict gives back the unsharded HF state dict exactly;
    loading it into a model sharded from another seed restores the outputs."""
    from shardformer.checkpoint import gather_full_state_dict, load_full_state_dict

    overrides = overrides or {}
    model, ref = _sharded_pair(ctx, name, **overrides)
    full, exp = gather_full_state_dict(model), ref.state_dict()
    assert full.keys() == exp.keys(), set(full) ^ set(exp)
    for k in exp:
        assert torch.equal(full[k], exp[k]), f"{name}: gathered {k} differs"
    other, _ = _sharded_pair(ctx, name, seed=123, **overrides)
    load_full_state_dict(other, full)
    inputs = {k: v for k, v in decoders.make_inputs(name).items() if k == "input_ids"}
    with torch.no_grad():
        parity.check_outputs(name, other(**inputs), ref(**inputs), parity.TOL[torch.float32])
    return len(full)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name, overrides", [
    ("MixtralForCausalLM", None),
    ("Phi3ForCausalLM", None),
    ("FalconForCausalLM", decoders.FALCON_NEW_ARCH),
    ("BloomForCausalLM", None),
    ("Gemma3ForCausalLM", None),
])
def test_state_dict_round_trip(pool, name, overrides, tp):
    pool.run(state_dict_round_trip, tp, name, overrides)


@pytest.mark.parametrize("name", ["MistralForCausalLM", "OPTForCausalLM", "FalconForCausalLM", "Qwen3ForCausalLM"])
def test_fused_normalization(pool, name):
    pool.run(check_fused, 2, name)


def check_fused(ctx, name: str):
    return parity.check_sharded(ctx, lambda: decoders.build(name), decoders.make_inputs(name), name=name,
                                config={"enable_fused_normalization": True})


def check_bf16(ctx, name: str):
    return parity.check_sharded(ctx, lambda: decoders.build(name, torch.bfloat16), decoders.make_inputs(name),
                                name=name, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["MistralForCausalLM", "MixtralForCausalLM", "FalconForCausalLM", "BloomForCausalLM"])
def test_bf16_forward(pool, name):
    pool.run(check_bf16, 4, name)


def test_grouped_qkv_spec():
    """Falcon's grouped rows [q q q k v | q q q k v] (head_dim 1) over 4 ranks:
    each rank keeps its query heads of its group, then that group's k and v."""
    from shardformer.layout import Heads

    spec = Heads(6, 2, 1).grouped_qkv
    shards = [spec.resolve(10, 4, r) for r in range(4)]
    assert [s.ranges for s in shards] == [((0, 2), (3, 2)), ((2, 1), (3, 2)), ((5, 2), (8, 2)), ((7, 1), (8, 2))]
    assert [s.length for s in shards] == [4, 3, 4, 3] and shards[0].replicated
    even = [Heads(4, 2, 1).grouped_qkv.resolve(8, 2, r).ranges for r in range(2)]
    assert even == [((0, 2), (2, 2)), ((4, 2), (6, 2))]
    with pytest.raises(ValueError, match="GroupedQKV"):
        spec.resolve(11, 4, 0)


@pytest.mark.parametrize("tp", [2, 4])
def test_mixtral_router_aux_loss(pool, tp):
    """With output_router_logits the load-balancing loss (from the replicated
    router) joins the LM loss; both and the router's gradient must match."""
    reports = pool.run(check, tp, "MixtralForCausalLM", {"output_router_logits": True, "router_aux_loss_coef": 0.5})
    assert all(r["grad"] < 1e-4 for r in reports)
