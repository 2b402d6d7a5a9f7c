"""OPT: attention heads and MLP features split; vocabulary-parallel embedding
and LM head (tied by default).

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

from shardformer.layer import FusedLayerNorm, Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layout import Heads
from shardformer.policies.mistral import DecoderPolicy
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class OPTPolicy(DecoderPolicy):
    hf_module = "opt.modeling_opt"
    tie_source = "model.decoder.embed_tokens"

    def config_sanity_check(self):
        pass

    def module_policy(self):
        hf = self.hf()
        cfg = self.model.config
        heads = Heads(cfg.num_attention_heads, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads)
        policy = {}
        if self.tensor_parallel:
            policy[hf.OPTDecoderLayer] = ModulePolicyDescription(
                attribute_replacement={"self_attn.num_heads": heads.local_heads()},
                sub_module_replacement=[
                    Sub("self_attn.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("self_attn.k_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("self_attn.v_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("self_attn.out_proj", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("fc1", Linear1D_Col),
                    Sub("fc2", Linear1D_Row),
                ],
            )
            policy[hf.OPTDecoder] = ModulePolicyDescription(
                sub_module_replacement=[Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())]
            )
            self.add_head(policy, hf)
        if self.shard_config.enable_fused_normalization and cfg.layer_norm_elementwise_affine:
            self.append_or_create_submodule_replacement(
                [Sub("self_attn_layer_norm", FusedLayerNorm), Sub("final_layer_norm", FusedLayerNorm)],
                policy, hf.OPTDecoderLayer)
            self.append_or_create_submodule_replacement(
                Sub("final_layer_norm", FusedLayerNorm, ignore_if_not_exist=True), policy, hf.OPTDecoder)
        return policy


class OPTModelPolicy(OPTPolicy):
    pass


class OPTForCausalLMPolicy(OPTPolicy):
    model_class, head = "OPTForCausalLM", "lm_head"


class OPTForSequenceClassificationPolicy(OPTPolicy):
    model_class, head = "OPTForSequenceClassification", "score"


class OPTForQuestionAnsweringPolicy(OPTPolicy):
    model_class, head = "OPTForQuestionAnswering", "qa_outputs"
