"""GPT-J: the GPT-style block of policies/shapes.py (GPTBlockShape):
attention heads and MLP features split; vocabulary-parallel wte and LM head
(with its bias; not tied by default).

    h.*.attn.q_proj, k_proj, v_proj   Linear1D_Col (per head)
    h.*.attn.out_proj                 Linear1D_Row
    h.*.mlp.fc_in / fc_out            Linear1D_Col / Linear1D_Row
    wte                               VocabParallelEmbedding1D
    lm_head                           VocabParallelLMHead1D
    score / qa_outputs                Linear1D_Col, gathered
    dropouts                          parallel on attention probabilities,
                                      replicated after row-parallel layers

GPTJAttention splits and merges heads with self.num_attention_heads, so that
becomes this rank's head count; rotary embeddings act within each head.

Split-gather sequence parallelism: GPTBlockShape's (hidden states split along
the sequence between the first and the last block, out_proj and the MLP's
down projection reduce-scatter and add their bias on this rank's rows,
residual dropouts draw a mask per rank, norms' gradients all-reduced).

all_to_all / ring_attn: GPT-J's attention is outside transformers' registry;
the split runs at GPTJAttention._attn(q, k, v, mask), q, k, v [B, H, S_r, D]
of this rank's rows.  The rotary embedding is applied before, from the
position_ids each layer receives: a split forward passes each layer this
rank's rows of them (row_kwargs), so the rows keep their global positions.
all_to_all: the model's own _attn on H/p heads over the whole padded
sequence; ring_attn: the ring kernel, causal, scale 1 / sqrt(head_dim).

enable_flash_attention: _attn by the C kernel, softmax(q . k / scale_attn +
mask) @ v with the model's mask added as it adds it (GPT-J has no causal
buffer: the mask it is given says it all); the model's own _attn where
attention dropout is active in training (the kernel's draws are not
torch's) or the weights are asked for.
"""
from shardformer.family import Family
from shardformer.layer.sequence_attention import head_major_seam
from shardformer.policies.shapes import GPTBlockShape, gpt_heads

SEAM = head_major_seam("GPTJAttention", scale=lambda attention: 1.0 / attention.scale_attn,
                       row_kwargs=("position_ids",)).registered(__name__, "SEAM")

FAMILY = Family("gptj", "gptj.modeling_gptj", GPTBlockShape,
                options={"prefix": "GPTJ", "attention": "attn", "heads_attribute": "num_attention_heads",
                         "mlp_names": ("fc_in", "fc_out"), "split_attention_at": ("GPTJModel", "h"),
                         "attention_seam": SEAM},
                heads=gpt_heads("GPTJ", token=False))
globals().update(FAMILY.policy_classes())
