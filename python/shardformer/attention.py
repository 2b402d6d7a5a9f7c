"""HuggingFace integration of the C attention kernel (ops.attention).

transformers 5.x looks a layer's attention up by `config._attn_implementation`
in `AttentionInterface`, and builds the masks handed to it through the
function registered under the same name in `AttentionMaskInterface`.  We
register both under "shardformer":

* the mask function keeps masks compact: for the plain patterns (causal,
  causal sliding window, bidirectional) over keys from position 0, with the
  queries at the end of the keys, it returns None without padding and a
  boolean key-padding mask [B, Sk] with it (a sliding pattern always gets
  one, tagged with its window), and the attention computes the causal /
  window part on the fly from the layer's `is_causal` and the window (the
  layer's `sliding_window` when the tag is gone).  Any other pattern (packed sequences, chunked or block overlays,
  custom and/or masks, a sliding or static cache's offsets) gets HF's materialized
  boolean [B, 1, Sq, Sk] mask, which the kernel reads as is (no causal flag
  on top: the mask says it all);
* the attention function calls ops.attention (logit soft-capping included:
  the `softcap` a layer passes, Gemma 2's attn_logit_softcapping), or, for
  what the kernel does not do (sinks, k / v head sizes that differ, output of the
  attention weights, a mask it cannot read, a non-CPU tensor), the model's own
  eager attention, with a warning once per reason.

`enable(model)` switches a model (and its sub-configs) over; the Policy base
calls it when ShardConfig.enable_flash_attention is set.

Families whose attention does not go through the registry (GPT-Neo, GPT-J,
BLOOM, Falcon, ChatGLM2) name the method where their q, k, v meet
(sequence_attention.AttentionSeam); a seam with a `kernel` gets it instead:
`enable_seam(model, seam)` replaces that method on each of the seam's modules
(an instance attribute; the class is untouched) by one that computes the
same attention with ops.attention, or, where the kernel cannot give the
model's own result (attention dropout active in training: the kernel draws
its own masks, not torch's; output_attentions; tensors the kernel does not
take), calls the model's method, warning once per reason.
"""
from __future__ import annotations

import sys
import warnings

import torch

from . import ops
from .pickling import BoundMethod

NAME = "shardformer"

#: calls served by the kernel, for tests and debugging
CALLS = {"kernel": 0, "fallback": 0}


def _count(what: str) -> None:
    """CALLS[what] += 1, in eager mode only: under torch.compile a Python
    counter in the graph would be a guard that fails at every call."""
    if not torch.compiler.is_compiling():
        CALLS[what] += 1
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"shardformer attention: {reason}; using the model's own attention for it",
                      stacklevel=3)


# ---- mask --------------------------------------------------------------------

