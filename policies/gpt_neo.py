"""GPT-Neo: the GPT-style block of policies/shapes.py (GPTBlockShape):
attention heads and MLP features split; vocabulary-parallel wte and LM head
(tied to wte when HF tied it).

    h.*.attn.attention.q_proj, k_proj, v_proj   Linear1D_Col (per head)
    h.*.attn.attention.out_proj                 Linear1D_Row
    h.*.mlp.c_fc / c_proj                       Linear1D_Col / Linear1D_Row
    wte                                         VocabParallelEmbedding1D
    lm_head                                     VocabParallelLMHead1D
    score / classifier / qa_outputs             Linear1D_Col, gathered
    dropouts                                    parallel on attention probabilities,
                                                replicated after row-parallel layers

GPTNeoSelfAttention splits and merges heads with self.num_heads, so that
becomes this rank's head count (global and local attention layers alike).

Split-gather sequence parallelism: GPTBlockShape's (hidden states split along
the sequence between the first and the last block, out_proj and the MLP's
down projection reduce-scatter and add their bias on this rank's rows,
residual dropouts draw a mask per rank, norms' gradients all-reduced).
"""
from shardformer.family import Family
from shardformer.policies.shapes import GPTBlockShape, gpt_heads

FAMILY = Family("gpt_neo", "gpt_neo.modeling_gpt_neo", GPTBlockShape,
                options={"prefix": "GPTNeo", "attention": "attn.attention", "heads_attribute": "num_heads",
                         "mlp_names": ("c_fc", "c_proj")},
                heads=gpt_heads("GPTNeo"))
globals().update(FAMILY.policy_classes())
