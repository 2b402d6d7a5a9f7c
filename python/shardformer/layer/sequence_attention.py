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
                 kernel call over the whole sequence would.  Packed
                 documents (the block-diagonal mask transformers builds
                 without a KV cache): each block and-s the equality of its
                 rows' and keys' documents into its mask, the documents
                 numbered from the full position_ids in the base model's
                 call (the mask checked to be that pattern, once per forward).

Around the layers: the first layer's input is split (backward: all-gather
of the rows' gradients), the last layer's output all-gathered (backward:
this rank's rows of the gradient, the same on every rank), so the model's
inputs, outputs, loss and head are full-sequence as without SP.  The layers'
parameters see only this rank's rows, so their gradients are summed over
the SP group (all-reduce, backward).

Encoder-decoder stacks (T5, Whisper) take the split per stack.  A decoder's
cross-attention queries are this rank's rows and its keys / values the
encoder output, full on every rank: each rank attends its rows to every key
with the model's own attention function (no collective; a 4-D cross mask
[B, 1, S_dec, S_enc] is cut to this rank's query rows).  Each rank's rows
contribute a partial gradient of the encoder output, so the decoder reads it
through an identity whose backward all-reduces over the SP group.  A
relative position bias built by the attention module itself (T5's
compute_bias, [1, H, Sq, Sk]) is built for the whole padded sequence,
[1, H, S', S']: under all_to_all each rank adds its H/p heads of it, under
ring_attn each block of the ring adds its (query rows, key columns) of it
(ring_attention's `bias`); the bias table's gradient is then this rank's
part (heads, or query rows), summed over the group like every other layer
parameter.

Layers applied more than once per forward (ALBERT's shared layer groups,
`repeated=True`): the input is split on the first entry of layers[0] in a
forward and the base's output (its last_hidden_state) is gathered; each
shared parameter has one gradient hook, and autograd sums its uses before
the hook runs, so the all-reduce counts every application once.
Attention outside transformers' registry (GPT-Neo, GPT-J, BLOOM, Falcon):
the family names a seam (AttentionSeam: the attention class and the method
where q, k, v [B, H, S_r, D] meet), the method is replaced on each such
module by one that runs the same exchange around the model's own math
(all_to_all) or the ring kernel (ring_attn); per-head tensors that the model
passes in (ALiBi slopes times key positions, a per-head mask) keep this
rank's heads after the exchange, over the full padded key axis; under
ring_attn a per-key bias (ALiBi) is added by each block of the ring at its
key columns (ring_rows' key_bias).  With enable_flash_attention the seam's
`kernel` serves the unsplit forwards.

Dropout in a split training forward: inside the layers every rank holds
other rows (or, inside all_to_all, other heads), so torch's global generator,
in the same state on every rank, would draw one mask for all of them.  While
each layer runs, the global generator draws from a per-rank stream
(_RankStream: seeded from one draw of the shared stream and the SP rank;
tensor-parallel peers, which hold the same rows, share it) and is put back
after, so dropouts outside the layers stay the same on every rank.  Per
layer, so that gradient checkpointing, which restores the shared stream
before recomputing a layer, draws the same seed and the same masks again.

A forward that uses a KV cache (past_key_values given, or use_cache=True)
runs unsplit: generate() works unchanged (each rank computes the whole
sequence); other forwards run split with use_cache=False, so they return no
cache.  An unsplit forward that would be differentiated is refused (its
gradients would be summed over the group).  The mask a split forward builds
is the one the unsharded model builds for the same call: packed documents in
the position_ids are masked block-diagonally only where the unsharded model,
with the cache it would make, does so (shardformer.packing, decided on the
base model's call before use_cache is dropped, and held while it runs).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import attention as sf_attention
from .. import distributed as D
from .. import packing
from ..distributed.mappings import (SequenceRows, all_to_all_along, copy_to_tp_region, gather_heads,
                                     gather_sequence_rows, pad_to, split_sequence_rows)
from ..pickling import BoundMethod, reference_of, register_reference, resolve_reference
from .dropout import RankStream as _RankStream, may_draw
from .parallel_module import ShardPlan
from .replicated import all_reduce_hook, has_grad_all_reduce
from . import ring_attention as ring   # looked up at each call (tests wrap ring.ring_attention)
from .sequence import mark_rows

SEQ_DIM = 1
MODES = ("all_to_all", "ring_attn")
_SYNC_MARK = "_shardformer_sp_grad_sync"

#: calls of the split attention, per mode (tests read them)
CALLS = {"all_to_all": 0, "ring_attn": 0, "unsplit": 0, "cross": 0, "bias": 0}
_CROSS_MARK = "_shardformer_cross_attention"
_UNSUMMED_MARK = "_shardformer_unsummed"       # the tensor an encoder output's all-reduce wrapper was made from


class SequenceSplit:
    """The state of one model's sequence split: the mode, the SP group, and
    per forward whether it is split (`active`), the unpadded length and the
    rows this rank holds."""

    def __init__(self, mode: str, group, name: str):
        self.mode, self.group, self.name = mode, group, name
        self.p, self.rank = D.world_size(group), D.rank(group)
        self.dim = SEQ_DIM                 # the sequence dimension of the layers' hidden states
        self.inner = "sdpa"                # the attention implementation the split one wraps
        self.seam: AttentionSeam | None = None      # where attention outside the registry is split
        self.active = False
        self.record_attentions = False             # output_attentions asked for in this forward (all_to_all)
        self.length = 0
        self.padded = 0
        self.rows: torch.Tensor | None = None      # this rank's rows of the padded sequence
        self.order: torch.Tensor | None = None     # every rank's rows, in all-gather order
        self.entered = False                       # repeated layers: the input was split in this forward
        self._local: dict = {}                     # id(full tensor) -> (full, this rank's rows of it)
        self.stream: _RankStream | None = None     # the per-rank generator stream of a training forward
        self.documents: torch.Tensor | None = None  # ring_attn, packed documents: each row's [B | 1, S]

    def start(self, length: int, device) -> None:
        multiple = 2 * self.p if self.mode == "ring_attn" else self.p
        self.length, self.padded = length, -(-length // multiple) * multiple
        if self.mode == "ring_attn":
            order = [ring.zigzag_rows(self.padded, self.p, r) for r in range(self.p)]
            self.order = torch.cat(order).to(device)
            self.rows = order[self.rank].to(device)
        else:
            n = self.padded // self.p
            self.order = None                       # contiguous: all-gather order is the sequence
            self.rows = torch.arange(self.rank * n, (self.rank + 1) * n, device=device)
        self._local.clear()

    def resume(self, full: torch.Tensor) -> None:
        """A forward that starts past the split (a later pipeline stage: its
        first layer receives this rank's rows from the previous stage);
        `full` is shaped like the unsplit layer input: the rows as start()
        would set them.  The received rows are split already: a repeated
        layer list (ALBERT, whose first layer may run on this stage) must not
        split them again (`entered`)."""
        if self.active:
            self.start(full.shape[self.dim], full.device)
            self.entered = True

    def layout(self) -> SequenceRows:
        """The rows of the forward in progress, frozen (an autograd function
        keeps the layout of its own forward)."""
        return SequenceRows(self.group, self.length, self.padded, self.dim, self.rows, self.order)

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows (along `dim`) of a full-sequence tensor that every
        layer receives (rotary cos / sin), computed once per forward."""
        hit = self._local.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        out = pad_to(t, self.padded, dim).index_select(dim, self.rows)
        self._local[id(t)] = (t, out)
        return out

    def __repr__(self) -> str:
        return f"SequenceSplit(mode={self.mode!r}, p={self.p}, active={self.active}, length={self.length})"


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
    q, k, v, groups, extra = _heads_for_split(query, key, value, state.p)
    # [B, H, S'/p, D] -> [B, H/p, S', D]: heads scattered (dim 1), sequence gathered (dim 2)
    q, k, v = (all_to_all_along(t, 1, 2, state.group) for t in (q, k, v))
    mask = _pad_mask(attention_mask, state.length, state.padded)
    if mask is None and state.padded > state.length and not getattr(module, "is_causal", True):
        mask = _padding_mask(q, state, additive=state.inner == "eager")
    if kwargs.get("position_bias") is not None:
        kwargs = {**kwargs, "position_bias": _bias_heads(kwargs["position_bias"], state, query.shape[1], extra)}
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
    if weights is None or not state.record_attentions:
        return out, None
    return out, gather_heads(weights, state.group, query.shape[1], state.length)


def _bias_heads(bias: torch.Tensor, state: SequenceSplit, heads: int, extra: int) -> torch.Tensor:
    """This rank's heads of an additive bias [1 | B, H, S', S'] built for the
    whole padded sequence: `extra` zero heads appended as to q / k / v, then
    the r-th of p equal blocks of heads (the block all_to_all_along gives
    rank r)."""
    if bias.dim() != 4 or bias.shape[1] != heads or tuple(bias.shape[-2:]) != (state.padded, state.padded):
        raise NotImplementedError(f"{state.name}: all_to_all needs the position bias for the whole padded sequence "
                                  f"[*, {heads}, {state.padded}, {state.padded}]; got {tuple(bias.shape)}")
    if extra:
        bias = F.pad(bias, (0, 0, 0, 0, 0, extra))
    block = bias.shape[1] // state.p
    CALLS["bias"] += 1
    return bias.narrow(1, state.rank * block, block)


def _cross_mask(mask, state: SequenceSplit):
    """A cross-attention mask for this rank's query rows: a 4-D mask with a
    row per decoder query [B, 1, S, S_enc] padded to S' rows (padded queries
    see every key) and cut to this rank's rows; a 2-D key padding mask or a
    4-D mask broadcast over queries is the same for every row."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] == 1:
        return mask
    if mask.shape[-2] != state.length:
        raise NotImplementedError(f"{state.name}: a cross-attention mask of {mask.shape[-2]} query rows for "
                                  f"{state.length} decoder tokens")
    seen = True if mask.dtype == torch.bool else 0.0
    mask = F.pad(mask, (0, 0, 0, state.padded - state.length), value=seen)
    return mask.index_select(2, state.rows)


def _cross(state, module, query, key, value, attention_mask, kwargs):
    """Cross-attention: query [B, H, S_r, D] of this rank's rows, key / value
    [B, H, S_enc, D] of the whole encoder output: the rows attend to every key
    with the wrapped implementation, no collective."""
    mask = _cross_mask(attention_mask, state)
    if state.mode == "ring_attn":
        return sf_attention.shardformer_attention(module, query, key, value, mask, **kwargs)
    return _inner_attention(state.inner, module)(module, query, key, value, mask, **kwargs)


def _ring(state, module, query, key, value, attention_mask, kwargs):
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"{state.name}: ring_attn never builds the attention weights "
                                  f"(output_attentions=True)")
    bias = kwargs.get("position_bias")
    if bias is not None and (bias.dim() != 4 or tuple(bias.shape[-2:]) != (state.padded, state.padded)):
        raise NotImplementedError(f"{state.name}: ring_attn needs the position bias for the whole padded sequence "
                                  f"[*, H, {state.padded}, {state.padded}]; got {tuple(bias.shape)}")
    dropout = float(kwargs.get("dropout") or 0.0) if module.training else 0.0
    padding = None
    # the sliding window as shardformer.attention reads it: the tag on the 2-D
    # key padding mask of a sliding layer, else the `sliding_window` HF passes
    window = getattr(attention_mask, "_shardformer_window", None) or kwargs.get("sliding_window") or 0
    causal = bool(getattr(module, "is_causal", True))
    documents = None
    if attention_mask is not None:
        if state.documents is not None:
            documents = _ring_documents(state, attention_mask, causal, int(window))
        elif not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise NotImplementedError(f"{state.name}: ring_attn covers causal attention with key padding, "
                                      f"sliding windows and packed documents; this attention mask pattern is not "
                                      f"supported (use sequence_parallelism_mode='all_to_all')")
        else:
            padding = F.pad(attention_mask.to(torch.bool), (0, state.padded - state.length), value=False)
    if padding is None and not causal and state.padded > state.length:    # padded keys: hidden
        padding = torch.arange(state.padded, device=query.device) < state.length
        padding = padding.expand(query.shape[0], state.padded)
    if bias is not None:
        CALLS["bias"] += 1
    out = _equal_widths(ring.ring_attention, query, key, value, state.group, scale=kwargs.get("scaling"),
                        causal=causal, key_padding=padding, window=int(window), bias=bias,   # global positions
                        softcap=kwargs.get("softcap"), dropout_p=dropout, documents=documents)
    return out.transpose(1, 2).contiguous(), None


def _ring_documents(state: SequenceSplit, mask, causal: bool, window: int) -> torch.Tensor:
    """The documents [B, S'] (padded rows: a document of their own, -1) for
    the ring kernel, of a forward whose mask transformers built for packed
    documents: checked, once per mask and forward, to be exactly causal
    (and the window) within each document, else refused."""
    hit = state._local.get(("documents", id(mask)))
    if hit is not None and hit[0] is mask:
        return hit[1]
    S = state.length
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (S, S):
        raise NotImplementedError(f"{state.name}: ring_attn with packed documents: an attention mask that is not "
                                  f"[B, 1, S, S] (use sequence_parallelism_mode='all_to_all')")
    docs = state.documents.to(mask.device).expand(mask.shape[0], S)
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    i = torch.arange(S, device=mask.device)
    d = i[:, None] - i[None, :]
    band = (d >= 0) if causal else torch.ones_like(d, dtype=torch.bool)
    if window:
        band = band & ((d < window) if causal else (d.abs() < window))
    expected = band[None, None] & (docs[:, None, :, None] == docs[:, None, None, :])
    if not torch.equal(visible, expected.expand_as(visible)):
        raise NotImplementedError(f"{state.name}: ring_attn covers causal attention within packed documents; "
                                  f"this forward's attention mask is another pattern (use "
                                  f"sequence_parallelism_mode='all_to_all')")
    out = F.pad(docs, (0, state.padded - S), value=-1).contiguous()
    state._local[("documents", id(mask))] = (mask, out)
    return out


def split_attention(module, query, key, value, attention_mask, **kwargs):
    """The AttentionInterface entry of the split modes: query [B, Hq, S_r, D],
    key / value [B, Hkv, S_r, D] of this rank's rows -> ([B, S_r, Hq, D], None).
    Unsplit forwards go straight to the wrapped implementation."""
    state: SequenceSplit = module.__dict__["_shardformer_sequence_split"]
    if not state.active:
        CALLS["unsplit"] += 1
        if state.mode == "ring_attn":      # the masks are the compact ones shardformer's attention reads
            return sf_attention.shardformer_attention(module, query, key, value, attention_mask, **kwargs)
        return _inner_attention(state.inner, module)(module, query, key, value, attention_mask, **kwargs)
    if module.__dict__.get(_CROSS_MARK):
        CALLS["cross"] += 1
        return _cross(state, module, query, key, value, attention_mask, kwargs)
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


# ---- attention outside transformers' registry: a named seam -------------------

@dataclass(frozen=True)
class AttentionSeam:
    """Where a family whose attention does not go through transformers'
    AttentionInterface can be split: on every module of class `module` (exact
    name: another implementation class, e.g. a flash-attention subclass, is
    refused) the method `method` is replaced, for the model's lifetime under
    SP, by one that calls

        split(state, module, original, args, kwargs)

    in a split forward (`original`: the class's own method, bound) and
    `original(*args, **kwargs)` otherwise.  `row_kwargs`: arguments
    of each layer (by keyword, or by position under that parameter name)
    holding a tensor with one entry per sequence row along `seq_dim` (GPT-J's
    position_ids, ChatGLM2's rotary table): a split forward passes this
    rank's rows.  `seq_dim`: the sequence dimension of the layers' hidden
    states (1 for [B, S, hidden]; 0 for ChatGLM2's [S, B, hidden]): the split
    before the first layer and the gather after the last run along it.
    `kernel(module, original, args, kwargs)`: the
    method computed with the C attention kernel (enable_flash_attention;
    shardformer.attention.enable_seam), returning what `original` returns;
    it calls shardformer.attention.own_attention where the kernel cannot
    give the model's result.  `kernel_also`: more class names the kernel
    serves (kernel_modules), the split never.  Under all_to_all / ring_attn an unsplit
    forward (a KV cache) runs it too."""

    module: str
    method: str
    split: Callable
    row_kwargs: tuple[str, ...] = ()
    seq_dim: int = SEQ_DIM
    kernel: Callable | None = None
    kernel_also: tuple[str, ...] = ()

    def modules(self, root: nn.Module) -> list:
        return [m for m in root.modules() if type(m).__name__ == self.module]

    def kernel_modules(self, root: nn.Module) -> list:
        """The modules `kernel` serves: `module`'s, and those of the classes
        `kernel_also` names (other implementations of the same attention with
        the same method signature, e.g. an SDPA subclass; not split)."""
        names = (self.module, *self.kernel_also)
        return [m for m in root.modules() if type(m).__name__ in names]

    def registered(self, module_name: str, attr: str) -> "AttentionSeam":
        """This seam, declared as bound to the module-level name
        `module_name`.`attr` (`SEAM = AttentionSeam(...).registered(__name__,
        "SEAM")`), so that a model sharded with it pickles: the seam pickles
        as that name (shardformer.pickling.register_reference)."""
        return register_reference(self, module_name, attr)

    def __reduce__(self):
        """Pickled by reference: the module-level name it was registered
        under (its split / kernel are closures of the factory that made it)."""
        home = reference_of(self)
        if home is None:
            raise TypeError(f"the AttentionSeam of {self.module}.{self.method} cannot be pickled: it was not "
                            f"registered under a module-level name (SEAM = AttentionSeam(...).registered(__name__, "
                            f"'SEAM'); docs/code-layers.md)")
        return resolve_reference, home

    def refuse(self, model: nn.Module, mode: str, name: str) -> None:
        """Refuse, before anything changes: a model none of whose attention
        modules is `module` (another attention implementation)."""
        if not self.modules(model):
            found = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
            impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
            raise NotImplementedError(
                f"{name}: sequence_parallelism_mode={mode!r} splits the attention at {self.module}.{self.method}; "
                f"this model's attention modules are {found} (attn_implementation={impl!r}): load it with "
                f"attn_implementation='eager'")


def _seam_method(module, *args, **kwargs):
    """The replaced method of a seam's module: split forwards go to the
    seam's `split`, the others to the class's own method."""
    state: SequenceSplit = module.__dict__["_shardformer_sequence_split"]
    seam = state.seam
    original = getattr(type(module), seam.method).__get__(module, type(module))
    if not state.active:
        CALLS["unsplit"] += 1

        if sf_attention.SEAM_MARK in module.__dict__:   # enable_flash_attention: the seam's kernel
            return seam.kernel(module, original, args, kwargs)
        return original(*args, **kwargs)
    CALLS[state.mode] += 1
    return seam.split(state, module, original, args, kwargs)


def bind_args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list:
    """The values of the parameters `names` (in this order, the method's
    leading parameters after self) from a call's args / kwargs; None when
    absent."""
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


def local_heads(t: torch.Tensor | None, state: SequenceSplit, heads: int, dim: int = 1):
    """This rank's heads, after the all-to-all, of a per-head tensor that the
    model built for all `heads` heads of the module (size 1 along `dim`:
    shared by every head, returned as is): padded with zero heads as
    _heads_for_split pads, then block `rank` of p equal blocks along `dim`
    (all_to_all_along sends block j to rank j)."""
    if t is None or t.shape[dim] == 1:
        return t
    if t.shape[dim] != heads:
        raise ValueError(f"{state.name}: a per-head tensor of {t.shape[dim]} heads for {heads} attention heads")
    extra = -heads % state.p
    if extra:
        t = pad_to(t, heads + extra, dim)
    return t.chunk(state.p, dim)[state.rank]


def additive(mask, dtype):
    """An attention mask as a bias to add to the scores: bool (True = attend)
    becomes 0 / the dtype's min; an additive one (or None) is returned as is."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def padded_keys(t: torch.Tensor | None, state: SequenceSplit):
    """A tensor over the key positions (last dim, the unpadded length)
    extended with zeros to the padded length S'."""
    return None if t is None else pad_to(t, state.padded, t.dim() - 1)


def ulysses(state: SequenceSplit, query, key, value, core: Callable, mask=None) -> torch.Tensor:
    """all_to_all around `core`: query / key / value [B, H(kv), S_r, D] of
    this rank's rows (contiguous) -> all-to-all (scatter heads, gather the
    sequence; backward: the inverse) -> core(q, k, v, mask) on [B, H/p, S', D]
    over the whole padded sequence, `mask` the model's mask extended to S'
    (_pad_mask), returning [B, H/p, S', D] -> all-to-all back (scatter the
    sequence, gather heads) -> [B, H, S_r, D].  Heads not dividing p:
    _heads_for_split (key / value repeated to the query heads, zero heads
    appended and dropped after)."""
    heads = query.shape[1]
    q, k, v, _groups, extra = _heads_for_split(query, key, value, state.p)
    q, k, v = (all_to_all_along(t.contiguous(), 1, 2, state.group) for t in (q, k, v))
    out = core(q, k, v, _pad_mask(mask, state.length, state.padded))
    out = all_to_all_along(out.contiguous(), 2, 1, state.group)
    return out[:, :heads] if extra else out


def causal_key_padding(mask, state: SequenceSplit) -> torch.Tensor | None:
    """The key padding [B, S'] (bool, True = attend; padded rows False) of a
    causal [B, 1|H, S, S] mask the model built (additive: visible where 0,
    hidden at the dtype's min; or bool), for the ring kernel, which applies
    causality itself.  A mask that is anything but causal x key padding
    (the last query row, which sees every key causally, gives the padding)
    is refused."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != state.length:
        raise NotImplementedError(f"{state.name}: ring_attn: an attention mask that is not [B, 1, S, S] "
                                  f"(use sequence_parallelism_mode='all_to_all')")
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    keys = visible[:, 0, -1, :]
    causal = torch.ones(state.length, state.length, dtype=torch.bool, device=mask.device).tril()
    if not torch.equal(visible, (causal[None, None] & keys[:, None, None, :]).expand_as(visible)):
        raise NotImplementedError(f"{state.name}: ring_attn covers causal attention with key padding; this "
                                  f"attention mask is another pattern (use sequence_parallelism_mode='all_to_all')")
    return F.pad(keys, (0, state.padded - state.length), value=False)


def ring_rows(state: SequenceSplit, query, key, value, mask, *, scale: float, window: int = 0,
              dropout: float = 0.0, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """ring_attn on this rank's zigzag rows: query [B, Hq, S_r, D], key /
    value [B, Hkv, S_r, D] -> [B, Hq, S_r, D], causal in global positions,
    the key padding read from the model's causal mask (causal_key_padding),
    sliding `window` (0: none), attention dropout `dropout` (the caller
    passes 0 outside training) drawn as one kernel call over the whole padded
    sequence would draw it (ring_attention), and `key_bias` [B, Hq, 1, S']:
    an additive bias per head and key position (ALiBi: slope_h x key
    position), the same for every query row: each block of the ring adds its
    key columns of it (ring_attention's `bias`, read through a broadcast
    view [B, Hq, S', S'], never materialized).  Value heads narrower or
    wider than the key heads (latent attention: k [.., 192], v [.., 128])
    are padded with zero columns to one width D (zeros leave q . k and P v
    unchanged; the scale is explicit) and the output cut back to v's width."""
    padding = causal_key_padding(mask, state)
    bias = None
    if key_bias is not None:
        CALLS["bias"] += 1
        bias = key_bias.expand(key_bias.shape[0], key_bias.shape[1], state.padded, state.padded)
    return _equal_widths(ring.ring_attention, query, key, value, state.group, scale=scale, causal=True,
                         key_padding=padding, window=int(window), dropout_p=float(dropout), bias=bias)


def _equal_widths(attend, query, key, value, *args, scale, **kwargs):
    """attend(query, key, value, ..., scale=...) with value heads as wide as
    the key heads: where they differ (latent attention), q / k / v get zero
    columns up to the wider one (q . k and P v unchanged; the scale, 1/sqrt
    of the key width unless given, stays the unpadded one) and the output is
    cut back to v's width."""
    dk, dv = key.shape[-1], value.shape[-1]
    if dk == dv:
        return attend(query, key, value, *args, scale=scale, **kwargs)
    width = max(dk, dv)
    scale = dk ** -0.5 if scale is None else scale
    query, key = F.pad(query, (0, width - dk)), F.pad(key, (0, width - dk))
    out = attend(query, key, F.pad(value, (0, width - dv)), *args, scale=scale, **kwargs)
    return out[..., :dv]


def head_major_seam(module: str, *, scale: Callable, window: Callable = lambda m: 0, causal: bool = False,
                    dropout: str = "attn_dropout", row_kwargs: tuple[str, ...] = ()) -> AttentionSeam:
    """The seam of a method `_attn(query, key, value, attention_mask=None) ->
    (out, weights)` on q / k / v [B, H, S_r, D] (heads major, positions
    already applied), returning out [B, H, S_r, D] (GPT-Neo, GPT-J).
    all_to_all calls the model's own `_attn` on H/p heads over S' with the
    extended mask; ring_attn runs the ring kernel with scale(module) (the
    factor on q . k) and window(module) (0: none), drawing attention dropout
    `dropout` (the module's nn.Dropout on the probabilities) in training.
    Weights are not returned (None).  The kernel (enable_flash_attention)
    computes softmax(scale q . k + mask) @ v, masked as the model masks:
    `causal` (the model's own causal / local-window buffer, bottom-right
    aligned as the kernel aligns it) and the model's mask added as it adds
    it; the model's `_attn` where attention dropout is active in training."""

    def split(state, mod, original, args, kwargs):
        query, key, value, mask = bind_args(args, kwargs, ("query", "key", "value", "attention_mask"))
        if state.mode == "all_to_all":
            return ulysses(state, query, key, value, lambda q, k, v, m: original(q, k, v, m)[0], mask), None
        p = getattr(mod, dropout).p if mod.training else 0.0
        return ring_rows(state, query, key, value, mask, scale=scale(mod), window=window(mod), dropout=p), None

    def kernel(mod, original, args, kwargs):
        query, key, value, mask = bind_args(args, kwargs, ("query", "key", "value", "attention_mask"))
        p = getattr(mod, dropout).p if mod.training else 0.0
        reason = sf_attention.seam_kernel_reason(mod, (query, key, value), p, sf_attention.wants_weights(mod))
        if reason is not None:
            return sf_attention.own_attention(reason, original, args, kwargs)
        out = sf_attention.seam_kernel(query, key, value, scale=scale(mod), causal=causal, mask=mask,
                                       window=window(mod), dropout=p)
        return out, None

    return AttentionSeam(module, "_attn", split, row_kwargs, kernel=kernel)


# ---- the hooks ----------------------------------------------------------------

def _open_stream(state: SequenceSplit, layer: nn.Module, config, device) -> None:
    """A per-rank stream while a layer of a split training forward runs
    (only where it can drop: a model without dropout leaves the shared
    stream untouched)."""
    _close_stream(state)
    if layer.training and may_draw(layer, config):
        state.stream = _RankStream(state.rank, device)


def _close_stream(state: SequenceSplit) -> None:
    if state.stream is not None:
        stream, state.stream = state.stream, None
        stream.close()


def _local_row_arguments(layer: nn.Module, args: tuple, kwargs: dict, state: SequenceSplit,
                         rows: tuple[str, ...]) -> tuple:
    """(args, kwargs) of a layer call with this rank's rows (along state.dim)
    of each argument named in `rows` (the seam's or the policy's
    row_kwargs), passed by keyword or by position (found by name in the
    layer's forward signature) and holding one entry per sequence position."""
    import inspect

    names = list(inspect.signature(layer.forward).parameters)
    args, kwargs = list(args), dict(kwargs)
    for key in rows:
        at = names.index(key) if key in names else None
        by_position = at is not None and at < len(args)
        t = args[at] if by_position else kwargs.get(key)
        if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[state.dim] == state.length):
            continue
        if by_position:
            args[at] = state.local(t, state.dim)
        else:
            kwargs[key] = state.local(t, state.dim)
    return tuple(args), kwargs


def _layer_inputs(args, kwargs):
    if args:
        return args[0], lambda v: ((v,) + tuple(args[1:]), kwargs)
    return kwargs["hidden_states"], lambda v: (args, {**kwargs, "hidden_states": v})


class SequenceAttentionParallel:
    """Applied to a decoder's `layers` (a ModuleList): kwargs `mode`
    ("all_to_all" | "ring_attn"), `group` (the SP group), `base` (the module
    that calls the layers: the decoder's base model) and `name` (the model's
    class name, for messages); optional: `cross` (names of the layers'
    cross-attention modules, e.g. ("EncDecAttention",): their keys are the
    base's `encoder_hidden_states` kwarg), `full_bias` (the name of the
    attention modules' method building their position bias from
    (query_length, key_length, ...): called for the whole padded sequence
    while split), `repeated` (the layers run more than once per forward:
    split at the first entry, gather the base's output) and `seam` (an
    AttentionSeam, for attention outside transformers' registry; None: the
    registry), `row_kwargs` (registry path: the layers' arguments holding
    one entry per sequence row, e.g. position_ids [B, S], passed to each
    layer as this rank's rows; a seam names its own).  Adds the hooks
    described in the module docstring and
    switches the attention of the layers (and the masks of the base model)
    to the split implementation, or replaces the seam's method; rollback()
    undoes it all."""

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
                              mode=None, group=None, base=None, name="", cross=(), full_bias=None,
                              repeated=False, seam=None, row_kwargs=(), **kwargs) -> "_SplitHooks":
        cls.plan_shard(module, 1, 0, mode=mode, group=group, base=base, name=name)
        state = SequenceSplit(mode, group, name)
        state.seam = seam
        if seam is not None:
            state.dim = seam.seq_dim
        rows = tuple(seam.row_kwargs) if seam is not None else tuple(row_kwargs)
        return _SplitHooks(module, base, state, cross=tuple(cross), full_bias=full_bias, repeated=bool(repeated),
                           row_kwargs=rows)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, **kwargs).commit()


class _SplitHooks:
    def __init__(self, layers: nn.ModuleList, base: nn.Module, state: SequenceSplit, cross: tuple = (),
                 full_bias: str | None = None, repeated: bool = False, row_kwargs: tuple[str, ...] = ()):
        self.layers, self.base, self.state = layers, base, state
        self.row_kwargs = row_kwargs
        self.cross, self.full_bias, self.repeated = cross, full_bias, repeated
        self.handles: list = []
        self.configs: list = []            # (config, its _attn_implementation before)
        self.attention: list = []          # attention modules given the state
        self.methods: list = []            # modules given an instance attribute `full_bias`
        self.packing: list = []            # per base call in progress: its packing.hold() token

    def _replace_seam(self) -> None:
        """The seam's method, on each of its modules under the layers, replaced
        by _seam_method (an instance attribute: the class is untouched)."""
        state, seam = self.state, self.state.seam
        found = seam.modules(self.layers)
        if not found:
            raise NotImplementedError(f"{state.name}: sequence_parallelism_mode={state.mode!r}: no {seam.module} "
                                      f"under the layers to split the attention at")
        for m in found:
            m.__dict__["_shardformer_sequence_split"] = state
            m.__dict__[seam.method] = BoundMethod(_seam_method, m)
            self.attention.append(m)

    def _switch_attention(self) -> None:
        state = self.state

        if state.seam is not None:
            self._replace_seam()
            return

        named = [(n, m) for n, m in self.layers.named_modules() if sf_attention.uses_registry(m)]
        users = [m for _, m in named]
        if not users:
            raise NotImplementedError(f"{state.name}: sequence_parallelism_mode={state.mode!r} needs attention "
                                      f"that goes through transformers' AttentionInterface, or a family that names "
                                      f"its attention's seam (AttentionSeam); this model has neither")
        if any("_shardformer_sequence_split" in m.__dict__ for m in users):
            raise ValueError(f"{state.name}: the model's attention is already split")
        cross = [m for path, m in named if path.split(".")[-1] in self.cross]
        if self.cross and not cross:
            raise ValueError(f"{state.name}: no cross-attention module named {self.cross} in the layers")
        configs = {id(m.config): m.config for m in users if getattr(m, "config", None) is not None}
        base_config = getattr(self.base, "config", None)
        if base_config is not None:
            configs.setdefault(id(base_config), base_config)
        # a config shared with a stack switched before (Whisper's encoder and decoder) is already
        # ours: the implementation it wraps is the suffix of the name
        ours = f"shardformer_sp_{state.mode}_"
        current = {id(c): getattr(c, "_attn_implementation", None) or "eager" for c in configs.values()}
        inner = {cur[len(ours):] if cur.startswith(ours) else cur for cur in current.values()}
        if len(inner) != 1:
            raise ValueError(f"{state.name}: the layers use different attention implementations {sorted(inner)}; "
                             f"sequence parallelism wraps one")
        state.inner = inner.pop()
        if state.inner.startswith("shardformer_sp_"):
            raise ValueError(f"{state.name}: the model's attention is already split ({state.inner})")
        name = _implementation_name(state.mode, state.inner)
        for key, cfg in configs.items():
            if not current[key].startswith(ours):
                self.configs.append((cfg, cfg._attn_implementation))
                cfg._attn_implementation = name
        for m in users:
            m.__dict__["_shardformer_sequence_split"] = state
            self.attention.append(m)
        for m in cross:
            m.__dict__[_CROSS_MARK] = True
        self._full_bias(users)

    def _full_bias(self, users: list) -> None:
        """Gives the attention modules that own the `full_bias` method an
        instance attribute of that name: while split, it builds the bias for
        the whole padded sequence (queries and keys at 0 .. S'-1)."""
        state, method = self.state, self.full_bias
        if method is None:
            return
        import types

        for m in users:
            own = getattr(type(m), method, None)
            if own is None or not getattr(m, "has_relative_attention_bias", True):
                continue

            def whole(module, query_length, key_length, *args, _own=own, **kwargs):
                if state.active:
                    query_length = key_length = state.padded
                return _own(module, query_length, key_length, *args, **kwargs)

            m.__dict__[method] = types.MethodType(whole, m)     # a deep copy rebinds it to the copy
            self.methods.append(m)

    def commit(self) -> nn.Module:
        state, layers = self.state, self.layers
        self._switch_attention()

        def base_pre(_module, args, kwargs):
            # the unsharded model's packed-sequence masking, decided before use_cache is dropped below
            self.packing.append(packing.hold(packing.unsharded_packs(_module, kwargs)))
            cache, use_cache = kwargs.get("past_key_values"), kwargs.get("use_cache")
            state.active = cache is None and use_cache is not True and state.p > 1
            state.entered = False
            if state.active:
                _refuse_recorded_outputs(_module, kwargs, state)
                state.documents = _packed_documents(kwargs, state)
                kwargs = {**kwargs, "use_cache": False}
                if self.cross:
                    kwargs = _encoder_states_summed(kwargs, args, state)
                if torch.is_grad_enabled():
                    _ensure_grad_sync(layers, state.group)
            elif state.p > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in layers.parameters()):
                raise RuntimeError(
                    f"{state.name}: sequence_parallelism_mode={state.mode!r}: a forward with a KV cache "
                    f"(use_cache=True or past_key_values) runs unsplit on every rank, and its gradients would "
                    f"be summed over the sequence-parallel group; run it under torch.no_grad(), or pass "
                    f"use_cache=False to train")
            return args, kwargs

        def base_post(_module, _args, _output):
            if self.packing:                  # also when the forward (or base_pre) raised: always_call
                packing.release(self.packing.pop())

        def first_pre(_module, args, kwargs):
            if not state.active or state.entered:
                return None
            state.entered = self.repeated
            x, rebuild = _layer_inputs(args, kwargs)
            _check_same_input(state, x)
            state.start(x.shape[state.dim], x.device)
            return rebuild(mark_rows(split_sequence_rows(x, state.layout()), _recorded_gather(state)))

        def mark_post(_module, _args, output):
            if not state.active:
                return None
            first = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
            mark_rows(first, _recorded_gather(state))
            return None

        def every_pre(module, args, kwargs):
            if not state.active:
                return None
            x, _ = _layer_inputs(args, kwargs)
            _open_stream(state, module, getattr(self.base, "config", None), x.device)
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, (tuple, list)):
                kwargs = {**kwargs, "position_embeddings": type(pe)(
                    state.local(t, SEQ_DIM) if isinstance(t, torch.Tensor) and t.dim() >= 2
                    and t.shape[SEQ_DIM] == state.length else t for t in pe)}
            elif isinstance(pe, torch.Tensor) and pe.dim() >= 2 and pe.shape[SEQ_DIM] == state.length:
                kwargs = {**kwargs, "position_embeddings": state.local(pe, SEQ_DIM)}
            if self.row_kwargs:
                args, kwargs = _local_row_arguments(module, args, kwargs, state, self.row_kwargs)
            return args, kwargs

        def every_post(_module, _args, _output):
            _close_stream(state)          # also when the layer raised (always_call)

        def last_post(_module, _args, output):
            if not state.active:
                return None
            if hasattr(output, "last_hidden_state"):
                output.last_hidden_state = gather_sequence_rows(output.last_hidden_state, state.layout())
                return output
            if isinstance(output, torch.Tensor):
                return gather_sequence_rows(output, state.layout())
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (gather_sequence_rows(output[0], state.layout()),) + tuple(output[1:])
            raise TypeError(f"{state.name}: a decoder layer returned {type(output).__name__}; expected the "
                            f"hidden states (a tensor, or a tuple starting with one)")

        self.handles.append(self.base.register_forward_pre_hook(base_pre, with_kwargs=True))
        self.handles.append(self.base.register_forward_hook(base_post, always_call=True))
        self.handles.append(layers[0].register_forward_pre_hook(first_pre, with_kwargs=True))
        for layer in layers:
            self.handles.append(layer.register_forward_pre_hook(every_pre, with_kwargs=True))
            self.handles.append(layer.register_forward_hook(every_post, always_call=True))
            self.handles.append(layer.register_forward_hook(mark_post))     # before the last one's gather
        # repeated layers: the last layer runs several times, the base's output comes once
        last = self.base if self.repeated else layers[len(layers) - 1]
        self.handles.append(last.register_forward_hook(last_post))
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
            m.__dict__.pop(_CROSS_MARK, None)
            if self.state.seam is not None:
                m.__dict__.pop(self.state.seam.method, None)
        self.attention.clear()
        for m in self.methods:
            m.__dict__.pop(self.full_bias, None)
        self.methods.clear()