def _pattern(mask_function):
    """("causal" | "full" | "sliding", window) for HF's plain mask functions, else None."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return "causal", 0
    if mask_function is mu.bidirectional_mask_function:
        return "full", 0
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal)
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        cells = [c.cell_contents for c in (mask_function.__closure__ or ())]
        parts = cells[0] if len(cells) == 1 and isinstance(cells[0], tuple) else ()
        if len(parts) == 2 and parts[1] is mu.causal_mask_function and \
                getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask":
            window = [c.cell_contents for c in (parts[0].__closure__ or ())]
            if len(window) == 1 and isinstance(window[0], int) and window[0] > 0:
                return "sliding", window[0]
    return None


def shardformer_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                     attention_mask=None, **kwargs):
    """The AttentionMaskInterface entry: None, a [B, Sk] bool key-padding mask, or HF's
    materialized [B, 1, Sq, Sk] bool mask (see the module docstring)."""
    from transformers import masking_utils as mu

    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    pattern = _pattern(mask_function) if not kwargs.get("use_vmap", False) else None
    try:
        q_off, kv_off = int(q_offset), int(kv_offset)
    except (TypeError, ValueError, RuntimeError):
        q_off, kv_off = None, None
    # Compact only when the keys start at position 0 (so that a [B, Sk] mask we
    # return reads the same when handed back to us: generate() builds masks
    # ahead for compileable caches and the model builds them again from those)
    # and, for causal patterns, the queries are the last Sk positions.
    if pattern is not None and kv_off == 0 and (pattern[0] == "full" or q_off == kv_length - q_length):
        kind, window = pattern
        padding = mu.prepare_padding_mask(attention_mask, kv_length, 0)
        if padding is not None:
            padding = padding[:, :kv_length].to(torch.bool)
        if padding is not None and kind != "sliding" and bool(padding.all()):
            padding = None
        if kind == "sliding":
            if padding is None:
                padding = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))
            elif padding is attention_mask:
                padding = padding.clone()          # never tag the caller's tensor
            padding._shardformer_window = window
        return padding
    return _materialized(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         kwargs)


def _materialized(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, kwargs):
    from transformers import masking_utils as mu

    kw = {k: v for k, v in kwargs.items() if k in ("use_vmap", "device")}
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kw)


# ---- attention ---------------------------------------------------------------

def _unsupported(module, query, key, value, attention_mask, kwargs) -> str | None:
    if kwargs.get("output_attentions"):
        return "output_attentions=True needs the attention weights"
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "attention sinks are not in the kernel"
    if kwargs.get("head_mask") is not None:
        return "head_mask is not in the kernel"
    for t in (query, key, value):
        if not ops.kernel_input(t):
            return f"{t.device.type} {t.dtype} tensors (the kernel is CPU float32/float16/bfloat16)"
    if key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1]:
        return f"head sizes differ (q {query.shape[-1]}, k {key.shape[-1]}, v {value.shape[-1]})"
    if query.shape[1] % max(key.shape[1], 1):
        return f"{query.shape[1]} query heads over {key.shape[1]} key-value heads"
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            return f"a {type(attention_mask).__name__} attention mask"
        if attention_mask.dim() not in (2, 4):
            return f"a {attention_mask.dim()}-D attention mask"
        if attention_mask.dim() == 2 and attention_mask.shape[-1] != key.shape[2]:
            return "a 2-D attention mask not matching the keys"
        full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        if attention_mask.dim() == 4 and any(m not in (1, f) for m, f in zip(attention_mask.shape, full)):
            return f"a 4-D attention mask of shape {tuple(attention_mask.shape)} for {list(full)}"
    return None


def _fallback(module, query, key, value, attention_mask, scaling, dropout, is_causal, window, kwargs):
    """The module's own eager attention, with our compact mask expanded to the
    additive 4-D mask eager functions take."""
    B, Sq, Sk = query.shape[0], query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and not isinstance(mask, torch.Tensor):
        pass                                   # e.g. a flex BlockMask: the model's own business
    elif mask is None or mask.dim() == 2:
        vis = ops.visible_pairs(Sq, Sk, is_causal, window, query.device)[None, None].expand(B, 1, Sq, Sk)
        if mask is not None:
            vis = vis & mask.to(torch.bool)[:, None, None, :]
        mask = vis
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as eager
    _count("fallback")
    return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def shardformer_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, is_causal: bool | None = None,
                          sliding_window: int | None = None, **kwargs):
    """The AttentionInterface entry: query [B, Hq, Sq, D], key / value [B, Hkv, Sk, D]
    -> (output [B, Sq, Hq, D], None)."""
    window = getattr(attention_mask, "_shardformer_window", None) or sliding_window or 0
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        causal, window = False, 0          # a materialized mask holds the whole pattern
        if attention_mask.shape[-1] > key.shape[2]:     # a static cache's mask: as eager slices it
            attention_mask = attention_mask[:, :, :, : key.shape[2]]
    causal = bool(causal)
    reason = _unsupported(module, query, key, value, attention_mask, kwargs)
    if reason is not None:
        _warn_once(reason)
        return _fallback(module, query, key, value, attention_mask, scaling, dropout, causal, window, kwargs)
    bias = kwargs.get("position_bias")
    _count("kernel")
    out = ops.attention(query, key, value, causal=causal, scale=scaling, mask=attention_mask, bias=bias,
                        window=window, dropout_p=float(dropout or 0.0), training=True,
                        softcap=kwargs.get("softcap"))
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register() -> None:
    """Register "shardformer" with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, shardformer_attention)
    AttentionMaskInterface.register(NAME, shardformer_mask)
    _registered = True


def uses_registry(module) -> bool:
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names




def enable(model) -> bool:
    """Route `model`'s attention through the kernel.  Configs (the model's and
    its sub-configs) whose layers look attention up in transformers' registry
    switch to "shardformer"; a model with no such layer keeps its attention and
    says so.  Returns whether anything switched."""
    config = getattr(model, "config", None)
    users = [m for m in model.modules() if uses_registry(m)]
    if config is None or not users:
        msg = (f"{type(model).__name__}: its attention does not go through transformers' "
               "AttentionInterface; enable_flash_attention keeps the model's own attention")
        warnings.warn(msg, stacklevel=2)
        return False
    register()
    configs = {id(m.config): m.config for m in users if getattr(m, "config", None) is not None}
    configs.setdefault(id(config), config)   # the model's own config: masks are built from it
    for cfg in configs.values():
        cfg._attn_implementation = NAME
    # A policy may give layers a config of their own when it shards them (a copy
    # made while planning, e.g. Phi-3's per-rank head counts), after this runs:
    # on each forward, a config not seen here is switched too, once, so that the
    # masks (built for "shardformer") and the attention always agree.  A config
    # seen here and switched back by the user is left alone.  The state lives
    # on the model (deepcopy and pickling keep working).
    model.__dict__["_shardformer_attention_users"] = users
    model.__dict__["_shardformer_attention_seen"] = list(configs.values())
    if "_shardformer_attention_hook" not in model.__dict__:
        model.__dict__["_shardformer_attention_hook"] = model.register_forward_pre_hook(_sync_configs)
    return True


