"""Rank-side checks of torch.distributed.checkpoint (DCP) on sharded models
(tests/test_dcp.py): model.state_dict() of a sharded model is refused by DCP,
naming shardformer.checkpoint.get_state_dict; the state dicts of
get_state_dict / set_state_dict (model and AdamW) saved with dcp.save at one
TP size load with dcp.load at another, or into the plain HF model, and the
next step equals the straight unsharded run.  Each function runs on every
rank of the pool; the group of ctx.tp_size ranks is the DCP process group."""
from __future__ import annotations

import io

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import PlacedShard, gather_full_state_dict, get_state_dict, set_state_dict

LR, WD = 1e-3, 0.1
TOL = parity.TOL[torch.float32]


def _config(ctx) -> ShardConfig:
    """The default ShardConfig() when the group is the whole world, else the explicit group."""
    if ctx.tp_size == ctx.world_size:
        return ShardConfig()
    return ShardConfig(tensor_parallel_process_group=ctx.group)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def _step(model, optimizer, inputs) -> None:
    parity.loss_of(model(**inputs), {}).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _model(ctx, name: str, seed: int):
    """zoo's `name` from `seed`, sharded over ctx's group (TP=1: the plain HF model)."""
    model = zoo.build(name, seed=seed)
    if ctx.tp_size > 1:
        ShardFormer(shard_config=_config(ctx)).optimize(model)
    return model


def _straight(name: str, steps: int, dtype=torch.float32):
    """The unsharded model from seed 0 after `steps` AdamW steps (the straight run)."""
    model = zoo.build(name, dtype=dtype, seed=0)
    optimizer = _adamw(model)
    inputs = zoo.make_inputs(name)
    if dtype == torch.float64:
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    for _ in range(steps):
        _step(model, optimizer, inputs)
    return model, inputs


def _state_dicts(ctx, model, optimizer):
    """shardformer's get_state_dict on a sharded model, torch's on the plain one (TP=1)."""
    if ctx.tp_size > 1:
        return get_state_dict(model, optimizer)
    from torch.distributed.checkpoint import state_dict as torch_sd
    return torch_sd.get_state_dict(model, optimizer)


def _put(ctx, model, optimizer, msd, osd) -> None:
    if ctx.tp_size > 1:
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    else:
        from torch.distributed.checkpoint import state_dict as torch_sd
        torch_sd.set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def train_and_save(ctx, name: str, directory: str) -> dict:
    """One AdamW step at this TP size (seed 0), then dcp.save of the model
    and optimizer state dicts; reports how many tensors were placed and
    the full weights saved (NumPy)."""
    model = _model(ctx, name, seed=0)
    optimizer = _adamw(model)
    _step(model, optimizer, zoo.make_inputs(name))
    msd, osd = _state_dicts(ctx, model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=ctx.group)
    placed = sum(isinstance(v, PlacedShard) for v in msd.values())
    moments = sum(isinstance(v, PlacedShard) for s in osd["state"].values() for v in s.values())
    return {"placed": placed, "moments": moments, "full": {k: v.numpy() for k, v in _full(ctx, model).items()}}


def _full(ctx, model) -> dict:
    return gather_full_state_dict(model) if ctx.tp_size > 1 else model.state_dict()


def load_and_step(ctx, name: str, directory: str, saved: dict, exact: bool = False) -> dict:
    """A model from another seed and a fresh AdamW at this TP size take the
    checkpoint (get_state_dict, dcp.load, set_state_dict): the weights are
    bit for bit the `saved` ones; after one more step here, the weights and
    logits equal the straight unsharded run after two steps (float32, within
    the tolerance plus twice the straight run's own error against float64:
    AdamW's first steps divide by |gradient| + eps); with `exact` (the TP
    size that saved), bit for bit the run at this TP size that never stopped."""
    model = _model(ctx, name, seed=5)
    optimizer = _adamw(model)
    msd, osd = _state_dicts(ctx, model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=ctx.group)
    _put(ctx, model, optimizer, msd, osd)
    loaded = _full(ctx, model)
    assert loaded.keys() == saved.keys(), sorted(set(loaded) ^ set(saved))
    differ = [k for k in saved if not torch.equal(loaded[k], torch.from_numpy(saved[k]))]
    assert not differ, f"{name}: loaded weights differ from the saved ones: {differ}"
    ref, inputs = _straight(name, 2)
    ref64, inputs64 = _straight(name, 2, torch.float64)
    _step(model, optimizer, inputs)
    full, exp, exp64 = _full(ctx, model), ref.state_dict(), ref64.state_dict()
    assert full.keys() == exp.keys(), sorted(set(full) ^ set(exp))
    errs = {"weights": max(parity.assert_close(f"{name} after the step: {k}", full[k], exp[k], TOL, exp64[k])
                           for k in exp)}
    with torch.no_grad():
        model.eval(), ref.eval(), ref64.eval()
        errs["logits"] = max(parity.check_outputs(f"{name} after the step", model(**inputs), ref(**inputs), TOL,
                                                  ref64(**inputs64)).values())
    errs["step"] = float(optimizer.state[next(iter(model.parameters()))]["step"])
    if exact:                   # the saving layout: bit for bit the run that never stopped
        straight = _model(ctx, name, seed=0)
        straight_opt = _adamw(straight)
        for _ in range(2):
            _step(straight, straight_opt, inputs)
        unbroken = _full(ctx, straight)
        differ = [k for k in unbroken if not torch.equal(full[k], unbroken[k])]
        assert not differ, f"{name}: the resumed run differs from the unbroken run at TP={ctx.tp_size}: {differ}"
    return errs


