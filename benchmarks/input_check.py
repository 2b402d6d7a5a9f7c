"""Cost of the input check (shardformer.input_check) against the forward it guards.

Two CPU ranks (one thread each; spawn's gloo group, shm for the check's
all-gather), a Llama sharded at TP=2 over the default group, for each size
and batch shape:

    check      InputCheck.step on the call's inputs alone (fingerprint of
               input_ids and labels, one [2, 3] int64 all-gather, compare)
    forward    the sharded model's forward on the same inputs, the check off
               (ShardConfig(check_inputs_every=0)); no_grad, and a training
               step (forward + backward)

each timed alone with perf_counter, interleaved call by call, medians of the
slower rank.  ratio = check / forward: what checking every call would add;
the default (check_inputs_every=100) adds ratio / 100 per call.

    .venv/bin/python benchmarks/input_check.py [--iters 30] [--quick]

writes benchmarks/results/input_check.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, batch=2, seq=16),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192, batch=4, seq=256),
}


def _rank(rank: int, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardformer import ShardConfig, ShardFormer
    from shardformer.input_check import CHECK_ATTR, InputCheck

    out = {}
    for name in cfg["sizes"]:
        spec = dict(SIZES[name])
        batch, seq = spec.pop("batch"), spec.pop("seq")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**spec, attn_implementation="eager"))
        ShardFormer(ShardConfig(check_inputs_every=0)).optimize(model)
        assert CHECK_ATTR not in model.__dict__
        check = InputCheck(name, [(None, "tensor-parallel")], every=1)
        ids = torch.randint(0, spec["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
        kwargs = {"input_ids": ids, "labels": ids}

        def train():
            model(**kwargs).loss.backward()

        def infer():
            with torch.no_grad():
                model(**kwargs)

        paths = {"check": lambda: check.step((), kwargs), "forward/no_grad": infer, "forward+backward": train}
        times = {p: [] for p in paths}
        for i in range(cfg["warmup"] + cfg["iters"]):
            for p, fn in paths.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if i >= cfg["warmup"]:
                    times[p].append(dt)
            model.zero_grad(set_to_none=True)
        out[name] = {p: statistics.median(v) * 1e6 for p, v in times.items()}
        out[name]["shape"] = [batch, seq]
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, out)
    if rank != 0:
        return None
    return {n: {k: (max(g[n][k] for g in got) if k != "shape" else got[0][n][k]) for k in got[0][n]}
            for n in cfg["sizes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model, few iterations (a smoke run)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "input_check"))
    args = ap.parse_args()
    from shardformer.launch import spawn

    cfg = {"sizes": ["tiny"] if args.quick else list(SIZES), "iters": 3 if args.quick else args.iters,
           "warmup": 1 if args.quick else args.warmup}
    res = spawn(_rank, 2, args=(cfg,), threads_per_rank=1)[0]
    rows = ["| model | batch x seq | check (us) | forward no_grad (us) | ratio | forward+backward (us) | ratio |",
            "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        r["ratio_no_grad"] = r["check"] / r["forward/no_grad"]
        r["ratio_train"] = r["check"] / r["forward+backward"]
        rows.append(f"| {name} | {r['shape'][0]} x {r['shape'][1]} | {r['check']:.0f} | {r['forward/no_grad']:.0f} "
                    f"| {r['ratio_no_grad']:.4f} | {r['forward+backward']:.0f} | {r['ratio_train']:.4f} |")
    table = "\n".join(rows)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"config": cfg, "ranks": 2, "results": res,
                   "note": "medians of the slower rank; ratio = check / forward (checking every call)"}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"Input check vs the forward it guards, TP=2, 2 CPU ranks, 1 thread each, "
                f"{cfg['iters']} iterations (benchmarks/input_check.py)\n\n{table}\n")


if __name__ == "__main__":
    main()
