"""Checkpoint save and load time of a ~1 GB model at TP=2: save_sharded /
load_sharded, torch.distributed.checkpoint (dcp.save / dcp.load of
checkpoint.get_state_dict, then set_state_dict), and the baseline
torch.save / torch.load of the unsharded state dict from one process.

The model is a LlamaForCausalLM of ~249M float32 parameters (hidden 1536,
MLP 4096, 6 layers, 12 heads, 4 KV heads, vocabulary 32000: 0.997 GB),
built under lazy_init() and sharded over 2 ranks (shardformer.launch.spawn,
gloo, one thread per rank).  Every method writes into a fresh directory
under --dir and makes its files durable (save_sharded and DCP fsync their
files; the baseline is followed by flush + os.fsync inside its timing), and
reads them back, `--repeats` times; the figures are medians.  A timing is
the wall time between two barriers of the 2 ranks, so it is the slowest
rank's.  The baseline runs on rank 0 alone with the state dict gathered
beforehand (not timed).  Reads come from the page cache (the files were
just written), as they would after a save on the same host; every load is
checked bit for bit against the saved weights.

    .venv/bin/python benchmarks/checkpoint_io.py               # 3 repeats
Results: benchmarks/results/checkpoint_io.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=12,
              num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
METHODS = ("save_sharded", "dcp", "torch.save (unsharded, 1 process)")


def _timed(call) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    call()
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, base: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardformer import ShardConfig, ShardFormer, lazy_init
    from shardformer.checkpoint import gather_full_state_dict, get_state_dict, load_sharded, save_sharded, \
        set_state_dict

    torch.manual_seed(0)
    with lazy_init():
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model, _ = ShardFormer(shard_config=ShardConfig()).optimize(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = gather_full_state_dict(model, rank0_only=True)
    params = sum(t.numel() for t in full.values()) if rank == 0 else 0
    out = {m: {"save": [], "load": []} for m in METHODS}

    def check(what):
        after = model.state_dict()
        bad = [k for k in before if not torch.equal(after[k], before[k])]
        assert not bad, f"{what}: loaded weights differ: {bad[:3]}"

    def scramble():
        with torch.no_grad():
            for t in model.state_dict().values():
                t.add_(1.0)

    for i in range(repeats):
        d = os.path.join(base, f"sharded{i}")
        out["save_sharded"]["save"].append(_timed(lambda: save_sharded(model, d)))
        scramble()
        out["save_sharded"]["load"].append(_timed(lambda: load_sharded(model, d)))
        check("load_sharded")

        d = os.path.join(base, f"dcp{i}")
        out["dcp"]["save"].append(_timed(lambda: dcp.save(get_state_dict(model)[0], checkpoint_id=d)))
        scramble()

        def dcp_load():
            msd, _ = get_state_dict(model)
            dcp.load(msd, checkpoint_id=d)
            set_state_dict(model, model_state_dict=msd)
        out["dcp"]["load"].append(_timed(dcp_load))
        check("dcp.load")

        path = os.path.join(base, f"torch{i}.pt")
        loaded = {}

        def torch_save():
            if rank == 0:
                with open(path, "wb") as f:
                    torch.save(full, f)
                    f.flush()
                    os.fsync(f.fileno())

        def torch_load():
            if rank == 0:
                loaded["sd"] = torch.load(path, weights_only=True)
        name = METHODS[2]
        out[name]["save"].append(_timed(torch_save))
        out[name]["load"].append(_timed(torch_load))
        if rank == 0:
            assert all(torch.equal(loaded["sd"][k], full[k]) for k in full), "torch.load differs"
            del loaded["sd"]
        dist.barrier()
        for sub in (f"sharded{i}", f"dcp{i}", f"torch{i}.pt"):
            if rank == 0:
                p = os.path.join(base, sub)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        dist.barrier()
    return {"times": out, "params": params}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary "
                                                    "directory under /tmp)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint_io.json"))
    args = parser.parse_args(argv)
    from shardformer.launch import spawn

    base = tempfile.mkdtemp(prefix="checkpoint_io-", dir=args.dir)
    load_before = os.getloadavg()
    try:
        results = spawn(_rank, 2, (base, args.repeats), threads_per_rank=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    times = results[0]["times"]
    params = results[0]["params"]
    summary = {m: {k: round(statistics.median(v), 3) for k, v in t.items()} for m, t in times.items()}
    report = {"model": dict(CONFIG, model="LlamaForCausalLM", params=params, gigabytes=round(params * 4 / 1e9, 3)),
              "tp": 2, "repeats": args.repeats, "median_seconds": summary,
              "runs_seconds": {m: {k: [round(x, 3) for x in v] for k, v in t.items()} for m, t in times.items()},
              "machine": {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                          "note": "shared with other jobs; the page cache holds the files on load"}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"LlamaForCausalLM, {params / 1e6:.0f}M float32 parameters ({params * 4 / 1e9:.2f} GB), TP=2, "
          f"median of {args.repeats}:")
    print(f"{'method':40s} {'save s':>8s} {'load s':>8s}")
    for m, t in summary.items():
        print(f"{m:40s} {t['save']:8.2f} {t['load']:8.2f}")
    print(f"load average before / after: {report['machine']['loadavg_before']} / {report['machine']['loadavg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
