"""Two source trees' ShardFormer.from_pretrained + first forward, and
transformers' unsharded load, measured alternately in one run (the ratio
between two trees taken at different times means little on a busy machine).

    .venv/bin/python benchmarks/load_ab.py --base /work/main --dir /tmp/ckpt1g --size 1g --tp 2 --repeats 5

Each measurement is a fresh set of processes (benchmarks/load.py's rank
functions) with PYTHONPATH=<tree>/python, so each tree runs its own
shardformer (its C extension built in place), with --mmap (default
"rows", from_pretrained's default); the order is hf, base,
candidate, repeated.  Printed: medians of the slowest rank's wall seconds
and CPU seconds (user + system) of load + first forward, each tree against
hf, and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import load
from shardformer.launch import spawn
fn = getattr(load, {fn!r})
ranks = spawn(fn, {tp}, ({path!r}, False) + {extra!r}, threads_per_rank=1)
keys = ("seconds", "seconds_first_forward", "cpu_seconds", "cpu_seconds_first_forward", "growth_first_forward",
        "pss_growth_first_forward")
print("RESULT" + json.dumps([{{k: r.get(k) for k in keys}} for r in ranks]))
"""


def measure(tree: str, fn: str, tp: int, path: str, extra: tuple = ()) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "python"))
    out = subprocess.run([sys.executable, "-c", _CHILD.format(here=HERE, fn=fn, tp=tp, path=path, extra=extra)], env=env,
                         capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"{fn} in {tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    ranks = json.loads(line[len("RESULT"):])
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other source tree (e.g. a worktree of main)")
    p.add_argument("--candidate", default=ROOT)
    p.add_argument("--size", default="1g")
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "shardformer-load-bench"))
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mmap", default="rows", choices=("rows", "True", "False"),
                   help='ShardFormer.from_pretrained(mmap=...) of both trees (default "rows", its default)')
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    import load

    path = os.path.join(args.dir, f"llama-{args.size}")
    load.make_checkpoint(args.size, path)
    load.warm_page_cache(path)
    mmap = ({"True": True, "False": False}.get(args.mmap, args.mmap),)
    print(f"load average before: {os.getloadavg()}; mmap={mmap[0]!r}", flush=True)
    for tp in args.tp:
        runs = {"hf": [], "base": [], "candidate": []}
        for _ in range(args.repeats):
            runs["hf"].append(measure(args.candidate, "rank_hf", 1, path))
            runs["base"].append(measure(args.base, "rank_lazy", tp, path, mmap))
            runs["candidate"].append(measure(args.candidate, "rank_lazy", tp, path, mmap))
        med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
        hf = med["hf"]
        print(f"TP={tp}, {args.repeats} alternating runs, medians (slowest rank):")
        print(f"  {'':10} {'load s':>7} {'+fwd s':>7} {'vs hf':>6} {'cpu s':>6} {'+fwd':>6} {'vs hf':>6} "
              f"{'peak MB':>8} {'pss MB':>7}")
        for k, m in med.items():
            print(f"  {k:10} {m['seconds']:>7.3f} {m['seconds_first_forward']:>7.3f} "
                  f"{m['seconds_first_forward'] / hf['seconds_first_forward']:>5.2f}x {m['cpu_seconds']:>6.3f} "
                  f"{m['cpu_seconds_first_forward']:>6.3f} "
                  f"{m['cpu_seconds_first_forward'] / hf['cpu_seconds_first_forward']:>5.2f}x "
                  f"{m['growth_first_forward'] / 1e6:>8.0f} {m['pss_growth_first_forward'] / 1e6:>7.0f}")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
