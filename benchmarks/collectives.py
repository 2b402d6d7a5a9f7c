"""Collective latency: the shared-memory backend (shardformer.distributed.shm)
vs torch.distributed over gloo, on the CPU ranks of this machine.

For 2 and 4 ranks (one process each, one thread each, joined by gloo over
loopback TCP), both communicators of the world group taken through
`shardformer.distributed.get_communicator` (SHARDFORMER_COMM forced to
"shm", then "torch"), each collective (all_reduce sum, all_gather, reduce_scatter,
broadcast, all_to_all) and each message size from 1 KiB to 64 MiB of fp32 (the
size is the full buffer: the all-reduced tensor, the gathered output, the
reduce-scatter input, the all-to-all input), both backends run in the same
processes, alternately.  A measurement
is: a barrier, then `iters` back-to-back calls timed with perf_counter; the
per-call time is the slowest rank's; the median over `reps` measurements is
reported.  Also timed: the two all-reduce algorithms of shm (one-shot vs
reduce-scatter + all-gather), to place the crossover, and one process's
memcpy bandwidth (torch copy_ of a 64 MiB fp32 tensor), the limit a
shared-memory collective moves data against.

Output: a ratio table on stdout and in benchmarks/results/collectives.md,
everything in benchmarks/results/collectives.json, and a plot
benchmarks/results/collectives.png when matplotlib is installed (`--out NAME`
writes NAME.md / .json / .png instead: for partial runs with `--only` or
`--sizes-kib`, which would otherwise replace the full run's files).

The ranks are started by shardformer.launch.spawn.  From the repository root,
in the venv `bash scripts/setup_env.sh` makes:

    .venv/bin/python benchmarks/collectives.py [--ranks 2 4] [--max-mib 64] [--reps 5]
        [--only all_to_all ...] [--sizes-kib 64 4096 ...] [--out NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
RUN_TIMEOUT_S = 3600.0  # one rank count, every size: the whole run and the process group's timeout


def _sizes(max_mib: int) -> list[int]:
    sizes, s = [], 1 << 10
    while s <= max_mib << 20:
        sizes.append(s)
        s *= 4 if s < (1 << 20) else 2
    if (32 << 20) <= (max_mib << 20) and (32 << 20) not in sizes:
        sizes.append(32 << 20)
    return sorted(sizes)


def _iters(nbytes: int) -> int:
    return max(2, min(200, int(64e6 / max(nbytes, 1) / 8)))


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 9) -> float:
    """GB/s of one thread copying nbytes (read + write counted once)."""
    import torch

    torch.set_num_threads(1)
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _worker(rank, args):
    """One rank (started by shardformer.launch.spawn, default process group ready)."""
    import torch
    import torch.distributed as dist

    from shardformer.distributed import get_communicator, reset_communicators

    size = dist.get_world_size()
    # Both backends' communicators of the world group, through the one interface:
    # SHARDFORMER_COMM is read when a communicator is made, so force each in turn.
    os.environ["SHARDFORMER_COMM"] = "torch"
    gloo = get_communicator(None, "cpu")
    reset_communicators()
    os.environ["SHARDFORMER_COMM"] = "shm"
    comm = get_communicator(None, "cpu")
    assert (gloo.backend, comm.backend) == ("torch", "shm"), (gloo, comm)
    shm_comm = comm.shm  # the ShmCommunicator: its all-reduce algorithms and info()

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def measure(fn, iters):
        fn()  # warm up (first touch of buffers, setup)
        out = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append(slowest((time.perf_counter() - t0) / iters))
        return statistics.median(out)

    results = []
    sizes = [k << 10 for k in args.sizes_kib] if args.sizes_kib else _sizes(args.max_mib)
    for nbytes in sizes:
        n = nbytes // 4
        iters = _iters(nbytes)
        x = torch.ones(n)
        part = torch.ones(max(n // size, 1))
        full = torch.empty(part.numel() * size)
        exchanged = torch.empty_like(full)
        for name in args.only or COLLECTIVES:
            calls = {
                "all_reduce": (lambda: comm.all_reduce(x),
                               lambda: gloo.all_reduce(x)),
                "all_gather": (lambda: comm.all_gather_into_tensor(full, part),
                               lambda: gloo.all_gather_into_tensor(full, part)),
                "reduce_scatter": (lambda: comm.reduce_scatter_tensor(part, full),
                                   lambda: gloo.reduce_scatter_tensor(part, full)),
                "broadcast": (lambda: comm.broadcast(x, 0),
                              lambda: gloo.broadcast(x, 0)),
                "all_to_all": (lambda: comm.all_to_all_single(exchanged, full),
                               lambda: gloo.all_to_all_single(exchanged, full)),
            }[name]
            t_shm = measure(calls[0], iters)
            t_gloo = measure(calls[1], iters)
            row = {"ranks": size, "collective": name, "bytes": nbytes, "iters": iters,
                   "shm_s": t_shm, "gloo_s": t_gloo}
            if name == "all_reduce":
                row["oneshot_s"] = measure(lambda: shm_comm.all_reduce(x, "sum", 1), iters)
                row["rsag_s"] = measure(lambda: shm_comm.all_reduce(x, "sum", 2), iters)
            results.append(row)
            if rank == 0:
                print(f"  P={size} {name:15s} {nbytes:>10d} B  shm {t_shm * 1e6:10.1f} us  "
                      f"gloo {t_gloo * 1e6:10.1f} us  x{t_gloo / t_shm:6.1f}", flush=True)
    out = None
    if rank == 0:
        out = {"results": results, "oneshot_max": shm_comm.info()["oneshot_max"],
               "workspace": shm_comm.info()["workspace"]}
    shm_comm.close()
    dist.barrier()
    return out


def run(size: int, args) -> dict:
    """`size` ranks of _worker, one process and one thread each; rank 0's results."""
    from shardformer.launch import spawn

    return spawn(_worker, size, args=(args,), threads_per_rank=1, timeout_s=RUN_TIMEOUT_S)[0]


