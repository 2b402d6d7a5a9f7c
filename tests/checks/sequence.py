"""Rank-side checks of split-gather sequence parallelism (tests/test_sequence_parallel.py)."""
from __future__ import annotations

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer

SP = {"enable_sequence_parallelism": True}


def sp_equals_unsharded(ctx, name: str, seq: int | None = None, config=None) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after a step)
    with sequence parallelism on; `seq`: the input length (odd lengths are
    padded inside)."""
    inputs = zoo.make_inputs(name)
    if seq is not None:
        inputs = {k: v[:, :seq].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
                  for k, v in inputs.items()}
    return parity.check_sharded(ctx, lambda: zoo.build(name), inputs, name=name, config={**SP, **(config or {})})


def sp_activations_are_split(ctx, name: str) -> dict:
    """Between the blocks each rank holds only its rows: the input of every
    decoder layer after the first, and of the norms, has ceil(S / tp) rows."""
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model)
    seen = []
    base = model.model if hasattr(model, "model") else model
    for layer in list(base.layers)[1:]:
        layer.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("hidden_states", a[0] if a else None).shape[1]),
                                        with_kwargs=True)
    inputs = zoo.make_inputs(name)
    seq = inputs["input_ids"].shape[1]
    with torch.no_grad():
        model(**inputs)
    expected = -(-seq // ctx.tp_size)
    assert seen and all(s == expected for s in seen), f"{name}: layer inputs of {seen} rows, expected {expected}"
    return {"rows": seen[0], "seq": seq}


def sp_generate_matches(ctx, name: str) -> list:
    """Greedy generate() with sequence parallelism equals the unsharded model's."""
    model = zoo.build(name).eval()
    import copy

    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model)
    return parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, 5).tolist()


def sp_regathers_in_backward(ctx, name: str) -> dict:
    """Each block keeps only its rows of the gathered input for backward and
    all-gathers them once when backward needs them: 2 re-gathers (attention,
    MLP) per decoder layer per backward, none in no_grad forwards."""
    from shardformer.layer.sequence import _Regathered

    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model)
    inputs = zoo.make_inputs(name)
    before = _Regathered.gathers
    with torch.no_grad():
        model(**inputs)
    assert _Regathered.gathers == before, "a no_grad forward re-gathered"
    parity.loss_of(model(**inputs), {}).backward()
    layers = model.config.num_hidden_layers
    got = _Regathered.gathers - before
    assert got == 2 * layers, f"{name}: {got} re-gathers in backward, expected {2 * layers}"
    return {"regathers": got}
