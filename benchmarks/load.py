"""Loading a HuggingFace checkpoint sharded: peak memory per rank and time.

For a LlamaForCausalLM checkpoint written by plain transformers
(safetensors; --size 1g: about 1.2 GB, --size 4g: about 4.1 GB, fp32), each
configuration runs in fresh processes (shardformer.launch.spawn):

  hf            transformers' LlamaForCausalLM.from_pretrained, unsharded, one
                process: the time baseline
  eager TP=n    what users did before lazy init: every rank from_pretrained's
                the whole model, then optimize() cuts its shard
  lazy TP=n     ShardFormer(cfg).from_pretrained(LlamaForCausalLM, dir): the
                model is built under lazy_init() (no parameter storage),
                optimize() allocates this rank's shards, and
                checkpoint.load_pretrained reads only its slices

Memory: each process imports torch, transformers and shardformer, reads its
VmRSS (the idle baseline), resets the kernel's peak counter (writes 5 to
/proc/self/clear_refs), loads, and reads VmHWM.  "peak growth" = VmHWM -
idle VmRSS, as a fraction of the checkpoint's bytes on disk.  VmHWM counts
file pages mapped from the checkpoint too.  Configurations whose estimated
need (ranks x the unsharded peak) exceeds this machine's available memory
are not run: they are reported as "would need N GB".

Time: wall time of the load in each process (the slowest rank for TP); the
page cache is warmed first (every file read once), so every configuration
reads from memory.  Correctness in the same run: the logits of a fixed
8-token input after the lazy TP load against the hf load's (max relative
error).

    .venv/bin/python benchmarks/load.py                  # 1g at TP=2 and 4
    .venv/bin/python benchmarks/load.py --size 4g --tp 4
    .venv/bin/python benchmarks/load.py --size 05g --no-eager --busy
Results: benchmarks/results/load_<size>[_busy].json and a table on stdout.

ShardFormer.from_pretrained maps a shard that is
one byte range of the file (mmap="rows", the default) and copies the
column shards compactly; mmap=True maps those too, as strided views (key
"lazy" in the JSON); mmap=False copies every shard; all three in the same run.  Goals (issue
34): load + first forward <= 1.0x hf's, and peak growth per rank <= its
shards + 64 MiB (the reader's window) + the largest single tensor; each
printed met or NOT met.  --busy: one busy-looping process beside every
measurement.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import load_phases  # noqa: E402

SIZES = {
    # ~131M parameters, ~0.53 GB fp32
    "05g": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
    # ~300M parameters, ~1.2 GB fp32
    "1g": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=12,
               num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
    # ~1.03B parameters, ~4.1 GB fp32
    "4g": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
               num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
}
IDS = [[1, 306, 4658, 278, 6593, 310, 2834, 338]]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measure(load, forward: bool = True, profile=None) -> tuple[object, dict]:
    """load() measured: seconds and peak RSS growth (bytes over the idle
    VmRSS) of the load, then of the load plus a first forward of IDS (which
    touches every weight: transformers' from_pretrained maps the checkpoint
    and reads it only then).  profile: the phases (load_phases.py) to count
    in the same run, or None."""
    import contextlib

    phases = load_phases.Phases(profile) if profile else None
    with phases if phases else contextlib.nullcontext():
        model, r = _measured(load, forward, phases)
    if phases:
        r["profile"] = phases.result()
    return model, r


def _measured(load, forward, phases):
    import gc

    import torch

    gc.collect()
    idle, idle_pss = _status("VmRSS"), _pss()
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    model = load()
    r = {"idle": idle, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
         "growth": _status("VmHWM") - idle}
    if forward:
        with torch.no_grad(), phases.phase("first forward") if phases else _null():
            r["logits"] = model(torch.tensor(IDS)).logits.float()
        r["seconds_first_forward"] = time.perf_counter() - t0
        r["cpu_seconds_first_forward"] = time.process_time() - c0
        r["growth_first_forward"] = _status("VmHWM") - idle
        r["pss_growth_first_forward"] = _pss() - idle_pss
    return model, r


def _pss() -> int:
    """This process's proportional set size: private pages, plus each page
    it shares (a checkpoint file's page cache mapped by several ranks)
    divided by the number of processes mapping it."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _null():
    import contextlib

    return contextlib.nullcontext()


def rank_hf(rank: int, path: str, profile: bool = False) -> dict:
    import torch
    import transformers
    importlib.import_module("shardformer")      # the same imports in every configuration

    cls = transformers.LlamaForCausalLM        # imported before the measurement, in every configuration
    _, r = _measure(lambda: cls.from_pretrained(path, dtype=torch.float32),
                    profile=load_phases.HF_PHASES if profile else None)
    return r


def rank_eager(rank: int, path: str, profile: bool = False) -> dict:
    import torch
    import transformers
    from shardformer import ShardConfig, ShardFormer

    cls = transformers.LlamaForCausalLM

    def load():
        model = cls.from_pretrained(path, dtype=torch.float32)
        return ShardFormer(ShardConfig()).optimize(model)[0]

    _, r = _measure(load)
    r["logits"] = r["logits"] if rank == 0 else None
    return r


def rank_lazy(rank: int, path: str, profile: bool = False, mmap: bool = True) -> dict:
    import torch
    import transformers
    from shardformer import ShardConfig, ShardFormer

    cls = transformers.LlamaForCausalLM
    model, r = _measure(lambda: ShardFormer(ShardConfig()).from_pretrained(
        cls, path, dtype=torch.float32, progress=False, mmap=mmap)[0],
        profile=load_phases.LAZY_PHASES if profile else None)
    r["local_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    r["largest_tensor"] = max(p.numel() * p.element_size() for p in model.parameters())
    r["logits"] = r["logits"] if rank == 0 else None
    return r


def rank_copy(rank: int, path: str, profile: bool = False) -> dict:
    """ShardFormer.from_pretrained(mmap=False): every shard copied (the way
    before aliasing), for the comparison in the same run."""
    return rank_lazy(rank, path, profile, mmap=False)


def rank_rows(rank: int, path: str, profile: bool = False) -> dict:
    """ShardFormer.from_pretrained(mmap="rows"): byte ranges mapped, column
    shards copied (the smaller peak per rank)."""
    return rank_lazy(rank, path, profile, mmap="rows")


def busy_process():
    """One process spinning on a core beside the measurement (--busy)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def make_checkpoint(size: str, directory: str) -> None:
    """Write the checkpoint with plain transformers, in a child process (so
    this process never holds the model)."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    code = f"""
import torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**{SIZES[size]!r}, max_position_embeddings=512)
model = transformers.LlamaForCausalLM(cfg)
model.save_pretrained({directory + '.partial'!r}, max_shard_size="1GB")
"""
    print(f"writing the {size} checkpoint to {directory} ...", flush=True)
    subprocess.run([sys.executable, "-c", code], check=True)
    os.rename(directory + ".partial", directory)


def checkpoint_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.endswith(".safetensors"))


def warm_page_cache(directory: str) -> None:
    for f in sorted(os.listdir(directory)):
        with open(os.path.join(directory, f), "rb") as fh:
            while fh.read(64 << 20):
                pass


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run(fn, nprocs: int, path: str, repeats: int, profile: bool = False) -> list[list[dict]]:
    from shardformer.launch import spawn

    return [spawn(fn, nprocs, (path, profile), threads_per_rank=1) for _ in range(repeats)]


def slowest_rank(ranks: list[dict]) -> dict:
    """The profile of the rank whose load took the most CPU seconds."""
    return max((r["profile"] for r in ranks),
               key=lambda p: p["phases"].get("from_pretrained", {}).get("cpu_seconds", 0))


def profile_of(runs: list[list[dict]]) -> list[dict]:
    """Every run's slowest-rank profile (for the JSON)."""
    return [slowest_rank(ranks) for ranks in runs]


def summarize(runs: list[list[dict]], ckpt: int) -> dict:
    """Medians over repeats of the slowest rank's times and of the largest
    rank's (and the sum over ranks of) peak growth, after the load and after
    the first forward."""
    def med(key, agg):
        return statistics.median(agg(r[key] for r in ranks) for ranks in runs)

    out = {"ranks": len(runs[0]), "idle_rss": runs[0][0]["idle"]}
    for suffix in ("", "_first_forward"):
        out["seconds" + suffix] = med("seconds" + suffix, max)
        out["peak_growth_per_rank" + suffix] = med("growth" + suffix, max)
        out["fraction_per_rank" + suffix] = out["peak_growth_per_rank" + suffix] / ckpt
        out["sum_over_ranks" + suffix] = med("growth" + suffix, sum)
        out["sum_fraction" + suffix] = out["sum_over_ranks" + suffix] / ckpt
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1g")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "shardformer-load-bench"))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--no-eager", action="store_true", help="skip the eager configurations")
    p.add_argument("--busy", action="store_true", help="one busy-looping process beside every measurement")
    p.add_argument("--profile", action="store_true",
                   help="per phase (build, plan, optimize, alias, copy, first forward): wall and CPU seconds, "
                        "page faults, bytes aliased / copied (benchmarks/load_phases.py), printed and in the JSON")
    args = p.parse_args(argv)
    busy = busy_process() if args.busy else None
    try:
        return _main(args)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def _main(args) -> int:

    import torch

    path = os.path.join(args.dir, f"llama-{args.size}")
    os.makedirs(args.dir, exist_ok=True)
    make_checkpoint(args.size, path)
    ckpt = checkpoint_bytes(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    print(f"checkpoint {path}: {ckpt / 1e9:.2f} GB in {len(files)} safetensors file(s)", flush=True)
    warm_page_cache(path)

    results = {"size": args.size, "checkpoint_bytes": ckpt, "config": SIZES[args.size], "repeats": args.repeats,
               "busy_process": args.busy, "load_average": os.getloadavg()[0]}
    rows = []
    avail = available_bytes()
    hf_runs = run(rank_hf, 1, path, args.repeats, args.profile)
    hf = summarize(hf_runs, ckpt)
    results["hf"] = hf
    profiles = []
    if args.profile:
        hf["profile"] = profile_of(hf_runs)
        profiles.append(("hf from_pretrained, unsharded", hf_runs))
    rows.append(("hf from_pretrained, unsharded", 1, hf, None))
    reference = hf_runs[0][0]["logits"]
    for tp in args.tp:
        need = tp * max(hf["peak_growth_per_rank_first_forward"], 1.5 * ckpt)
        if args.no_eager:
            eager = None
        elif need < 0.8 * avail:
            eager = summarize(run(rank_eager, tp, path, args.repeats, args.profile), ckpt)
        else:
            eager = {"would_need_bytes": need, "available_bytes": avail}
        if eager is not None:
            results[f"eager_tp{tp}"] = eager
            rows.append(("eager from_pretrained + optimize", tp, eager, None))
        for key, fn, label in (("copy", rank_copy, "from_pretrained(mmap=False)"),
                               ("rows", rank_rows, 'from_pretrained (mmap="rows", default)'),
                               ("lazy", rank_lazy, "from_pretrained(mmap=True)")):
            lazy_runs = run(fn, tp, path, args.repeats, args.profile)
            lazy = summarize(lazy_runs, ckpt)
            got = lazy_runs[0][0]["logits"]
            err = ((got - reference).abs().max() / reference.abs().max()).item()
            lazy["logits_rel_err_vs_hf"] = err
            lazy["local_param_bytes"] = max(r["local_bytes"] for r in lazy_runs[0])
            lazy["largest_tensor_bytes"] = max(r["largest_tensor"] for r in lazy_runs[0])
            # the goal: peak growth per rank <= its shards + the reader's window + the largest tensor
            lazy["peak_goal_bytes"] = lazy["local_param_bytes"] + (64 << 20) + lazy["largest_tensor_bytes"]
            lazy["time_vs_hf_first_forward"] = lazy["seconds_first_forward"] / hf["seconds_first_forward"]
            lazy["time_goal_met"] = lazy["time_vs_hf_first_forward"] <= 1.0
            lazy["peak_goal_met"] = lazy["peak_growth_per_rank_first_forward"] <= lazy["peak_goal_bytes"]
            if args.profile:
                lazy["profile"] = profile_of(lazy_runs)
                profiles.append((f"{label} TP={tp}", lazy_runs))
            results[f"{key}_tp{tp}"] = lazy
            rows.append((label, tp, lazy, err))

    print(f"\nLlama {args.size} checkpoint: {ckpt / 1e9:.2f} GB (fp32); medians of {args.repeats} runs; "
          f"torch {torch.__version__}; page cache warm.  load = the call; +fwd = the call and a first "
          f"forward of {len(IDS[0])} tokens (HF maps the file and reads it only then)")
    print(f"{'path':34} {'ranks':>5} {'load s':>7} {'+fwd s':>7} {'vs hf':>6} {'peak/rank':>10} {'/ckpt':>6} "
          f"{'+fwd':>6} {'sum ranks':>10} {'/ckpt':>6}  logits err")
    base = hf["seconds_first_forward"]
    for label, tp, r, err in rows:
        if "would_need_bytes" in r:
            print(f"{label:34} {tp:>5}   would need {r['would_need_bytes'] / 1e9:.1f} GB "
                  f"(available {r['available_bytes'] / 1e9:.1f} GB): not run")
            continue
        print(f"{label:34} {tp:>5} {r['seconds']:>7.2f} {r['seconds_first_forward']:>7.2f} "
              f"{r['seconds_first_forward'] / base:>5.2f}x {r['peak_growth_per_rank'] / 1e9:>8.2f}GB "
              f"{r['fraction_per_rank']:>6.2f} {r['fraction_per_rank_first_forward']:>6.2f} "
              f"{r['sum_over_ranks_first_forward'] / 1e9:>8.2f}GB {r['sum_fraction_first_forward']:>6.2f}  "
              + (f"{err:.1e}" if err is not None else ""))
        if "peak_goal_bytes" in r:
            print(f"{'':34} goals: time {r['time_vs_hf_first_forward']:.2f}x <= 1.00x "
                  f"{'met' if r['time_goal_met'] else 'NOT met'}; peak/rank "
                  f"{r['peak_growth_per_rank_first_forward'] / 1e6:.0f} MB <= shards + 64 MiB + largest tensor "
                  f"{r['peak_goal_bytes'] / 1e6:.0f} MB {'met' if r['peak_goal_met'] else 'NOT met'}")
    if profiles:
        print("\nwhere the time goes (--profile; medians; per run the rank with the most CPU seconds; CPU s "
              "counts all threads, user + system; a phase nested in another counts in both):")
        for label, runs_ in profiles:
            print(load_phases.report(label, [slowest_rank(ranks) for ranks in runs_]))
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"load_{args.size}{'_busy' if args.busy else ''}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
