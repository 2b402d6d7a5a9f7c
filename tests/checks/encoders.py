"""Rank-side checks of the encoder and encoder-decoder families and ChatGLM2
(tests/test_models_encoders.py, models of zoo.encoders): each function runs
on every rank of the pool."""
from __future__ import annotations

from checks import parity
from zoo import encoders


def check_model(ctx, name: str, config=None, dtype_name: str = "float32") -> dict:
    import torch

    dtype = getattr(torch, dtype_name)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in encoders.make_inputs(name).items()}
    return parity.check_sharded(ctx, lambda: encoders.build(name, dtype), inputs,
                                name=name, config=config, dtype=dtype)


def _shard(ctx, model, **config):
    from shardformer import ShardConfig, ShardFormer

    return ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config)).optimize(model)[0]


def generate_matches(ctx, name: str, new_tokens: int = 5):
    """Greedy generate() of the sharded model equals the unsharded one."""
    import copy

    import torch

    model = encoders.build(name)
    model.eval()
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    inputs = encoders.make_inputs(name)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    if "input_features" in inputs:
        prompt = {"input_features": inputs["input_features"]}
    else:
        prompt = {"input_ids": inputs["input_ids"][:, :5]}
    with torch.no_grad():
        if hasattr(model, "greedy"):
            got, exp = model.greedy(prompt["input_ids"], new_tokens), ref.greedy(prompt["input_ids"], new_tokens)
        else:
            kwargs["pad_token_id"] = 0
            got, exp = model.generate(**prompt, **kwargs), ref.generate(**prompt, **kwargs)
    got = getattr(got, "sequences", got)
    exp = getattr(exp, "sequences", exp)
    assert torch.equal(got, exp), f"{name}: generate() differs:\n{got}\n{exp}"
    assert got.shape[1] >= new_tokens, got.shape
    return got.tolist()


def t5_relative_bias_and_ties(ctx, name: str):
    """The relative position bias table [buckets, n_heads] of each stack's
    first layer holds this rank's heads, the same heads as q/k/v; every
    T5Attention's n_heads is local; the embeddings and LM head stay tied."""
    import copy

    import torch

    from shardformer.layer import Embedding1D

    model = encoders.build(name)
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    local = None
    for stack in ("encoder", "decoder"):
        attn = model.get_submodule(f"{stack}.block.0.layer.0.SelfAttention")
        ref_attn = ref.get_submodule(f"{stack}.block.0.layer.0.SelfAttention")
        table = attn.relative_attention_bias
        assert isinstance(table, Embedding1D) and not table.gather_output, type(table)
        local = attn.n_heads
        start = attn.q.shard.ranges[0][0] // ref.config.d_kv
        assert table.weight.shape == (ref.config.relative_attention_num_buckets, local), table.weight.shape
        assert torch.equal(table.weight, ref_attn.relative_attention_bias.weight[:, start:start + local])
        with torch.no_grad():
            got, exp = attn.compute_bias(5, 7), ref_attn.compute_bias(5, 7)
        assert torch.equal(got, exp[:, start:start + local]), "compute_bias: not this rank's heads"
    for m in model.modules():
        if type(m).__name__ == "T5Attention":
            assert m.n_heads == local and m.inner_dim == local * ref.config.d_kv, (m.n_heads, m.inner_dim)
            assert m.q.weight.shape[0] == m.inner_dim
    shared = model.shared.weight
    for path in ("encoder.embed_tokens", "decoder.embed_tokens", "lm_head"):
        assert model.get_submodule(path).weight is shared, f"{path} is no longer tied to shared"
    return {"local_heads": local, "scale_decoder_outputs": bool(ref.config.scale_decoder_outputs)}


