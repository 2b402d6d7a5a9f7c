"""SAM (Segment Anything): the vision encoder's heads and MLP features and the
mask decoder's two-way transformer split over the tensor-parallel group.

    vision_encoder.layers.*.attn.qkv        Linear1D_Col, split Fused(q, k, v) per head: the
                                            fused rows are [q | k | v], each [heads x head_dim]
    vision_encoder.layers.*.attn.proj       Linear1D_Row (input split by the same heads)
    vision_encoder.layers.*.attn            rel_pos_h / rel_pos_w [2S-1, head_dim] are shared by
                                            all heads: kept whole on every rank (each rank adds
                                            them to its own heads' scores), their gradients
                                            all-reduced (ReplicatedInParallelRegion)
    vision_encoder.layers.*.mlp.lin1 / lin2 Linear1D_Col / Linear1D_Row
    mask_decoder SamAttention.{q,k,v}_proj  Linear1D_Col (per head; the cross attentions work in
                                            hidden / attention_downsample_rate, so head_dim is
                                            read from each projection's width)
    mask_decoder SamAttention.out_proj      Linear1D_Row
    mask_decoder layers.*.mlp.lin1 / lin2   Linear1D_Col / Linear1D_Row

Heads need not divide the group (5 heads on 2 ranks: 3, 2); every rank needs
at least one head.  Both attentions reshape by self.num_attention_heads, so it
becomes this rank's head count.  The prompt encoder, the positional
embeddings (tied between shared_image_embedding and the prompt encoder), the
vision neck, the mask decoder's output tokens, upscaling convolutions and
hypernetwork / IoU MLPs are small and stay replicated.

enable_flash_attention: the vision encoder's SamVisionAttention at its seam
(VISION_SEAM, kernel_vision_attention: the decomposed relative positions as
the kernel's additive bias), the mask decoder's SamAttention through
transformers' registry.

SamVisionModel is the vision encoder alone (its config is the vision
config); SamModel adds the mask decoder (config.mask_decoder_config).

Sequence parallelism, split_gather only, in the vision encoder: its hidden
states are [B, H, W, C] patch grids, split along the grid rows H (dimension
1, padded with zero rows to a multiple of p) from layers.0 to the last
layer, whose output is all-gathered (the neck, the prompt encoder and the
mask decoder see the whole grid).  Windowed and global attention need whole
windows / the whole grid, and HF's layer partitions its input into windows
between layer_norm1 and attn, so the layer's forward is replaced by one that
runs, with Xr this rank's rows:

    layer_norm1(Xr)                   on this rank's rows (gradients all-reduced)
    all-gather along H                 (backward: reduce-scatter of dX), qkv reads it
                                       without copy_to_tp_region (sequence_parallel=True)
    window partition, attn, unpartition   HF's own, on this rank's heads; proj is a
                                       plain row-parallel layer (all-reduce, then its bias)
    this rank's rows of the sum        (backward: all-gather of the rows' gradients)
    residual add, layer_norm2          on this rank's rows
    mlp                                ENTER: input all-gathered, lin1 reads it,
                                       lin2 reduce-scatters along H and adds its bias

With enable_sequence_overlap, attn.qkv's output is computed during the
all-gather (gather_block_input: this rank's rows first) and cut into windows
after it (see _layer_forward_on_rows).  The relative position tables are
added to the scores of every window on the gathered grid, as unsplit.  The mask decoder runs unsplit (its tokens
attend to the whole image embedding).  all_to_all / ring_attn are refused
by name: the layers cut their grid into windows before the attention, so
the grid rows split over the ranks would cut windows (not implemented).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from shardformer.attention import own_attention, seam_kernel, seam_kernel_reason, weights_recorded
from shardformer.family import Family, SpecPolicy, spec_capabilities
from shardformer.layer import sequence_attention as sa
from shardformer.layer.sequence_layout import ENTER
from shardformer.layout import Heads
from shardformer.pipeline.stages import StageSplit
from shardformer.spec import Attribute, Entry, Method, ModuleSpec, PolicySpec, SplitGatherSpec


def sequence_parallel_layer_forward(state, group, overlap: bool = False):
    """SamVisionLayer.forward on this rank's rows of the patch grid (the
    steps in the module docstring); `state`: the encoder's SequenceState
    (dim 1: the grid rows), `group`: the tensor-parallel group, `overlap`:
    enable_sequence_overlap.  A partial of a module-level function, so the
    model pickles."""
    return functools.partial(_layer_forward_on_rows, state, group, overlap)


def layer_forward_method(site):
    """The spec's Method row making SamVisionLayer.forward under split_gather
    (shardformer.spec.MethodSite: the spec's sequence state, the group,
    whether enable_sequence_overlap holds)."""
    return sequence_parallel_layer_forward(site.sequence_state, site.group, "overlap" in site.held)


def _padded_with(y, window: int, fill):
    """y [B, H, W, n] padded at the bottom / right to multiples of `window`
    with rows equal to `fill` [n]: what a projection gives the zero rows
    window_partition pads its input with (its bias, or 0)."""
    batch, height, width, n = y.shape
    pad_h, pad_w = (-height) % window, (-width) % window
    if pad_w:
        y = torch.cat([y, fill.expand(batch, height, pad_w, n)], dim=2)
    if pad_h:
        y = torch.cat([y, fill.expand(batch, pad_h, width + pad_w, n)], dim=1)
    return y


def _layer_forward_on_rows(state, group, overlap, layer, hidden_states):
    """With `overlap`, attn.qkv's output is computed while the grid rows are
    gathered (gather_block_input: this rank's rows first, each arriving chunk
    as it lands): LayerNorm and the projection act per token and window
    partitioning only permutes (and pads) tokens, so projecting before
    partitioning equals partitioning before projecting, the padded tokens'
    projections being qkv's bias.  The windows of the projected grid are
    handed to attn.qkv as its precomputed output for the windows of the
    gathered grid."""
    from shardformer.layer.sequence import block_input, gather_block_input, release_block_input, split_rows

    residual = hidden_states                                   # [B, H'/p, W, C]
    normed = layer.layer_norm1(hidden_states)
    qkv = layer.attn.qkv
    x = gather_block_input(layer.attn, normed, state, group) if overlap else block_input(normed, state, group)
    try:
        if layer.window_size > 0:
            height, width = x.shape[1], x.shape[2]
            pre = qkv._precomputed if overlap else None
            x, padding_shape = layer.window_partition(x, layer.window_size)
            if pre is not None and pre[0] is not None:
                bias = qkv._local_params()[1]
                fill = bias if bias is not None else pre[1].new_zeros(pre[1].shape[-1])
                windows, _ = layer.window_partition(_padded_with(pre[1], layer.window_size, fill), layer.window_size)
                qkv._precomputed = (x, windows)
        x, _ = layer.attn(hidden_states=x)
    finally:
        if overlap:
            release_block_input(layer.attn)
    if layer.window_size > 0:
        x = layer.window_unpartition(x, layer.window_size, padding_shape, (height, width))
    x = residual + split_rows(x, state, group)
    return x + layer.mlp(layer.layer_norm2(x))


def kernel_vision_attention(attention, original, args, kwargs):
    """SamVisionAttention.forward with the C kernel (enable_flash_attention):
    hidden_states [B, H, W, C] (a window, or the whole grid) -> (proj(context)
    [B, H, W, C], None).  With q, k, v [B, heads, H W, d] from attn.qkv (this
    rank's heads under TP) and scale d^-1/2:

        context = softmax(scale q k^T + R) v,   R[b, h, (i, j), (k, l)] = q_(i,j) . Rh[i, k] + q_(i,j) . Rw[j, l]

    R, the decomposed relative positions, is the layer's own
    get_decomposed_rel_pos of the unscaled queries (the tables rel_pos_h /
    rel_pos_w interpolated to the window), handed to the kernel as its
    additive bias: the kernel's bias gradient carries it back to q and the
    tables.  The weights asked for (output_attentions, or recorded by
    transformers' output capturing), attention dropout in training, or tensors
    the kernel does not take: the layer's own forward."""
    hidden, weights = sa.bind_args(args, kwargs, ("hidden_states", "output_attentions"))
    reason = seam_kernel_reason(attention, (hidden,), float(attention.dropout), bool(weights) or weights_recorded())
    if reason is not None:
        return own_attention(reason, original, args, kwargs)
    batch, height, width, _ = hidden.shape
    heads, rows = attention.num_attention_heads, height * width
    query, key, value = attention.qkv(hidden).reshape(batch, rows, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    bias = None
    if attention.use_rel_pos:
        bias = attention.get_decomposed_rel_pos(query.reshape(batch * heads, rows, -1), attention.rel_pos_h,
                                                attention.rel_pos_w, (height, width), (height, width))
        bias = bias.reshape(batch, heads, rows, rows)
    context = seam_kernel(query, key, value, scale=attention.scale, bias=bias)      # [B, heads, H W, d]
    context = context.reshape(batch, heads, height, width, -1).permute(0, 2, 3, 1, 4).reshape(batch, height, width, -1)
    return attention.proj(context), None


def _no_split(state, attention, original, args, kwargs):
    raise NotImplementedError(f"{state.name}: SAM has no all_to_all / ring_attn split (SamShape refuses them)")


# enable_flash_attention only: the vision encoder's attention (its own, with decomposed relative positions)
# at its forward; the mask decoder's SamAttention goes through transformers' registry
# (the SDPA subclass, what from_pretrained builds by default, computes the same)
VISION_SEAM = sa.AttentionSeam("SamVisionAttention", "forward", _no_split, kernel=kernel_vision_attention,
                               kernel_also=("SamVisionSdpaAttention",)).registered(__name__, "VISION_SEAM")


class SamShape(SpecPolicy):
    """A spec factory (build_spec(), interpreted by shardformer.plan.interpret):
    the vision layer and the mask decoder's attentions split by their own
    heads (read from the bound model's sub-configs), split-gather SP of the
    vision encoder with its layer forward a Method row."""

    attention_weights_folded = ("SamVisionAttention",)   # [B * heads, S, S]
    attention_seam = VISION_SEAM
    sp_modes = ("split_gather",)
    # The vision encoder's layers are the stack (most of SAM's compute); the neck runs on the last stage,
    # and so does everything SamModel runs after the encoder (prompt encoder, mask decoder), every stage
    # being given the micro-batch's prompts.  The absolute positions (a Parameter of the encoder, added to
    # the patch embedding's stand-in) and the image-wide positional embedding (computed by SamModel before
    # the encoder, tied to the prompt encoder's) run on every stage, their gradients summed over them.
    pipeline_split = StageSplit("SamVisionEncoder", "layers", last=("neck",),
                                everywhere=("pos_embed", "shared_image_embedding"))
    # enable_sequence_overlap: attn.qkv projects the grid rows while they are gathered (_layer_forward_on_rows)
    sequence_overlap = True
    # output_hidden_states=True under split_gather is refused by name
    records_hidden_states = False
    sp_refusal = ("vision_encoder.layers.*.attn: SAM's vision layers cut their [B, H, W, C] grid into windows "
                  "before the attention (which adds decomposed relative positions per window), so a split of the "
                  "grid rows would cut windows across ranks; not implemented (docs/sequence-parallelism.md); use "
                  "'split_gather'")

    def vision_module(self, vision_cfg) -> ModuleSpec:
        """SamVisionLayer: the fused [q | k | v] by heads, proj by the same
        heads (a plain row layer even under split_gather: the layer forward
        cuts this rank's rows of its sum), the MLP (lin2 reduce-scatters
        under split_gather), the relative position tables replicated with
        their gradients all-reduced; num_attention_heads this rank's."""
        n = vision_cfg.num_attention_heads
        heads = Heads(n, n, vision_cfg.hidden_size // n)
        rel_pos = (Entry("attn", "replicated_with_grad_allreduce",
                         kwargs=(("params", ("rel_pos_h", "rel_pos_w")),)),) if vision_cfg.use_rel_pos else ()
        return ModuleSpec("SamVisionLayer", (
            Entry("attn.qkv", "colwise_qkv", heads=heads), Entry("attn.proj", "rowwise_heads", heads=heads, sp=""),
            Entry("mlp.lin1", "colwise"), Entry("mlp.lin2", "rowwise")) + rel_pos,
            attributes=(Attribute("attn.num_attention_heads", "heads", heads=heads),
                        Method("forward", layer_forward_method, when=("sequence_parallel", "tensor_parallel_ranks"))),
            sp_linear="rows")

    def mask_decoder_modules(self, decoder_cfg) -> tuple[ModuleSpec, ...]:
        """The mask decoder's two-way transformer, unsplit along the
        sequence.  One head count for every SamAttention; head_dim differs
        between the self attention (hidden / n) and the downsampled cross
        attentions, so the projections split by whole heads of any width."""
        heads = Heads(decoder_cfg.num_attention_heads)
        return (ModuleSpec("SamAttention", tuple(Entry(f"{p}_proj", "colwise_heads", heads=heads) for p in "qkv")
                           + (Entry("out_proj", "rowwise_heads", heads=heads),),
                           attributes=(Attribute("num_attention_heads", "heads", heads=heads),), sp_linear=""),
                ModuleSpec("SamTwoWayAttentionBlock", (Entry("mlp.lin1", "colwise"), Entry("mlp.lin2", "rowwise")),
                           sp_linear=""))

    def build_spec(self) -> PolicySpec:
        cfg = self.model.config
        vision_cfg = getattr(cfg, "vision_config", cfg)
        decoder = self.mask_decoder_modules(cfg.mask_decoder_config) if hasattr(cfg, "mask_decoder_config") else ()
        return PolicySpec(
            name="sam",
            modules=(self.vision_module(vision_cfg),) + decoder,
            split_gather=SplitGatherSpec("SamVisionEncoder", "layers", "SamVisionLayer",
                                         (("mlp", ENTER), ("layer_norm1", None), ("layer_norm2", None)),
                                         overlap=False, when=("tensor_parallel_ranks",)),
            capabilities=replace(spec_capabilities(self), sp_refusal=self.sp_refusal),
        )


FAMILY = Family("sam", "sam.modeling_sam", SamShape, heads={"SamModel": (), "SamVisionModel": ()})
globals().update(FAMILY.policy_classes())
