"""Swinv2: the Swin-style vision stages (policies/shapes.py StageShape) with
Swinv2's cosine window attention block: heads and MLP features split over the
tensor-parallel group, stage by stage (num_heads[i] heads in stage i).

    encoder.layers.i.blocks.*.attention.self.{query,key,value}   Linear1D_Col (heads of stage i)
    encoder.layers.i.blocks.*.attention.output.dense             Linear1D_Row (all-reduce forward)
    ...attention.self.continuous_position_bias_mlp.2            Linear1D_Col, not gathered: the
        bias MLP's last layer [heads, 512] keeps this rank's head rows, so the MLP yields the
        bias of its own heads; its replicated input layer gets the all-reduced gradient
    ...attention.self (logit_scale [heads, 1, 1])                ShardParams, split by heads
    encoder.layers.i.blocks.*.intermediate.dense                 Linear1D_Col
    encoder.layers.i.blocks.*.output.dense                       Linear1D_Row
    encoder.layers.i.blocks.*.output.dropout                     DropoutForReplicatedInput
    classifier                                                   Linear1D_Col, gathered (none
                                                                 with num_labels=0)

Swinv2SelfAttention reshapes with num_attention_heads and all_head_size, so
both become this rank's values (set per block).  Patch embeddings, patch
merging, norms and the masked-image-modeling decoder stay replicated.

enable_flash_attention: Swinv2SelfAttention computes scaled cosine attention
itself, outside transformers' AttentionInterface; its forward is replaced
(kernel_attention below) by the C kernel on q' = normalize(q) t_h,
k' = normalize(k) (t_h = exp(min(logit_scale_h, log 100)), the head's
learned temperature, folded into the queries; kernel scale 1) with the
additive bias 16 sigmoid(cpb_h(i, j)) (the continuous position bias of the
window, [H, N, N], differentiable through the kernel's bias gradient) plus,
for shifted windows, twice the window mask (the model adds it twice), per
window [B nW, H, N, N]; the model's own forward where its attention
dropout is active in training or the weights are asked for.
Split-gather sequence parallelism, per stage (Swinv2Shape): the layers'
hidden states between the blocks of a stage are this rank's rows; each
block runs whole, as under plain TP.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardformer.family import Family, gathered
from shardformer.layer import sequence_attention as sa
from shardformer.layout import Heads
from shardformer.policies.shapes import StageShape
from shardformer.spec import Entry, Stack, WindowOverlap


def _position_bias(attention) -> torch.Tensor:
    """16 sigmoid(cpb(relative coordinates)) [H, N, N] of the module's window
    (N = its area), for the heads this rank holds."""
    heads, area = attention.num_attention_heads, attention.window_size[0] * attention.window_size[1]
    table = attention.continuous_position_bias_mlp(attention.relative_coords_table).view(-1, heads)
    bias = table[attention.relative_position_index.view(-1)].view(area, area, heads)
    return 16 * torch.sigmoid(bias.permute(2, 0, 1))


def kernel_attention(attention, original, args, kwargs):
    """Swinv2SelfAttention.forward with the C kernel: hidden_states [B nW, N,
    C] -> (context [B nW, N, H d],) (see the module docstring)."""
    from shardformer.attention import own_attention, seam_kernel, seam_kernel_reason

    hidden, mask, weights = sa.bind_args(args, kwargs, ("hidden_states", "attention_mask", "output_attentions"))
    dropout = attention.dropout.p if attention.training else 0.0
    reason = seam_kernel_reason(attention, (hidden,), dropout, bool(weights))
    if reason is not None:
        return own_attention(reason, original, args, kwargs)
    batch, area, _ = hidden.shape
    heads, size = attention.num_attention_heads, attention.attention_head_size
    query, key, value = (proj(hidden).view(batch, area, heads, size).transpose(1, 2)
                         for proj in (attention.query, attention.key, attention.value))
    temperature = torch.clamp(attention.logit_scale, max=math.log(100.0)).exp()          # [H, 1, 1]
    bias = _position_bias(attention)[None]                                                # [1, H, N, N]
    if mask is not None:                                                                  # [nW, N, N]
        windows = mask.shape[0]
        bias = (bias + 2 * mask[:, None]).repeat(batch // windows, 1, 1, 1)               # [B nW, H, N, N]
    context = seam_kernel(F.normalize(query, dim=-1) * temperature, F.normalize(key, dim=-1), value, scale=1.0,
                          bias=bias)
    return (context.transpose(1, 2).reshape(batch, area, heads * size),)


def _no_split(state, attention, original, args, kwargs):
    raise NotImplementedError(f"{state.name}: Swinv2 has no all_to_all / ring_attn split (StageShape refuses them)")


SEAM = sa.AttentionSeam("Swinv2SelfAttention", "forward", _no_split,
                        kernel=kernel_attention).registered(__name__, "SEAM")


class Swinv2Shape(StageShape):
    """Split-gather sequence parallelism, stage by stage, with whole blocks.
    Swinv2Layer is post-norm: it reads its input X [B, H*W, C] twice before
    any of its modules runs, as the residual and, viewed as the (H, W) map,
    as the windows' input; no module boundary inside it sees the sequence
    in order before the residual add.  So each block runs on the full
    sequence, the same on every rank of the TP group (its column / row
    layers as plain TP: copy_to_tp_region in, all-reduce out), and the
    hidden states between the blocks of a stage are this rank's rows
    (S padded to S', a multiple of p, rows [r S'/p, (r+1) S'/p)):

        blocks.0            output cut to this rank's rows ("split_output";
                            backward: all-gather of the rows' gradients)
        blocks.1 .. d-2     input all-gathered ("gather_input"; backward:
                            this rank's rows of the gradient, which every
                            rank computed in full and alike), output cut
        blocks.d-1          input all-gathered; output full, for patch
                            merging (the 2 x 2 neighbours of the map)

    Forward and backward are plain TP's inside each block; what is split is
    the activation kept between blocks (1/p of it).  A stage of one block
    has nothing between blocks and runs as plain TP.  all_to_all / ring_attn
    are refused (StageShape).  enable_sequence_overlap: blocks.1 .. d-1
    gather their input by one overlapped pass that also computes q/k/v of
    the map (layer/window_overlap.py, gather_at=None)."""

    attention_seam = SEAM       # enable_flash_attention only (kernel_attention)

    sp_linear = ""              # whole blocks: their column / row layers as plain TP

    def stage_stack(self, i: int, depth: int) -> Stack:
        """The roles of stage i's blocks: only what lies between them is this
        rank's rows (ends "rows_between"); no norm gradient all-reduce: every
        parameter sees the full sequence.  With overlap blocks 1..d-1 gather
        their input by the window-overlap pass (gather_at None)."""
        return Stack(f"layers.{i}.blocks", depth, ends="rows_between",
                     overlap=WindowOverlap("attention.self", first=1))

    def block_entries(self):
        return (Entry("attention.self.query", "colwise_heads"), Entry("attention.self.key", "colwise_heads"),
                Entry("attention.self.value", "colwise_heads"),
                Entry("attention.self.continuous_position_bias_mlp.2", "colwise_head_rows"),
                Entry("attention.self", "logit_scale_heads"), Entry("attention.output.dense", "rowwise_heads"),
                Entry("intermediate.dense", "colwise"), Entry("output.dense", "rowwise"),
                Entry("output.dropout", "dropout_replicated"))

    def block_attributes(self, heads: Heads) -> dict:
        return heads.attributes({"attention.self.num_attention_heads": "heads", "attention.self.all_head_size": "width"})


FAMILY = Family("swinv2", "swinv2.modeling_swinv2", Swinv2Shape, options={"prefix": "Swinv2"}, heads={
    "Swinv2Model": (),
    "Swinv2ForImageClassification": gathered("classifier"),
    "Swinv2ForMaskedImageModeling": (),
})
globals().update(FAMILY.policy_classes())