def albert_shared_layer(ctx, overrides: dict):
    """ALBERT's layer groups are called num_hidden_layers times but exist
    once: each is split exactly once, and the gradients of the shared layer
    (accumulated over every call) match the unsharded ones."""
    import copy

    from shardformer.layer import Linear1D_Col

    name = "AlbertForMaskedLM"
    model = encoders.build(name, **overrides)
    cfg = copy.deepcopy(model.config)
    _shard(ctx, model)
    cols = [n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, Linear1D_Col)
            and n.endswith("attention.query")]
    assert len(cols) == cfg.num_hidden_groups * cfg.inner_group_num, cols
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    local = []
    for group in model.albert.encoder.albert_layer_groups:
        for layer in group.albert_layers:
            q = layer.attention.query
            assert q.weight.shape == (layer.attention.num_attention_heads * head_dim, cfg.hidden_size), q.weight.shape
            local.append(layer.attention.num_attention_heads)
    report = parity.check_sharded(ctx, lambda: encoders.build(name, **overrides),
                                  encoders.make_inputs(name), name=f"{name}{overrides}")
    report["local_heads"] = local
    return report


def whisper_front_end(ctx, name: str):
    """The audio front-end stays replicated (full conv and position weights,
    equal to the unsharded ones); attention modules hold local heads."""
    import copy

    import torch
    from torch import nn

    model = encoders.build(name)
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    enc, ref_enc = model.get_encoder(), ref.get_encoder()
    for part in ("conv1", "conv2", "embed_positions"):
        m, r = getattr(enc, part), getattr(ref_enc, part)
        assert type(m) in (nn.Conv1d, nn.Embedding), (part, type(m))
        assert torch.equal(m.weight, r.weight), part
    heads = sorted({m.num_heads for m in model.modules() if type(m).__name__ == "WhisperAttention"})
    assert len(heads) == 1, heads
    if hasattr(model, "proj_out"):
        assert model.proj_out.weight is model.get_input_embeddings().weight, "proj_out untied"
    return heads[0]


def chatglm2_layout(ctx):
    """Per-rank attention sizes of ChatGLM2's multi-query attention, and the
    rank's [q | k | v] rows of query_key_value cut from the full weight."""
    import copy

    import torch

    name = "ChatGLMForConditionalGeneration"
    model = encoders.build(name)
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    attn = model.transformer.encoder.layers[0].self_attention
    ref_attn = ref.transformer.encoder.layers[0].self_attention
    n, g, d = attn.num_attention_heads_per_partition, attn.num_multi_query_groups_per_partition, 8
    w = attn.query_key_value.weight
    assert w.shape[0] == (n + 2 * g) * d, w.shape
    assert attn.core_attention.hidden_size_per_partition == n * d
    full = ref_attn.query_key_value.weight
    (qs, qn), (ks, kn), (vs, vn) = attn.query_key_value.shard.ranges
    assert qn == n * d and kn == vn == g * d and ks - 48 == vs - 64  # q: 48 rows, k and v: 16 each
    assert torch.equal(w, torch.cat([full[qs:qs + qn], full[ks:ks + kn], full[vs:vs + vn]]))
    return {"heads": n, "groups": g, "q_start": qs // d, "kv_start": (ks - 48) // d}


def bad_config_raises(ctx, name: str, overrides: dict):
    """optimize() raises a clear error before changing the model."""
    import torch

    model = encoders.build(name, **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    text = repr(model)
    try:
        _shard(ctx, model)
    except (ValueError, TypeError) as e:
        message = str(e)
    else:
        raise AssertionError("optimize() did not raise")
    assert repr(model) == text, "module tree changed after a failed optimize()"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    return message


def state_dict_round_trip(ctx, name: str):
    """gather_full_state_dict of the sharded model equals the unsharded HF
    state dict; loaded into a sharded model from another seed it gives the
    original outputs."""
    import copy

    import torch

    from shardformer.checkpoint import gather_full_state_dict, load_full_state_dict

    model = encoders.build(name)
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    full = gather_full_state_dict(model)
    exp = ref.state_dict()
    assert full.keys() == exp.keys(), set(full) ^ set(exp)
    for k in exp:
        assert torch.equal(full[k], exp[k]), f"{name}: gathered {k} differs"
    other = encoders.build(name, seed=123)
    _shard(ctx, other)
    load_full_state_dict(other, full)
    inputs = encoders.make_inputs(name)
    with torch.no_grad():
        parity.check_outputs(name, other(**inputs), ref(**inputs), parity.TOL[torch.float32])
    return len(full)
