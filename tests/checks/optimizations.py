"""Rank-side checks of the optimizations the sharder applies by module type
(shardformer.optimizations, shardformer.attention): each function runs on
every rank of the pool."""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager

import torch

import zoo
from checks import parity
from shardformer import attention as sf_attention
from shardformer import ops

# The Python entry points of the C kernels in shardformer.ops the optimizations call.
COUNTED = ("layer_norm", "rms_norm", "swiglu", "bias_gelu", "bias_dropout_add", "attention")
# Every optimization switch on, as a user turns them on.
ALL_ON = {"enable_fused_normalization": True, "enable_jit_fused": True, "enable_flash_attention": True}
DROPOUT = 0.1


@contextmanager
def counting_calls(targets: dict):
    """Count the calls of each attribute `targets` names, {label: (owner,
    attribute)} (a module's function, a class's method), under its label."""
    calls = dict.fromkeys(targets, 0)
    saved = {label: getattr(owner, attr) for label, (owner, attr) in targets.items()}

    def wrap(label):
        def counted(*args, **kwargs):
            calls[label] += 1
            return saved[label](*args, **kwargs)
        return counted

    for label, (owner, attr) in targets.items():
        setattr(owner, attr, wrap(label))
    try:
        yield calls
    finally:
        for label, (owner, attr) in targets.items():
            setattr(owner, attr, saved[label])


def counting_kernels(names: tuple[str, ...] = COUNTED):
    """Count the calls of the C kernels' Python entry points `names` in shardformer.ops."""
    return counting_calls({name: (ops, name) for name in names})


# Second configurations of a class the zoo does not name: name -> (zoo name, config overrides)
VARIANTS = {
    # Falcon's new decoder architecture: two norms in parallel (ln_attn, ln_mlp), 2 KV heads
    "FalconForCausalLM/parallel_norms": ("FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2,
                                                               "multi_query": False}),
}


def zoo_name(name: str) -> str:
    return VARIANTS[name][0] if name in VARIANTS else name


def overrides(name: str) -> dict:
    """Config changes of the optimization runs: the VARIANTS'; Mistral's sliding
    window below the 8 tokens (the kernel's window); Gemma-2's attention logit
    soft-capping at 0.05, a cap that changes a tiny model's logits (the zoo's 50
    does not), computed by the kernel."""
    if name in VARIANTS:
        return dict(VARIANTS[name][1])
    if name.startswith("Mistral"):
        return {"sliding_window": 4}
    if name.startswith("Gemma2"):
        return {"attn_logit_softcapping": 0.05}
    return {}


def build(name: str):
    """`name` with every dropout probability of its config at DROPOUT (where it has any)."""
    try:
        return zoo.build_with_dropout(zoo_name(name), DROPOUT, **overrides(name))
    except AssertionError:            # a config without dropout probabilities
        return zoo.build(zoo_name(name), **overrides(name))


def optimized_matches(ctx, names: list[str]) -> dict:
    """For each of `names`: the model in eval mode with dropout > 0 in its config,
    sharded over ctx.group with every optimization switch on, equals the
    unsharded HF model from the same seed (forward, loss, every gradient, the
    outputs after an SGD step; parity.compare_sharded).  Returns, per name, the
    kernel calls counted during those sharded forwards (two: before and after the
    step) and the attention calls that fell back to the model's own attention."""
    from shardformer import ShardConfig, ShardFormer

    report = {}
    for name in names:
        torch.manual_seed(0)
        model = build(name).eval()
        ref = copy.deepcopy(model)
        fp64 = name in getattr(zoo.module_of(zoo_name(name)), "FP64_FLOOR", ())
        ref64 = copy.deepcopy(ref).double() if fp64 else None
        inputs = zoo.make_inputs(zoo_name(name))
        inputs64 = parity._double(inputs) if fp64 else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sharded, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **ALL_ON)).optimize(model)
            training = [n for n, m in sharded.named_modules() if m.training]
            assert not training, f"{name}: modules in training mode after optimize(): {training[:4]}"
            fallback = sf_attention.CALLS["fallback"]
            with counting_kernels() as calls:
                errors = parity.compare_sharded(sharded, ref, inputs, name, ref64=ref64, inputs64=inputs64)
        report[name] = {"calls": dict(calls), "fallback": sf_attention.CALLS["fallback"] - fallback,
                        "errors": errors}
    return report

