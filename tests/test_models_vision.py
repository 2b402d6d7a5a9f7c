"""Vision and multimodal families (ViT, BEiT, Swin, Swinv2, BLIP-2, SAM):
every policy class sharded at TP=2 and TP=4 against the unsharded model from
the same seed, generate() equality, and the family-specific hard parts
(per-head relative position bias tables, per-stage head counts, SAM's uneven
fused-qkv and downsampled heads, BLIP-2's composed and tied language model)."""
import copy

import pytest
import torch

from checks import parity
from shardformer import ShardConfig, ShardFormer
from zoo import vision

NAMES = sorted(set(vision.MODELS) - vision.OUTSIDE_SWEEPS)


def check_model(ctx, name):
    return parity.check_sharded(ctx, lambda: vision.build(name), vision.make_inputs(name), name=name,
                                fp64_floor=name in vision.FP64_FLOOR)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_backward_step(pool, name, tp):
    reports = pool.run(check_model, tp, name)
    assert all(r["tp"] == tp for r in reports)
    assert all(r["param_fraction"] < 1.0 for r in reports)


# ---- rank functions (run on every rank of the pool) ----

def _sharded_pair(ctx, name, **overrides):
    model = vision.build(name, **overrides)
    model.eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    return model, ref


def generate_matches(ctx, name, new_tokens=5, prompt=True):
    """Greedy generate() of a BLIP-2 model, sharded and not, from images (and
    a prompt of image placeholders + text, or HF's default start tokens)."""
    model, ref = _sharded_pair(ctx, name, **vision.blip2_wide_init(name))
    _, _, cfg, _ = vision.MODELS[name]
    g = torch.Generator().manual_seed(3)
    x = {"pixel_values": torch.randn(vision.BATCH, vision.CHANNELS, vision.IMAGE, vision.IMAGE,
                                     generator=g)}
    if prompt:
        x["input_ids"] = vision.blip2_prompt(cfg, g)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, exp = model.generate(**x, **kwargs), ref.generate(**x, **kwargs)
    assert torch.equal(got, exp), f"{name}: generate() differs:\n{got}\n{exp}"
    new = got[:, -new_tokens:]
    assert not torch.equal(new[0], new[1]), f"{name}: both images generate {new[0].tolist()}: a weak test"
    return got.tolist()


def local_shapes(ctx, name):
    """{parameter name: local shape} of the sharded model, and whether its LM
    head is still the input embedding's Parameter."""
    model, _ = _sharded_pair(ctx, name)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    tied = None
    if hasattr(model, "language_model"):
        lm = model.language_model
        tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    return {"shapes": shapes, "tied": tied}


# ---- BLIP-2 and SAM specifics ----

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name,prompt", [
    pytest.param("Blip2ForConditionalGeneration", True, id="Blip2ForConditionalGeneration-prompt"),
    pytest.param("Blip2ForConditionalGeneration", False, id="Blip2ForConditionalGeneration-no_prompt"),
    pytest.param("Blip2ForConditionalGeneration/t5", True, id="Blip2ForConditionalGeneration/t5-prompt"),
])
def test_generate_matches_unsharded(pool, name, prompt, tp):
    tokens = pool.run(generate_matches, tp, name, 5, prompt)
    assert all(t == tokens[0] for t in tokens)


def test_sam_heads_split_unevenly_at_tp4(pool):
    """Vision encoder 5 heads -> 2,1,1,1 (fused qkv rows 3 x heads x 8; relative
    position tables whole); mask decoder 6 heads -> 2,2,1,1 in the self attention
    (head_dim 8) and the downsampled cross attentions (head_dim 4)."""
    res = pool.run(local_shapes, 4, "SamModel")
    enc = "vision_encoder.layers.0.attn"
    dec = "mask_decoder.transformer.layers.0"
    assert [r["shapes"][f"{enc}.qkv.weight"][0] for r in res] == [48, 24, 24, 24]
    assert [r["shapes"][f"{enc}.proj.weight"][1] for r in res] == [16, 8, 8, 8]
    assert all(r["shapes"][f"{enc}.rel_pos_h"] == (3, 8) for r in res)
    assert [r["shapes"][f"{dec}.self_attn.q_proj.weight"][0] for r in res] == [16, 16, 8, 8]
    assert [r["shapes"][f"{dec}.cross_attn_token_to_image.k_proj.weight"][0] for r in res] == [8, 8, 4, 4]


@pytest.mark.parametrize("tp", [2, 4])
def test_blip2_language_model_sharded_and_tied(pool, tp):
    """The OPT inside BLIP-2 gets OPT's policy: heads split, vocabulary-parallel
    embedding and LM head, still one Parameter."""
    res = pool.run(local_shapes, tp, "Blip2ForConditionalGeneration")
    assert all(r["tied"] is True for r in res)
    vocab = [r["shapes"]["language_model.model.decoder.embed_tokens.weight"][0] for r in res]
    assert len(set(vocab)) == 1 and vocab[0] * tp >= 101 and vocab[0] < 101
    q = [r["shapes"]["language_model.model.decoder.layers.0.self_attn.q_proj.weight"][0] for r in res]
    assert sum(q) == 48 and len(set(q)) == (1 if tp == 2 else 2)
    qkv = [r["shapes"]["vision_model.encoder.layers.0.self_attn.qkv.weight"][0] for r in res]
    assert sum(qkv) == 3 * 48
    cross = [r["shapes"]["qformer.encoder.layer.0.crossattention.attention.key.weight"] for r in res]
    assert sum(c[0] for c in cross) == 40 and all(c[1] == 48 for c in cross)


@pytest.mark.parametrize("tp", [2, 4])
def test_blip2_t5_language_model_tied(pool, tp):
    """A T5 inside BLIP-2 gets T5's policy: shared / encoder / decoder embeddings
    and LM head one vocabulary-parallel Parameter."""
    res = pool.run(local_shapes, tp, "Blip2ForConditionalGeneration/t5")
    assert all(r["tied"] is True for r in res)
    vocab = [r["shapes"]["language_model.shared.weight"][0] for r in res]
    assert len(set(vocab)) == 1 and vocab[0] < 99 <= vocab[0] * tp
    q = [r["shapes"]["language_model.decoder.block.0.layer.1.EncDecAttention.q.weight"][0] for r in res]
    assert sum(q) == 48
