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

all_to_all / ring_attn: GPT-Neo's attention is outside transformers'
registry; the split runs at GPTNeoSelfAttention._attn(q, k, v, mask), where
q, k, v [B, H, S_r, D] of this rank's rows meet (positions are learned
embeddings added before the layers).  all_to_all: the model's own _attn on
H/p heads over the whole padded sequence (its causal / local-window buffer
and the extended mask).  ring_attn: the ring kernel, causal, unscaled
(GPT-Neo does not scale q . k), and on the "local" layers a window of
config.window_size keys (key j seen by query i iff i - window < j <= i).

enable_flash_attention: _attn by the C kernel, softmax(q . k + mask) @ v,
unscaled, causal (the model's causal buffer, sliced bottom-right for a KV
cache, as the kernel aligns queries), the local layers' window, the model's
additive mask added as it adds it; the model's own _attn where attention
dropout is active in training (the kernel's draws are not torch's) or the
weights are asked for.
"""
from shardformer.family import Family
from shardformer.layer.sequence_attention import head_major_seam
from shardformer.policies.shapes import GPTBlockShape, gpt_heads


def _window(attention) -> int:
    return attention.config.window_size if attention.attention_type == "local" else 0


SEAM = head_major_seam("GPTNeoSelfAttention", scale=lambda attention: 1.0, window=_window,
                       causal=True).registered(__name__, "SEAM")

FAMILY = Family("gpt_neo", "gpt_neo.modeling_gpt_neo", GPTBlockShape,
                options={"prefix": "GPTNeo", "attention": "attn.attention", "heads_attribute": "num_heads",
                         "mlp_names": ("c_fc", "c_proj"), "split_attention_at": ("GPTNeoModel", "h"),
                         "attention_seam": SEAM},
                heads=gpt_heads("GPTNeo"))
globals().update(FAMILY.policy_classes())
