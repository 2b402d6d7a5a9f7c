"""Whisper: heads and feed-forward features split in the encoder, the
decoder and the cross attention; the audio front-end (conv1, conv2,
positional embeddings) stays replicated; vocabulary-parallel token
embeddings and output projection.

    *.self_attn / encoder_attn .{q,k,v}_proj   Linear1D_Col (per head)
    *.self_attn / encoder_attn .out_proj       Linear1D_Row (all-reduce forward)
    layers.*.fc1 / fc2                         Linear1D_Col / Linear1D_Row
    decoder.embed_tokens                       VocabParallelEmbedding1D
    proj_out                                   VocabParallelLMHead1D (tied to embed_tokens when HF ties it)
    projector / classifier (audio classification)   Linear1D_Col / Linear1D_Row: the mean over
                                               time of the projector's split features is split too

The encoder and decoder layers have their own head counts
(encoder_attention_heads, decoder_attention_heads).  WhisperAttention
reshapes keys and values with num_heads, so num_heads and embed_dim become
this rank's values.  Whisper's dropouts are functional (torch's global RNG),
so they are not replaced.
"""
from __future__ import annotations

from shardformer.family import Family, FamilyPolicy, lm
from shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class WhisperShape(FamilyPolicy):
    """Option `split_head`: (column, row) module names of a head split by
    features rather than gathered (WhisperForAudioClassification's projector
    and classifier)."""

    split_head: tuple[str, str] | None = None

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        policy = {}
        for layer_cls, n_heads, attns in (
            ("WhisperEncoderLayer", cfg.encoder_attention_heads, ("self_attn",)),
            ("WhisperDecoderLayer", cfg.decoder_attention_heads, ("self_attn", "encoder_attn")),
        ):
            heads = Heads(n_heads, n_heads, cfg.d_model // n_heads)
            attrs, subs = {}, []
            for a in attns:
                attrs[f"{a}.num_heads"] = heads.local_heads()
                attrs[f"{a}.embed_dim"] = heads.local_width(heads.head_dim)
                subs += [Sub(f"{a}.{p}_proj", Linear1D_Col, kwargs={"split": heads.q}) for p in "qkv"]
                subs.append(Sub(f"{a}.out_proj", Linear1D_Row, kwargs={"split": heads.q}))
            subs += [Sub("fc1", Linear1D_Col), Sub("fc2", Linear1D_Row)]
            policy[layer_cls] = ModulePolicyDescription(attribute_replacement=attrs, sub_module_replacement=subs)
        policy["WhisperDecoder"] = ModulePolicyDescription(sub_module_replacement=[
            Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())])
        return policy

    def module_policy(self):
        policy = super().module_policy()
        if self.tensor_parallel and self.split_head is not None:
            col, row = self.split_head
            self.append_or_create_submodule_replacement([Sub(col, Linear1D_Col), Sub(row, Linear1D_Row)],
                                                        policy, self.model_class)
        return policy


FAMILY = Family("whisper", "whisper.modeling_whisper", WhisperShape, heads={
    "WhisperModel": (),
    "WhisperForConditionalGeneration": lm("proj_out"),
    "WhisperForCausalLM": lm("proj_out"),
})
AUDIO = Family("whisper", "whisper.modeling_whisper", WhisperShape, options={"split_head": ("projector", "classifier")},
               heads={"WhisperForAudioClassification": ()})
FAMILIES = (FAMILY, AUDIO)
for _family in FAMILIES:
    globals().update(_family.policy_classes())
