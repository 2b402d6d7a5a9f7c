"""Rank-side checks of modes combined on one world (tests/test_combos.py).

TP x SP x PP: shardformer.mesh(pp=2, sp=2, tp=2) on 8 ranks, the ShardConfig
from m.shard_config(sequence_parallelism_mode=...): each pipeline stage is
split over 2 x 2 ranks, heads / MLP features over .tp, the sequence over .sp
(all_to_all or ring_attn attention across it), and the stages exchange
their rows of the hidden states.  EP x PP: mesh(pp=2, dp=2, ep=2) (and with
tp=2 on 8 ranks): Mixtral's experts split over the EP group (a subgroup of
the data-parallel group, ranks of the same stage) and its layers over the
stages; each pipeline runs its schedule on its DP rows.

Every case runs `STEPS` SGD steps against the unsharded HF model built from
the same seed and run on the whole batch: each step's loss, the last
stage's outputs, every gradient (this rank's shard of the reference's),
and after the last step the full state dict gathered from the stages."""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from checks import expert_parallel as ep_check
from checks import packed, parity
from checks import pipeline as pipe
from checks.optimizations import counting_calls
from shardformer import ShardFormer, average_gradients, mesh
from shardformer.checkpoint import gather_full_state_dict
from shardformer.layer import expert_parallel, sequence_attention
from shardformer.layer.expert_parallel import ExpertParallelExperts, expert_block
from shardformer.pipeline import (GPipeSchedule, InterleavedSchedule, OneForwardOneBackwardSchedule,
                                  ZeroBubbleSchedule, ZeroBubbleVSchedule, p2p)
from shardformer.pipeline.stages import runtime_of

TOL = parity.TOL[torch.float32]
LR = 0.1
STEPS = 2
LAYERS = 3        # uneven over 2 stages: 2 + 1
# name -> (schedule class, model chunks per stage, stage manager layout)
SCHEDULES = {"gpipe": (GPipeSchedule, 1, "loop"), "1f1b": (OneForwardOneBackwardSchedule, 1, "loop"),
             "interleaved": (InterleavedSchedule, 2, "loop"), "zb-h1": (ZeroBubbleSchedule, 1, "loop"),
             "zb-v": (ZeroBubbleVSchedule, 2, "v")}


def _layers(schedule: str) -> int:
    """LAYERS for one chunk per stage; 4 (one per virtual stage) for two."""
    return LAYERS if SCHEDULES[schedule][1] == 1 else 4


def _switches(schedule: str) -> dict:
    """The stage manager's switches of mesh.shard_config for `schedule`."""
    _, chunks, layout = SCHEDULES[schedule]
    return {"num_model_chunks": chunks, "pipeline_layout": layout}


def _train(name: str, model, ref, schedule: str, batch: dict, ref_batch: dict, dp_group=None, dp: int = 1,
           average=None, compare_grads=None) -> dict:
    """STEPS SGD steps of the pipelined `model` on `batch` (this pipeline's
    rows) and of `ref` on `ref_batch` (every pipeline's rows; dp of them):
    loss, outputs and gradients compared each step, the gathered state dict
    after the last.  average(model): the data-parallel gradient average,
    called before the comparison; compare_grads(model, ref, what): the
    gradient comparison (default parity.compare_grads)."""
    compare_grads = compare_grads or (lambda mdl, r, what: parity.compare_grads(mdl, r, what, TOL))
    manager = runtime_of(model).manager
    runner = SCHEDULES[schedule][0](manager, num_microbatches=2)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    report = {"loss": 0.0, "outputs": 0.0, "grads": 0.0}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        sent = p2p.COUNTS["sent"]
        out = runner.forward_backward_step(model, batch, return_outputs=True)
        assert p2p.COUNTS["sent"] > sent, f"{name}: nothing went between the stages"
        exp = ref(**ref_batch)
        exp.loss.backward()
        loss = out["loss"].detach().clone()
        if dp > 1:
            dist.all_reduce(loss, group=dp_group)
            loss /= dp
        what = f"{name} ({schedule}) step {step}"
        report["loss"] = max(report["loss"], parity.assert_close(f"{what} loss", loss, exp.loss.detach(), TOL))
        if manager.is_last_stage():
            rows = out["outputs"].logits.shape[0]
            first = dist.get_rank(dp_group) * rows if dp > 1 else 0
            report["outputs"] = max(report["outputs"], parity.assert_close(
                f"{what} logits", out["outputs"].logits, exp.logits[first:first + rows], TOL))
        if average is not None:
            average(model)
        report["grads"] = max(report["grads"], compare_grads(model, ref, what))
        opt.step()
        ref_opt.step()
    full = gather_full_state_dict(model)
    expected = ref.state_dict()
    assert set(full) == set(expected), sorted(set(full) ^ set(expected))[:5]
    report["state"] = max(parity.assert_close(f"{name} ({schedule}) {key} after {STEPS} steps", full[key], t, TOL)
                          for key, t in expected.items())
    return report