def _check_same_input(state: SequenceSplit, x: torch.Tensor) -> None:
    """Every rank of the SP group splits the same sequence: one all-gather of
    the first layer's input shape (4 int64) before any rows are exchanged.
    Ranks given different inputs (another length, which the padding to S' can
    hide from the exchanges themselves) raise on every rank, naming them."""
    if state.p == 1:
        return
    shape = list(x.shape)[:4]
    mine = torch.tensor([shape + [-1] * (4 - len(shape))], dtype=torch.int64, device=x.device)
    table = torch.empty((state.p, 4), dtype=torch.int64, device=x.device)
    D.all_gather_into_tensor(table, mine, state.group)
    if bool((table == table[0]).all()):
        return
    rows = [tuple(v for v in row if v >= 0) for row in table.tolist()]
    ranks = ", ".join(f"rank {r}{_global_rank(state.group, r)}: {list(row)} (sequence length "
                      f"{row[state.dim] if state.dim < len(row) else '?'})" for r, row in enumerate(rows))
    raise ValueError(f"{state.name}: sequence_parallelism_mode={state.mode!r}: the ranks of the sequence-parallel "
                     f"group were given different inputs; the first layer's input shapes are {ranks}.  Every "
                     f"rank of the group must be given the same batch: the group splits one sequence")


