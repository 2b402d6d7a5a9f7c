"""Multimodal Gemma 3 (Gemma3Model, Gemma3ForConditionalGeneration,
Gemma3ForSequenceClassification) at TP=2 and TP=4 against the unsharded HF
model from the same seed: outputs (image hidden states included), loss, every
gradient (vision tower, projector, text model, head) and outputs after an SGD
step; greedy generate() from an image prompt; the uneven SigLIP head split."""
from __future__ import annotations


import pytest
import torch

from checks import parity
from zoo import gemma3mm

NAMES = sorted(gemma3mm.MODELS)


# ---- rank functions (run on every rank of the pool) ----

def check(ctx, name: str, overrides: dict | None = None, config: dict | None = None, text_only: bool = False):
    overrides = overrides or {}
    inputs = gemma3mm.make_inputs(name)
    if text_only:
        inputs = {k: v for k, v in inputs.items() if k not in ("pixel_values", "token_type_ids")}
    return parity.check_sharded(ctx, lambda: gemma3mm.build(name, **overrides), inputs,
                                name=f"{name}{overrides or ''}", config=config,
                                fp64_floor=name in gemma3mm.FP64_FLOOR)


def _sharded_pair(ctx, name, **overrides):
    return parity.sharded_pair(ctx, gemma3mm.build(name, **overrides))


def generate_matches(ctx, name: str, new_tokens: int = 5):
    model, ref = _sharded_pair(ctx, name)
    return parity.greedy_matches(model, ref, gemma3mm.prompt(seed=3, length=8), name, new_tokens).tolist()


def local_shapes(ctx, name: str, overrides: dict | None = None):
    model, ref = _sharded_pair(ctx, name, **(overrides or {}))
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    heads = model.model.vision_tower.encoder.layers[0].self_attn.num_heads
    return {"shapes": shapes, "vision_heads": heads,
            "tied": model.lm_head.weight is model.get_input_embeddings().weight,
            "ref_tied": ref.lm_head.weight is ref.get_input_embeddings().weight}


def state_dict_round_trip(ctx, name: str):
    """gather_full_state_dict gives back the unsharded state dict exactly;
    loading it into a model sharded from another seed restores the outputs."""
    from shardformer.checkpoint import gather_full_state_dict, load_full_state_dict

    model, ref = _sharded_pair(ctx, name)
    full, exp = gather_full_state_dict(model), ref.state_dict()
    assert full.keys() == exp.keys(), set(full) ^ set(exp)
    for k in exp:
        assert torch.equal(full[k], exp[k]), f"{name}: gathered {k} differs"
    other, _ = _sharded_pair(ctx, name, seed=123)
    load_full_state_dict(other, full)
    inputs = gemma3mm.prompt()
    with torch.no_grad():
        parity.check_outputs(name, other(**inputs), ref(**inputs), parity.TOL[torch.float32])
    return len(full)


# ---- tests ----

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_backward_step(pool, name, tp):
    reports = pool.run(check, tp, name)
    assert all(r["tp"] == tp and r["param_fraction"] < 1 for r in reports)


@pytest.mark.parametrize("tp", [2, 4])
def test_generate_matches_unsharded(pool, tp):
    tokens = pool.run(generate_matches, tp, "Gemma3ForConditionalGeneration")
    assert all(t == tokens[0] for t in tokens)


def test_siglip_uneven_heads_and_tied_head(pool):
    """5 vision heads of width 8 at TP=4: 2,1,1,1 per rank (q/k/v rows, out_proj
    columns); fc1 70 features 18,18,17,17; the LM head tied as HF ties it."""
    res = pool.run(local_shapes, 4, "Gemma3ForConditionalGeneration")
    layer = "model.vision_tower.encoder.layers.0."
    assert [r["vision_heads"] for r in res] == [2, 1, 1, 1]
    for r, heads, fc1 in zip(res, [2, 1, 1, 1], [18, 18, 17, 17]):
        s = r["shapes"]
        for p in ("q_proj", "k_proj", "v_proj"):
            assert s[f"{layer}self_attn.{p}.weight"] == (8 * heads, 40), s
        assert s[f"{layer}self_attn.out_proj.weight"] == (40, 8 * heads), s
        assert s[f"{layer}mlp.fc1.weight"] == (fc1, 40), s
        assert s["model.multi_modal_projector.mm_input_projection_weight"] == (40, 48), s
        assert r["tied"] is True and r["ref_tied"] is True
    res = pool.run(local_shapes, 2, "Gemma3ForConditionalGeneration", {"tie_word_embeddings": False})
    assert all(r["tied"] is False and r["ref_tied"] is False for r in res)


@pytest.mark.parametrize("tp", [2, 4])
def test_state_dict_round_trip(pool, tp):
    pool.run(state_dict_round_trip, tp, "Gemma3ForConditionalGeneration")


def test_variants(pool):
    """Untied LM head; text-only input (no image); fused vision layer norms."""
    pool.run(check, 2, "Gemma3ForConditionalGeneration", {"tie_word_embeddings": False})
    pool.run(check, 4, "Gemma3ForConditionalGeneration", None, None, True)
    pool.run(check, 2, "Gemma3Model", None, {"enable_fused_normalization": True})
