"""Mixtral: the Llama-shaped attention (policies/shapes.py DecoderShape) with a
sparse mixture of experts as MLP.  Every expert is split by tensor parallelism
(shardformer.layer.moe.FusedExperts1D: its [gate | up] rows column-parallel, its
down projection row-parallel) and the router mlp.gate stays replicated, so all
ranks route alike.
"""
from __future__ import annotations

from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads, text_config


class MixtralShape(DecoderShape):
    def config_sanity_check(self):
        super().config_sanity_check()
        jitter = text_config(self.model).router_jitter_noise
        if self.tensor_parallel and jitter:
            raise ValueError(f"{type(self.model).__name__}: router_jitter_noise={jitter} is not supported: "
                             "each rank would draw its own noise and route tokens differently (set it to 0)")


FAMILY = Family("mixtral", "mixtral.modeling_mixtral", MixtralShape, options={"prefix": "Mixtral", "mlp": "moe"},
                heads=decoder_heads("Mixtral"))
globals().update(FAMILY.policy_classes())
