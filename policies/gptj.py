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
"""
from shardformer.family import Family
from shardformer.policies.shapes import GPTBlockShape, gpt_heads

FAMILY = Family("gptj", "gptj.modeling_gptj", GPTBlockShape,
                options={"prefix": "GPTJ", "attention": "attn", "heads_attribute": "num_attention_heads",
                         "mlp_names": ("fc_in", "fc_out")},
                heads=gpt_heads("GPTJ", token=False))
globals().update(FAMILY.policy_classes())