def _fmt_bytes(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def table(rows: list[dict], memcpy_gbs: float) -> str:
    lines = ["| ranks | collective | size | shm (us) | gloo (us) | gloo / shm | shm GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        gbs = r["bytes"] / r["shm_s"] / 1e9
        lines.append(f"| {r['ranks']} | {r['collective']} | {_fmt_bytes(r['bytes'])} | "
                     f"{r['shm_s'] * 1e6:.1f} | {r['gloo_s'] * 1e6:.1f} | "
                     f"{r['gloo_s'] / r['shm_s']:.1f}x | {gbs:.2f} |")
    lines += ["", f"memcpy bandwidth (one thread, 64 MiB copy_): {memcpy_gbs:.2f} GB/s"]
    if not any(r["collective"] == "all_reduce" for r in rows):
        return "\n".join(lines)
    lines += ["", "all_reduce algorithms (shm): one-shot vs reduce-scatter + all-gather", "",
              "| ranks | size | one-shot (us) | RS+AG (us) | faster |", "|---|---|---|---|---|"]
    for r in rows:
        if r["collective"] == "all_reduce":
            best = "one-shot" if r["oneshot_s"] <= r["rsag_s"] else "RS+AG"
            lines.append(f"| {r['ranks']} | {_fmt_bytes(r['bytes'])} | {r['oneshot_s'] * 1e6:.1f} "
                         f"| {r['rsag_s'] * 1e6:.1f} | {best} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [c for c in COLLECTIVES if any(r["collective"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, names):
        for size in sorted({r["ranks"] for r in rows}):
            sel = [r for r in rows if r["collective"] == name and r["ranks"] == size]
            xs = [r["bytes"] for r in sel]
            ax.loglog(xs, [r["shm_s"] * 1e6 for r in sel], "o-", label=f"shm, {size} ranks")
            ax.loglog(xs, [r["gloo_s"] * 1e6 for r in sel], "s--", label=f"gloo, {size} ranks")
        ax.set_title(name)
        ax.set_xlabel("bytes")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("latency (us, median)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=COLLECTIVES, default=None,
                    help="these collectives only (default: all)")
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=None,
                    help="these message sizes, in KiB (default: 1 KiB .. --max-mib)")
    ap.add_argument("--out", default="collectives",
                    help="name of the result files in benchmarks/results (default: collectives)")
    args = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    memcpy_gbs = memcpy_bandwidth()
    rows, meta = [], {}
    for size in args.ranks:
        print(f"{size} ranks", flush=True)
        out = run(size, args)
        rows += out["results"]
        meta = {"oneshot_max": out["oneshot_max"], "workspace": out["workspace"]}
    md = table(rows, memcpy_gbs)
    print(md)
    with open(os.path.join(RESULTS, f"{args.out}.md"), "w") as f:
        f.write(f"# benchmarks/collectives.py ({platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n")
        f.write(md + "\n")
    with open(os.path.join(RESULTS, f"{args.out}.json"), "w") as f:
        json.dump({"memcpy_GBps": memcpy_gbs, "cpu_count": os.cpu_count(), "args": vars(args),
                   **meta, "results": rows}, f, indent=1)
    if plot(rows, os.path.join(RESULTS, f"{args.out}.png")):
        print(f"plot: benchmarks/results/{args.out}.png")


if __name__ == "__main__":
    main()
