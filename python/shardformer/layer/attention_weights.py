"""output_attentions under tensor parallelism: the weights of every head.

An attention split by heads computes on rank r the weights of its query
heads only, W_r = softmax(Q_r K_r^T / sqrt(d) + mask) of shape
[B, H_r, S_q, S_k].  HF hands that tensor up unchanged (output recorders,
or the layers' own tuples), so without this a user asking for
`output_attentions=True` gets H_r of the H heads, silently.  The module that
owns the head-split projections therefore gathers its weights output along
dimension 1 over the TP group, in head order (all-gather in forward; in
backward each rank keeps its heads' slice of the gradient), before anything
above it sees the tuple:

    [B, H_r, S_q, S_k] on rank r  ->  [B, H, S_q, S_k] on every rank

Where the weights sit in the module's output is policy data
(`Policy.attention_weights_at`: class name -> index, default 1; T5's
attention returns (output, position_bias, weights)), and a module whose
weights fold the heads into the batch ([B*H_r, S_q, S_k], SAM's vision
attention) is named in `Policy.attention_weights_folded`.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import _C
from ..distributed.mappings import gather_from_tp_region
from ..layout import DimShard
from .linear import Linear1D_Col
from .parallel_module import ParallelModule

_MARK = "_shardformer_gathers_attention_weights"


def query_heads_of(module: nn.Module) -> tuple[int, int] | None:
    """(num_heads, num_kv_heads) of the query-head split of one of the
    module's direct children (a sharded projection), or None."""
    for child in module.children():
        if isinstance(child, ParallelModule):
            for request in child.shard_plan.requests.values():
                found = _heads_in(request[0])
                if found is not None:
                    return found
    return None


def projects_query_heads(module: nn.Module) -> bool:
    """Whether one of the module's direct children is a column-parallel
    projection split by query heads (q, or a fused qkv): the module computes
    attention on this rank's heads."""
    return any(isinstance(child, Linear1D_Col) and any(_heads_in(r[0]) is not None
                                                       for r in child.shard_plan.requests.values())
               for child in module.children())


def _heads_in(data) -> tuple[int, int] | None:
    if not isinstance(data, tuple):
        return None
    if len(data) >= 6 and data[0] == "heads" and data[5] == 0:
        return int(data[2]), int(data[3])
    for part in data:
        found = _heads_in(part)
        if found is not None:
            return found
    return None


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> DimShard:
    """This rank's query heads as a DimShard of the head dimension."""
    spans = [_C.heads_layout(num_heads, num_kv_heads, tp_size, r)[:2] for r in range(tp_size)]
    return DimShard(full=num_heads, length=spans[rank][1], ranges=((spans[rank][0], spans[rank][1]),),
                    all_ranges=tuple(((s, n),) for s, n in spans), all_lengths=tuple(n for _, n in spans),
                    rank=rank, tp_size=tp_size)


def gather_attention_weights(model: nn.Module, group, tp_size: int, rank: int,
                             index_of: dict[str, int], folded: tuple[str, ...] = ()) -> int:
    """Install the gather on every module owning a query-head split; returns
    how many."""
    count = 0
    for module in model.modules():
        heads = None if getattr(module, _MARK, False) else query_heads_of(module)
        if heads is None:
            continue
        name = type(module).__name__
        shard = head_shard(*heads, tp_size, rank)
        module.register_forward_hook(_Gathering(shard, group, index_of.get(name, 1), name in folded),
                                     prepend=True)
        object.__setattr__(module, _MARK, True)
        count += 1
    return count


class _Gathering:
    """Forward hook: output[index], this rank's weights [B, H_r, S_q, S_k]
    (folded: [B * H_r, S_q, S_k]), replaced by all heads' (all-gather along
    the head dimension in forward, this rank's slice of the gradient in
    backward).  A class, not a closure, so the model pickles."""

    #: shardformer.decode's fast step may skip this hook (see decode._foreign_hooks)
    INERT_IN_DECODE = True

    def __init__(self, shard: DimShard, group, index: int, folded: bool):
        self.shard, self.group, self.index, self.folded = shard, group, index, folded

    def __call__(self, _module, _args, output):
        index, local = self.index, self.shard.length
        if not isinstance(output, tuple) or len(output) <= index:
            return None
        w = output[index]
        if not isinstance(w, torch.Tensor):
            return None
        if self.folded and w.dim() == 3 and w.shape[0] % max(local, 1) == 0:
            full = gather_from_tp_region(w.unflatten(0, (-1, local)), 1, self.shard, self.group).flatten(0, 1)
        elif not self.folded and w.dim() == 4 and w.shape[1] == local:
            full = gather_from_tp_region(w, 1, self.shard, self.group)
        else:
            return None
        return output[:index] + (full,) + output[index + 1:]
