"""Gemma 3: the text models and the multimodal ones.

Text models (Gemma3TextModel, Gemma3ForCausalLM, ...): as Gemma 2, with
per-head q/k RMSNorms (replicated, they act on head_dim) and sliding/full
attention layers; see policies/mistral.py.

Multimodal models (Gemma3Model, Gemma3ForConditionalGeneration,
Gemma3ForSequenceClassification): a SigLIP vision tower, a projector and the
text model, composed as in policies/blip2.py:

    SiglipEncoderLayer .self_attn.{q,k,v}_proj  Linear1D_Col (per head, uneven allowed)
                       .self_attn.out_proj      Linear1D_Row (input split by the same heads)
                       .mlp.fc1 / fc2           Linear1D_Col / Linear1D_Row
    language_model                              Gemma3TextModelPolicy, found in the registry
    lm_head                                     VocabParallelLMHead1D (tied when HF tied it)
    score                                       Linear1D_Col, gathered

Patch and position embeddings, the vision layer norms (FusedLayerNorm with
enable_fused_normalization) and the multi-modal projector (an average pool,
an RMSNorm and one [vision, text] matrix over a few tokens per image) stay
replicated: the projector's output joins the replicated input embeddings,
whose gradient the text layers already all-reduce.
"""
from __future__ import annotations

import importlib

from shardformer.layer import FusedLayerNorm, Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D
from shardformer.layout import Heads
from shardformer.policies.mistral import DecoderPolicy
from shardformer.policy import ModulePolicyDescription, Policy, merge_policies
from shardformer.policy import SubModuleReplacementDescription as Sub


class Gemma3Policy(DecoderPolicy):
    hf_module, prefix = "gemma3.modeling_gemma3", "Gemma3"
    base_model = "TextModel"
    qk_norm = True
    embed_scale = True

    def fused_norm_ok(self):
        return False


class Gemma3TextModelPolicy(Gemma3Policy):
    pass


class Gemma3ForCausalLMPolicy(Gemma3Policy):
    model_class, head = "Gemma3ForCausalLM", "lm_head"


class Gemma3TextForSequenceClassificationPolicy(Gemma3Policy):
    model_class, head = "Gemma3TextForSequenceClassification", "score"


# ---- the multimodal models: SigLIP vision tower + projector + the text model above ----

def _siglip():
    from transformers.models.siglip import modeling_siglip

    return modeling_siglip


def siglip_policy(vision_cfg) -> dict:
    """SigLIP encoder layers split by attention heads (uneven allowed) and MLP
    features.  SiglipAttention reshapes by head_dim with -1 heads, so only the
    (informational) num_heads attribute changes per rank."""
    n = vision_cfg.num_attention_heads
    heads = Heads(n, n, vision_cfg.hidden_size // n)
    return {
        _siglip().SiglipEncoderLayer: ModulePolicyDescription(
            attribute_replacement={"self_attn.num_heads": heads.local_heads()},
            sub_module_replacement=[
                Sub("self_attn.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                Sub("self_attn.k_proj", Linear1D_Col, kwargs={"split": heads.q}),
                Sub("self_attn.v_proj", Linear1D_Col, kwargs={"split": heads.q}),
                Sub("self_attn.out_proj", Linear1D_Row, kwargs={"split": heads.q}),
                Sub("mlp.fc1", Linear1D_Col),
                Sub("mlp.fc2", Linear1D_Row),
            ]),
    }


class Gemma3MultimodalPolicy(Policy):
    """Gemma3Model and the heads around it, described by class attributes:

    base         path of the Gemma3Model inside the model ("" for Gemma3Model itself)
    model_class, head   the head's model class and module ("lm_head": vocabulary-parallel,
                 tied to the text embedding exactly when HF tied it; "score": gathered)
    """

    base = "model"
    model_class = ""
    head = ""

    def __init__(self) -> None:
        super().__init__()
        self._tied = False

    def gemma3_model(self):
        return self.model.get_submodule(self.base) if self.base else self.model

    def language_policy(self) -> Policy:
        """The registered policy of the text model (Gemma3TextModelPolicy), bound to it."""
        return self.sub_policy(self.gemma3_model().language_model)

    def config_sanity_check(self):
        self.language_policy().config_sanity_check()

    def module_policy(self):
        policy = {}
        if self.tensor_parallel:
            merge_policies(policy, siglip_policy(self.model.config.vision_config))
            if self.head:
                sub = (Sub("lm_head", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()) if self.head == "lm_head"
                       else Sub(self.head, Linear1D_Col, kwargs={"gather_output": True}))
                hf = importlib.import_module("transformers.models.gemma3.modeling_gemma3")
                self.append_or_create_submodule_replacement(sub, policy, getattr(hf, self.model_class))
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("layer_norm1", FusedLayerNorm), Sub("layer_norm2", FusedLayerNorm)], policy,
                _siglip().SiglipEncoderLayer)
        return merge_policies(policy, self.language_policy().module_policy())

    def preprocess(self):
        if self.head == "lm_head":
            self._tied = self.model.lm_head.weight is self.model.get_input_embeddings().weight
        self.language_policy().preprocess()
        return super().preprocess()

    def postprocess(self):
        self.language_policy().postprocess()
        if self.tensor_parallel and self._tied:
            self.tie_weight(f"{self.base}.language_model.embed_tokens", "lm_head")
        return self.model


class Gemma3ModelPolicy(Gemma3MultimodalPolicy):
    base = ""


class Gemma3ForConditionalGenerationPolicy(Gemma3MultimodalPolicy):
    model_class, head = "Gemma3ForConditionalGeneration", "lm_head"


class Gemma3ForSequenceClassificationPolicy(Gemma3MultimodalPolicy):
    model_class, head = "Gemma3ForSequenceClassification", "score"
