"""Sequence parallelism whose attention runs across the sequence split:
modes "all_to_all" (Ulysses) and "ring_attn".

Notation: hidden states X [batch, S, hidden]; an SP group of p ranks, rank
r.  S is padded with zero rows to S' (a multiple of p for all_to_all, of 2p
for ring_attn) and rank r holds the rows `rows_r` of the padded sequence:

    all_to_all   contiguous:  rows_r = [r S'/p, (r+1) S'/p)
    ring_attn    zigzag:      chunks of c = S'/(2p) rows; rank r holds chunks
                              r and 2p-1-r (equal causal work on every rank)

Every module of a decoder layer runs on this rank's rows with its full
weights (or its tensor-parallel shard, over a separate TP group): norms,
projections, rotary embeddings (cos/sin taken at rows_r), MLP, residuals.
Attention is the one place rows meet:

    all_to_all   q, k, v [B, H, S'/p, D] --all-to-all--> [B, H/p, S', D]
                 (heads scattered, sequence gathered; backward: the inverse
                 all-to-all), the model's own attention function runs on its
                 H/p heads over the whole sequence, and the output
                 [B, S', H/p, D] --all-to-all--> [B, S'/p, H, D].  Heads that
                 do not divide p: key/value heads repeated to the query heads
                 and zero heads appended, dropped again after.
    ring_attn    K/V blocks travel around the ring and the C flash kernel's
                 log-sum-exp merges the blocks exactly
                 (shardformer.layer.ring_attention), soft-capping the
                 logits in each block when the layer passes `softcap`, and
                 in training drawing the layer's attention dropout as one
                 kernel call over the whole sequence would.

Around the layers: the first layer's input is split (backward: all-gather
of the rows' gradients), the last layer's output all-gathered (backward:
this rank's rows of the gradient, the same on every rank), so the model's
inputs, outputs, loss and head are full-sequence as without SP.  The layers'
parameters see only this rank's rows, so their gradients are summed over
the SP group (all-reduce, backward).

A forward that uses a KV cache (past_key_values given, or use_cache=True)
runs unsplit: generate() works unchanged (each rank computes the whole
sequence); other forwards run split with use_cache=False, so they return no
cache.  An unsplit forward that would be differentiated is refused (its
gradients would be summed over the group).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .. import distributed as D
from ..distributed.mappings import _all_gather_seq
from .parallel_module import ShardPlan
from .replicated import _all_reduce_hook

SEQ_DIM = 1
MODES = ("all_to_all", "ring_attn")
_SYNC_MARK = "_shardformer_sp_grad_sync"

#: calls of the split attention, per mode (tests read them)
CALLS = {"all_to_all": 0, "ring_attn": 0, "unsplit": 0}


class SequenceSplit:
    """The state of one model's sequence split: the mode, the SP group, and
    per forward whether it is split (`active`), the unpadded length and the
    rows this rank holds."""

    def __init__(self, mode: str, group, name: str):
        self.mode, self.group, self.name = mode, group, name
        self.p, self.rank = D.world_size(group), D.rank(group)
        self.inner = "sdpa"                # the attention implementation the split one wraps
        self.active = False
        self.length = 0
        self.padded = 0
        self.rows: torch.Tensor | None = None      # this rank's rows of the padded sequence
        self.order: torch.Tensor | None = None     # every rank's rows, in all-gather order
        self._local: dict = {}                     # id(full tensor) -> (full, this rank's rows of it)

    def start(self, length: int, device) -> None:
        multiple = 2 * self.p if self.mode == "ring_attn" else self.p
        self.length, self.padded = length, -(-length // multiple) * multiple
        if self.mode == "ring_attn":
            from .ring_attention import zigzag_rows

            order = [zigzag_rows(self.padded, self.p, r) for r in range(self.p)]
            self.order = torch.cat(order).to(device)
            self.rows = order[self.rank].to(device)
        else:
            n = self.padded // self.p
            self.order = None                       # contiguous: all-gather order is the sequence
            self.rows = torch.arange(self.rank * n, (self.rank + 1) * n, device=device)
        self._local.clear()

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows (along `dim`) of a full-sequence tensor that every
        layer receives (rotary cos / sin), computed once per forward."""
        hit = self._local.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        out = _padded(t, self.padded, dim).index_select(dim, self.rows)
        self._local[id(t)] = (t, out)
        return out

    def __repr__(self) -> str:
        return f"SequenceSplit(mode={self.mode!r}, p={self.p}, active={self.active}, length={self.length})"