def _global_rank(group, r: int) -> str:
    import torch.distributed as dist

    try:
        return f" (global {dist.get_global_rank(group, r)})" if group is not None else ""
    except (RuntimeError, ValueError):
        return ""


def _packed_documents(kwargs: dict, state: SequenceSplit) -> torch.Tensor | None:
    """ring_attn: the document of every row [B | 1, S] (transformers'
    numbering of the full position_ids) when the forward's mask is the
    block-diagonal one of packed documents (shardformer.packing decided so),
    else None.  all_to_all reads the mask itself."""
    if state.mode != "ring_attn" or not packing.current() or kwargs.get("position_ids") is None:
        return None
    return packing.documents(kwargs["position_ids"])


def _encoder_states_summed(kwargs: dict, args: tuple, state: SequenceSplit) -> dict:
    """The base's `encoder_hidden_states` (full on every rank) through an
    identity whose backward all-reduces over the SP group: each rank's
    cross-attention rows give a partial gradient of it."""
    states = kwargs.get("encoder_hidden_states")
    if states is None:
        if len(args) > 1:
            raise TypeError(f"{state.name}: sequence parallelism with cross-attention needs the decoder's "
                            f"encoder_hidden_states passed by keyword")
        return kwargs
    summed = copy_to_tp_region(states, state.group)
    summed.__dict__[_UNSUMMED_MARK] = states
    return {**kwargs, "encoder_hidden_states": summed}