def tp_sp_pp(ctx, cases) -> list[dict]:
    """TP=2 x SP=2 x PP=2 on 8 ranks for each (model name, sequence mode,
    schedule, position ids kind or None) of `cases`: 3 layers (2 + 1 over
    the stages), 7 tokens (uneven over SP), 4 rows in 2 micro-batches.
    kind="packed": documents packed in each row, restarting position_ids,
    no attention_mask (checks.packed)."""
    m = mesh(pp=2, sp=2, tp=2)
    reports = []
    for name, mode, schedule, kind in cases:
        start = time.perf_counter()
        torch.manual_seed(0)
        model = pipe.build(name, _layers(schedule))
        model.train()
        ref = copy.deepcopy(model)
        model, _ = ShardFormer(m.shard_config(sequence_parallelism_mode=mode, **_switches(schedule))).optimize(model)
        batch = pipe.batch_of(name, 4) if kind is None else packed.packed_inputs(name, kind, rows=4)
        batch, _ = pipe.cut_to(name, batch, 7, {})
        if kind is not None:
            packed.masking_matters(name, batch)
        before = sequence_attention.CALLS[mode]
        report = _train(name, model, ref, schedule, batch, batch)
        assert sequence_attention.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
        reports.append(dict(report, case=(name, mode, schedule, kind), seconds=time.perf_counter() - start))
    return reports


def ep_pp(ctx, tp: int = 1, schedules=("1f1b",)) -> list[dict]:
    """ep_pp_case for each of `schedules`."""
    return [ep_pp_case(tp, schedule) for schedule in schedules]


def ep_pp_case(tp: int, schedule: str) -> dict:
    """EP=2 x PP=2 (x TP=tp) on 4 * tp ranks: mesh(pp=2, dp=2, tp=tp, ep=2),
    Mixtral with 4 experts (2 per EP rank), 3 layers (4 with two chunks per
    stage); each pipeline runs `schedule` on its 2 rows of a 4-row batch,
    gradients averaged over DP by average_gradients(model, mesh) (expert
    parameters summed over .expert_dp, one rank here, and divided by DP)."""
    start = time.perf_counter()
    m = mesh(pp=2, dp=2, tp=tp, ep=2)
    torch.manual_seed(0)
    model = pipe.build("MixtralForCausalLM", _layers(schedule), num_local_experts=4)
    model.train()
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(m.shard_config(**_switches(schedule))).optimize(model)
    layers = [mod for mod in model.modules() if isinstance(mod, ExpertParallelExperts)]
    assert layers, "MixtralForCausalLM: no expert-parallel layer on this stage"
    first, count = expert_block(4, 2, m.coords["dp"])
    assert all((mod.first_expert, mod.num_experts) == (first, count) for mod in layers)
    whole = ep_check.batch(ref.config.vocab_size, 4)
    d = m.coords["dp"]
    mine = {k: v[2 * d:2 * d + 2] for k, v in whole.items()}
    with counting_calls({"a2a": (expert_parallel, "all_to_all_along")}) as calls:
        report = _train("MixtralForCausalLM", model, ref, schedule, mine, whole, dp_group=m.dp, dp=2,
                        average=lambda mdl: average_gradients(mdl, m),
                        compare_grads=lambda mdl, r, what: ep_check.compare(mdl, r, f"{what} grad", grads=True))
    # dispatch + combine per MoE layer per micro-batch, forward, in each of the steps
    assert calls["a2a"] >= 2 * 2 * len(layers) * STEPS, (calls["a2a"], len(layers))
    return dict(report, experts_here=count, moe_layers=len(layers), schedule=schedule,
                seconds=time.perf_counter() - start)


def ep_pp_disagree(ctx) -> dict:
    """EP=2 x PP=2 on 4 ranks (rank = 2 * stage + pipeline) where one rank,
    stage 0 of pipeline 1 (global rank 1), runs 1 micro-batch and the others
    2: its stage and its EP peer (rank 0) find the disagreement in their
    all-gathers, and rank 2 (stage 1 of pipeline 0), whose own groups agree
    but who would wait on rank 0's activations, learns of it from the
    spread.  Every rank raises ValueError, before any forward and within
    seconds, instead of waiting on an exchange that never comes."""
    m = mesh(pp=2, dp=2, ep=2)
    torch.manual_seed(0)
    model, _ = ShardFormer(m.shard_config()).optimize(pipe.build("MixtralForCausalLM", 2, num_local_experts=4))
    runner = OneForwardOneBackwardSchedule(runtime_of(model).manager, num_microbatches=1 if ctx.rank == 1 else 2)
    mine = ep_check.batch(model.config.vocab_size, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = time.perf_counter()
    try:
        runner.forward_backward_step(model, mine)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {ctx.rank}: EP peers running other schedules were not refused")
    took = time.perf_counter() - start
    expected = {0: ("expert-parallel group", "global rank 0: OneForwardOneBackwardSchedule, num_microbatches=2",
                    "global rank 1: OneForwardOneBackwardSchedule, num_microbatches=1"),
                1: ("the pipeline's ranks disagree", "num_microbatches=1"),
                2: ("global ranks 0, 3 refused this step",),
                3: ("the pipeline's ranks disagree", "num_microbatches=2")}[ctx.rank]
    assert all(part in message for part in expected), (ctx.rank, message)
    assert all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters()), \
        "a parameter changed before the refusal"
    return {"message": message, "seconds": took}


