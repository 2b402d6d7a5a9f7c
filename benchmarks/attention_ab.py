"""A/B timing of the C attention kernel: two builds of shardformer._C in one process.

Loads a base build (e.g. the commit before a kernel change) and the current
build side by side and times each case's forward + backward alternately
(so both see the same machine load), reporting the median of --reps runs;
then, on the current build, the cost of logit soft-capping.

    git worktree add /tmp/base REV && (cd /tmp/base && .venv-python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/attention_ab.py /tmp/base/python/shardformer/_C*.so [--reps 15]
"""
import argparse
import glob
import importlib.machinery
import importlib.util
import os
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"causal": (True, 0), "window128": (True, 128), "full": (False, 0)}


def load(path: str):
    """The extension at `path` as a module object (not registered in sys.modules)."""
    loader = importlib.machinery.ExtensionFileLoader("shardformer._C", path)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location("shardformer._C", path,
                                                                               loader=loader))
    loader.exec_module(mod)
    return mod


def fwd_bwd(mod, q, k, v, dout, causal, window, *softcap) -> float:
    """Seconds of one attention_forward + attention_backward of `mod`."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    t0 = time.perf_counter()
    mod.attention_forward(q, k, v, out, lse, 0.125, causal, window, None, None, None, 0.0, 0, *softcap)
    mod.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, None, 0.125, causal, window, None, None, None,
                           0.0, 0, *softcap)
    return time.perf_counter() - t0


def alternate(runs: dict, reps: int) -> dict:
    """{name: median seconds}: one warm-up each, then `reps` rounds, the order flipped every round."""
    times = {name: [] for name in runs}
    names = list(runs)
    for rep in range(reps + 1):
        for name in (names if rep % 2 else names[::-1]):
            dt = runs[name]()
            if rep:
                times[name].append(dt)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the base build's _C*.so")
    ap.add_argument("new", nargs="?", help="the build to compare (default: this checkout's)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shape", default="1,8,1024,64", help="B,H,S,D (float32)")
    args = ap.parse_args()
    new_path = args.new or glob.glob(os.path.join(HERE, "..", "python", "shardformer", "_C*.so"))[0]
    base, new = load(args.base), load(new_path)
    for mod in (base, new):
        mod.kernel_set_num_threads(1)
    shape = tuple(int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(*shape, generator=g) for _ in range(4))
    for name, (causal, window) in CASES.items():
        med = alternate({tag: (lambda m=m: fwd_bwd(m, q, k, v, dout, causal, window))
                         for tag, m in (("base", base), ("new", new))}, args.reps)
        print(f"{name:10s} {list(shape)} fp32 fwd+bwd, 1 thread: base {med['base'] * 1e3:7.2f} ms  "
              f"new {med['new'] * 1e3:7.2f} ms  new/base {med['new'] / med['base']:.3f}")
    med = alternate({cap: (lambda c=cap: fwd_bwd(new, q, k, v, dout, True, 0, c)) for cap in (0.0, 30.0)},
                    args.reps)
    print(f"causal, new build: softcap=0 {med[0.0] * 1e3:.2f} ms, softcap=30 {med[30.0] * 1e3:.2f} ms "
          f"({med[30.0] / med[0.0]:.2f}x)")


if __name__ == "__main__":
    main()
