"""Which PEFT configs LoRA on a sharded model accepts (no import of peft).

check_config(config, where, added) refuses, naming `where` and the field,
another tuner than LoRA, a LoRA variant or extra modules, and (added=True:
an adapter added after optimize()) an initialization that reads the base
weight, of which each rank holds only a shard.  Used by shardformer.lora
(adapters present at optimize()) and layer/lora.py (adapters added later),
and importable where peft is not installed.
"""
from __future__ import annotations

import dataclasses

__all__ = ["check_config"]

#: PEFT config fields that add modules or variants the sharded layers do not implement
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora=True)",
    "lora_bias": "lora_bias=True",
    "modules_to_save": "modules_to_save (full trainable copies of modules)",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (LoRA on nn.Parameter targets)",
    "layer_replication": "layer_replication",
}


#: init_lora_weights values whose initialization does not read the base weight
#: (an adapter added to an already-sharded layer sees only this rank's shard of it)
_WEIGHT_FREE_INITS = (True, False, "gaussian")


def check_config(config, where: str, added: bool = False) -> None:
    """Refuse, naming it, a PEFT config that is not plain LoRA: another tuner,
    or LoRA with a variant or extra modules (_UNSUPPORTED_FIELDS, the fields
    PEFT tags as LoRA variants, variant initializations such as EVA/CorDA).
    added=True: for adapters added to an already-sharded model, whose
    initialization must not read the base weight either."""
    kind = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
    if kind != "LORA":
        raise NotImplementedError(
            f"{where}: PEFT {kind} ({type(config).__name__}) adapters cannot be sharded; shardformer shards "
            f"LoRA (LoraConfig) only")
    bad = [what for name, what in _UNSUPPORTED_FIELDS.items() if getattr(config, name, None)]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.metadata.get("is_lora_variant") and value and field.name not in _UNSUPPORTED_FIELDS:
            bad.append(f"the LoRA variant {field.name}")
        if field.name == "init_lora_weights" and isinstance(value, str) and \
                value in field.metadata.get("lora_variants", ()):
            bad.append(f"the LoRA variant init_lora_weights={value!r}")
    if bad:
        raise NotImplementedError(f"{where}: {', '.join(bad)} is not supported on a sharded model; "
                                  f"plain LoRA on linear layers is")
    if added and config.init_lora_weights not in _WEIGHT_FREE_INITS:
        raise NotImplementedError(
            f"{where}: init_lora_weights={config.init_lora_weights!r} initializes the adapter from the base "
            f"weight, which each rank of a sharded model holds only a shard of; add the adapter before "
            f"optimize() (get_peft_model, then ShardFormer.optimize) or use init_lora_weights=True / 'gaussian'")
