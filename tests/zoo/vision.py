"""Tiny configurations, builders and inputs for the vision and multimodal
families (ViT, BEiT, Swin, Swinv2, BLIP-2, SAM).  Heads, MLP features and
label counts do not divide 2 or 4 evenly where the model allows it; every
dropout is 0 and attention is "eager", as in every zoo module.  Images are 32x32
random pixels from a fixed generator."""
from __future__ import annotations

import math

import torch

BATCH, IMAGE, CHANNELS = 2, 32, 3

VIT = dict(image_size=IMAGE, patch_size=8, num_channels=CHANNELS, hidden_size=48, num_attention_heads=6,
           num_hidden_layers=2, intermediate_size=90, num_labels=3, hidden_dropout_prob=0.0,
           attention_probs_dropout_prob=0.0, encoder_stride=8)
# BEiT: per-layer relative position bias tables, layer scale, a 99-token visual vocabulary.
BEIT = dict(VIT, vocab_size=99, use_relative_position_bias=True, use_shared_relative_position_bias=False,
            use_absolute_position_embeddings=False, layer_scale_init_value=0.1, use_mask_token=True,
            drop_path_rate=0.0, auxiliary_channels=8, pool_scales=[1, 2],
            use_auxiliary_head=True, semantic_loss_ignore_index=255)
BEIT_SEG = dict(BEIT, num_hidden_layers=4, out_indices=[1, 2, 3, 4])
BEIT_SHARED = dict(BEIT, use_relative_position_bias=False, use_shared_relative_position_bias=True)
# Swin: 5 then 10 heads per stage (head_dim 8), window 2 on an 8x8 patch grid (shifted windows).
SWIN = dict(image_size=IMAGE, patch_size=4, num_channels=CHANNELS, embed_dim=40, depths=[2, 2], num_heads=[5, 10],
            window_size=2, mlp_ratio=1.5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0, num_labels=3, encoder_stride=8)
SWINV2 = dict(SWIN)
# Four Swin stages (16x16, 8x8, 4x4, 2x2 patches: patch 2), one block each: a pipeline of 4 virtual
# stages (tests/test_pipeline.py) holds one Swin stage each, every edge after a patch merging.
SWIN_STAGES4 = dict(SWIN, patch_size=2, depths=[1, 1, 1, 1], num_heads=[5, 10, 20, 40], encoder_stride=16)
# The SAM and BLIP-2 vision configs default to initializer_range=1e-10, which
# leaves the vision encoders ~0 and their gradients ~1e-22: set HF's usual 0.02.
# SAM: vision encoder 5 heads (windowed layer 0, global layer 1, relative positions),
# mask decoder 6 heads (cross attentions at hidden / 2: head_dim 4), an 8x8 -> 16x16 mask.
SAM_VISION = dict(hidden_size=40, num_attention_heads=5, mlp_dim=70, num_hidden_layers=2, image_size=IMAGE,
                  patch_size=8, num_channels=CHANNELS, output_channels=48, window_size=2, global_attn_indexes=[1],
                  num_pos_feats=24, use_rel_pos=True, use_abs_pos=True, attention_dropout=0.0,
                  initializer_range=0.02)
SAM = dict(vision_config=SAM_VISION,
           prompt_encoder_config=dict(hidden_size=48, image_size=IMAGE, patch_size=8, image_embedding_size=4,
                                      mask_input_channels=8),
           mask_decoder_config=dict(hidden_size=48, num_attention_heads=6, mlp_dim=45, num_hidden_layers=2,
                                    iou_head_hidden_dim=24))
# BLIP-2: vision 6 heads (fused qkv with q/v bias), Q-Former 5 heads with cross attention
# every layer, 4 query tokens; OPT (tied embeddings) or T5 language models.
BLIP2_VISION = dict(hidden_size=48, num_attention_heads=6, intermediate_size=90, num_hidden_layers=2,
                    image_size=IMAGE, patch_size=8, qkv_bias=True, attention_dropout=0.0, initializer_range=0.02)
