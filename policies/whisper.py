"""Whisper: heads and feed-forward features split in the encoder, the
decoder and the cross attention; the audio front-end (conv1, conv2,
positional embeddings) stays replicated; vocabulary-parallel token
embeddings and output projection.

    *.self_attn / encoder_attn .{q,k,v}_proj   Linear1D_Col (per head)
    *.self_attn / encoder_attn .out_proj       Linear1D_Row
    layers.*.fc1 / fc2                         Linear1D_Col / Linear1D_Row
    decoder.embed_tokens                       VocabParallelEmbedding1D
    proj_out                                   VocabParallelLMHead1D (tied to embed_tokens when HF ties it)
    projector / classifier (audio classification)   Linear1D_Col / Linear1D_Row: the mean over
                                               time of the projector's split features is split too

WhisperAttention reshapes keys and values with num_heads, so num_heads and
embed_dim become this rank's values.  Whisper's dropouts are functional
(torch's global RNG), so they are not replaced.
"""
from __future__ import annotations

from shardformer.layer import (
    FusedLayerNorm,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


def _hf():
    from transformers.models.whisper import modeling_whisper

    return modeling_whisper


class WhisperPolicy(Policy):
    def _heads(self, module_heads: int) -> Heads:
        return Heads(module_heads, module_heads, self.model.config.d_model // module_heads)

    def module_policy(self):
        hf = _hf()
        cfg = self.model.config
        policy = {}
        if self.tensor_parallel:
            for layer_cls, n_heads, attns in (
                (hf.WhisperEncoderLayer, cfg.encoder_attention_heads, ("self_attn",)),
                (hf.WhisperDecoderLayer, cfg.decoder_attention_heads, ("self_attn", "encoder_attn")),
            ):
                heads = self._heads(n_heads)
                attrs, subs = {}, []
                for a in attns:
                    attrs[f"{a}.num_heads"] = heads.local_heads()
                    attrs[f"{a}.embed_dim"] = heads.local_width(heads.head_dim)
                    subs += [Sub(f"{a}.{p}", Linear1D_Col, kwargs={"split": heads.q})
                             for p in ("q_proj", "k_proj", "v_proj")]
                    subs.append(Sub(f"{a}.out_proj", Linear1D_Row, kwargs={"split": heads.q}))
                subs += [Sub("fc1", Linear1D_Col), Sub("fc2", Linear1D_Row)]
                policy[layer_cls] = ModulePolicyDescription(attribute_replacement=attrs, sub_module_replacement=subs)
            policy[hf.WhisperDecoder] = ModulePolicyDescription(sub_module_replacement=[
                Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())])
        if self.shard_config.enable_fused_normalization:
            norms = ["self_attn_layer_norm", "final_layer_norm"]
            self.append_or_create_submodule_replacement([Sub(n, FusedLayerNorm) for n in norms], policy,
                                                        hf.WhisperEncoderLayer)
            self.append_or_create_submodule_replacement(
                [Sub(n, FusedLayerNorm) for n in norms + ["encoder_attn_layer_norm"]], policy, hf.WhisperDecoderLayer)
            for cls in (hf.WhisperEncoder, hf.WhisperDecoder):
                self.append_or_create_submodule_replacement(Sub("layer_norm", FusedLayerNorm), policy, cls)
        return policy


class WhisperModelPolicy(WhisperPolicy):
    pass


class _WhisperLMPolicy(WhisperPolicy):
    model_class = ""

    def module_policy(self):
        policy = super().module_policy()
        model = self.model
        self._tied = model.proj_out.weight is model.get_input_embeddings().weight
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub("proj_out", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()),
                policy, getattr(_hf(), self.model_class))
        return policy

    def postprocess(self):
        if self.tensor_parallel and self._tied:
            self.tie_weight("model.decoder.embed_tokens", "proj_out")
        return self.model


class WhisperForConditionalGenerationPolicy(_WhisperLMPolicy):
    model_class = "WhisperForConditionalGeneration"


class WhisperForCausalLMPolicy(_WhisperLMPolicy):
    model_class = "WhisperForCausalLM"


class WhisperForAudioClassificationPolicy(WhisperPolicy):
    def module_policy(self):
        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                [Sub("projector", Linear1D_Col), Sub("classifier", Linear1D_Row)],
                policy, _hf().WhisperForAudioClassification)
        return policy