def _sync_configs(model, _args) -> None:
    seen = model.__dict__.get("_shardformer_attention_seen", [])
    for m in model.__dict__.get("_shardformer_attention_users", ()):
        cfg = getattr(m, "config", None)
        if cfg is not None and not any(cfg is s for s in seen):
            cfg._attn_implementation = NAME
            seen.append(cfg)


# ---- attention outside the registry: a family's seam ---------------------------

SEAM_MARK = "_shardformer_seam_kernel"


def own_attention(reason: str, original, args: tuple, kwargs: dict):
    """The model's own method for a call the kernel cannot serve (counted as a
    fallback, warned once per reason)."""
    _warn_once(reason)
    _count("fallback")
    return original(*args, **kwargs)


def weights_recorded() -> bool:
    """Whether transformers' output capturing collects attention weights in the
    forward now running (a model whose layers do not take output_attentions
    records each attention module's weights output by a hook: SAM's vision
    encoder): a seam kernel must then return the weights, i.e. fall back."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:          # transformers without output capturing: the layers take output_attentions
        return False
    collected = _active_collector.get()
    return isinstance(collected, dict) and "attentions" in collected


def seam_kernel_reason(module, tensors, dropout: float = 0.0, output_attentions: bool = False) -> str | None:
    """Why the kernel cannot serve a seam call, or None: attention dropout
    `dropout` active (module in training), the weights asked for, tensors the
    kernel does not take."""
    if output_attentions:
        return "output_attentions=True needs the attention weights"
    if module.training and dropout > 0:
        return (f"{type(module).__name__}: attention dropout {dropout} in training (the kernel's dropout "
                f"draws are not torch's)")
    for t in tensors:
        if not ops.kernel_input(t):
            return f"{t.device.type} {t.dtype} tensors (the kernel is CPU float32/float16/bfloat16)"
    return None


def seam_kernel(q, k, v, *, scale: float, causal: bool = False, mask=None, bias=None, window: int = 0,
                dropout: float = 0.0):
    """ops.attention for a seam: q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] ->
    [B, Hq, Sq, D]; `mask` as the model built it (bool, or additive with the
    dtype's minimum where hidden: added to the scores as the model adds it).
    `dropout`: the module's attention dropout when active (in training), 0
    otherwise; seam_kernel_reason keeps such calls on the model's own
    attention, so the kernel draws it only where that check is lifted (the
    reference of a test comparing with the ring's draws).  A query row whose
    every key the additive mask hides (a left-padding row: scores at the
    dtype's minimum) gets the model's forward, not its gradient (the
    log-sum-exp the backward recomputes from cannot resolve those scores);
    such rows reach nothing real and carry no loss in a padded batch."""
    _count("kernel")
    return ops.attention(q, k, v, causal=causal, scale=scale, mask=mask, bias=bias, window=window,
                         dropout_p=float(dropout), training=True)


def _seam_kernel_method(module, *args, **kwargs):
    seam = module.__dict__[SEAM_MARK]
    original = getattr(type(module), seam.method).__get__(module, type(module))
    return seam.kernel(module, original, args, kwargs)


WANTS_WEIGHTS = "_shardformer_wants_weights"


def wants_weights(module) -> bool:
    """Whether the forward in progress of a seam's module was asked for its
    attention weights (output_attentions), for a seam below forward."""
    return bool(module.__dict__.get(WANTS_WEIGHTS))


def _recording_forward(module, *args, **kwargs):
    """The class's forward, recording output_attentions (by keyword or by
    position) for the seam's method it calls."""
    import inspect

    forward = type(module).forward
    bound = inspect.signature(forward).bind_partial(module, *args, **kwargs).arguments
    module.__dict__[WANTS_WEIGHTS] = bool(bound.get("output_attentions") or
                                          bound.get("kwargs", {}).get("output_attentions"))
    return forward(module, *args, **kwargs)


def enable_seam(model, seam) -> bool:
    """Route the attention of the seam's modules through the kernel (the
    seam's `kernel`); a seam below forward also gets a forward recording
    whether the weights are asked for.  Returns whether any module switched."""
    modules = seam.kernel_modules(model) if seam is not None and seam.kernel is not None else []
    if not modules:
        return False
    for m in modules:
        m.__dict__[SEAM_MARK] = seam
        m.__dict__[seam.method] = BoundMethod(_seam_kernel_method, m)
        if seam.method != "forward":
            m.__dict__["forward"] = BoundMethod(_recording_forward, m)
    return True


def disable_seam(model) -> None:
    """Undo enable_seam."""
    for m in model.modules():
        seam = m.__dict__.pop(SEAM_MARK, None)
        if seam is not None:
            m.__dict__.pop(seam.method, None)
            m.__dict__.pop(WANTS_WEIGHTS, None)
            if seam.method != "forward":
                m.__dict__.pop("forward", None)
