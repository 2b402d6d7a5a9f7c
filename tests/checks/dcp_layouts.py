"""Rank-side checks of torch.distributed.checkpoint (DCP) and save_sharded /
load_sharded across parallel layouts (tests/test_dcp_layouts.py): pipeline
stages (TP x PP), data-parallel replicas (DP x TP, with and without ZeRO-1)
and expert parallelism (EP), each saved at one layout and loaded at another.

A layout is a dict of mesh sizes (dp, pp, tp, ep) and `zero` (AdamW inside
torch's ZeroRedundancyOptimizer over the DP group); {"tp": 2, "ranks": 2}
is plain TP over the pool's first 2 ranks with an explicit group, {"tp": 4,
"ranks": 4} the default ShardConfig() (group = the world).  Every layout
trains on the same global batch of 4 rows: each DP rank on its rows
(shardformer.data_parallel averages the gradients), a pipeline through
1F1B with 2 micro-batches.  The reference is the unsharded model from the
same seed trained on the whole batch."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zoo
from checks import parity
from checks import pipeline as pp_checks
from shardformer import ShardConfig, ShardFormer, data_parallel, mesh
from shardformer.checkpoint import PlacedShard, gather_full_state_dict, get_state_dict, set_state_dict
from shardformer.checkpoint.sharded import MANIFEST, load_sharded, save_sharded
from shardformer.pipeline import OneForwardOneBackwardSchedule
from shardformer.pipeline.stages import runtime_of

LR, WD = 1e-3, 0.1
TP2 = {"tp": 2, "ranks": 2}                      # explicit group of the first 2 ranks
TP4 = {"tp": 4, "ranks": 4}                      # ShardConfig(): the world
PP2TP2 = PP2TP2_LAYOUT = {"pp": 2, "tp": 2}
DP2TP2 = {"dp": 2, "tp": 2}
ZERO = {"dp": 2, "tp": 2, "zero": True}
EP2 = {"dp": 2, "tp": 2, "ep": 2}
EP4 = {"dp": 4, "ep": 4}
TOL = parity.TOL[torch.float32]
MODELS = {"llama": ("LlamaForCausalLM", {}),        # 6 heads, 2 KV heads, 90 MLP features, vocab 101
          "mixtral": ("MixtralForCausalLM", {"num_local_experts": 5}),   # 5 experts: uneven over EP 2 and 4
          "gpt2": ("GPT2LMHeadModel", {})}     # TP dropout modules (checks.resume), 6 heads, vocab 99


def ranks(layout: dict) -> int:
    """How many of the pool's ranks run the layout."""
    return layout.get("ranks", 4)


def _mesh(layout: dict):
    return mesh(dp=layout.get("dp", 1), pp=layout.get("pp", 1), tp=layout.get("tp", 1), ep=layout.get("ep"))


def _batch(name: str) -> dict:
    return pp_checks.batch_of(name, 4)


def _build(ctx, arch: str, layout: dict, seed: int, dropout: float = 0.0):
    """(sharded model, mesh or None) of `arch` from `seed` in `layout`, every
    dropout probability `dropout` (0: the config's)."""
    name, overrides = MODELS[arch]
    model = zoo.build_with_dropout(name, dropout, seed=seed, **overrides) if dropout else \
        zoo.build(name, seed=seed, **overrides)
    model.train()
    if "ranks" in layout:                     # plain TP: the world's default group, or the first ranks'
        cfg = ShardConfig() if layout["ranks"] == ctx.world_size else \
            ShardConfig(tensor_parallel_process_group=ctx.group)
        return ShardFormer(shard_config=cfg).optimize(model)[0], None
    m = _mesh(layout)
    return ShardFormer(m.shard_config(extra_kwargs={"check_replicas": False})).optimize(model)[0], m


def _optimizer(model, layout: dict, wrapped):
    if layout.get("zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW,
                                       process_group=_mesh(layout).dp, lr=LR, weight_decay=WD)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def _trainer(model, m, layout: dict):
    """(wrapped model, step()) : one AdamW step on this rank's part of the batch."""
    name = type(model).__name__
    batch = _batch(name)
    dp, d = (1, 0) if m is None else (m.sizes["dp"], m.coords["dp"])
    rows = {k: v[d * 4 // dp:(d + 1) * 4 // dp] for k, v in batch.items()}
    wrapped = data_parallel(model, m) if dp > 1 else model
    stages = runtime_of(model)
    schedule = OneForwardOneBackwardSchedule(stages.manager, num_microbatches=2) \
        if stages is not None and stages.manager.num_stages > 1 else None

    def step(optimizer):
        if schedule is not None:
            schedule.forward_backward_step(model, rows)
        else:
            wrapped(**rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return wrapped, step


def _straight(arch: str, steps: int, dtype=torch.float32, lr_lambda=None):
    """The unsharded model from seed 0 after `steps` AdamW steps on the whole
    batch (with lr_lambda: under LambdaLR(lr_lambda))."""
    name, overrides = MODELS[arch]
    model = zoo.build(name, seed=0, dtype=dtype, **overrides)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda) if lr_lambda is not None else None
    batch = _batch(name)
    if dtype == torch.float64:
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return model


def _group(ctx, layout: dict):
    """The DCP process group: the pool's first ranks for plain TP on fewer ranks, else the world."""
    return ctx.group if ranks(layout) < ctx.world_size else None


def _numpy(full: dict) -> dict:
    return {k: v.numpy() for k, v in full.items()}


def train_and_save(ctx, arch: str, layout: dict, directory: str, sharded: bool = False) -> dict:
    """One AdamW step in `layout` from seed 0, then dcp.save of get_state_dict
    (model and optimizer) into directory/dcp, and with `sharded` also
    save_sharded into directory/sharded.  Returns the full weights (NumPy)
    and counts of what was placed."""
    model, m = _build(ctx, arch, layout, seed=0)
    wrapped, step = _trainer(model, m, layout)
    optimizer = _optimizer(model, layout, wrapped)
    step(optimizer)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "dcp"),
             process_group=_group(ctx, layout))
    if sharded:
        save_sharded(model, os.path.join(directory, "sharded"))
    placed = [k for k, v in msd.items() if isinstance(v, PlacedShard)]
    report = {"placed": len(placed), "keys": len(msd), "states": len(osd["state"]),
              "multi": sum(len(getattr(msd[k], "placements", [None])) > 1 for k in placed),
              "full": _numpy(gather_full_state_dict(model))}
    return report