def _padded(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def _gather_rows(x: torch.Tensor, group, order: torch.Tensor | None) -> torch.Tensor:
    """All ranks' rows, placed at their positions: [B, S', ...] (`order`:
    every rank's rows in all-gather order; None: contiguous)."""
    gathered = _all_gather_seq(x.contiguous(), SEQ_DIM, group)
    if order is None:
        return gathered
    full = torch.empty_like(gathered)
    return full.index_copy_(SEQ_DIM, order, gathered)


# The autograd functions keep the layout of their own forward (the state
# moves on with the next forward, e.g. under gradient accumulation).

class _Split(torch.autograd.Function):
    """Forward: pad to S', keep this rank's rows.  Backward: all-gather the
    rows' gradients into place, drop the padding."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.group, ctx.order, ctx.length = state.group, state.order, state.length
        return _padded(x, state.padded, SEQ_DIM).index_select(SEQ_DIM, state.rows)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, ctx.order).narrow(SEQ_DIM, 0, ctx.length), None


class _Gather(torch.autograd.Function):
    """Forward: all-gather the rows into place, drop the padding.
    Backward: this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.rows, ctx.padded = state.rows, state.padded
        return _gather_rows(x, state.group, state.order).narrow(SEQ_DIM, 0, state.length)

    @staticmethod
    def backward(ctx, grad):
        return _padded(grad, ctx.padded, SEQ_DIM).index_select(SEQ_DIM, ctx.rows), None


# ---- attention ---------------------------------------------------------------

def _inner_attention(name: str, module):
    """The attention function `name` of transformers' registry ("eager":
    the model's own eager_attention_forward)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(f"sequence parallelism: {type(module).__name__} has no eager_attention_forward "
                               f"and {name!r} is not a registered attention implementation")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def _pad_mask(mask, length: int, padded: int):
    """An attention mask built for S rows and keys, extended to S': padded
    keys hidden from every real query (additive masks: -inf); a padded query
    sees itself only (a row with no key would give NaN in some
    implementations)."""
    if mask is None or not isinstance(mask, torch.Tensor) or padded == length:
        return mask
    extra = padded - length
    window = getattr(mask, "_shardformer_window", None)
    if mask.dim() == 2:                                  # [B, S] key padding (bool)
        out = F.pad(mask, (0, extra), value=False)
    elif mask.dim() == 4:                                # [B, 1|H, S, S]
        # -inf, not the dtype's min that HF uses: a query whose every real key is
        # masked (a left-padding row) spreads over its S keys in the unsplit
        # model, and must not spread over the padded ones too
        hidden, seen = (False, True) if mask.dtype == torch.bool else (float("-inf"), 0.0)
        out = F.pad(mask, (0, extra, 0, extra), value=hidden)
        idx = torch.arange(length, padded, device=mask.device)
        out[..., idx, idx] = seen
    else:
        raise NotImplementedError(f"sequence parallelism: a {mask.dim()}-D attention mask")
    if window is not None:
        out._shardformer_window = window
    return out


def _padding_mask(q: torch.Tensor, state: SequenceSplit, additive: bool) -> torch.Tensor:
    """[B, 1, S', S'] for bidirectional attention without a mask: the padded
    keys hidden from every query, a padded query seeing itself (bool, or
    additive 0 / -inf for eager functions)."""
    keys = torch.arange(state.padded, device=q.device) < state.length
    mask = keys[None, :].expand(state.padded, state.padded).clone()
    idx = torch.arange(state.length, state.padded, device=q.device)
    mask[idx, idx] = True
    mask = mask[None, None].expand(q.shape[0], 1, state.padded, state.padded)
    if additive:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    return mask


def _heads_for_split(query, key, value, p: int):
    """(q, k, v, groups, extra): heads divided over p ranks.  When the query
    or key-value heads do not divide p, k / v are repeated to the query heads
    (groups becomes 1) and `extra` zero heads are appended to all three."""
    hq, hkv = query.shape[1], key.shape[1]
    if hq % p == 0 and hkv % p == 0:
        return query, key, value, None, 0
    g = hq // hkv
    key = key.repeat_interleave(g, dim=1) if g > 1 else key
    value = value.repeat_interleave(g, dim=1) if g > 1 else value
    extra = -hq % p
    if extra:
        key, value, query = (F.pad(t, (0, 0, 0, 0, 0, extra)) for t in (key, value, query))
    return query, key, value, 1, extra


def _ulysses(state, module, query, key, value, attention_mask, kwargs):
    from ..distributed.mappings import all_to_all_along

    q, k, v, groups, extra = _heads_for_split(query, key, value, state.p)
    # [B, H, S'/p, D] -> [B, H/p, S', D]: heads scattered (dim 1), sequence gathered (dim 2)
    q, k, v = (all_to_all_along(t, 1, 2, state.group) for t in (q, k, v))
    mask = _pad_mask(attention_mask, state.length, state.padded)
    if mask is None and state.padded > state.length and not getattr(module, "is_causal", True):
        mask = _padding_mask(q, state, additive=state.inner == "eager")
    fn = _inner_attention(state.inner, module)
    saved = getattr(module, "num_key_value_groups", None)
    if groups is not None and saved is not None:
        module.num_key_value_groups = groups
    try:
        out, weights = fn(module, q, k, v, mask, **kwargs)
    finally:
        if groups is not None and saved is not None:
            module.num_key_value_groups = saved
    # [B, S', H/p, D] -> [B, S'/p, H, D]: sequence scattered (dim 1), heads gathered (dim 2)
    out = all_to_all_along(out.contiguous(), 1, 2, state.group)
    if extra:
        out = out[:, :, : query.shape[1]]
    return out, None


def _ring(state, module, query, key, value, attention_mask, kwargs):
    from .ring_attention import ring_attention

    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"{state.name}: ring_attn never builds the attention weights "
                                  f"(output_attentions=True)")
    dropout = float(kwargs.get("dropout") or 0.0) if module.training else 0.0
    padding = None
    # the sliding window as shardformer.attention reads it: the tag on the 2-D
    # key padding mask of a sliding layer, else the `sliding_window` HF passes
    window = getattr(attention_mask, "_shardformer_window", None) or kwargs.get("sliding_window") or 0
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise NotImplementedError(f"{state.name}: ring_attn covers causal attention with key padding and "
                                      f"sliding windows; this attention mask pattern is not supported "
                                      f"(use sequence_parallelism_mode='all_to_all')")
        padding = F.pad(attention_mask.to(torch.bool), (0, state.padded - state.length), value=False)
    causal = bool(getattr(module, "is_causal", True))
    if padding is None and not causal and state.padded > state.length:    # padded keys: hidden
        padding = torch.arange(state.padded, device=query.device) < state.length
        padding = padding.expand(query.shape[0], state.padded)
    out = ring_attention(query, key, value, state.group, scale=kwargs.get("scaling"), causal=causal,
                         key_padding=padding, window=int(window),   # global positions, as the split rows
                         softcap=kwargs.get("softcap"), dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def split_attention(module, query, key, value, attention_mask, **kwargs):
    """The AttentionInterface entry of the split modes: query [B, Hq, S_r, D],
    key / value [B, Hkv, S_r, D] of this rank's rows -> ([B, S_r, Hq, D], None).
    Unsplit forwards go straight to the wrapped implementation."""
    state: SequenceSplit = module.__dict__["_shardformer_sequence_split"]
    if not state.active:
        CALLS["unsplit"] += 1
        if state.mode == "ring_attn":      # the masks are the compact ones shardformer's attention reads
            from ..attention import shardformer_attention

            return shardformer_attention(module, query, key, value, attention_mask, **kwargs)
        return _inner_attention(state.inner, module)(module, query, key, value, attention_mask, **kwargs)
    CALLS[state.mode] += 1
    if state.mode == "all_to_all":
        return _ulysses(state, module, query, key, value, attention_mask, kwargs)
    return _ring(state, module, query, key, value, attention_mask, kwargs)


def _implementation_name(mode: str, inner: str) -> str:
    """The registered name for `mode` wrapping `inner`: the masks the model
    builds come from inner's mask function (all_to_all) or from the compact
    one of shardformer.attention (ring_attn: None or key padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .. import attention as sf_attention

    name = f"shardformer_sp_{mode}_{inner}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        if mode == "ring_attn":
            mask_fn = sf_attention.shardformer_mask
        elif inner in ALL_MASK_ATTENTION_FUNCTIONS:
            mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[inner]
        else:
            mask_fn = ALL_MASK_ATTENTION_FUNCTIONS["eager"]
        AttentionInterface.register(name, split_attention)
        AttentionMaskInterface.register(name, mask_fn)
    return name


# ---- the hooks ----------------------------------------------------------------

def _layer_inputs(args, kwargs):
    if args:
        return args[0], lambda v: ((v,) + tuple(args[1:]), kwargs)
    return kwargs["hidden_states"], lambda v: (args, {**kwargs, "hidden_states": v})


class SequenceAttentionParallel:
    """Applied to a decoder's `layers` (a ModuleList): kwargs `mode`
    ("all_to_all" | "ring_attn"), `group` (the SP group), `base` (the module
    that calls the layers: the decoder's base model) and `name` (the model's
    class name, for messages).  Adds the hooks described in the module
    docstring and switches the attention of the layers (and the masks of the
    base model) to the split implementation; rollback() undoes it all."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, mode=None, group=None, base=None,
                   name="", **kwargs) -> ShardPlan:
        if mode not in MODES:
            raise ValueError(f"SequenceAttentionParallel: mode must be one of {MODES}, got {mode!r}")
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            raise TypeError(f"{name}: SequenceAttentionParallel applies to the non-empty ModuleList of the "
                            f"decoder layers, got {type(module).__name__}")
        if not isinstance(base, nn.Module):
            raise TypeError(f"{name}: SequenceAttentionParallel needs `base`, the module calling the layers")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              mode=None, group=None, base=None, name="", **kwargs) -> "_SplitHooks":
        cls.plan_shard(module, 1, 0, mode=mode, group=group, base=base, name=name)
        return _SplitHooks(module, base, SequenceSplit(mode, group, name))

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, **kwargs).commit()


class _SplitHooks:
    def __init__(self, layers: nn.ModuleList, base: nn.Module, state: SequenceSplit):
        self.layers, self.base, self.state = layers, base, state
        self.handles: list = []
        self.configs: list = []            # (config, its _attn_implementation before)
        self.attention: list = []          # attention modules given the state

    def _switch_attention(self) -> None:
        state = self.state
        from ..attention import _uses_registry

        users = [m for m in self.layers.modules() if _uses_registry(m)]
        if not users:
            raise NotImplementedError(f"{state.name}: sequence_parallelism_mode={state.mode!r} needs attention "
                                      f"that goes through transformers' AttentionInterface; this model's does not")
        configs = {id(m.config): m.config for m in users if getattr(m, "config", None) is not None}
        base_config = getattr(self.base, "config", None)
        if base_config is not None:
            configs.setdefault(id(base_config), base_config)
        inner = {getattr(c, "_attn_implementation", None) or "eager" for c in configs.values()}
        if len(inner) != 1:
            raise ValueError(f"{state.name}: the layers use different attention implementations {sorted(inner)}; "
                             f"sequence parallelism wraps one")
        state.inner = inner.pop()
        if state.inner.startswith("shardformer_sp_"):
            raise ValueError(f"{state.name}: the model's attention is already split ({state.inner})")
        name = _implementation_name(state.mode, state.inner)
        for cfg in configs.values():
            self.configs.append((cfg, cfg._attn_implementation))
            cfg._attn_implementation = name
        for m in users:
            m.__dict__["_shardformer_sequence_split"] = state
            self.attention.append(m)

    def commit(self) -> nn.Module:
        state, layers = self.state, self.layers
        self._switch_attention()

        def base_pre(_module, args, kwargs):
            cache, use_cache = kwargs.get("past_key_values"), kwargs.get("use_cache")
            state.active = cache is None and use_cache is not True and state.p > 1
            if state.active:
                _refuse_recorded_outputs(_module, kwargs, state)
                kwargs = {**kwargs, "use_cache": False}
                if torch.is_grad_enabled():
                    _ensure_grad_sync(layers, state.group)
            elif state.p > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in layers.parameters()):
                raise RuntimeError(
                    f"{state.name}: sequence_parallelism_mode={state.mode!r}: a forward with a KV cache "
                    f"(use_cache=True or past_key_values) runs unsplit on every rank, and its gradients would "
                    f"be summed over the sequence-parallel group; run it under torch.no_grad(), or pass "
                    f"use_cache=False to train")
            return args, kwargs

        def first_pre(_module, args, kwargs):
            if not state.active:
                return None
            x, rebuild = _layer_inputs(args, kwargs)
            state.start(x.shape[SEQ_DIM], x.device)
            return rebuild(_Split.apply(x, state))

        def every_pre(_module, args, kwargs):
            if not state.active:
                return None
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, (tuple, list)):
                kwargs = {**kwargs, "position_embeddings": type(pe)(
                    state.local(t, SEQ_DIM) if isinstance(t, torch.Tensor) and t.dim() >= 2
                    and t.shape[SEQ_DIM] == state.length else t for t in pe)}
            elif isinstance(pe, torch.Tensor) and pe.dim() >= 2 and pe.shape[SEQ_DIM] == state.length:
                kwargs = {**kwargs, "position_embeddings": state.local(pe, SEQ_DIM)}
            return args, kwargs

        def last_post(_module, _args, output):
            if not state.active:
                return None
            if isinstance(output, torch.Tensor):
                return _Gather.apply(output, state)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (_Gather.apply(output[0], state),) + tuple(output[1:])
            raise TypeError(f"{state.name}: a decoder layer returned {type(output).__name__}; expected the "
                            f"hidden states (a tensor, or a tuple starting with one)")

        self.handles.append(self.base.register_forward_pre_hook(base_pre, with_kwargs=True))
        self.handles.append(layers[0].register_forward_pre_hook(first_pre, with_kwargs=True))
        for layer in layers:
            self.handles.append(layer.register_forward_pre_hook(every_pre, with_kwargs=True))
        self.handles.append(layers[len(layers) - 1].register_forward_hook(last_post))
        return layers

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for cfg, old in reversed(self.configs):
            cfg._attn_implementation = old
        self.configs.clear()
        for m in self.attention:
            m.__dict__.pop("_shardformer_sequence_split", None)
        self.attention.clear()


def _refuse_recorded_outputs(base: nn.Module, kwargs: dict, state: SequenceSplit) -> None:
    """Hidden states between layers and attention weights are split (rows,
    heads) under these modes: asked for in a split forward, they raise
    rather than come back partial."""
    config = getattr(base, "config", None)
    for what in ("output_hidden_states", "output_attentions"):
        want = kwargs.get(what)
        if want is None:
            want = getattr(config, what, False)
        if want:
            raise NotImplementedError(
                f"{state.name}: {what}=True with sequence_parallelism_mode={state.mode!r}: between the layers "
                f"each rank holds only its rows of the sequence; run that forward with use_cache=True under "
                f"torch.no_grad() (unsplit), or without {what}")


def _ensure_grad_sync(layers: nn.Module, group) -> None:
    """Every trainable parameter of the layers sums its gradient over the SP
    group (all-reduce in backward), once per parameter.  Done at the first
    split forward, on the parameters the model holds then (the sharder
    may have replaced modules after this change was committed)."""
    for p in layers.parameters():
        # the mark holds the group in a tuple: None (the default group) is a group too
        if p.requires_grad and p.__dict__.get(_SYNC_MARK) != (group,):
            p.register_hook(_all_reduce_hook(group))
            p.__dict__[_SYNC_MARK] = (group,)
