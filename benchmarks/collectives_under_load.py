"""All-reduce latency of the shm backend against gloo while other processes load the cores.

The shm backend waits for its peers in user space: it spins briefly, then
yields the core, then sleeps in growing steps (csrc/comm/shm_wait.c, wait_step);
gloo blocks in the kernel on a socket.  A wait that spins can steal the core
a peer needs once the machine is oversubscribed, so this measures both under
N busy-loop processes (`--load 0 1 2`; this machine has 2 cores, and the
2 ranks already use both).

For each load and message size: 2 ranks (1 thread each, started by
shardformer.launch.spawn), `--warmup` untimed all-reduces, then `--iters`
timed ones, each timed alone on rank 0 with perf_counter.  The backends
alternate over `--rounds` rounds (shm, gloo, shm, gloo, ...) so slow drifts
of the machine hit both.  Reported: median and 90th percentile per round,
then the median over rounds; ratio = gloo / shm (above 1: shm is faster).

    .venv/bin/python benchmarks/collectives_under_load.py                 # load 0 1 2
    .venv/bin/python benchmarks/collectives_under_load.py --quick         # a smoke run

Results: benchmarks/results/collectives_under_load.json (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BACKENDS = {"shm": "shm", "gloo": "torch"}     # label -> SHARDFORMER_COMM


def rank_main(rank: int, sizes: list, warmup: int, iters: int) -> dict:
    import torch

    from shardformer.distributed import all_reduce, backend_for

    out = {}
    for size in sizes:
        t = torch.ones(size // 4)
        backend = backend_for(t, None)
        for _ in range(warmup):
            all_reduce(t, None)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            all_reduce(t, None)
            times.append(time.perf_counter() - t0)
        times.sort()
        out[size] = {"backend": backend, "median_us": statistics.median(times) * 1e6,
                     "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6}
    return out


def busy_loops(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(load: int, sizes: list, args) -> dict:
    from shardformer.launch import spawn

    import collectives_under_load as me

    rounds = {label: [] for label in BACKENDS}
    busy = busy_loops(load)
    try:
        time.sleep(0.5)
        for _ in range(args.rounds):
            for label, comm in BACKENDS.items():
                saved = os.environ.get("SHARDFORMER_COMM")
                os.environ["SHARDFORMER_COMM"] = comm
                try:
                    rounds[label].append(spawn(me.rank_main, 2, (sizes, args.warmup, args.iters))[0])
                finally:
                    if saved is None:
                        os.environ.pop("SHARDFORMER_COMM", None)
                    else:
                        os.environ["SHARDFORMER_COMM"] = saved
    finally:
        for p in busy:
            p.kill()
            p.wait()
    result = {}
    for size in sizes:
        row = {}
        for label in BACKENDS:
            per = [r[size] for r in rounds[label]]
            row[label] = {"backend": per[0]["backend"],
                          "median_us": statistics.median(p["median_us"] for p in per),
                          "p90_us": statistics.median(p["p90_us"] for p in per)}
        row["ratio_median_gloo_over_shm"] = row["gloo"]["median_us"] / row["shm"]["median_us"]
        row["ratio_p90_gloo_over_shm"] = row["gloo"]["p90_us"] / row["shm"]["p90_us"]
        result[size] = row
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", type=int, nargs="+", default=[0, 1, 2], help="busy-loop processes per measurement")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20], help="message bytes")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "collectives_under_load.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.load, args.sizes, args.iters, args.warmup, args.rounds = [1], [4096], 20, 5, 1
    with open("/proc/loadavg") as f:
        before = f.read().split()[:3]
    results = {}
    print(f"{'load':>4} {'bytes':>8} {'shm med':>9} {'shm p90':>9} {'gloo med':>9} {'gloo p90':>9} "
          f"{'gloo/shm med':>12} {'p90':>6}", flush=True)
    for load in args.load:
        results[load] = measure(load, args.sizes, args)
        for size, row in results[load].items():
            print(f"{load:>4} {size:>8} {row['shm']['median_us']:>9.1f} {row['shm']['p90_us']:>9.1f} "
                  f"{row['gloo']['median_us']:>9.1f} {row['gloo']['p90_us']:>9.1f} "
                  f"{row['ratio_median_gloo_over_shm']:>12.2f} {row['ratio_p90_gloo_over_shm']:>6.2f}", flush=True)
    out = {"results": results, "loadavg_before": before, "cpu_count": os.cpu_count(),
           "args": {k: v for k, v in vars(args).items() if k != "out"},
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
