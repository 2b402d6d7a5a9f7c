"""Mixtral: the Llama-shaped attention (policies/shapes.py DecoderShape) with a
sparse mixture of experts as MLP.  Every expert is split by tensor parallelism
(shardformer.layer.moe.FusedExperts1D: its [gate | up] rows column-parallel, its
down projection row-parallel) and the router mlp.gate stays replicated, so all
ranks route alike.

Split-gather sequence parallelism: the DecoderShape layout (self_attn and
mlp BLOCK regions, the norms on this rank's rows, split at layers.0 and
gathered after the last layer), with the MoE block as the mlp region: the
router mlp.gate runs on the gathered tokens (replicated; its gradients,
partial on each rank, all-reduced, and the router logits handed out for the
load-balancing loss pass back 1/p of their gradient: RouterInSequenceParallel)
and the experts return their partial sums to the block's reduce-scatter
(FusedExperts1D sequence_parallel=True), see shardformer.layer.moe.  The MoE
options live in DecoderShape (mlp="moe"): router_jitter_noise is refused
under TP (each rank would draw its own noise and route differently).
"""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("mixtral", "mixtral.modeling_mixtral", DecoderShape, options={"prefix": "Mixtral", "mlp": "moe"},
                heads=decoder_heads("Mixtral"))
globals().update(FAMILY.policy_classes())
