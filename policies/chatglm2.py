"""ChatGLM2 (remote code, matched by class name): multi-query attention heads
and SwiGLU features split; vocabulary-parallel embedding and output layer.

    encoder.layers.*.self_attention.query_key_value   FusedLinear1D_Col, [q | k | v] each split
                                                      per head; the multi_query_group_num KV groups
                                                      are replicated when fewer than ranks
    encoder.layers.*.self_attention.dense              Linear1D_Row
    encoder.layers.*.mlp.dense_h_to_4h                 FusedLinear1D_Col, [gate | up] each split
    encoder.layers.*.mlp.dense_4h_to_h                 Linear1D_Row
    embedding.word_embeddings                          VocabParallelEmbedding1D
    output_layer                                       VocabParallelLMHead1D (gathered; tied to
                                                       word_embeddings when the model tied them)

The attention reads its per-partition sizes from attributes, which become
this rank's values: num_attention_heads_per_partition,
num_multi_query_groups_per_partition, projection_size, and core_attention's
num_attention_heads_per_partition / hidden_size_per_partition.

Remote code need not define get_input_embeddings, so the tie of the output
layer is found on ChatGLMModel's embedding.word_embeddings directly.
original_rope=False is refused; so is pre_seq_len (p-tuning's prefix_encoder)
under pipeline parallelism.

Sequence parallelism, split_gather only (the layout of
shardformer.layer.sequence with SequenceState(dim=0): ChatGLM2 runs
[S, batch, hidden], so the sequence is dimension 0).  The hidden states
are split along S (padded to a multiple of p) at encoder.layers.0 and
all-gathered after the last layer (final_layernorm, the output layer and the
loss see the full sequence).  self_attention and mlp are sequence-parallel
blocks: input all-gathered along S (backward: reduce-scatter),
query_key_value / dense_h_to_4h read it without copy_to_tp_region, dense /
dense_4h_to_h return partial sums, which the block reduce-scatters along S
(backward: all-gather).  The attention therefore sees the whole sequence with
the model's own rotary table and mask; input_layernorm,
post_attention_layernorm, the hidden dropouts and the residual adds run on
this rank's rows (a dropout mask per rank; the norms' gradients
all-reduced).  Refused by name: add_bias_linear=True (the row layers'
biases would be summed over the ranks by the block's reduce-scatter).
With enable_sequence_overlap each block's gather of [S/p, batch, hidden]
rows along dimension 0 overlaps query_key_value's / dense_h_to_4h's matmuls
of this rank's rows (gather_block_input, with the state's dim 0).

all_to_all / ring_attn: the attention is remote code outside transformers'
AttentionInterface, so the split runs at a seam (AttentionSeam) on
CoreAttention.forward(q, k, v[, mask]), where q, k, v are [B, H, S_r, D]
(heads major; the key / value groups of multi-query attention already
expanded to the query heads by SelfAttention) of this rank's rows.  The
layers hold [S_r, B, hidden] between them: the sequence is split along
dimension 0 before encoder.layers.0 (padded to S', a multiple of p, or of
2p for ring_attn's zigzag rows) and all-gathered after the last layer
(backward: this rank's rows of the gradient).  Each layer receives this
rank's rows of the rotary table (rows along dimension 0), so the rotation
uses the rows' global positions.  At the seam:

    all_to_all   q, k, v [B, H, S'/p, D] --all-to-all--> [B, H/p, S', D]
                 (backward: the inverse), the model's own CoreAttention on
                 its H/p heads over the whole padded sequence (causal, so a
                 real query never sees the padded keys at the end), the
                 context [B, H/p, S', D] --all-to-all--> [B, H, S_r, D];
                 heads not dividing p: zero heads appended, dropped after
    ring_attn    the ring kernel on the zigzag rows, causal in global
                 positions, scale 1 / sqrt(D)

and the context returned as CoreAttention returns it, [S_r, B, H D], for
the dense projection on this rank's rows.  A mask passed to CoreAttention
(padded batches in the remote code) is refused in a split forward.

Pipeline parallelism (PIPELINE): the stages split encoder.layers of
ChatGLMModel.  The embedding runs on the first stage; encoder.final_layernorm
and output_layer on the last; the rotary table has no weights and is computed
by ChatGLMModel's forward on every stage, which hands it to every layer.
GLMTransformer's forward loops `for i in range(self.num_layers)` over
`self.layers[i]`: the stage sets num_layers to the running chunk's layer
count and its i-th layer answers index i (StageSplit.count).  The
activations between stages are [S, b, hidden] (b: the micro-batch's rows;
under split_gather, this rank's rows of the padded sequence along
dimension 0), and ChatGLMModel's last_hidden_state [S, B, hidden] is
concatenated over the micro-batches along dimension 1 (StageSplit.batch_dims).

enable_flash_attention: CoreAttention.forward with the C kernel
(kernel_core_attention below), as the remote code's
scaled_dot_product_attention path: causal without a mask, the mask's
complement with one, no attention dropout.
"""
from __future__ import annotations

