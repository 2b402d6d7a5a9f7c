"""OPT: attention heads and MLP features split; vocabulary-parallel embedding
and LM head (tied to decoder.embed_tokens when HF tied it, the default).

    decoder.layers.*.self_attn.q_proj, k_proj, v_proj   Linear1D_Col (per head)
    decoder.layers.*.self_attn.out_proj                 Linear1D_Row
    decoder.layers.*.fc1 / fc2                          Linear1D_Col / Linear1D_Row
    decoder.embed_tokens                                VocabParallelEmbedding1D
    lm_head                                             VocabParallelLMHead1D
    score / qa_outputs                                  Linear1D_Col, gathered

OPTAttention reshapes the query by self.num_heads, so that becomes this
rank's head count.  Learned positions and project_in / project_out (when
word_embed_proj_dim != hidden_size) stay replicated.
"""
from __future__ import annotations

from shardformer.family import Family, FamilyPolicy
from shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layout import Heads
from shardformer.policies.shapes import attention_by_heads, gpt_heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class OPTShape(FamilyPolicy):
    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        n = cfg.num_attention_heads
        heads = Heads(n, n, cfg.hidden_size // n)
        return {
            "OPTDecoderLayer": ModulePolicyDescription(
                attribute_replacement={"self_attn.num_heads": heads.local_heads()},
                sub_module_replacement=[
                    *attention_by_heads("self_attn", heads, o="out_proj"),
                    Sub("fc1", Linear1D_Col),
                    Sub("fc2", Linear1D_Row),
                ],
            ),
            "OPTDecoder": ModulePolicyDescription(
                sub_module_replacement=[Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())]),
        }


FAMILY = Family("opt", "opt.modeling_opt", OPTShape, heads=gpt_heads("OPT", token=False))
globals().update(FAMILY.policy_classes())
