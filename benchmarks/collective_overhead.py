"""Python overhead of a small all-reduce on the layer path vs the raw communicator call.

Two CPU ranks (one process and one thread each, gloo over loopback for setup,
the backend shardformer picks for the all-reduce: shm), fp32 all-reduces of
4 KiB and 64 KiB (`--sizes`), each call timed alone with perf_counter and the
paths interleaved call by call (the same fresh activation `leaf * 1.0`,
requiring grad, for each):

    raw          shm.communicator(group).all_reduce(y): the ShmCommunicator,
                 the lowest Python layer, the same class in both trees
    collectives  shardformer.distributed.all_reduce(y, group)
    reduce       reduce_from_tp_region(y, group) under autograd (training)
    reduce/ng    the same with grad mode off (inference; y made with it off)
    row          Linear1D_Row forward (input_is_parallel, bias), autograd on
    linear+raw   what that layer must do: F.linear, raw all-reduce, + bias

overhead = path - raw (row: row - linear+raw), from the medians.

BEFORE vs AFTER in the same run: with `--baseline-tree DIR` the same
measurement runs for the tree at DIR (its package at DIR/python, imported
through PYTHONPATH; each rank checks that `shardformer` came from there) and
for this tree, each in its own subprocess, in alternating order over
`--rounds` rounds; the table gives the median over rounds of each round's
median.  `--load N [N ...]` repeats everything with N busy-loop processes
running (0 = quiet), since the shm backend spin-waits and behaves
differently when the cores are contended.

The ranks are started by shardformer.launch.spawn of the tree being measured,
so a baseline tree must have python/shardformer/launch.py.  From the
repository root, in the venv `bash scripts/setup_env.sh` makes:

    .venv/bin/python benchmarks/collective_overhead.py --baseline-tree /tmp/old --load 0 2
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
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PATHS = ("raw", "collectives", "reduce", "reduce/ng", "row", "linear+raw")
OVERHEADS = (("collectives", "raw"), ("reduce", "raw"), ("reduce/ng", "raw"), ("row", "linear+raw"))
TAG = "@@collective_overhead@@"


# ---- one rank (inside a worker subprocess) ----------------------------------------------

def _rank(rank: int, cfg: dict) -> dict | None:
    """One rank (started by spawn with one thread, the default gloo group ready); rank 0 returns the results."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    size = dist.get_world_size()
    import shardformer
    from shardformer.distributed import collectives as coll
    from shardformer.distributed import shm
    from shardformer.distributed.mappings import reduce_from_tp_region
    from shardformer.layer import Linear1D_Row

    where = os.path.dirname(os.path.abspath(shardformer.__file__))
    if not where.startswith(os.path.abspath(cfg["tree"])):
        raise RuntimeError(f"rank {rank} imported shardformer from {where}, not {cfg['tree']}")
    group = None  # the default ShardConfig: layers hold process_group=None
    backend = coll.backend_for(torch.ones(1), group)
    raw = shm.communicator(group)
    if raw is None or backend != "shm":
        raise RuntimeError(f"expected the shm backend, got {backend!r}")
    torch.manual_seed(0)
    k = 16  # input features per rank of the row-parallel layer
    results = {}
    for nbytes in cfg["sizes"]:
        n = nbytes // 4
        leaf = torch.randn(n, requires_grad=True)
        row = Linear1D_Row.from_native_module(torch.nn.Linear(k * size, n), group)
        xp = torch.randn(1, k, requires_grad=True)

        def linear_raw():
            y = F.linear(xp, row.weight)
            raw.all_reduce(y)
            return y + row.bias

        calls = {
            "raw": lambda y: raw.all_reduce(y),
            "collectives": lambda y: coll.all_reduce(y, group),
            "reduce": lambda y: reduce_from_tp_region(y, group),
            "reduce/ng": lambda y: reduce_from_tp_region(y, group),
            "row": lambda y: row(xp),
            "linear+raw": lambda y: linear_raw(),
        }
        times = {p: [] for p in PATHS}
        for i in range(cfg["warmup"] + cfg["iters"]):
            for p in PATHS:
                grad = p != "reduce/ng"
                torch.set_grad_enabled(grad)  # untimed, like the fresh activation:
                y = leaf * 1.0  # made by an op (nothing saved it); requires grad iff grad
                fn = calls[p]
                t0 = time.perf_counter()
                fn(y)
                dt = time.perf_counter() - t0
                torch.set_grad_enabled(True)
                if i >= cfg["warmup"]:
                    times[p].append(dt)
        results[nbytes] = {p: statistics.median(v) * 1e6 for p, v in times.items()}
    got = [None] * size
    dist.all_gather_object(got, results)
    out = None
    if rank == 0:
        # per path: the slower rank's median
        merged = {nb: {p: max(r[nb][p] for r in got) for p in PATHS} for nb in cfg["sizes"]}
        out = {"results": merged, "where": where}
    dist.barrier()
    return out


