"""Rank-side checks of the zero-bubble schedules (tests/test_zero_bubble.py).

The reference is the unsharded HF model from the same seed, run on the
whole batch.  For each of two optimizer steps (SGD with momentum, on both):
the pipelined loss equals the reference's, every gradient this rank holds
equals the reference's (this rank's TP shard of it), and after the steps the
full state dict gathered from the stages equals the reference's.  The B / W
split ran (linear products deferred, their weight gradients applied in W)."""
from __future__ import annotations

import copy
import inspect

import torch

import shardformer
from checks import parity
from checks.pipeline import batch_of, build, groups
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import gather_full_state_dict
from shardformer.pipeline import PipelineStageManager, ZeroBubbleSchedule, ZeroBubbleVSchedule, weight_grads

SCHEDULES = {"zb-h1": (ZeroBubbleSchedule, 1, "loop"), "zb-v": (ZeroBubbleVSchedule, 2, "v")}
TOL = parity.TOL[torch.float32]


def _pipelined(ctx, name: str, pp: int, tp: int, schedule: str, layers: int, how: str, shape=None):
    """(reference, pipelined model, stage manager).  how: "groups" (explicit TP / PP groups,
    checks.pipeline.groups), "default" (PipelineStageManager over the world and ShardConfig's
    default groups, TP off: the world is the pipeline), "mesh" (shardformer.mesh(pp=, tp=)).
    shape: (chunks, layout) instead of the zero-bubble schedule's."""
    _, chunks, layout = (None, *shape) if shape is not None else SCHEDULES[schedule]
    torch.manual_seed(0)
    model = build(name, layers)
    model.train()
    ref = copy.deepcopy(model)
    if how == "mesh":
        cfg = shardformer.mesh(pp=pp, tp=tp).shard_config(num_model_chunks=chunks, pipeline_layout=layout)
        sm = cfg.pipeline_stage_manager
    elif how == "default":
        assert tp == 1 and pp == ctx.world_size
        sm = PipelineStageManager(num_model_chunks=chunks, layout=layout)
        cfg = ShardConfig(pipeline_stage_manager=sm, enable_tensor_parallelism=False)
    else:
        tp_group, pp_group = groups(ctx, pp, tp)
        sm = PipelineStageManager(pp_group, num_model_chunks=chunks, layout=layout)
        cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                          enable_tensor_parallelism=tp > 1)
    model, _ = ShardFormer(shard_config=cfg).optimize(model)
    return ref, model, sm


def equals_unsharded(ctx, name: str, pp: int, schedule: str, m: int, tp: int = 1, layers: int = 4,
                     how: str = "groups", steps: int = 2, reentrant: bool | None = None) -> dict:
    """See the module docstring.  reentrant: HF's gradient checkpointing on the pipelined model
    (torch.utils.checkpoint's reentrant or non-reentrant form; the layers recompute in B, and
    nothing is deferred).  Returns the worst relative errors and the split's counts."""
    ref, model, sm = _pipelined(ctx, name, pp, tp, schedule, layers, how)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = batch_of(name, m if m % 2 == 0 else 2 * m)
    assert "labels" in batch, f"{name}: the zoo batch has no labels"
    runner = SCHEDULES[schedule][0](sm, num_microbatches=m)
    runner.timeline = []
    opts = [torch.optim.SGD([p for p in mdl.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
            for mdl in (model, ref)]
    # the schedule runs the stages with use_cache=False; so does the reference
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(type(ref).forward).parameters else {}
    before = dict(weight_grads.COUNTS)
    worst = {"loss": 0.0, "grads": 0.0, "state": 0.0}
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        out = runner.forward_backward_step(model, batch)
        exp = ref(**batch, **no_cache)
        exp.loss.backward()
        tag = f"{name} ({schedule}, pp={pp}, tp={tp}, m={m}, step {step + 1})"
        worst["loss"] = max(worst["loss"], parity.assert_close(f"{tag} loss", out["loss"], exp.loss.detach(), TOL))
        worst["grads"] = max(worst["grads"], parity.compare_grads(model, ref, tag, TOL))
        for opt in opts:
            opt.step()
    full, expected = gather_full_state_dict(model), ref.state_dict()
    missing = sorted(set(expected) - set(full))
    assert not missing, f"{name}: gathered state dict lacks {missing[:5]}"
    for key, t in expected.items():
        worst["state"] = max(worst["state"], parity.assert_close(f"{name} {key} after {steps} steps", full[key], t,
                                                                 TOL))
    deferred = weight_grads.COUNTS["deferred"] - before["deferred"]
    applied = weight_grads.COUNTS["applied"] - before["applied"]
    if reentrant is None:
        assert deferred > 0 and applied == deferred, \
            f"{name}: stage {sm.stage}: {deferred} linear products deferred, {applied} weight gradients applied"
    else:                                        # checkpointed layers: every gradient in B
        assert deferred == applied == 0, (deferred, applied)
    kinds = [k for k, *_ in runner.timeline]
    assert kinds.count("W") == kinds.count("B") == steps * m * sm.num_model_chunks, kinds
    return dict(worst, deferred=deferred, stage=sm.stage)
