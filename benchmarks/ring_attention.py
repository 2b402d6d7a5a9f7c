"""Ring attention against full attention on one rank: forward + backward time, same run.

For each sequence length S and masking (causal, full), q, k, v [1, H, S, D]
(default H = 8 heads, 8 KV heads, D = 64, fp32): each of --ranks CPU
processes (one thread each) holds its 2c = S / p zigzag rows and runs
shardformer.layer.ring_attention forward + backward (the slowest rank's time
per step, median of --iters after --warmup); then rank 0 alone runs
ops.attention (the same C kernel) over the whole sequence with one thread,
forward + backward, while the others wait ("full"), and every rank runs that
same full attention at once ("full xp": on a machine with fewer free cores
than ranks, or shared caches, p concurrent processes each run slower than one
alone).  ring/full = ring / full: a perfect split over p ranks with free
communication on an idle machine gives 1 / p; ring/ideal = ring / (full xp / p)
takes the machine's concurrency out (1.0: the ring costs nothing beyond its
share of the work).  The CPU seconds of each process (all its threads) are
reported too: on a loaded machine they say more than wall time about the
work a rank does (ring cpu / full cpu: 1 / p plus the merges, copies and the
transport's own CPU, e.g. the shm worker's spinning waits).

    .venv/bin/python benchmarks/ring_attention.py --seq 2048 4096
    ... --comm torch     the group on torch.distributed (gloo) altogether
    ... --p2p torch      the group on shm, the ring's messages on gloo isend / irecv
Results: a table on stdout and benchmarks/results/ring_attention_p<N>_<backend>.json (--out DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _steps(fn, warmup: int, iters: int, barrier) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process, all its threads) of each timed step."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def _slowest(times, dist) -> tuple[float, float]:
    """Medians over the steps of the slowest rank's wall and CPU seconds, step by step."""
    import torch

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t[:, 0].tolist()), statistics.median(t[:, 1].tolist())


def rank_main(rank: int, args) -> dict:
    import torch
    import torch.distributed as dist

    from shardformer import ops
    from shardformer.distributed import get_communicator
    from shardformer.layer import ring_attention as ra

    p = dist.get_world_size()
    ra.P2P = args.p2p
    backend = get_communicator(None, "cpu").backend
    if args.p2p == "torch":
        backend += ", ring p2p on torch isend/irecv"
    out = {"backend": backend, "rows": []}
    for S in args.seq:
        for causal in (True, False):
            gen = torch.Generator().manual_seed(S)
            q = torch.randn(1, args.heads, S, args.dim, generator=gen)
            k = torch.randn(1, args.kv_heads, S, args.dim, generator=gen)
            v = torch.randn(1, args.kv_heads, S, args.dim, generator=gen)
            g = torch.randn(1, args.heads, S, args.dim, generator=gen)
            rows = ra.zigzag_rows(S, p, rank)
            ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
            gl = g[:, :, rows].contiguous()

            def ring_step():
                ql.grad = kl.grad = vl.grad = None
                ra.ring_attention(ql, kl, vl, None, causal=causal).backward(gl)

            ring_s, ring_cpu = _slowest(_steps(ring_step, args.warmup, args.iters, dist.barrier), dist)

            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))

            def full_step():
                qf.grad = kf.grad = vf.grad = None
                ops.attention(qf, kf, vf, causal=causal).backward(g)

            # every rank at once: what p concurrent processes get from this machine each
            concurrent_s, _ = _slowest(_steps(full_step, args.warmup, args.iters, dist.barrier), dist)
            full_s = full_cpu = None
            if rank == 0:   # alone, the others waiting in a (blocking) gloo barrier
                alone = _steps(full_step, args.warmup, args.iters, lambda: None)
                full_s = statistics.median(w for w, _ in alone)
                full_cpu = statistics.median(c for _, c in alone)
            dist.barrier()
            out["rows"].append({"seq": S, "causal": causal, "ring_s": ring_s, "ring_cpu_s": ring_cpu,
                                "full_s": full_s, "full_cpu_s": full_cpu, "full_concurrent_s": concurrent_s})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--comm", choices=["auto", "shm", "torch"], default="auto",
                    help="SHARDFORMER_COMM for the ranks (auto: shm when the ranks share a host)")
    ap.add_argument("--p2p", choices=["auto", "torch"], default="auto",
                    help="ring_attention.P2P: the ring's transport (auto: the group's backend)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args(argv)
    for S in args.seq:
        if S % (2 * args.ranks):
            ap.error(f"--seq {S} is not a multiple of 2 x ranks = {2 * args.ranks}")

    from shardformer.launch import spawn

    if args.comm != "auto":
        os.environ["SHARDFORMER_COMM"] = args.comm     # the spawned ranks inherit it
    res = spawn(rank_main, args.ranks, (args,), threads_per_rank=1)[0]
    print(f"ring attention vs full attention: [1, {args.heads} heads ({args.kv_heads} KV), S, {args.dim}] fp32, "
          f"forward + backward, {args.ranks} CPU ranks x 1 thread over {res['backend']} vs ops.attention on one "
          f"rank x 1 thread; medians of {args.iters} steps (ring: slowest rank)")
    print(f"full: ops.attention over the whole sequence on one rank alone; full x{args.ranks}: the same on every "
          f"rank at once (what {args.ranks} concurrent processes each get from this machine); "
          f"ideal ring = (full x{args.ranks}) / {args.ranks}")
    print("cpu: CPU seconds of the process (every thread: the kernel's, the transport's), ring: the "
          "largest rank's; ideal cpu ratio 1 / p")
    print(f"{'seq':>6} {'mask':>7} {'full s':>8} {f'full x{args.ranks} s':>10} {'ring s':>8} {'ring/full':>10} "
          f"{'ring/ideal':>11} {'full cpu':>9} {'ring cpu':>9} {'cpu ratio':>10}")
    for row in res["rows"]:
        ideal = row["full_concurrent_s"] / args.ranks
        print(f"{row['seq']:>6} {'causal' if row['causal'] else 'none':>7} {row['full_s']:>8.3f} "
              f"{row['full_concurrent_s']:>10.3f} {row['ring_s']:>8.3f} {row['ring_s'] / row['full_s']:>10.2f} "
              f"{row['ring_s'] / ideal:>11.2f} {row['full_cpu_s']:>9.3f} {row['ring_cpu_s']:>9.3f} "
              f"{row['ring_cpu_s'] / row['full_cpu_s']:>10.2f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ring_attention_p{args.ranks}_{res['backend'].split(',')[0]}"
                        f"{'_p2p_torch' if args.p2p == 'torch' else ''}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "backend": res["backend"], "rows": res["rows"]}, f, indent=1)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
