"""Packed sequences: transformers' block-diagonal mask, decided as the unsharded
model decides it, in every staged (pipeline) and split (sequence-parallel) forward.

Several documents packed in one row show in its position_ids, which restart
(or jump) where a document begins: [0 1 2 0 1 2], or [5 6 9 10].
transformers (5.15 to 5.18: masking_utils._preprocess_mask_arguments and
find_packed_sequence_indices) numbers them

    doc(t) = #{ s <= t : p_s - p_{s-1} != 1 }        (p_{-1} = p_0 - 1)

and create_causal_mask (and its sliding-window and chunked variants) lets
query i see key j only when j <= i and doc(i) == doc(j).  It does so only
when

    position_ids is given, attention_mask is None and past_key_values is None,

and a decoder's base model makes a cache (a DynamicCache) first when use_cache
is true: the call's use_cache, else config.use_cache, turned off by gradient
checkpointing in training (merge_with_config_defaults).  So

    packed  <=>  position_ids given, attention_mask None, past_key_values None,
                 and not (use_cache or config.use_cache, and not
                          (gradient checkpointing and training))

The unsharded model called with its defaults (a config whose use_cache is
True) masks causally across the documents (its positions still restart, in
the rotary embedding); called with use_cache=False, or checkpointing in
training, it masks block-diagonally.

Pipeline stages and the split forwards of all_to_all / ring_attn run the
model without a cache (use_cache=False: a stage or a rank holds part of it),
which alone would turn the packed mask on.  So the decision is taken once,
on the user's call (`unsharded_packs(module, kwargs)`: the pipeline schedule
on its batch, the split on the base model's call), and held while that
forward runs (`held(decision)`: a context variable, one per thread / task;
an outer decision wins over an inner one).  While one is held, transformers'
detection answers by it: no documents (None) where the unsharded model would
not pack; where it would, its own answer on the full position_ids, which
every stage and a split forward's base model are given (masks are built
before the sequence is split).  With nothing held it is transformers' own:
unsharded models are untouched.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading

import torch
from torch import nn

__all__ = ["unsharded_packs", "held", "hold", "release", "current", "documents"]

_HELD: contextvars.ContextVar = contextvars.ContextVar("shardformer_packed_decision", default=None)
_ORIGINAL = None                  # transformers' find_packed_sequence_indices, once replaced
_LOCK = threading.Lock()


def unsharded_packs(module: nn.Module, kwargs: dict) -> bool:
    """Whether the unsharded model, called as `module(**kwargs)` (module: the
    model or its base model), masks packed documents block-diagonally (the
    rule in the module docstring).  Position ids that hold one document per
    row give the same mask either way."""
    if kwargs.get("position_ids") is None or kwargs.get("attention_mask") is not None \
            or kwargs.get("past_key_values") is not None:
        return False
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", None)
    if use_cache and module.training and _checkpointing(module):
        use_cache = False
    return not use_cache


def _checkpointing(module: nn.Module) -> bool:
    """Gradient checkpointing on (transformers sets `gradient_checkpointing`
    on the base model and its layers)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def current() -> bool | None:
    """The decision held now (None: none)."""
    return _HELD.get()


def hold(decision: bool):
    """Holds `decision` unless one is held already (an outer call decided: a
    pipeline schedule around a split); returns what release() takes."""
    if _HELD.get() is not None:
        return None
    _install()
    return _HELD.set(bool(decision))


def release(token) -> None:
    """Ends what hold() returned `token` for (None: nothing)."""
    if token is not None:
        _HELD.reset(token)


@contextlib.contextmanager
def held(decision: bool):
    """hold(decision) for the forward run inside."""
    token = hold(decision)
    try:
        yield
    finally:
        release(token)


def documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' document numbers doc(t) [B, S] of `position_ids`, or
    None where every row holds one document."""
    _install()
    return _ORIGINAL(position_ids)


def _find_packed(position_ids):
    if _HELD.get() is False:
        return None
    return _ORIGINAL(position_ids)


def _install() -> None:
    """Routes transformers' packed-sequence detection through the held
    decision (once; a module attribute, read by _preprocess_mask_arguments
    at each call)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    from transformers import masking_utils

    with _LOCK:
        if _ORIGINAL is not None:
            return
        found = getattr(masking_utils, "find_packed_sequence_indices", None)
        if found is None:
            raise RuntimeError("shardformer.packing: transformers.masking_utils has no "
                               "find_packed_sequence_indices; this transformers version is outside the "
                               "supported range")
        _ORIGINAL = found
        masking_utils.find_packed_sequence_indices = _find_packed
