"""torch.compile vs eager: one training step of a TP=2 sharded Llama on CPU.

Two ranks (shardformer.launch.spawn, one thread each, gloo process group;
collectives on the backend shardformer picks: shm), each building the same
fixed-seed transformers LlamaForCausalLM (default: hidden 256, 4 heads / 2 KV
heads, intermediate 688, 4 layers, vocab 4096, seq 128, batch 2, float32),
sharded with the plain ShardConfig() (TP over the world) -- or with
enable_all_optimization (--fused: the C kernels, as custom ops under compile).

One step = forward + backward of model(input_ids, labels=input_ids).loss,
gradients set to None between steps, no optimizer.  Two copies of the model
from the same seed, in the same processes: "eager", and "compiled" =
torch.compile(model) with --backend (inductor by default).  The first step of
each (the compile) is timed on its own, then `--warmup` untimed steps each,
then `--iters` timed steps of each, the two modes alternating step by step (so
that other processes' load falls on both alike); a step's time is the slower
rank's (ranks start each step together after a barrier).  The step-0 losses
must agree (relative 1e-4).  The printed ratio is
median(compiled) / median(eager); the goal is <= 1.0.

Run (from the repository root, in the venv of scripts/setup_env.sh):

    .venv/bin/python benchmarks/compile_step.py             # a few minutes on 2 cores
    .venv/bin/python benchmarks/compile_step.py --quick     # tiny model, aot_eager, for a smoke run

CPU timings on a shared machine are noisy: the script prints the 1-minute load
average before and after the timed steps next to the medians.
Results go to benchmarks/results/compile_step.json (--out to change).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "compile_step.json")
LOSS_RTOL = 1e-4
GOAL_RATIO = 1.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--fused", action="store_true", help="ShardConfig(enable_all_optimization=True)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, aot_eager, 3 steps: a smoke run")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.kv_heads, args.intermediate = 64, 4, 2, 96
        args.layers, args.vocab, args.seq, args.batch = 2, 101, 16, 2
        args.iters, args.warmup, args.backend = 3, 1, "aot_eager"
    return args


def worker(rank: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    from shardformer import ShardConfig, ShardFormer

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, vocab_size=args.vocab,
                                   max_position_embeddings=max(args.seq, 64), tie_word_embeddings=False)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    runs, models = {}, {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).train()
        model, _ = ShardFormer(shard_config=ShardConfig(enable_all_optimization=args.fused)).optimize(model)
        models[mode] = model
        runs[mode] = torch.compile(model, backend=args.backend) if mode == "compiled" else model

    def step(mode):
        loss = runs[mode](input_ids=ids, labels=ids).loss
        loss.backward()
        for p in models[mode].parameters():
            p.grad = None
        return loss.item()

    result = {mode: {"times_s": []} for mode in runs}
    for mode in runs:
        dist.barrier()
        t0 = time.perf_counter()
        result[mode]["loss0"] = step(mode)
        result[mode]["first_step_s"] = time.perf_counter() - t0
        for _ in range(args.warmup):
            step(mode)
    # the two modes alternate step by step, so that other processes' load
    # (which comes and goes) falls on both alike
    load = [os.getloadavg()[0]]
    for _ in range(args.iters):
        for mode in runs:
            dist.barrier()
            t0 = time.perf_counter()
            step(mode)
            result[mode]["times_s"].append(time.perf_counter() - t0)
    load.append(os.getloadavg()[0])
    result["load_1min"] = load
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    from shardformer.launch import spawn

    per_rank = spawn(worker, 2, args=(args,), timeout_s=3600)
    summary = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "modes": {}}
    for mode in ("eager", "compiled"):
        steps = [max(r[mode]["times_s"][i] for r in per_rank) for i in range(args.iters)]
        summary["modes"][mode] = {
            "median_ms": 1e3 * statistics.median(steps), "min_ms": 1e3 * min(steps), "max_ms": 1e3 * max(steps),
            "first_step_s": max(r[mode]["first_step_s"] for r in per_rank),
            "loss0": per_rank[0][mode]["loss0"],
        }
    summary["load_1min"] = per_rank[0]["load_1min"]  # before and after the timed steps
    eager, comp = summary["modes"]["eager"], summary["modes"]["compiled"]
    ratio = comp["median_ms"] / eager["median_ms"]
    loss_ok = abs(comp["loss0"] - eager["loss0"]) <= LOSS_RTOL * abs(eager["loss0"])
    summary.update(ratio=ratio, goal=GOAL_RATIO, loss_agrees=loss_ok)
    print(f"TP=2 Llama step, backend={args.backend}{', all optimizations' if args.fused else ''}, "
          f"{args.iters} timed steps of each, alternating ({os.cpu_count()} cores, 1-minute load average "
          f"{summary['load_1min'][0]:.1f} before, {summary['load_1min'][1]:.1f} after)")
    for mode, s in summary["modes"].items():
        print(f"  {mode:9s} median {s['median_ms']:8.1f} ms  min {s['min_ms']:8.1f}  max {s['max_ms']:8.1f}  "
              f"first step {s['first_step_s']:6.1f} s  loss {s['loss0']:.6f}")
    print(f"  compiled / eager: {ratio:.2f}x (goal <= {GOAL_RATIO:.1f}x); step-0 losses "
          f"{'agree' if loss_ok else 'DIFFER'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if loss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
