"""The skinny-linear kernel (shardformer.ops.skinny_linear) against torch's F.linear.

y = x W^T on m = 1, 2, 4, 8 rows (a decode step of that many sequences), for
the per-rank weight shapes of TP=2 decoding (SmolLM2-135M and the 302M Llama
of benchmarks/generate.py: q/k/v/o, gate/up, down, LM head), in float32,
bfloat16 and float16, at 1 and 2 threads.  Each timed call sweeps a set of
distinct weights of one shape larger than the caches (--set-mib, 96 MiB), so W
comes from memory as in a model.  Per shape and m, every variant runs on the
same x, rounds interleaved (torch f32, kernel f32, torch bf16, kernel bf16,
kernel bf16 on the AVX2 path, torch f16, kernel f16, then again), medians.
The bf16 kernel runs its default path (AVX512-BF16 where the CPU has it: the
"path" column) and, for comparison, the AVX2 path.  The machine's read
bandwidth (a torch.sum over --set-mib) is measured in the same run, at the
same thread count, as the ceiling.

Prints, per case: torch's and the kernel's weight GB/s, the ratio
torch time / kernel time (> 1: the kernel is faster), and the kernel's share
of the read bandwidth; and per (threads, m): the median over the shapes of
each ratio, and of "bf16 kernel time per weight matrix / fp32's best" (the
time of one layer's product, as a decode step pays it; < 1: bf16 faster).
Writes results/skinny_linear.json.

    .venv/bin/python benchmarks/skinny_linear.py [--rounds 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from shardformer import ops

# (label, out_features, in_features): one rank's shards at TP=2
SHAPES = [
    ("smollm2 q/o (5 of 9 heads)", 320, 576),
    ("smollm2 gate|up", 768, 576),
    ("smollm2 down", 576, 768),
    ("smollm2 lm_head (vocab/2)", 24576, 576),
    ("300m q", 512, 1024),
    ("300m gate|up", 1408, 1024),
    ("300m down", 1024, 1408),
    ("300m lm_head (vocab/2)", 16000, 1024),
]


def sweep(fn, x, ws):
    t0 = time.perf_counter()
    for w in ws:
        fn(x, w)
    return time.perf_counter() - t0


def bandwidth(nbytes: int, rounds: int) -> float:
    buf = torch.ones(nbytes // 4)
    buf.sum()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


# (dtype, op name): the variants timed per shape and m, interleaved
VARIANTS = [("float32", "torch"), ("float32", "kernel"), ("bfloat16", "torch"), ("bfloat16", "kernel"),
            ("bfloat16", "kernel-avx2"), ("float16", "torch"), ("float16", "kernel")]


def _op(name: str):
    if name == "torch":
        return F.linear
    path = "avx2" if name == "kernel-avx2" else "auto"
    return lambda x, w: ops.skinny_linear(x, w, path=path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set-mib", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="2 shapes, 8 MiB sets, 2 rounds (a smoke run)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "skinny_linear"))
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    set_bytes = (8 if args.quick else args.set_mib) << 20
    rounds = 2 if args.quick else args.rounds
    variants = [v for v in VARIANTS if v[1] != "kernel-avx2" or ops.skinny_linear_path(torch.bfloat16) != "avx2"]
    paths = {d: ops.skinny_linear_path(getattr(torch, d)) for d in ("float32", "bfloat16", "float16")}
    print(f"kernel paths: {paths}; load average {os.getloadavg()}", flush=True)
    rows, per_matrix = [], {}
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            bw = bandwidth(set_bytes, rounds * 2)
            print(f"--- {threads} thread(s): read bandwidth {bw / 1e9:.1f} GB/s", flush=True)
            for label, n, k in shapes:
                g = torch.Generator().manual_seed(n + k)
                base = torch.randn(n, k, generator=g)
                sets = {}
                for dtype in ("float32", "bfloat16", "float16"):
                    per = n * k * (4 if dtype == "float32" else 2)
                    count = max(1, set_bytes // per)
                    # distinct matrices (a rolled copy each): W from memory, not the cache
                    sets[dtype] = [base.roll(i, 0).to(getattr(torch, dtype)) for i in range(count)]
                for m in (1, 2, 4, 8):
                    x32 = torch.randn(m, k, generator=g)
                    xs = {d: x32.to(getattr(torch, d)) for d in sets}
                    times = {v: [] for v in variants}
                    for r in range(rounds + 1):            # round 0 warms up
                        for v in variants:
                            t = sweep(_op(v[1]), xs[v[0]], sets[v[0]])
                            if r:
                                times[v].append(t)
                    med = {v: statistics.median(ts) for v, ts in times.items()}
                    for v, t in med.items():
                        per_matrix[(threads, label, m) + v] = t / len(sets[v[0]])
                    for dtype in sets:
                        nbytes = n * k * (4 if dtype == "float32" else 2) * len(sets[dtype])
                        for kern in ("kernel", "kernel-avx2"):
                            if (dtype, kern) not in med:
                                continue
                            a, b = med[(dtype, "torch")], med[(dtype, kern)]
                            row = {"threads": threads, "dtype": dtype, "op": kern,
                                   "path": paths[dtype] if kern == "kernel" else "avx2", "shape": label, "n": n,
                                   "k": k, "m": m, "torch_gbps": nbytes / a / 1e9, "kernel_gbps": nbytes / b / 1e9,
                                   "speedup": a / b, "kernel_of_bandwidth": nbytes / b / bw,
                                   "bandwidth_gbps": bw / 1e9, "torch_us_per_matrix": a / len(sets[dtype]) * 1e6,
                                   "kernel_us_per_matrix": b / len(sets[dtype]) * 1e6}
                            rows.append(row)
                            print(f"{dtype:8s} {row['path']:11s} {label:28s} m={m}: torch {row['torch_gbps']:5.1f} "
                                  f"GB/s, kernel {row['kernel_gbps']:5.1f} GB/s ({row['kernel_of_bandwidth']:.0%} of "
                                  f"bandwidth), {row['speedup']:.2f}x", flush=True)
    summary, bf16_vs_f32 = {}, {}
    for threads in args.threads:
        for m in (1, 2, 4, 8):
            for dtype, kern in {(r["dtype"], r["op"]) for r in rows}:
                sel = [r["speedup"] for r in rows
                       if (r["threads"], r["dtype"], r["op"], r["m"]) == (threads, dtype, kern, m)]
                summary[f"{threads}t/{dtype}/{kern}/m{m}"] = statistics.median(sel)
            ratios = [per_matrix[(threads, label, m, "bfloat16", "kernel")] /
                      min(per_matrix[(threads, label, m, "float32", "torch")],
                          per_matrix[(threads, label, m, "float32", "kernel")]) for label, _, _ in shapes]
            bf16_vs_f32[f"{threads}t/m{m}"] = statistics.median(ratios)
    print("median torch/kernel over the shapes: " + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(summary.items())))
    print("median bf16 kernel time / best fp32 time per matrix: "
          + ", ".join(f"{k} {v:.2f}" for k, v in bf16_vs_f32.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": rows, "paths": paths, "median_speedup": summary, "bf16_over_best_f32": bf16_vs_f32,
                   "loadavg": os.getloadavg(),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
