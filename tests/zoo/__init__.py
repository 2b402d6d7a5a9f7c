"""Tiny models for the tests, found by class name.

    import zoo

    zoo.build("MistralForCausalLM")          # the unsharded model, weights from seed 0
    zoo.make_inputs("MistralForCausalLM")    # a batch for it (labels for its head)
    zoo.module_of("MistralForCausalLM")      # the module defining it (zoo.decoders): its configs
    zoo.names()                              # every name some module can build

A name is a model class name, or "Class/variant" for a second configuration
of one class (e.g. "T5ForConditionalGeneration/v1.1").  The modules, each
with a MODELS table keyed by name, build(name, ...) and make_inputs(name, ...):

    llama_gpt2_bert   Llama, GPT-2 and BERT: every class of their policies
    decoders          the other decoder-only language models (Mistral, Qwen2/3,
                      Gemma 1-3, Phi-3, Mixtral, GLM, OPT, GPT-Neo, GPT-J,
                      BLOOM, Falcon)
    encoders          RoBERTa, ALBERT, ERNIE, T5, Whisper, and ChatGLM2
    vision            ViT, BEiT, Swin, Swinv2, SAM, BLIP-2
    gemma3mm          multimodal Gemma 3 (SigLIP vision tower + Gemma 3 text)

and the models no library provides:

    chatglm2          a local model with ChatGLM2's module tree (its real code is remote code)
    custom            a user-defined model (ToyModel) and the Policy a user would write

Sizes are chosen so that heads, KV heads, MLP features, vocabularies and label
counts do not divide 2 or 4 evenly where the model allows it; every dropout is
0 and attention is "eager".
"""
from __future__ import annotations

import copy
import importlib

# Searched in this order (a name is in exactly one of them).
MODULES = ("llama_gpt2_bert", "decoders", "encoders", "vision", "gemma3mm")


def _modules():
    return [importlib.import_module(f"{__name__}.{m}") for m in MODULES]


def module_of(name: str):
    """The zoo module whose MODELS holds `name`."""
    for mod in _modules():
        if name in mod.MODELS:
            return mod
    raise KeyError(f"no test zoo builds {name!r}")


def names() -> list[str]:
    """Every name the zoo modules build for the sweeps (the tests parametrized
    over the whole zoo); a module's OUTSIDE_SWEEPS names are built only by the
    tests that ask for them by name (e.g. Swin's 4-stage pipeline configs)."""
    return sorted(n for mod in _modules() for n in mod.MODELS if n not in getattr(mod, "OUTSIDE_SWEEPS", ()))


def build(name: str, *args, **kwargs):
    """module_of(name).build(name, ...): the unsharded model `name`."""
    return module_of(name).build(name, *args, **kwargs)


def make_inputs(name: str, *args, **kwargs) -> dict:
    """module_of(name).make_inputs(name, ...): a batch for `name`."""
    return module_of(name).make_inputs(name, *args, **kwargs)


def family_classes() -> dict[str, list[str]]:
    """family -> the registered classes (of shardformer.autopolicy's registry) that the zoo can build."""
    from shardformer.autopolicy import registry

    buildable = set(names())
    out: dict[str, list[str]] = {}
    for key, (family, _) in sorted(registry().items()):
        cls = key.rsplit(".", 1)[-1]
        if cls in buildable:
            out.setdefault(family, []).append(cls)
    return out


def _with_dropout(cfg, p: float, seen=None) -> list[str]:
    """Set every float dropout probability of `cfg` (and its sub-configs) to p."""
    from transformers import PretrainedConfig

    seen = seen if seen is not None else set()
    if id(cfg) in seen:
        return []
    seen.add(id(cfg))
    changed = []
    for key, value in list(vars(cfg).items()):
        if isinstance(value, PretrainedConfig):
            changed += [f"{key}.{c}" for c in _with_dropout(value, p, seen)]
        elif isinstance(value, float) and not isinstance(value, bool) and (
                "dropout" in key or "pdrop" in key or key == "layerdrop"):
            setattr(cfg, key, p)
            changed.append(key)
    return changed


def build_with_dropout(name: str, p: float, **overrides):
    """The model `name` (its weights), rebuilt from a config whose every
    dropout probability is p (overrides: of build())."""
    import torch
    from transformers import PretrainedConfig

    base = build(name, **overrides)
    if not isinstance(base.config, PretrainedConfig):
        return base  # zoo.chatglm2's model has no dropout (the training flags are still checked)
    cfg = copy.deepcopy(base.config)
    changed = _with_dropout(cfg, p)
    if not changed:
        raise AssertionError(f"{name}: its config has no dropout probability to set")
    torch.manual_seed(0)
    model = type(base)(cfg)
    model.load_state_dict(base.state_dict())
    return model.to(next(base.parameters()).dtype)