BLIP2_QFORMER = dict(hidden_size=40, num_attention_heads=5, intermediate_size=70, num_hidden_layers=2,
                     encoder_hidden_size=48, cross_attention_frequency=1, vocab_size=99, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
BLIP2_OPT = dict(model_type="opt", hidden_size=48, num_attention_heads=6, ffn_dim=90, num_hidden_layers=2,
                 vocab_size=101, word_embed_proj_dim=48, max_position_embeddings=64, dropout=0.0,
                 attention_dropout=0.0, layerdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
BLIP2_T5 = dict(model_type="t5", d_model=40, d_kv=8, num_heads=6, d_ff=90, num_layers=2, num_decoder_layers=2,
                vocab_size=99, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
BLIP2 = dict(vision_config=BLIP2_VISION, qformer_config=BLIP2_QFORMER, text_config=BLIP2_OPT, num_query_tokens=4,
             image_token_index=100, image_text_hidden_size=24)
BLIP2_T5_LM = dict(BLIP2, text_config=BLIP2_T5, image_token_index=98)
# Retrieval and the text model run text through the Q-Former: its text feed-forward exists.
BLIP2_TEXT = dict(BLIP2, qformer_config=dict(BLIP2_QFORMER, use_qformer_text_input=True))

# name -> (model class, config class, config kwargs, input kind)
MODELS = {
    "ViTModel": ("ViTModel", "ViTConfig", VIT, "pixels"),
    "ViTForImageClassification": ("ViTForImageClassification", "ViTConfig", VIT, "image_cls"),
    "ViTForMaskedImageModeling": ("ViTForMaskedImageModeling", "ViTConfig", VIT, "mim"),
    "BeitModel": ("BeitModel", "BeitConfig", BEIT, "pixels"),
    "BeitModel/shared_bias": ("BeitModel", "BeitConfig", BEIT_SHARED, "pixels"),
    "BeitForImageClassification": ("BeitForImageClassification", "BeitConfig", BEIT, "image_cls"),
    "BeitForMaskedImageModeling": ("BeitForMaskedImageModeling", "BeitConfig", BEIT, "beit_mim"),
    "BeitForSemanticSegmentation": ("BeitForSemanticSegmentation", "BeitConfig", BEIT_SEG, "segmentation"),
    "SwinModel": ("SwinModel", "SwinConfig", SWIN, "pixels"),
    "SwinForImageClassification": ("SwinForImageClassification", "SwinConfig", SWIN, "image_cls"),
    "SwinForMaskedImageModeling": ("SwinForMaskedImageModeling", "SwinConfig", SWIN, "mim"),
    "Swinv2Model": ("Swinv2Model", "Swinv2Config", SWINV2, "pixels"),
    "Swinv2ForImageClassification": ("Swinv2ForImageClassification", "Swinv2Config", SWINV2, "image_cls"),
    "Swinv2ForMaskedImageModeling": ("Swinv2ForMaskedImageModeling", "Swinv2Config", SWINV2, "mim"),
    **{f"{cls}/stages4": (cls, cfg, SWIN_STAGES4, kind) for cls, cfg, _, kind in (
        ("SwinModel", "SwinConfig", None, "pixels"), ("SwinForImageClassification", "SwinConfig", None, "image_cls"),
        ("SwinForMaskedImageModeling", "SwinConfig", None, "mim"), ("Swinv2Model", "Swinv2Config", None, "pixels"),
        ("Swinv2ForImageClassification", "Swinv2Config", None, "image_cls"),
        ("Swinv2ForMaskedImageModeling", "Swinv2Config", None, "mim"))},
    "SamModel": ("SamModel", "SamConfig", SAM, "sam"),
    "SamVisionModel": ("SamVisionModel", "SamVisionConfig", SAM_VISION, "pixels"),
    "Blip2Model": ("Blip2Model", "Blip2Config", BLIP2, "blip2"),
    "Blip2ForConditionalGeneration": ("Blip2ForConditionalGeneration", "Blip2Config", BLIP2, "blip2_lm"),
    "Blip2ForConditionalGeneration/t5": ("Blip2ForConditionalGeneration", "Blip2Config", BLIP2_T5_LM, "blip2_lm"),
    "Blip2ForImageTextRetrieval": ("Blip2ForImageTextRetrieval", "Blip2Config", BLIP2_TEXT, "blip2_itm"),
    "Blip2ForImageTextRetrieval/itc": ("Blip2ForImageTextRetrieval", "Blip2Config", BLIP2_TEXT, "blip2_itc"),
    "Blip2VisionModel": ("Blip2VisionModel", "Blip2VisionConfig", BLIP2_VISION, "pixels"),
    "Blip2VisionModelWithProjection": ("Blip2VisionModelWithProjection", "Blip2Config", BLIP2, "pixels"),
    "Blip2QFormerModel": ("Blip2QFormerModel", "Blip2QFormerConfig", BLIP2_QFORMER, "qformer"),
    "Blip2TextModelWithProjection": ("Blip2TextModelWithProjection", "Blip2Config", BLIP2_TEXT, "text"),
}
# The 4-stage Swin configs exist for the pipeline tests (test_pipeline.py: one Swin stage per
# pipeline stage); the TP / lazy / policy sweeps cover Swin with the configs above.
OUTSIDE_SWEEPS = frozenset(name for name in MODELS if name.endswith("/stages4"))


# Parameters HF initializes to zeros (SAM's relative and absolute positions,
# BLIP-2's query tokens and its q/v biases), made random.
_ZERO_INIT = ("rel_pos_h", "rel_pos_w", "pos_embed", "query_tokens", "self_attn.qkv.bias")


def build(name: str, seed: int = 0, **overrides):
    """The unsharded HF model `name`, built from `seed`, with random weights
    everywhere (position bias tables and logit scales included, which HF
    initializes to constants)."""
    import transformers

    model_cls, cfg_name, cfg_kwargs, _ = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**dict(cfg_kwargs, **overrides))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(_ZERO_INIT):  # SAM, BLIP-2: zeros in HF's init
                p.copy_(0.5 * torch.randn(p.shape))
            elif "relative_position_bias_table" in pname or "logit_scale" in pname or "mask_token" in pname:
                if "logit_scale" in pname:  # HF's log(10), made different per head
                    p.copy_(math.log(10.0) + 0.2 * torch.randn(p.shape))
                else:
                    p.copy_(0.5 * torch.randn(p.shape))
    return model


# Models whose unsharded float32 result is itself ~1e-5 (relative) from the
# float64 one, so the plain fp32 tolerance would judge rounding, not sharding:
# Swinv2Model's cosine attention normalizes small q/k vectors and its gradients
# through them (|dL/dW_q| ~ 150 under the random-projection loss) carry
# 7e-6 .. 2.5e-5 relative float32 error at every input seed tried (1..15),
# before and after the SGD step.  For these, checks.parity also runs the model in
# float64 and allows the unsharded fp32 model's own error on top of the tolerance.
FP64_FLOOR = {"Swinv2Model"}


def make_inputs(name: str, seed: int | None = None) -> dict:
    _, _, cfg, kind = MODELS[name]
    seed = 1 if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    x = {"pixel_values": torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g)}
    if kind in ("sam", "qformer", "text") or kind.startswith("blip2"):
        return _multimodal_inputs(kind, cfg, x, g)
    patches = (IMAGE // cfg.get("patch_size", 1)) ** 2
    if kind == "image_cls":
        x["labels"] = torch.randint(0, cfg["num_labels"], (BATCH,), generator=g)
    elif kind in ("mim", "beit_mim"):
        x["bool_masked_pos"] = torch.rand(BATCH, patches, generator=g) < 0.5
        if kind == "beit_mim":
            # BEiT's loss reads one visual token per masked patch.
            x["labels"] = torch.randint(0, cfg["vocab_size"], (int(x["bool_masked_pos"].sum()),), generator=g)
    elif kind == "segmentation":
        x["labels"] = torch.randint(0, cfg["num_labels"], (BATCH, IMAGE, IMAGE), generator=g)
    return x


TEXT = 5  # text tokens after BLIP-2's query-token placeholders


def blip2_prompt(cfg: dict, g: torch.Generator, batch: int = BATCH) -> torch.Tensor:
    """[image token] * num_query_tokens followed by TEXT random text tokens."""
    vocab = min(cfg["text_config"]["vocab_size"], cfg["qformer_config"]["vocab_size"]) - 2
    image = torch.full((batch, cfg["num_query_tokens"]), cfg["image_token_index"])
    return torch.cat([image, torch.randint(3, vocab, (batch, TEXT), generator=g)], dim=1)


def _multimodal_inputs(kind: str, cfg: dict, x: dict, g: torch.Generator) -> dict:
    if kind == "sam":
        # 2 images x 2 prompts x 3 points each (labels 0 / 1), pixel coordinates.
        x["input_points"] = torch.rand(BATCH, 2, 3, 2, generator=g) * IMAGE
        x["input_labels"] = torch.randint(0, 2, (BATCH, 2, 3), generator=g)
    elif kind == "qformer":
        x = {"query_embeds": torch.randn(BATCH, 4, cfg["hidden_size"], generator=g),
             "encoder_hidden_states": torch.randn(BATCH, 17, cfg["encoder_hidden_size"], generator=g)}
    elif kind == "text":
        x = {"input_ids": torch.randint(3, cfg["qformer_config"]["vocab_size"], (BATCH, TEXT), generator=g)}
    else:
        x["input_ids"] = blip2_prompt(cfg, g)
        if kind == "blip2_lm":
            if cfg["text_config"]["model_type"] == "t5":
                x["labels"] = torch.randint(3, cfg["text_config"]["vocab_size"] - 2, (BATCH, 4), generator=g)
            else:
                x["labels"] = x["input_ids"].masked_fill(x["input_ids"] == cfg["image_token_index"], -100)
        elif kind in ("blip2_itm", "blip2_itc"):
            x["attention_mask"] = torch.ones_like(x["input_ids"])
            x["use_image_text_matching_head"] = kind == "blip2_itm"
    return x


def blip2_wide_init(name: str, std: float = 0.2) -> dict:
    """Config overrides giving every part of a BLIP-2 model weights of scale
    `std`: with HF's 0.02 a tiny random model's greedy tokens are one id
    repeated, the same for every image, which tests generate() little."""
    _, _, cfg, _ = MODELS[name]
    text = dict(cfg["text_config"], initializer_range=std)
    if text["model_type"] == "t5":
        text["initializer_factor"] = std / 0.02   # T5 scales its own d_model**-0.5 init
    return dict(initializer_range=std, text_config=text,
                vision_config=dict(cfg["vision_config"], initializer_range=std),
                qformer_config=dict(cfg["qformer_config"], initializer_range=std))
