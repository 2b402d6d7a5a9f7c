"""Rank-side check of tests/test_sequence_heads.py: every head class of a
family under one sequence-parallel mode, in one pool call.

Each class is built from the seed, sharded with the plain ShardConfig (no
group given: the world of the two-rank pool) and compared with its unsharded
copy by parity.check_sharded: forward outputs, loss, every gradient (each
rank's shard of the reference's) and the outputs after an SGD step.  The
text inputs are cut to an odd length (7 tokens over 2 ranks: padded to 8
inside), so a head that reads one position of the sequence (the last
non-padding token of sequence classification, [CLS] of a pooler, the
multiple-choice rows [batch * choices, S]) reads it from the full sequence,
not from one rank's rows.
"""
from __future__ import annotations

import torch

import zoo
from checks import parity
from checks.sequence import cut_sequence
from shardformer.layer import sequence_attention as sa
from shardformer.layer.linear import GatherRowsLinear
from shardformer.layer.sequence import _Regathered


def config_of(mode: str) -> dict:
    """The ShardConfig arguments of `mode`: split_gather runs on the tensor-
    parallel blocks (TP on); all_to_all / ring_attn split the sequence over
    the same ranks with TP off (their SP group is then the TP group)."""
    if mode == "split_gather":
        return {"enable_sequence_parallelism": True}
    return {"enable_tensor_parallelism": False, "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": mode}


def right_padded(inputs: dict, pad: int | None, keep: int = 4) -> dict:
    """`inputs` with the first row (of each choice: ids [batch, (choices,) S])
    right-padded after `keep` tokens: those ids set to `pad`, their
    attention_mask 0 (a mask of ones made where there was none).  Its last
    real token then lies in rank 0's rows (7 tokens over 2 ranks: 4 each)
    while the other row's lies in the last rank's: a head that reads the last
    non-padding token (sequence classification) must find each.  keep=4: the
    zoo's shortest sliding window (Gemma 3's 4) still reaches a real key from
    every padding query (a query whose every visible key is padding gets each
    attention implementation's own convention, docs/sequence-parallelism.md).
    Unchanged without input_ids or a pad id."""
    ids = inputs.get("input_ids")
    if ids is None or pad is None or ids.shape[-1] <= keep:
        return inputs
    ids = ids.clone()
    ids[0, ..., keep:] = pad
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.clone()
    mask[0, ..., keep:] = 0
    return {**inputs, "input_ids": ids, "attention_mask": mask}


def _split_ran(mode: str) -> int:
    """A counter that grows only when the sequence was split: split_gather's
    blocks re-gathering their saved rows in backward, the split attention
    calls of all_to_all / ring_attn."""
    if mode == "split_gather":
        return _Regathered.gathers + GatherRowsLinear.regathers
    return sa.CALLS[mode]


def heads_equal_unsharded(ctx, mode: str, names: list, seq: int | None = 7) -> dict:
    """check_sharded for every class in `names` under `mode` with the plain
    ShardConfig, and the sequence was split in each (_split_ran grew).
    Returns {class: its report}.  A mismatch raises naming the class and the
    tensor (check_sharded's message)."""
    assert ctx.world_size == ctx.tp_size, "the plain ShardConfig splits over the world: run on world_pool(n)"
    reports = {}
    for name in names:
        model = zoo.build(name)
        inputs = zoo.make_inputs(name)
        inputs = cut_sequence(inputs, seq if "input_ids" in inputs else None)
        inputs = right_padded(inputs, getattr(model.config, "pad_token_id", None))
        before = _split_ran(mode)
        report = parity.check_sharded(ctx, lambda: model, inputs, name=f"{name} ({mode})",
                                      config=config_of(mode), default_group=True)
        report["split_ran"] = _split_ran(mode) - before
        assert report["split_ran"] > 0, f"{name}: {mode} never split the sequence"
        reports[name] = report
    return reports