def _refusal(call) -> str:
    """The message of the exception `call` raises (AssertionError if none)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        call()
    except (TypeError, ValueError, RuntimeError, CheckpointException) as e:   # DCP gathers the ranks' errors in one
        return str(e)
    raise AssertionError("torch.distributed.checkpoint accepted model.state_dict() of a sharded model")


def plain_state_dict_refused(ctx, name: str, directory: str) -> dict:
    """dcp.save(model.state_dict()) of a sharded model raises on every rank,
    naming a sharded key and get_state_dict; dcp.load into model.state_dict()
    raises too, from a checkpoint of per-rank shards (what DCP wrote before)
    as from a correct one, and the model is unchanged.  The plain state dict
    still works everywhere else: torch.save / torch.load(weights_only=True)
    and load_state_dict."""
    model = _model(ctx, name, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    msgs = {"save": _refusal(lambda: dcp.save(model.state_dict(), checkpoint_id=directory + "/plain",
                                              process_group=ctx.group))}
    # what DCP made of the shards before: each rank's local tensor under the full name
    local = {k: v.as_subclass(torch.Tensor) for k, v in model.state_dict().items()}
    dcp.save(local, checkpoint_id=directory + "/local", process_group=ctx.group)
    msgs["load_local"] = _refusal(lambda: dcp.load(model.state_dict(), checkpoint_id=directory + "/local",
                                                   process_group=ctx.group))
    msd, _ = get_state_dict(model)
    dcp.save(msd, checkpoint_id=directory + "/placed", process_group=ctx.group)
    msgs["load_placed"] = _refusal(lambda: dcp.load(model.state_dict(), checkpoint_id=directory + "/placed",
                                                    process_group=ctx.group))
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "a refused load changed the model"
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in back.items())
    model.load_state_dict(back)
    return msgs


def placed_pieces(ctx, name: str) -> dict:
    """Every split tensor's written pieces tile its full shape exactly once
    over the ranks (gathered to every rank): no index twice, none missing."""
    import torch.distributed as dist

    model = _model(ctx, name, seed=0)
    msd, _ = get_state_dict(model)
    mine = {}
    for k, v in msd.items():
        if isinstance(v, PlacedShard):
            mine[k] = [(list(w.tensor_data.chunk.offsets), list(w.tensor_data.chunk.sizes))
                       for w in v.__create_write_items__(k, v)]
    every = [None] * ctx.tp_size
    dist.all_gather_object(every, mine, group=ctx.group)
    for k, v in msd.items():
        if not isinstance(v, PlacedShard):
            continue
        count = np.zeros(tuple(v.shape), dtype=np.int64)
        for pieces in every:
            for off, size in pieces[k]:
                count[tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
        assert (count == 1).all(), f"{k}: indices written {count.min()}..{count.max()} times"
    return {"placed": len(mine)}


def bad_dicts_refused(ctx) -> list[str]:
    """A state dict that does not fit (a missing key, a wrong shape) is
    refused with both named, the model unchanged.  (Pipeline stages, expert
    parallelism and ZeRO-1: tests/test_dcp_layouts.py.)"""
    msgs = []
    model = _model(ctx, "LlamaForCausalLM", seed=0)
    msd, _ = get_state_dict(model)
    bad = dict(msd)
    del bad["lm_head.weight"]
    bad["model.norm.weight"] = torch.zeros(7)
    names = ("lm_head.weight: missing", "model.norm.weight: shape [7], expected [96]")
    msgs.append(parity.refused_unchanged(model, lambda: set_state_dict(model, model_state_dict=bad), "a bad dict",
                                         ValueError, names=names))
    return msgs
