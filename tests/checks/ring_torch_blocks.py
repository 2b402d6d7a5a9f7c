"""Rank-side checks of ring attention with its blocks forced onto torch's ops
(ring_attention.BLOCKS = "torch", the path tensors on CUDA take): the
existing ring and sequence-parallel checks, run under the switch, and the
counters showing that no block ran on the C kernel."""
from __future__ import annotations

import contextlib
import copy

import zoo
from checks import parity
from checks import ring_attention as ring_checks
from checks import sequence_attention as seq_checks
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import ring_attention as ra


@contextlib.contextmanager
def torch_blocks():
    """BLOCKS = "torch" for the body, counters zeroed; afterwards the body's
    blocks must all have run in torch's ops, forward and backward."""
    old = ra.BLOCKS
    ra.BLOCKS = "torch"
    ra.reset_counters()
    try:
        yield
    finally:
        ra.BLOCKS = old
    calls = dict(ra.CALLS)
    assert calls["kernel_forward"] == 0 and calls["kernel_backward"] == 0, calls
    assert calls["torch_forward"] > 0 and calls["torch_backward"] > 0, calls


def ring_equals_full(ctx, cases: list) -> list:
    """checks.ring_attention.ring_equals_full for each (args, kwargs) case."""
    out = []
    for args, kwargs in cases:
        with torch_blocks():
            out.append(ring_checks.ring_equals_full(ctx, *args, **kwargs))
    return out


def models_equal_unsharded(ctx, cases: list) -> list:
    """checks.sequence_attention's `fn` for each (fn name, args) case: the
    SP-sharded HF model equals the unsharded one."""
    out = []
    for fn, args in cases:
        with torch_blocks():
            out.append(getattr(seq_checks, fn)(ctx, *args))
    return out


def llama_default_group(ctx, seq: int = 7) -> dict:
    """Llama sharded with the plain ShardConfig (the default group = the world)
    in ring_attn mode, its blocks in torch's ops, equals the unsharded copy."""
    model = zoo.build("LlamaForCausalLM").train()
    ref = copy.deepcopy(model)
    inputs = seq_checks._trim(zoo.make_inputs("LlamaForCausalLM"), seq)
    with torch_blocks():
        ShardFormer(shard_config=ShardConfig(**seq_checks.sp_config("ring_attn"))).optimize(model)
        return parity.compare_sharded(model, ref, inputs, "LlamaForCausalLM ring_attn ShardConfig()")
