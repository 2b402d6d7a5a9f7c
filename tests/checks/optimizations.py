"""Rank-side checks of the optimizations the sharder applies by module type
(shardformer.optimizations): each function runs on every rank of the pool."""
from __future__ import annotations

from contextlib import contextmanager

import zoo
from checks import parity
from shardformer import ops

COUNTED = ("layer_norm", "rms_norm", "swiglu", "bias_gelu")


@contextmanager
def counting_kernels():
    """Count the calls of the fused C kernels' Python entry points in shardformer.ops."""
    calls = dict.fromkeys(COUNTED, 0)
    saved = {name: getattr(ops, name) for name in COUNTED}

    def wrap(name):
        def counted(*args, **kwargs):
            calls[name] += 1
            return saved[name](*args, **kwargs)
        return counted

    for name in COUNTED:
        setattr(ops, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)


def fused_matches(ctx, name: str) -> dict:
    """`name` sharded with fused normalization and fused MLP activations equals
    the unsharded model (forward, loss, gradients, a step); returns the kernel
    calls of one forward of the sharded model (counted apart from optimize(),
    whose probes also call the kernels)."""
    from shardformer import ShardConfig, ShardFormer

    config = {"enable_fused_normalization": True, "enable_jit_fused": True}
    parity.check_sharded(ctx, lambda: zoo.build(name), zoo.make_inputs(name), name=name, config=config,
                         fp64_floor=name in getattr(zoo.module_of(name), "FP64_FLOOR", ()))
    sharded, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config)).optimize(zoo.build(name))
    with counting_kernels() as calls:
        sharded(**zoo.make_inputs(name))
    return dict(calls)