def _worker(cfg: dict) -> None:
    """One measurement of one tree: cfg["ranks"] ranks, results as one JSON line on stdout."""
    # This tree's launcher (PYTHONPATH): the ranks import the same shardformer.  A rank
    # that fails or dies raises RankError here at once, with its traceback.
    from shardformer.launch import spawn

    out = spawn(_rank, cfg["ranks"], args=(cfg,), threads_per_rank=1, timeout_s=cfg["timeout"])[0]
    print(TAG + json.dumps(out), flush=True)


# ---- the driver --------------------------------------------------------------------------

def _run_tree(tree: str, cfg: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "python"), OMP_NUM_THREADS="1")
    cfg = dict(cfg, tree=os.path.join(tree, "python"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
                          env=env, capture_output=True, text=True, timeout=cfg["timeout"] + 120)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"measurement of {tree} failed (rc {proc.returncode}):\n"
                       f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _start_load(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop_load(procs: list) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _fmt_size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def table(summary: dict, trees: list[str], loads: list[int], sizes: list[int]) -> str:
    """summary[load][tree][size][path] = median over rounds (us)."""
    names = {"after": "after", "before": "before"}
    cols = [names[t] for t in trees]
    head = "| load | size | path | " + " | ".join(f"{c} (us)" for c in cols)
    head += " | after - before |" if len(trees) == 2 else " |"
    lines = [head, "|" + "---|" * (3 + len(cols) + (len(trees) == 2))]
    for load in loads:
        for nb in sizes:
            for p in PATHS:
                vals = [summary[load][t][nb][p] for t in trees]
                row = f"| {load} | {_fmt_size(nb)} | {p} | " + " | ".join(f"{v:.1f}" for v in vals)
                row += f" | {vals[0] - vals[1]:+.1f} |" if len(trees) == 2 else " |"
                lines.append(row)
            for a, b in OVERHEADS:
                vals = [summary[load][t][nb][a] - summary[load][t][nb][b] for t in trees]
                row = (f"| {load} | {_fmt_size(nb)} | **overhead {a} - {b}** | "
                       + " | ".join(f"**{v:.1f}**" for v in vals))
                row += f" | {vals[0] - vals[1]:+.1f} |" if len(trees) == 2 else " |"
                lines.append(row)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-tree", help="an older checkout (its package in DIR/python) to compare")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4 << 10, 64 << 10], help="bytes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2000, help="timed calls per path and size (quiet)")
    ap.add_argument("--iters-loaded", type=int, default=300, help="timed calls per path and size (loaded)")
    ap.add_argument("--load", type=int, nargs="+", default=[0],
                    help="busy-loop processes running during the measurement (one table row set each)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "collective_overhead"),
                    help="writes OUT.md and OUT.json ('' for none)")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        _worker(json.loads(args._worker))
        return
    trees = {"after": REPO}
    if args.baseline_tree:
        trees["before"] = os.path.abspath(args.baseline_tree)
    order = list(trees)
    raw_rounds: dict = {}
    summary: dict = {}
    for load in args.load:
        iters = args.iters if load == 0 else args.iters_loaded
        cfg = {"sizes": args.sizes, "iters": iters, "warmup": max(20, iters // 10),
               "ranks": args.ranks, "timeout": 900}
        procs = _start_load(load)
        try:
            per_tree = {t: [] for t in order}
            for r in range(args.rounds):
                for t in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
                    out = _run_tree(trees[t], cfg)
                    per_tree[t].append(out["results"])
                    print(f"load {load} round {r} {t:6s} ({out['where']}): " + "  ".join(
                        f"{_fmt_size(int(nb))} " + " ".join(f"{p}={v:.1f}" for p, v in res.items())
                        for nb, res in out["results"].items()), flush=True)
        finally:
            _stop_load(procs)
        raw_rounds[load] = per_tree
        summary[load] = {t: {nb: {p: statistics.median(rr[str(nb)][p] for rr in per_tree[t])
                                  for p in PATHS} for nb in args.sizes} for t in order}
    md = table(summary, order, args.load, args.sizes)
    head = (f"benchmarks/collective_overhead.py: {args.ranks} ranks, CPU, 1 thread each, "
            f"{os.cpu_count()} cores; median over {args.rounds} rounds of per-call medians (us); "
            f"load = busy-loop processes running")
    print()
    print(head)
    print()
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(f"# {head}\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                    f"trees: {trees}\n\n{md}\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"args": vars(args), "trees": trees, "summary": summary, "rounds": raw_rounds},
                      f, indent=1)


if __name__ == "__main__":
    main()
