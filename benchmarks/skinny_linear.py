"""The skinny-linear kernel (shardformer.ops.skinny_linear) against torch's F.linear.

y = x W^T on m = 1, 2, 4, 8 rows (a decode step of that many sequences), for
the per-rank weight shapes of TP=2 decoding (SmolLM2-135M and the 302M Llama
of benchmarks/generate.py: q/k/v/o, gate/up, down, LM head), float32 and
bfloat16, at 1 and 2 threads.  Each timed call sweeps a set of distinct
weights of one shape larger than the caches (--set-mib, 96 MiB), so W comes
from memory as in a model; both ops run on the same x and weights, rounds
interleaved (A, B, A, B ...), medians.  The machine's read bandwidth (a
torch.sum over --set-mib) is measured in the same run, at the same thread
count, as the ceiling.

Prints, per case: torch's and the kernel's weight GB/s, the ratio
torch time / kernel time (> 1: the kernel is faster), and the kernel's share
of the read bandwidth; writes results/skinny_linear.json.

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set-mib", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="2 shapes, 8 MiB sets, 2 rounds (a smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "skinny_linear"))
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    set_bytes = (8 if args.quick else args.set_mib) << 20
    rounds = 2 if args.quick else args.rounds
    rows = []
    with torch.no_grad():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            bw = bandwidth(set_bytes, rounds * 2)
            print(f"--- {threads} thread(s): read bandwidth {bw / 1e9:.1f} GB/s", flush=True)
            for dtype in (torch.float32, torch.bfloat16):
                for label, n, k in shapes:
                    per = n * k * (4 if dtype == torch.float32 else 2)
                    g = torch.Generator().manual_seed(n + k)
                    ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(max(1, set_bytes // per))]
                    nbytes = per * len(ws)
                    for m in (1, 2, 4, 8):
                        x = torch.randn(m, k, generator=g).to(dtype)
                        sweep(F.linear, x, ws)
                        sweep(ops.skinny_linear, x, ws)
                        t_torch, t_ours = [], []
                        for _ in range(rounds):
                            t_torch.append(sweep(F.linear, x, ws))
                            t_ours.append(sweep(ops.skinny_linear, x, ws))
                        a, b = statistics.median(t_torch), statistics.median(t_ours)
                        row = {"threads": threads, "dtype": str(dtype).split(".")[1], "shape": label, "n": n,
                               "k": k, "m": m, "torch_gbps": nbytes / a / 1e9, "kernel_gbps": nbytes / b / 1e9,
                               "speedup": a / b, "kernel_of_bandwidth": nbytes / b / bw, "bandwidth_gbps": bw / 1e9}
                        rows.append(row)
                        print(f"{row['dtype']:8s} {label:28s} m={m}: torch {row['torch_gbps']:5.1f} GB/s, "
                              f"kernel {row['kernel_gbps']:5.1f} GB/s ({row['kernel_of_bandwidth']:.0%} of "
                              f"bandwidth), {row['speedup']:.2f}x", flush=True)
    summary = {}
    for threads in (1, 2):
        for dtype in ("float32", "bfloat16"):
            for m in (1, 2, 4, 8):
                sel = [r["speedup"] for r in rows if (r["threads"], r["dtype"], r["m"]) == (threads, dtype, m)]
                summary[f"{threads}t/{dtype}/m{m}"] = statistics.median(sel)
    print("median speedup over the shapes: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": rows, "median_speedup": summary, "loadavg": os.getloadavg(),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
