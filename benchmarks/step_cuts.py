"""The TP=2 training step before and after issue 34's cuts, against its matmul floor and DTensor.

The cuts (each switched back to the code before it by `before_cuts()`, in the
same processes, on the same models):

* the vocabulary-parallel cross-entropy's per-row statistics in ONE all-gather
  (before: an all-reduce max, then an all-reduce of the rescaled sums);
* the vocabulary-parallel embedding's weight gradient written by the C kernel
  into a recycled buffer (before: a fresh float32 torch.zeros [V/p, h] each
  step, summed into, cast to the weight's dtype);
* the cross-entropy's logits gradient in a recycled buffer (before: a fresh
  torch.empty_like of the logits each step).

Each of the two ranks (one thread each, the shm backend) builds the Llama of
benchmarks/tp_step.py (default: the issue size, hidden 1024, 2 layers, vocab
32000, seq 512, batch 2, fp32) three times: shardformer's default config
(gathered logits, the loss on the vocabulary shards), shardformer with
enable_all_optimization + parallel_output ("fused-po"), and DTensor
(tp_step's plan, vocabulary sharded).  Every iteration runs, interleaved:
default after / before the cuts, fused-po after / before, DTensor, and the
floor replay of each shardformer model's own matmuls (step_floor.FloorReplay).
A step's time is the slower rank's; medians over the iterations.  Ledgers
(step_floor.ledger_of) of one profiled fused-po step before and after.

    .venv/bin/python benchmarks/step_cuts.py [--iters 7] [--layers 2] [--out ...]
    .venv/bin/python benchmarks/step_cuts.py --pieces 15   # the cut pieces alone, one process

Results: benchmarks/results/tp_step_cuts.json, with the load average.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import step_floor  # noqa: E402
import tp_step  # noqa: E402

VARIANTS = ("default", "default-before", "fused-po", "fused-po-before", "dtensor",
            "floor-default", "floor-fused-po")


@contextlib.contextmanager
def before_cuts():
    """The code before the cuts, patched in for the duration (the math main had)."""
    import torch

    from shardformer import _C, ops, recycled
    from shardformer.distributed import collectives as C
    from shardformer.layer import loss

    def gather_two_all_reduces(mx, se, tg, sz, group):
        m = mx.clone()
        C.all_reduce(m, group, op="max")
        stacked = torch.stack([se * torch.exp(mx - m), tg] + ([sz] if sz is not None else []))
        C.all_reduce(stacked, group)
        return m, stacked

    def combine_reduced(pair):
        m, stacked = pair
        return m + stacked[0].log(), stacked[1], stacked[2] if stacked.shape[0] > 2 else None

    def embedding_bwd_zeros(dout, i, vocab_start, vocab_real, padding_local, shape, dtype):
        dout = ops._data(dout, "embedding grad").to(dtype).contiguous()
        dw = torch.zeros(shape, dtype=torch.float32)
        _C.embedding_backward(dout, i, vocab_start, vocab_real, -1 if padding_local is None else padding_local, dw)
        return dw.to(dtype)

    def fresh_empty(shape, dtype, device=None):
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    saved = (loss.gather_stats, loss.combine_stats, ops.embedding_bwd, recycled.empty)
    loss.gather_stats, loss.combine_stats = gather_two_all_reduces, combine_reduced
    ops.embedding_bwd, recycled.empty = embedding_bwd_zeros, fresh_empty
    try:
        yield
    finally:
        loss.gather_stats, loss.combine_stats, ops.embedding_bwd, recycled.empty = saved


def worker(rank: int, sizes: dict, iters: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    import shardformer

    torch.set_num_threads(1)
    full = tp_step.build_model(sizes)
    models = {
        "default": tp_step.shard_with_shardformer(copy.deepcopy(full), dist.group.WORLD, {}),
        "fused-po": tp_step.shard_with_shardformer(copy.deepcopy(full), dist.group.WORLD,
                                                   {"enable_all_optimization": True, "parallel_output": True}),
        "dtensor": tp_step.shard_with_dtensor(full, sizes["layers"], shard_vocab=True),
    }
    ids = tp_step.make_inputs(sizes)

    def step_of(name):
        model = models[name]

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
        return step

    steps = {"default": step_of("default"), "fused-po": step_of("fused-po"), "dtensor": step_of("dtensor")}
    for _ in range(warmup):
        for name, fn in steps.items():
            fn()
            if name != "dtensor":
                with before_cuts():
                    fn()
    # one profiled step per shardformer model: its floor replay; and fused-po's ledger before / after
    profiles = {}
    for name in ("default", "fused-po"):
        dist.barrier()
        profiles[name] = step_floor.profile_step(steps[name], shardformer.comm_stats)
        if name == "fused-po":
            dist.barrier()
            with before_cuts():
                profiles["fused-po-before"] = step_floor.profile_step(steps[name], shardformer.comm_stats)
    floors = {name: step_floor.FloorReplay(profiles[name].pop("matmuls")) for name in ("default", "fused-po")}
    profiles["fused-po-before"].pop("matmuls")
    for f in floors.values():
        f.run()
    times = {v: [] for v in VARIANTS}
    with shardformer.comm_stats() as comm_after:
        dist.barrier()
        steps["fused-po"]()
    with before_cuts(), shardformer.comm_stats() as comm_before:
        dist.barrier()
        steps["fused-po"]()
    for _ in range(iters):
        for v in VARIANTS:
            dist.barrier()
            t0 = time.perf_counter()
            if v.startswith("floor-"):
                floors[v[len("floor-"):]].run()
            elif v.endswith("-before"):
                with before_cuts():
                    steps[v[:-len("-before")]]()
            else:
                steps[v]()
            times[v].append(time.perf_counter() - t0)
    dist.barrier()
    return {"times_s": times,
            "ledgers_ms": {k: {c: p["ledger_s"][c] * 1e3 for c in step_floor.CATEGORIES}
                           for k, p in profiles.items()},
            "profiled_ms": {k: p["wall_s"] * 1e3 for k, p in profiles.items()},
            "comm_fused_po": {"after": comm_after.summary(), "before": comm_before.summary()}}


def pieces(sizes: dict, reps: int) -> dict:
    """The cut pieces alone in this process (one thread), before / after interleaved, medians in ms:
    the embedding's backward (a [V/p, h] table, batch * seq ids) and the cross-entropy's forward +
    backward on a [batch * seq, V/p] logit shard (one rank: no collective)."""
    import torch

    from shardformer import ops
    from shardformer.layer import cross_entropy_1d

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    v, h, n = sizes["vocab"] // 2, sizes["hidden"], sizes["batch"] * sizes["seq"]
    w = torch.randn(v, h, generator=g).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    dout = torch.randn(n, h, generator=g)
    z = torch.randn(n, v, generator=g).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)

    def embedding():
        w.grad = None
        ops.vocab_embedding(ids, w, 0, v).backward(dout)

    def xent():
        z.grad = None
        cross_entropy_1d(z, labels, vocab_size=v).backward()

    out = {}
    for name, fn in (("embedding backward", embedding), ("cross-entropy fwd+bwd", xent)):
        fn()
        with before_cuts():
            fn()
        t = {"after": [], "before": []}
        for _ in range(reps):
            for which in ("before", "after"):
                ctx = before_cuts() if which == "before" else contextlib.nullcontext()
                with ctx:
                    t0 = time.perf_counter()
                    fn()
                    t[which].append((time.perf_counter() - t0) * 1e3)
        out[name] = {k: statistics.median(x) for k, x in t.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--pieces", type=int, default=0, metavar="REPS",
                   help="only time the cut pieces alone in this process, REPS interleaved pairs")
    p.add_argument("--out", default=os.path.join(HERE, "results", "tp_step_cuts.json"))
    args = p.parse_args(argv)
    sizes = dict(tp_step.FULL, layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq,
                 seed=0, heads=8, kv_heads=8, intermediate=max(64, int(round(args.hidden * 2.75 / 64)) * 64))
    if args.pieces:
        load0 = os.getloadavg()
        res = pieces(sizes, args.pieces)
        print(f"pieces, {args.pieces} interleaved pairs, medians (load average {load0} -> {os.getloadavg()}):")
        for k, r in res.items():
            print(f"  {k:24s} before {r['before']:7.1f} ms   after {r['after']:7.1f} ms   "
                  f"after/before {r['after'] / r['before']:.2f}")
        path = args.out.replace(".json", "_pieces.json")
        with open(path, "w") as f:
            json.dump({"sizes": sizes, "reps": args.pieces, "load_average": [load0, os.getloadavg()],
                       "median_ms": res}, f, indent=1)
        print("wrote", path)
        return 0
    load0 = os.getloadavg()
    t0 = time.time()
    per_rank = tp_step.launch(worker, 2, (sizes, args.iters, args.warmup), 3600)
    load1 = os.getloadavg()
    step = {v: [max(r["times_s"][v][i] for r in per_rank) * 1e3 for i in range(args.iters)] for v in VARIANTS}
    med = {v: statistics.median(ts) for v, ts in step.items()}
    ratios = {
        "fused-po / its floor, after": med["fused-po"] / med["floor-fused-po"],
        "fused-po / its floor, before": med["fused-po-before"] / med["floor-fused-po"],
        "default / DTensor, after": med["default"] / med["dtensor"],
        "default / DTensor, before": med["default-before"] / med["dtensor"],
        "default / its floor, after": med["default"] / med["floor-default"],
        "default / its floor, before": med["default-before"] / med["floor-default"],
        "fused-po after / before": med["fused-po"] / med["fused-po-before"],
        "default after / before": med["default"] / med["default-before"],
    }
    goals = {"fused-po <= 1.05x its floor": ratios["fused-po / its floor, after"] <= 1.05,
             "default <= 0.7x DTensor": ratios["default / DTensor, after"] <= 0.7}
    print(f"sizes {sizes}\nload average at start {load0}, at end {load1}, {time.time() - t0:.0f} s")
    for v in VARIANTS:
        print(f"  {v:18s} median {med[v]:8.1f} ms   steps {[round(x) for x in step[v]]}")
    for k, r in ratios.items():
        print(f"  {k:32s} {r:.3f}")
    for k, ok in goals.items():
        print(f"  goal {k}: {'met' if ok else 'NOT met'} in this run")
    r0 = per_rank[0]
    for k in ("fused-po-before", "fused-po"):
        print(f"ledger rank 0, {k}: " + step_floor.format_ledger({c: ms / 1e3 for c, ms in r0['ledgers_ms'][k].items()},
                                                                 r0["profiled_ms"][k] / 1e3))
    print("fused-po collectives per step, rank 0:",
          {w: {k: (v["calls"], v["bytes"]) for k, v in r0["comm_fused_po"][w].items() if v["calls"]}
           for w in ("before", "after")})
    out = {"sizes": sizes, "tp_size": 2, "load_average_start": load0, "load_average_end": load1,
           "step_ms": step, "median_ms": med, "ratios": ratios, "goals_met": goals,
           "per_rank": [{k: r[k] for k in ("ledgers_ms", "profiled_ms", "comm_fused_po")} for r in per_rank],
           "versions": tp_step._versions()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