def unsummed(t: torch.Tensor) -> torch.Tensor:
    """The encoder output that _encoder_states_summed wrapped into `t` (a
    pipeline stage sends that one on: shardformer.pipeline.stages), else t."""
    return t.__dict__.get(_UNSUMMED_MARK, t)


def _recorded_gather(state: SequenceSplit):
    """The gather of a recorded hidden state of the forward in progress: its
    layout (rows, zigzag order, lengths) now, all-gathered and put in
    sequence order (gather_sequence_rows; backward: this rank's rows)."""
    rows = state.layout()

    def gather(t: torch.Tensor) -> torch.Tensor:
        return gather_sequence_rows(t, rows)

    return gather


def _refuse_recorded_outputs(base: nn.Module, kwargs: dict, state: SequenceSplit) -> None:
    """output_attentions in a split forward: all_to_all over eager attention
    returns every layer's weights [B, H, S, S] gathered over the heads
    (gather_heads; state.record_attentions); ring_attn never builds them and
    all_to_all over another attention (SDPA, the C kernel) returns none:
    refused rather than come back empty.  Recorded hidden states come back
    full (mark_rows, and the policy's record_full_hidden_states)."""
    want = kwargs.get("output_attentions")
    if want is None:
        want = getattr(getattr(base, "config", None), "output_attentions", False)
    state.record_attentions = bool(want) and state.mode == "all_to_all" and state.inner == "eager"
    if want and not state.record_attentions:
        why = ("ring_attn merges key / value blocks by log-sum-exp and never builds the weights"
               if state.mode == "ring_attn" else
               f"all_to_all returns them from eager attention only (this model's is {state.inner!r})")
        raise NotImplementedError(
            f"{state.name}: output_attentions=True with sequence_parallelism_mode={state.mode!r}: {why}; "
            f"run that forward with use_cache=True under torch.no_grad() (unsplit), or without output_attentions")


def _ensure_grad_sync(layers: nn.Module, group) -> None:
    """Every trainable parameter of the layers sums its gradient over the SP
    group (all-reduce in backward), once per parameter.  Done at the first
    split forward, on the parameters the model holds then (the sharder
    may have replaced modules after this change was committed)."""
    for p in layers.parameters():
        # by the hook itself, not a mark: torch.load restores a parameter's attributes, not its hooks
        if p.requires_grad and not has_grad_all_reduce(p, group):
            p.register_hook(all_reduce_hook(group))
            p.__dict__[_SYNC_MARK] = (group,)
