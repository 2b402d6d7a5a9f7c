"""Tiny multimodal Gemma 3 models (SigLIP vision tower + projector + Gemma 3
text model) and their image-and-text inputs.

The vision tower has 5 heads (2,1,1,1 at TP=4), the text model 6 query heads
over 2 KV heads (zoo.decoders.GEMMA3).  A 16x16 image in 4x4 patches gives
16 patches, pooled 2x2 into 4 image tokens; input_ids hold the image token
id at those 4 positions (between begin/end-of-image ids) and token_type_ids
mark them, as Gemma3's processor does."""
from __future__ import annotations

import torch

from zoo import decoders

BATCH, SEQ, IMAGE, IMAGE_TOKENS = 2, 10, 16, 4
BOI, EOI, IMAGE_ID = 98, 99, 100   # inside the 101-token vocabulary, as in the real Gemma 3

TEXT = {k: v for k, v in decoders.GEMMA3.items() if k not in ("num_labels", "classifier_dropout")}
VISION = dict(hidden_size=40, intermediate_size=70, num_hidden_layers=2, num_attention_heads=5,
              image_size=IMAGE, patch_size=4, num_channels=3, attention_dropout=0.0, vision_use_head=False)
CONFIG = dict(mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=BOI, eoi_token_index=EOI,
              image_token_index=IMAGE_ID, num_labels=3, pad_token_id=0, tie_word_embeddings=True)

# The k_proj bias gradient of a softmax attention is exactly zero (a key bias
# shifts each query's scores by a constant); under Gemma3Model's
# random-projection loss (|dL/dW| up to ~50 in the vision tower) its float32
# value is rounding noise of ~7e-7 in the unsharded model itself, above the
# 1e-6 absolute floor.  Every other gradient passes the plain tolerance (worst
# 2.1e-6 relative, measured with that bias frozen); the models with a loss have
# ~1e-9 there.  For Gemma3Model, checks.parity also runs float64 and allows the
# unsharded float32 model's own error on top of the tolerance.
FP64_FLOOR = {"Gemma3Model"}

# model class -> input kind
MODELS = {"Gemma3Model": "base", "Gemma3ForConditionalGeneration": "causal_lm",
          "Gemma3ForSequenceClassification": "seq_cls"}


def config_of(**overrides):
    """The config; overrides of the text model's config go in as text_config={...}."""
    from transformers import Gemma3Config

    text = dict(TEXT, **overrides.pop("text_config", {}))
    cfg = Gemma3Config(text_config=text, vision_config=dict(VISION), **dict(CONFIG, **overrides))
    cfg._attn_implementation = "eager"
    return cfg


def build(name: str, dtype=torch.float32, seed: int = 0, **overrides):
    """The unsharded HF model `name` from `seed`.  HF initialises the
    projector matrix to zeros, which would leave the vision tower without
    gradient; it is drawn at random here (from the same seed)."""
    import transformers

    cfg = config_of(**overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, name)(cfg)
    projector = model.get_submodule("multi_modal_projector" if name == "Gemma3Model" else "model.multi_modal_projector")
    with torch.no_grad():
        projector.mm_input_projection_weight.normal_(0.0, 0.3)
    return model.to(dtype)


def prompt(seed: int = 1, length: int = SEQ) -> dict:
    """input_ids with one image each (row 0 after a text token, row 1 at the
    start), token_type_ids and pixel_values."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, BOI, (BATCH, length), generator=g)
    image = [BOI] + [IMAGE_ID] * IMAGE_TOKENS + [EOI]
    for row, start in enumerate((1, 0)):
        ids[row, start:start + len(image)] = torch.tensor(image)
    return {"input_ids": ids, "token_type_ids": (ids == IMAGE_ID).long(),
            "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)}


def make_inputs(name: str, seed: int = 1) -> dict:
    x = prompt(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if MODELS[name] == "causal_lm":
        x["labels"] = x["input_ids"].masked_fill(x["token_type_ids"].bool(), -100)
    elif MODELS[name] == "seq_cls":
        x["labels"] = torch.randint(0, CONFIG["num_labels"], (BATCH,), generator=g)
    return x
