"""Per-call cost of the kernels' thread driver, the case the worker pool is for.

Small row-parallel calls (ops.layer_norm forward on [rows x 256], just above
the size where the driver starts using threads) are timed one by one: the
median of --calls calls, at 1 and 2 threads, alone ("kernel only") and right
after a torch op that runs on torch's OpenMP workers ("after torch op": the
pattern of a model, where torch's workers may still spin when our kernel
starts, OMP_WAIT_POLICY unset).  F.layer_norm on the same input is the
reference in the same run.  Prints one line per case, and the pool's
counters (shardformer._C.kernel_pool_stats, where the build has them).

    .venv/bin/python benchmarks/kernel_pool.py [--calls 400] [--rows 2048] [--load N]

--load N runs N busy-loop processes meanwhile (a loaded machine).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from shardformer import _C, ops


def per_call(fn, calls):
    fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--load", type=int, default=0)
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        x = torch.randn(args.rows, 256)
        w = torch.randn(256)
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} load={args.load} "
              f"loadavg={os.getloadavg()[0]:.1f} rows={args.rows}")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ops.set_num_threads(threads)
            for case, pre in (("kernel only", None), ("after torch op", lambda: torch.mm(a, b))):
                def ours():
                    if pre:
                        pre()
                    ops.layer_norm(x, (256,), w)

                def ref():
                    if pre:
                        pre()
                    F.layer_norm(x, (256,), w)
                t_o, t_r = per_call(ours, args.calls), per_call(ref, args.calls)
                print(f"thr={threads} {case:15s} ours {t_o * 1e6:8.1f} us  torch {t_r * 1e6:8.1f} us  "
                      f"x{t_r / t_o:5.2f}", flush=True)
        stats = getattr(_C, "kernel_pool_stats", None)
        print("pool:", stats() if stats else "(no pool in this build: a thread per call)")
    finally:
        for p in busy:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
