"""Mixtral: the Llama-shaped attention with a sparse mixture of experts as MLP.
Every expert is split by tensor parallelism (shardformer.layer.moe.FusedExperts1D:
its [gate | up] rows column-parallel, its down projection row-parallel) and the
router mlp.gate stays replicated, so all ranks route alike; see policies/mistral.py.
"""
from __future__ import annotations

from shardformer.policies.mistral import DecoderPolicy


class MixtralPolicy(DecoderPolicy):
    hf_module, prefix = "mixtral.modeling_mixtral", "Mixtral"
    mlp = "moe"

    def config_sanity_check(self):
        super().config_sanity_check()
        jitter = self.text_config().router_jitter_noise
        if self.tensor_parallel and jitter:
            raise ValueError(f"{type(self.model).__name__}: router_jitter_noise={jitter} is not supported: "
                             "each rank would draw its own noise and route tokens differently (set it to 0)")


class MixtralModelPolicy(MixtralPolicy):
    pass


class MixtralForCausalLMPolicy(MixtralPolicy):
    model_class, head = "MixtralForCausalLM", "lm_head"


class MixtralForSequenceClassificationPolicy(MixtralPolicy):
    model_class, head = "MixtralForSequenceClassification", "score"


class MixtralForTokenClassificationPolicy(MixtralPolicy):
    model_class, head = "MixtralForTokenClassification", "score"


class MixtralForQuestionAnsweringPolicy(MixtralPolicy):
    model_class, head = "MixtralForQuestionAnswering", "qa_outputs"