def _ep_pp_model(seed: int):
    """Mixtral (4 experts, 3 layers) from `seed` in eval mode."""
    torch.manual_seed(seed)
    return pipe.build("MixtralForCausalLM", LAYERS, num_local_experts=4).eval()


def ep_pp_generate_and_checkpoints(ctx, directory: str) -> dict:
    """EP=2 x PP=2 on 4 ranks, ShardConfig from mesh(pp=2, dp=2, ep=2) (the
    world), Mixtral with 4 experts, 3 layers over 2 stages, in eval mode.

    generate(): each pipeline decodes its own rows -- pipeline 0 three
    left-padded prompts and 3 new tokens, pipeline 1 the last two and 6 --
    greedy and sampled (every rank seeded 100 + rank): every rank's tokens
    equal the unsharded model's generate() on its pipeline's rows (sampled:
    seeded as the pipeline's first rank).  Pipeline 0 stops 3 steps early and
    keeps stepping (HF's synced_gpus loop) so that the MoE exchanges of its
    EP peer are met; generate(synced_gpus=False) is refused by name before
    any step.  Checkpoints: save_sharded, then load_sharded into the model of
    another seed at this layout; get_state_dict + dcp.save, then dcp.load +
    set_state_dict into the model of another seed: each loaded model's
    gathered state dict is bit for bit the unsharded model's."""
    from checks.pipeline_generate import prompts
    from shardformer.checkpoint import get_state_dict, load_sharded, save_sharded, set_state_dict

    m = mesh(pp=2, dp=2, ep=2)
    d = m.coords["dp"]
    model = _ep_pp_model(0)
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(m.shard_config()).optimize(model)
    assert any(isinstance(mod, ExpertParallelExperts) for mod in model.modules()), "no expert-parallel layer"
    batch = {k: v[d:] for k, v in prompts().items()}
    base = dict(max_new_tokens=3 + 3 * d, pad_token_id=0)
    first = min(m.ranks("pp"))
    out = {}

    def generate(mdl, what: str, **kwargs) -> list:
        with torch.no_grad():
            torch.manual_seed(100 + ctx.rank)
            got = mdl.generate(**batch, **base, **kwargs)
            torch.manual_seed(100 + first)
            exp = ref.generate(**batch, **base, **kwargs)
        assert torch.equal(got, exp), f"{what}: rank {ctx.rank} (pipeline {d}) decoded\n{got}\nunsharded\n{exp}"
        return got.tolist()

    out["greedy"] = generate(model, "EP x PP greedy", do_sample=False)
    out["sampled"] = generate(model, "EP x PP sampled", do_sample=True, top_k=0, top_p=1.0)
    out["refused"] = parity.refused_unchanged(
        model, lambda: model.generate(**batch, **base, do_sample=False, synced_gpus=False),
        "generate(synced_gpus=False) under EP x PP")
    expected = ref.state_dict()

    def loaded(mdl, what: str) -> None:
        full = gather_full_state_dict(mdl)
        differ = [k for k, v in expected.items() if not torch.equal(full[k], v)]
        assert full.keys() == expected.keys() and not differ, f"{what}: {differ or sorted(set(full) ^ set(expected))}"

    save_sharded(model, f"{directory}/sharded")
    other, _ = ShardFormer(m.shard_config()).optimize(_ep_pp_model(1))
    load_sharded(other, f"{directory}/sharded")
    loaded(other, "save_sharded / load_sharded")
    msd, _ = get_state_dict(model)
    dcp.save({"model": msd}, checkpoint_id=f"{directory}/dcp")
    other, _ = ShardFormer(m.shard_config()).optimize(_ep_pp_model(1))
    msd, _ = get_state_dict(other)
    dcp.load({"model": msd}, checkpoint_id=f"{directory}/dcp")
    set_state_dict(other, model_state_dict=msd)
    loaded(other, "get_state_dict / dcp.save / dcp.load / set_state_dict")
    return out


def eight_ranks(ctx, cases, ep_schedules) -> dict:
    """On 8 ranks: tp_sp_pp(cases), then ep_pp at TP=2 for each of `ep_schedules`."""
    return {"tp_sp_pp": tp_sp_pp(ctx, cases), "ep_tp_pp": ep_pp(ctx, 2, ep_schedules)}