import math

from shardformer.family import Family, SpecPolicy, lm, sequence_mode_refused, spec_capabilities
from shardformer.layer import sequence_attention as sa
from shardformer.layer.sequence_layout import BLOCK
from shardformer.pipeline.stages import StageSplit
from shardformer.spec import Entry, HeadsFrom, ModuleSpec, PolicySpec, Refusal, SplitGatherSpec


def _own_core(core, original, q, k, v):
    """The model's CoreAttention on q, k, v [B, h, S', D] (h: the heads
    this rank holds after the all-to-all) -> [B, h, S', D].  Its output
    width, hidden_size_per_partition, is set to h D for the call."""
    heads, width = core.num_attention_heads_per_partition, core.hidden_size_per_partition
    core.num_attention_heads_per_partition, core.hidden_size_per_partition = q.shape[1], q.shape[1] * q.shape[-1]
    try:
        out = original(q, k, v)                                  # [S', B, h D]
    finally:
        core.num_attention_heads_per_partition, core.hidden_size_per_partition = heads, width
    return out.view(out.shape[0], out.shape[1], q.shape[1], q.shape[-1]).permute(1, 2, 0, 3)


def split_core_attention(state, core, original, args, kwargs):
    """CoreAttention.forward in a split forward: q, k, v [B, H, S_r, D] of
    this rank's rows -> the context [S_r, B, H D] of those rows (all_to_all
    around the model's own CoreAttention, or the ring kernel)."""
    query, key, value, mask = sa.bind_args(args, kwargs, ("query_layer", "key_layer", "value_layer",
                                                          "attention_mask"))
    if mask is not None:
        raise NotImplementedError(
            f"{state.name}: sequence_parallelism_mode={state.mode!r}: CoreAttention received an attention mask "
            f"(a padded batch); the split attention covers the causal mask only")
    batch, heads, rows, dim = query.shape
    if state.mode == "all_to_all":
        context = sa.ulysses(state, query, key, value, lambda q, k, v, _m: _own_core(core, original, q, k, v))
    else:       # no attention dropout: the remote code's torch-2 path (scaled_dot_product_attention) has none
        context = sa.ring_rows(state, query, key, value, None, scale=1.0 / math.sqrt(dim))
    return context.permute(2, 0, 1, 3).reshape(rows, batch, heads * dim)


def kernel_core_attention(core, original, args, kwargs):
    """CoreAttention.forward with the C kernel (enable_flash_attention):
    q, k, v [B, H, S, D] -> the context [S, B, H D], softmax(q . k / sqrt(D))
    @ v as the remote code's scaled_dot_product_attention path computes it:
    causal when no mask is given and the queries are the keys, else the
    given mask (True: hidden) inverted, no attention dropout (that path has
    none)."""
    from shardformer.attention import own_attention, seam_kernel, seam_kernel_reason

    query, key, value, mask = sa.bind_args(args, kwargs, ("query_layer", "key_layer", "value_layer",
                                                          "attention_mask"))
    reason = seam_kernel_reason(core, (query, key, value))
    if reason is not None:
        return own_attention(reason, original, args, kwargs)
    causal = mask is None and query.shape[2] == key.shape[2]
    context = seam_kernel(query, key, value, scale=1.0 / math.sqrt(query.shape[-1]), causal=causal,
                          mask=None if mask is None else ~mask)
    batch, heads, rows, dim = context.shape
    return context.permute(2, 0, 1, 3).reshape(rows, batch, heads * dim)


SEAM = sa.AttentionSeam("CoreAttention", "forward", split_core_attention,
                        row_kwargs=("rope", "rotary_pos_emb"), seq_dim=0,
                        kernel=kernel_core_attention).registered(__name__, "SEAM")

PIPELINE = StageSplit("ChatGLMModel", "encoder.layers", last=("encoder.final_layernorm", "output_layer"),
                      count="num_layers", batch_dims=(("last_hidden_state", 1),))


