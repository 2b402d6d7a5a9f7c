"""Pipeline parallelism on 4 CPU ranks: step time, measured bubble against
the theoretical one, and per-stage activation memory of GPipe, 1F1B,
interleaved 1F1B and the zero-bubble schedules ZB-H1 and ZB-V, same run.

A LlamaForCausalLM (default: hidden 512, 8 heads / 8 KV heads, intermediate
1376, 8 layers, vocab 8000, seq 256, fp32, micro-batch 1 row, global batch
m rows) on 4 CPU processes (one thread each), for each layout (--layouts):

    pp4       PP=4: one pipeline over the 4 ranks, TP off (2 layers a stage)
    tp2pp2    TP=2 x PP=2: TP groups {0,1},{2,3}, pipelines {0,2},{1,3}
    pp2       PP=2 on 2 ranks, TP off: on a 2-core machine the one layout whose
              ranks each have a core, so its bubble measures the schedule

each schedule (--schedules: gpipe, 1f1b, interleaved with 2 model chunks a
rank, zb-h1, zb-v with 2 chunks a rank folded in a V) and each micro-batch
count m (--m), forward_backward_step on the model's own loss after
`--warmup` untimed steps, `--iters` timed steps.

  step       the slowest rank's wall time of forward_backward_step (ranks
             start together after a barrier), median over the steps.
  x unsh     step / the unsharded step: the whole model (same seed) doing
             forward + backward of the same m-row batch in one process, one
             thread, run alone (in its own process, before the pipelines).
  bubble     measured per rank from its timeline (PipelineSchedule.timeline:
             the start and end of every F, B and W step): 1 - busy / step,
             where busy is the time inside F steps (a chunk's forward and,
             on the last virtual stage, the loss), B steps (the backward) and
             W steps (the deferred weight gradients of the zero-bubble
             schedules) -- TP collectives inside a layer count as busy; the
             rest (p2p send / recv waits, the loss broadcast, the schedule's
             bookkeeping) is bubble.  Median over steps, then median (and
             range) over the ranks.
  theory     the schedule's formula for equal stages and F = B = W:
             GPipe / 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1) with
             v=2, ZB-H1 (p-1)/(3m+p-1), ZB-V about (p-1)/(6m+p-1);
  unit-time  the bubble of the schedule's own step lists run with every F,
             B and W of a chunk taking one unit (B two without the split)
             and free messages (zero_bubble.ideal_bubble), the largest stage.
             Both assume equal stages: here the last virtual stage also runs
             the norm, the LM head (hidden x vocab) and the loss, the first
             one the embedding, so stages are unequal (under ZB-V both sit on
             stage 0).
  act        activation memory of the step: the largest heap in use (glibc
             mallinfo2, sequence_parallel._heap_in_use) sampled after every
             decoder layer's forward (forward hooks), at the end of every F
             step and before every B step, minus the heap at the start of the
             step (parameter gradients are kept allocated between steps,
             zero_grad(set_to_none=False), so they are not counted); medians
             over the steps, for stage 0 and the last stage (the largest of
             its TP ranks).  GPipe keeps m micro-batches in flight on every
             stage, 1F1B at most p-s on stage s, so with m = p stage 0 holds
             as many under both; interleaved keeps more on stage 0.
  loss diff  |pipelined loss - unsharded loss| of the same batch.

CAVEAT: pp4 and tp2pp2 run 4 ranks (1 thread each) on os.cpu_count() cores;
on a 2-core machine they oversubscribe the cores 2x, so a rank's F/B wall
time includes time it is descheduled while other ranks compute, and the
measured bubble mixes the schedule's with the machine's.  pp2 (2 ranks) is
the layout whose bubble measures the schedule there.  Per-rank CPU time
inside F/B (thread_time) and of the whole step (process_time) are in the
JSON next to the wall figures.  Nothing else should be running (the load
averages at the start and end are recorded).  Memory and losses do not
depend on the load; step times do (re-run to see their spread).

    .venv/bin/python benchmarks/pipeline.py            # the default run (~10 min on 2 cores)
    .venv/bin/python benchmarks/pipeline.py --quick    # a smaller model, m=4 only
    .venv/bin/python benchmarks/pipeline.py --schedules 1f1b zb-h1 zb-v --layouts pp2 pp4 \
        --json benchmarks/results/pipeline_zb.json        # the zero-bubble schedules against 1F1B
Results: benchmarks/results/pipeline_4ranks.json (--json) and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from sequence_parallel import _heap_in_use  # noqa: E402

LAYOUTS = {"pp4": (4, 1), "tp2pp2": (2, 2), "pp2": (2, 1)}   # name -> (pp, tp); ranks = pp * tp
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
# schedule -> (chunks a rank, PipelineStageManager layout): one set of rank processes per pair
MANAGER = {"gpipe": (1, "loop"), "1f1b": (1, "loop"), "interleaved": (2, "loop"), "zb-h1": (1, "loop"),
           "zb-v": (2, "v")}
CHUNKS = {name: chunks for name, (chunks, _) in MANAGER.items()}


def _llama_config(args):
    import transformers

    return transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                    num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                                    max_position_embeddings=args.seq, attn_implementation="sdpa")


def _batch(args, m: int):
    import torch

    return torch.randint(0, args.vocab, (m * args.mbs, args.seq), generator=torch.Generator().manual_seed(m))


def _groups(pp: int, tp: int):
    """(tp_group, pp_group) of this rank; TP innermost (rank = stage * tp + t).
    Every rank creates every group, in the same order (new_group is collective)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tp_group = pp_group = None
    for s in range(pp):
        ranks = [s * tp + t for t in range(tp)]
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    if pp == dist.get_world_size():
        return tp_group, None                         # the pipeline is the world
    for t in range(tp):
        ranks = [s * tp + t for s in range(pp)]
        g = dist.new_group(ranks)
        if rank in ranks:
            pp_group = g
    return tp_group, pp_group