def _compare_step(ctx, arch: str, model, step, optimizer, saved: dict) -> dict:
    """The loaded weights are bit for bit `saved`; after one more step they
    and the logits equal the straight unsharded run of two steps (float32,
    within the tolerance plus twice its own error against float64)."""
    name = MODELS[arch][0]
    loaded = gather_full_state_dict(model)
    assert loaded.keys() == saved.keys(), sorted(set(loaded) ^ set(saved))
    differ = [k for k in saved if not torch.equal(loaded[k], torch.from_numpy(saved[k]))]
    assert not differ, f"{name}: loaded weights differ from the saved ones: {differ}"
    ref, ref64 = _straight(arch, 2), _straight(arch, 2, torch.float64)
    step(optimizer)
    full, exp, exp64 = gather_full_state_dict(model), ref.state_dict(), ref64.state_dict()
    assert full.keys() == exp.keys(), sorted(set(full) ^ set(exp))
    # MoE: the experts' gradients are summed over the EP ranks' tokens (another order than the
    # unsharded batch), and AdamW's first steps divide by |g| + eps, so a weight whose gradient is
    # near 0 moves by up to lr on rounding alone: compared to 5% of lr, as checks.expert_parallel
    # does (a wrong or missing state moves weights by ~lr everywhere)
    tol = (0.0, 0.05 * LR) if arch == "mixtral" else TOL
    errs = {"weights": max(parity.assert_close(f"{name} after the step: {k}", full[k], exp[k], tol, exp64[k])
                           for k in exp)}
    if runtime_of(model) is None:
        batch = _batch(name)
        with torch.no_grad():
            model.eval(), ref.eval(), ref64.eval()
            b64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
            errs["logits"] = max(parity.check_outputs(f"{name} after the step", model(**batch), ref(**batch), tol,
                                                      ref64(**b64)).values())
    return errs


def load_and_step(ctx, arch: str, layout: dict, directory: str, saved: dict) -> dict:
    """A model from another seed with a fresh optimizer in `layout` takes the
    DCP checkpoint of directory/dcp (get_state_dict, dcp.load,
    set_state_dict), then steps once more (_compare_step)."""
    model, m = _build(ctx, arch, layout, seed=5)
    wrapped, step = _trainer(model, m, layout)
    optimizer = _optimizer(model, layout, wrapped)
    msd, osd = get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "dcp"),
             process_group=_group(ctx, layout))
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    local = optimizer.optim if layout.get("zero") else optimizer
    steps = {float(s["step"]) for s in local.state.values()}
    assert steps <= {1.0}, f"optimizer steps after the load: {steps}"
    return _compare_step(ctx, arch, model, step, optimizer, saved)


def sharded_load(ctx, arch: str, layout: dict, directory: str, saved: dict, saved_layout: dict,
                 drop_mesh: bool = False) -> dict:
    """The manifest of directory/sharded records the saving mesh; load_sharded
    of it into a model from another seed in `layout` gives the saved weights
    bit for bit.  drop_mesh: then again from the manifest without its mesh
    (as written before the mesh was recorded)."""
    path = os.path.join(directory, "sharded", MANIFEST)
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    mesh_rec = manifest["mesh"]
    for dim in ("tp", "pp", "dp", "ep"):
        want = saved_layout.get(dim, 1) if dim != "ep" else saved_layout.get("ep") or 1
        assert mesh_rec[dim] == want, (dim, mesh_rec, saved_layout)
    for old in (False, True) if drop_mesh else (False,):
        if old:
            dist.barrier()
            if ctx.rank == 0:
                with open(path, "w", encoding="utf-8") as f:
                    json.dump({k: v for k, v in manifest.items() if k != "mesh"}, f)
            dist.barrier()
        model, _ = _build(ctx, arch, layout, seed=5 + old)
        load_sharded(model, os.path.join(directory, "sharded"))
        loaded = gather_full_state_dict(model)
        differ = [k for k in saved if not torch.equal(loaded[k], torch.from_numpy(saved[k]))]
        assert loaded.keys() == saved.keys() and not differ, f"load_sharded at {layout} (old: {old}): {differ}"
    return mesh_rec


def stages_disagree(ctx) -> str:
    """Pipeline stages whose optimizers have different hyperparameters (the
    saved param_groups would name one stage's): get_state_dict raises on
    every rank naming each stage's groups, before anything is saved."""
    model, m = _build(ctx, "llama", PP2TP2_LAYOUT, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * (1 + m.coords["pp"]))
    msg = parity.refused_unchanged(model, lambda: get_state_dict(model, optimizer), "stages that disagree",
                                   ValueError, names=("get_state_dict", "stage 0", "stage 1", "pipeline"))
    return msg