class ChatGLM2Shape(SpecPolicy):
    """A spec factory (build_spec(), interpreted by shardformer.plan.interpret):
    the GLMBlock's entries and head attributes, the embedding, the refusals
    and split-gather SP along dimension 0, from the bound model's config."""

    # all_to_all / ring_attn: the layers of the encoder, split at CoreAttention (SEAM); the base is the model
    # (its config carries the dropout probabilities the per-rank dropout streams read)
    split_attention_at = ("ChatGLMModel", "encoder.layers")
    attention_seam = SEAM
    pipeline_split = PIPELINE
    sp_modes = ("split_gather",)
    # enable_sequence_overlap: each block's gather along dimension 0 overlaps its column layers' matmuls
    sequence_overlap = True
    # output_hidden_states=True under split_gather is refused by name (the layers' rows are not marked:
    # split_gather_ends(mark=False))
    records_hidden_states = False

    #: {attribute under GLMBlock: what it holds} (shardformer.layout.Heads.attributes)
    head_attributes = {
        "self_attention.num_attention_heads_per_partition": "heads",
        "self_attention.num_multi_query_groups_per_partition": "kv_heads",
        "self_attention.projection_size": "width",
        "self_attention.core_attention.num_attention_heads_per_partition": "heads",
        "self_attention.core_attention.hidden_size_per_partition": "width",
    }

    def layers_path(self) -> str:
        return "transformer.encoder.layers" if hasattr(self.model, "transformer") else "encoder.layers"

    def block_entries(self) -> tuple[Entry, ...]:
        """GLMBlock's replacements: the fused [q | k | v] by heads (the KV
        groups replicated when fewer than ranks), dense by the same heads,
        the packed [gate | up] halves, dense_4h_to_h."""
        return (Entry("self_attention.query_key_value", "fused_colwise_qkv"),
                Entry("self_attention.dense", "rowwise_heads"),
                Entry("mlp.dense_h_to_4h", "fused_packed_colwise"),
                Entry("mlp.dense_4h_to_h", "rowwise"))

    def refusals(self) -> tuple[Refusal, ...]:
        """original_rope=False; add_bias_linear=True under split_gather (the
        block's reduce-scatter would sum the row layers' biases over the
        ranks); pre_seq_len (p-tuning) under pipeline parallelism
        (ChatGLMModel's prefix_encoder makes every layer's prefix keys and
        values before the first layer, which the first stage alone holds)."""
        glm = "transformer." if hasattr(self.model, "transformer") else ""
        mode = self.shard_config.sequence_parallelism_mode if self.shard_config is not None else None
        return (
            Refusal("original_rope", allowed=(True, None), default=True),
            Refusal("add_bias_linear", allowed=(False, None), default=False, when=("sequence_parallel",),
                    error="NotImplementedError",
                    message=str(sequence_mode_refused(
                        "{model}", f"{glm}encoder.layers.*.self_attention.dense / mlp.dense_4h_to_h", mode,
                        "add_bias_linear=True: the sequence-parallel block reduce-scatters the row layers' "
                        "outputs, which would sum their biases over the ranks"))),
            Refusal("pre_seq_len", allowed=(None, 0), when=("pipeline_parallel",), error="NotImplementedError",
                    message="{model}: pipeline parallelism is not available with {attribute}={value} (p-tuning): "
                            f"{glm}prefix_encoder computes the prefix keys and values of every layer of "
                            f"{glm}encoder.layers before the first one, on the first stage only"),
        )

    def build_spec(self) -> PolicySpec:
        cfg = self.model.config
        return PolicySpec(
            name="chatglm2",
            modules=(ModuleSpec("GLMBlock", self.block_entries(), attributes=tuple(self.head_attributes.items())),
                     ModuleSpec("ChatGLMModel", (Entry("embedding.word_embeddings", "embedding_rowwise"),))),
            heads=HeadsFrom(kv_heads="multi_query_group_num" if cfg.multi_query_attention else None,
                            head_dim="kv_channels"),
            split_gather=SplitGatherSpec("GLMTransformer", "layers", "GLMBlock",
                                         (("self_attention", BLOCK), ("mlp", BLOCK),
                                          ("input_layernorm", None), ("post_attention_layernorm", None)),
                                         dim=0, marks=False),
            capabilities=spec_capabilities(self),
            refusals=self.refusals(),
        )

    def input_embeddings(self):
        # The remote code has no get_input_embeddings(): found by path.
        glm = self.model.transformer if hasattr(self.model, "transformer") else self.model
        return glm.embedding.word_embeddings


FAMILY = Family("chatglm2", "", ChatGLM2Shape, heads={
    "ChatGLMModel": lm("output_layer"),
    "ChatGLMForConditionalGeneration": lm("transformer.output_layer", loss="causal"),  # its own shifted CE
})
globals().update(FAMILY.policy_classes())
