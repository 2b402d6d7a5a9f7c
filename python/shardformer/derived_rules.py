"""What DerivedPolicy guesses about a model it has no policy for: every heuristic in one place.

transformers' plan ({"model.layers.*.self_attn.q_proj": "colwise", ...}) says
which Linear is split which way, but not what the model's forward needs
around the split: which module is an attention, which attribute holds a head
count, which module runs on split features.  DerivedPolicy
(shardformer.derived_policy) reads those from the module tree with the rules
below, and writes what they find in the same spec the built-in families use
(plan styles, per-rank attributes, sequence-parallel regions).  Each rule,
and why it is a guess:

  is_attention        a module is an attention when its class name contains
                      "Attention" or it has `head_dim` / `head_size`: HF names
                      its attention classes so, and keeps the head size there
                      (the plan names projections, never their attention).
  norm_like           a normalization (LayerNorm, RMSNorm, or a class whose name
                      contains "Norm"): acts on each row alone, so it may run
                      on this rank's rows under split-gather SP.
  is_mla              a DeepSeek-V2-style latent attention: a joint KV
                      down-projection `kv_a_proj_with_mqa` (nn.Linear) and a
                      `qk_rope_head_dim` (found by its shape, not its class).
  HEAD_ATTRS          integer attributes of an attention that hold head counts
                      (num_heads, num_key_value_heads, ...), rewritten to this
                      rank's counts: HF's attentions reshape with them.
  WIDTH_ATTRS         attributes equal to heads * head_dim (all_head_size,
                      hidden_size, ...), rewritten to this rank's width: the
                      value, not the name, tells the query width from the model width.
  reads_head_counts   an attention whose forward source mentions
                      `config.num_attention_heads` / `num_key_value_heads` /
                      `head_dim` gets a per-rank copy of its config
                      (Heads.local_config): the source is the only place that says so.
  added_children      children of a block whose call its forward adds to
                      something (`x + self.child(...)`, read from its source):
                      a shared expert beside routed experts returns a full
                      output the experts' partial sums are added to.
  side_of_norm        a norm beside split layers runs outside them (on whole
                      rows) when its width is the column layers' input width;
                      when it is their input and output width, where it runs
                      cannot be told (refused).
"""
from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from .layout import Heads

#: Integer attributes of an attention holding head counts: which count (Heads.attributes).
HEAD_ATTRS = {"num_heads": "heads", "num_attention_heads": "heads", "num_key_value_heads": "kv_heads",
              "num_kv_heads": "kv_heads", "num_key_value_groups": "groups"}
#: Attributes of an attention that may hold the query width (heads * head_dim).
WIDTH_ATTRS = ("all_head_size", "hidden_size", "embed_dim", "inner_dim")
_CONFIG_READS = re.compile(r"config\.(num_attention_heads|num_key_value_heads|head_dim)")


def is_attention(module: nn.Module) -> bool:
    return "Attention" in type(module).__name__ or hasattr(module, "head_dim") or hasattr(module, "head_size")


def norm_like(module: nn.Module) -> bool:
    """A normalization (LayerNorm, RMSNorm, ...): acts on each row alone."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


def is_mla(module: nn.Module) -> bool:
    """A DeepSeek-V2-style latent attention: a joint KV down-projection and a
    shared rotary key."""
    return isinstance(getattr(module, "kv_a_proj_with_mqa", None), nn.Linear) and hasattr(module, "qk_rope_head_dim")


def forward_source(module: nn.Module) -> str:
    """The source of `module`'s class's forward ("" when there is none to read)."""
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def reads_head_counts(module: nn.Module) -> bool:
    """Whether `module`'s forward reads head counts from `self.config`."""
    return _CONFIG_READS.search(forward_source(module)) is not None


def added_children(block: nn.Module) -> list[str]:
    """The children of `block` whose call its forward adds to something
    (`x + self.child(...)` or `self.child(...) + x`), found in its source."""
    source = forward_source(block)
    out = []
    for child, _ in block.named_children():
        call = rf"self\.{re.escape(child)}\((?:[^()]|\([^()]*\))*\)"
        if re.search(rf"\+\s*{call}", source) or re.search(rf"{call}\s*\+", source):
            out.append(child)
    return out


def side_of_norm(norm: nn.Module, widths_in: set[int], widths_out: set[int]) -> str | None:
    """Where a norm beside column layers (input widths `widths_in`, output
    widths `widths_out`) runs: "outside" when its width is their input width
    (it normalizes the whole rows they read), "ambiguous" when it is both
    their input and output width, None otherwise (not a norm with a weight,
    or on their split output)."""
    weight = getattr(norm, "weight", None)
    if not norm_like(norm) or not isinstance(weight, torch.Tensor):
        return None
    width = weight.shape[-1]
    if width in widths_in and width in widths_out:
        return "ambiguous"
    return "outside" if width in widths_in else None


def attention_counts(path: str, module: nn.Module, heads: Heads, widths: bool = True) -> dict:
    """{dotted attribute under the model: what it holds (Heads.attributes'
    kinds)} for an attention split by `heads`: its HEAD_ATTRS, its
    WIDTH_ATTRS equal to the query width (not with `widths`: a latent
    attention reshapes with -1), and "config" (a per-rank copy of the config
    it holds) when its forward reads head counts from it."""
    lead = f"{path}." if path else ""
    counts = {lead + name: kind for name, kind in HEAD_ATTRS.items() if isinstance(getattr(module, name, None), int)}
    counts.update({lead + name: "width" for name in (WIDTH_ATTRS if widths else ())
                   if getattr(module, name, None) == heads.num_heads * heads.head_dim})
    if getattr(module, "config", None) is not None and reads_head_counts(module):
        counts[lead + "config"] = "config"
    return counts