def unsharded_main(rank: int, args, ms) -> dict:
    """The baseline: the whole model, forward + backward of the full m-row batch, one process."""
    import gc

    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(args))
    model.train()
    out = {}
    for m in ms:
        ids = _batch(args, m)
        times, acts, loss = [], [], None
        for k in range(args.warmup + args.iters):
            model.zero_grad(set_to_none=False)
            gc.collect()
            t0 = time.perf_counter()
            before = _heap_in_use()
            l = model(input_ids=ids, labels=ids).loss
            acts.append(_heap_in_use() - before)
            l.backward()
            loss = l.item()
            if k >= args.warmup:
                times.append(time.perf_counter() - t0)
        out[m] = {"seconds": statistics.median(times), "activations": statistics.median(acts[args.warmup:]),
                  "loss": loss}
    return out


def rank_main(rank: int, args, layout: str, manager: tuple, runs) -> list:
    """One layout and (chunks, chunk layout) in fresh processes: every (schedule, m) of `runs` on one model."""
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    from shardformer import ShardConfig, ShardFormer
    from shardformer.pipeline import (GPipeSchedule, InterleavedSchedule, OneForwardOneBackwardSchedule,
                                      PipelineStageManager, ZeroBubbleSchedule, ZeroBubbleVSchedule, runtime_of,
                                      weight_grads)

    pp, tp = LAYOUTS[layout]
    tp_group, pp_group = _groups(pp, tp)
    chunks, chain = manager
    sm = PipelineStageManager(pp_group, num_model_chunks=chunks, layout=chain)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(args))
    model.train()
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                      enable_tensor_parallelism=tp > 1)
    model, _ = ShardFormer(shard_config=cfg).optimize(model)

    # -- instrumentation, from outside the library ----------------------------------------
    probe = {"on": False, "busy": 0.0, "busy_cpu": 0.0, "peak": 0}

    def sample():
        if probe["on"]:
            probe["peak"] = max(probe["peak"], _heap_in_use())

    def timed(fn, before_hook=None):
        def wrapped(*a, **kw):
            if before_hook:
                before_hook()
            c0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                if probe["on"]:
                    probe["busy_cpu"] += time.thread_time() - c0
                sample()                              # F: its output (and what it saved) is alive here
        return wrapped

    rt = runtime_of(model)
    rt.run = timed(rt.run)                            # F steps (instance attribute; the class is untouched)
    torch.autograd.backward = timed(torch.autograd.backward, before_hook=sample)   # B steps, this process only
    weight_grads.apply = timed(weight_grads.apply)                                 # W steps
    for mod in model.modules():
        if type(mod).__name__ == "LlamaDecoderLayer":
            mod.register_forward_hook(lambda *_: sample())

    classes = {"gpipe": GPipeSchedule, "1f1b": OneForwardOneBackwardSchedule, "interleaved": InterleavedSchedule,
               "zb-h1": ZeroBubbleSchedule, "zb-v": ZeroBubbleVSchedule}
    results = []
    for name, m in runs:
        sched = classes[name](sm, num_microbatches=m)
        timelines = []
        ids = _batch(args, m)
        batch = {"input_ids": ids, "labels": ids}
        steps = []
        for k in range(args.warmup + args.iters):
            model.zero_grad(set_to_none=False)        # gradients stay allocated: not counted as activations
            gc.collect()
            dist.barrier()
            before = _heap_in_use()
            probe.update(on=True, busy=0.0, busy_cpu=0.0, peak=before)
            sched.timeline = []
            t0, c0 = time.perf_counter(), time.process_time()
            out = sched.forward_backward_step(model, batch)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            probe["on"] = False
            probe["busy"] = sum(end - start for _, _, _, start, end in sched.timeline)
            if k >= args.warmup:
                timelines.append([(kind, c, i, round(start - t0, 6), round(end - t0, 6))
                                  for kind, c, i, start, end in sched.timeline])
            sched.timeline = None
            if k >= args.warmup:
                steps.append({"wall": wall, "cpu": cpu, "busy": probe["busy"], "busy_cpu": probe["busy_cpu"],
                              "act": probe["peak"] - before, "loss": float(out["loss"])})
        slowest = torch.tensor([s["wall"] for s in steps], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        med = (lambda key: statistics.median(s[key] for s in steps))
        results.append({"schedule": name, "m": m, "rank": rank, "stage": sm.stage, "pp": pp, "tp": tp,
                        "chunks": chunks, "step_slowest": statistics.median(slowest.tolist()),
                        "wall": med("wall"), "cpu": med("cpu"), "busy": med("busy"), "busy_cpu": med("busy_cpu"),
                        "bubble": statistics.median(1 - s["busy"] / s["wall"] for s in steps),
                        "act": med("act"), "loss": steps[-1]["loss"], "timeline": timelines[-1]})
    return results


def theory(name: str, p: int, m: int) -> float:
    """The schedule's formula (docstring, "theory")."""
    work = {"zb-h1": 3 * m, "zb-v": 6 * m, "interleaved": 2 * m}.get(name, m)
    return (p - 1) / (work + p - 1)


def unit_time(name: str, p: int, m: int) -> float:
    """The largest stage's bubble of the schedule's step lists in unit time (docstring, "unit-time")."""
    from shardformer.pipeline import schedule as S
    from shardformer.pipeline import zero_bubble as Z

    steps = {"gpipe": S._gpipe_steps, "1f1b": S._one_f_one_b_steps, "interleaved": S._interleaved_steps,
             "zb-h1": Z._zb_h1_steps, "zb-v": Z._zb_v_steps}[name]
    chunks, chain = MANAGER[name]
    return max(Z.ideal_bubble(steps, p, chunks, m, chain, split=name.startswith("zb")))


QUICK = dict(hidden=256, heads=4, kv_heads=4, intermediate=688, layers=8, vocab=2000, seq=128, m=[4], iters=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batch counts")
    p.add_argument("--mbs", type=int, default=1, help="rows per micro-batch (global batch: m * mbs)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=f"a smaller preset: {QUICK}")
    p.add_argument("--json", default=None,
                   help="output path (default benchmarks/results/pipeline_4ranks[_quick].json)")
    args = p.parse_args(argv)
    if args.quick:                       # the preset, except for the options given on the command line
        given = {a[2:].split("=")[0].replace("-", "_") for a in (sys.argv[1:] if argv is None else argv)
                 if a.startswith("--")}
        for k, val in QUICK.items():
            if k not in given:
                setattr(args, k, val)
    if args.json is None:
        args.json = os.path.join(ROOT, "benchmarks", "results",
                                 "pipeline_4ranks_quick.json" if args.quick else "pipeline_4ranks.json")
    for layout in args.layouts:
        pp = LAYOUTS[layout][0]
        bad = [m for m in args.m if "interleaved" in args.schedules and m % pp]
        if bad:
            p.error(f"interleaved needs m to be a multiple of PP={pp} ({layout}); got m={bad}")
        if "zb-v" in args.schedules and min(args.m) < pp:
            p.error(f"zb-v needs m >= PP={pp} ({layout}); got m={min(args.m)}")

    import torch
    import transformers

    from shardformer.launch import spawn

    load0 = os.getloadavg()
    t_start = time.perf_counter()
    base = spawn(unsharded_main, 1, (args, args.m), threads_per_rank=1)[0]
    rows = []
    for layout in args.layouts:
        for manager in sorted({MANAGER[s] for s in args.schedules}):
            runs = [(s, m) for s in args.schedules if MANAGER[s] == manager for m in args.m]
            pp, tp = LAYOUTS[layout]
            per_rank = spawn(rank_main, pp * tp, (args, layout, manager, runs), threads_per_rank=1)
            for j, (name, m) in enumerate(runs):
                ranks = [per_rank[r][j] for r in range(pp * tp)]
                v = CHUNKS[name]
                first = [r for r in ranks if r["stage"] == 0]
                last = [r for r in ranks if r["stage"] == pp - 1]
                bubbles = [r["bubble"] for r in ranks]
                step = ranks[0]["step_slowest"]
                rows.append({
                    "layout": layout, "schedule": name, "pp": pp, "tp": tp, "chunks": v, "m": m,
                    "step_s": step, "unsharded_s": base[m]["seconds"], "x_unsharded": step / base[m]["seconds"],
                    "bubble_median": statistics.median(bubbles), "bubble_min": min(bubbles),
                    "bubble_max": max(bubbles), "bubble_theory": theory(name, pp, m),
                    "bubble_unit_time": unit_time(name, pp, m),
                    "act_stage0": max(r["act"] for r in first), "act_last": max(r["act"] for r in last),
                    "act_unsharded": base[m]["activations"],
                    "loss": ranks[0]["loss"], "loss_unsharded": base[m]["loss"],
                    "loss_diff": abs(ranks[0]["loss"] - base[m]["loss"]),
                    "ranks": [{k: r[k] for k in ("rank", "stage", "wall", "cpu", "busy", "busy_cpu", "bubble",
                                                 "act", "loss", "timeline")} for r in ranks]})
    elapsed = time.perf_counter() - t_start

    print(f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"intermediate {args.intermediate}, vocab {args.vocab}, seq {args.seq}, fp32, micro-batch {args.mbs} row(s); "
          f"pp*tp CPU ranks x 1 thread on {os.cpu_count()} cores; medians of {args.iters} steps")
    print(f"{'layout':>7} {'schedule':>11} {'p':>2} {'tp':>2} {'m':>3} {'step ms':>8} {'unsh ms':>8} {'x unsh':>6} "
          f"{'bubble (min-max)':>18} {'theory':>6} {'unit':>6} {'act s0 MiB':>10} {'act last':>8} {'loss diff':>9}")
    for r in rows:
        print(f"{r['layout']:>7} {r['schedule']:>11} {r['pp']:>2} {r['tp']:>2} {r['m']:>3} {r['step_s'] * 1e3:>8.0f} "
              f"{r['unsharded_s'] * 1e3:>8.0f} {r['x_unsharded']:>6.2f} "
              f"{r['bubble_median']:>6.3f} ({r['bubble_min']:.2f}-{r['bubble_max']:.2f}) {r['bubble_theory']:>6.3f} "
              f"{r['bubble_unit_time']:>6.3f} "
              f"{r['act_stage0'] / 2**20:>10.1f} {r['act_last'] / 2**20:>8.1f} {r['loss_diff']:>9.1e}")
    print("unsharded activations (full batch, after the forward): "
          + ", ".join(f"m={m}: {base[m]['activations'] / 2**20:.0f} MiB" for m in args.m))
    print(f"wall time {elapsed:.0f} s; load average at start {load0[0]:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    machine = {"cpu_count": os.cpu_count(), "ranks": {k: pp * tp for k, (pp, tp) in LAYOUTS.items()},
               "threads_per_rank": 1,
               "oversubscribed": {k: pp * tp > (os.cpu_count() or 1) for k, (pp, tp) in LAYOUTS.items()}, "platform": platform.platform(),
               "processor": _cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__, "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    command = " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable,
                        os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    with open(args.json, "w") as f:
        json.dump({"command": command, "args": vars(args), "machine": machine, "wall_s": elapsed,
                   "unsharded": {str(m): b for m, b in base.items()}, "rows": rows}, f, indent=1)
    print(f"written {args.json}")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
