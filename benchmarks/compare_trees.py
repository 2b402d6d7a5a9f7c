"""The TP training step of two source trees, measured in one run: before / after a change.

Runs benchmarks/tp_step.py (this tree's copy, which only uses shardformer's public
API) once per round for each tree, alternating (A, B, A, B, ...), with
PYTHONPATH pointing at that tree's `python/` directory so that `import
shardformer` loads its code and its built C extension.  Each run reports the
median step of every shardformer configuration (shm collectives, gloo-forced,
fused kernels) and of the unsharded baseline; this script prints, per
configuration, the median over rounds of each tree and the ratio B / A.

    .venv/bin/python benchmarks/compare_trees.py --a /tmp/old --b . --rounds 3
    .venv/bin/python benchmarks/compare_trees.py --a /tmp/old --b . -- --hidden 512 --layers 2   # tp_step sizes

The tree given as --a must have its C extension built in place
(`python setup.py build_ext --inplace` in it), and python/shardformer/launch.py
(tp_step.py starts its ranks with shardformer.launch.spawn).  Alternating the trees spreads
slow phases of a noisy machine over both; read the ratio, not the absolute
times.  Results: benchmarks/results/compare_trees.json (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TP_ARGS = ["--hidden", "512", "--heads", "8", "--layers", "2", "--vocab", "8000", "--seq", "256",
                   "--batch", "2", "--warmup", "1", "--iters", "5"]


def _run(tree: str, tp_args: list[str]) -> dict[str, float]:
    """{configuration: median step ms} of one tp_step.py run against `tree`."""
    import_dir = os.path.join(os.path.abspath(tree), "python")
    env = dict(os.environ, PYTHONPATH=import_dir)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tp_step.json")
        check = subprocess.run([sys.executable, "-c", "import shardformer, sys; print(shardformer.__file__)"],
                               env=env, capture_output=True, text=True, check=True)
        if not check.stdout.startswith(import_dir):
            raise RuntimeError(f"PYTHONPATH={import_dir}: shardformer loads from {check.stdout.strip()}")
        subprocess.run([sys.executable, os.path.join(HERE, "tp_step.py"), "--skip", "dtensor",
                        "--wait-idle", "0", "--out", out, *tp_args], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            rows = json.load(f)["rows"]
    return {r["config"]: r["median_ms"] for r in rows if r.get("median_ms") is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="the 'before' tree (repository root)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="the 'after' tree (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "compare_trees.json"))
    p.add_argument("tp_args", nargs="*", help="arguments for tp_step.py (after --)")
    args = p.parse_args()
    tp_args = args.tp_args or DEFAULT_TP_ARGS
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b"):
            runs[side].append(_run(getattr(args, side), tp_args))
            print(f"round {r + 1}/{args.rounds} {side}: " +
                  ", ".join(f"{k} {v:.0f} ms" for k, v in runs[side][-1].items()), flush=True)
    configs = [c for c in runs["a"][0] if all(c in x for x in runs["a"] + runs["b"])]
    table = {}
    print(f"\n| configuration | A ({args.a}) median ms | B ({args.b}) median ms | B / A |")
    print("|---|---|---|---|")
    for c in configs:
        a = statistics.median(x[c] for x in runs["a"])
        b = statistics.median(x[c] for x in runs["b"])
        table[c] = {"a_ms": a, "b_ms": b, "ratio": b / a}
        print(f"| {c} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"a": args.a, "b": args.b, "tp_args": tp_args, "rounds": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
