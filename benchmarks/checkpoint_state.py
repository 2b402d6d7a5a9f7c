"""checkpoint.save_state / load_state: how long the training is blocked.

A LlamaForCausalLM (--size; 1g: about 300M parameters, 1.2 GB fp32, 3.6 GB
with AdamW's two moments) sharded at TP=--tp in fresh processes
(shardformer.launch.spawn), one AdamW step taken so that the optimizer has
its state, then on every rank (times: the slowest rank):

  step            one training step (forward, backward, AdamW), no save
  save (block)    save_state(async_save=False): the training waits for all of it
  save (async)    save_state(async_save=True): the training waits for the
                  copy of every tensor and the plan only ("blocked"); then
                  training steps run while the files are written, until the
                  handle is done ("steps meanwhile", "until in place")
  load            load_state into a fresh model and optimizer

The checkpoints go to --dir (default: a temporary directory beside this
machine's /tmp).  Results: benchmarks/results/checkpoint_state_<size>.json
and a table on stdout.

    .venv/bin/python benchmarks/checkpoint_state.py --size 1g --tp 2
    .venv/bin/python benchmarks/checkpoint_state.py --size small      # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from load import SIZES as _LOAD_SIZES  # noqa: E402 - benchmarks/load.py's models ("1g", "4g")

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),
    # ~40M parameters, 0.16 GB fp32
    "small": dict(_LOAD_SIZES["1g"], hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8),
    **_LOAD_SIZES,
}


def _work(rank: int, size: str, directory: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardformer import ShardConfig, ShardFormer
    from shardformer.checkpoint import load_state, save_state

    def build(seed):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**SIZES[size], max_position_embeddings=128))
        ShardFormer(shard_config=ShardConfig()).optimize(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    ids = torch.randint(0, SIZES[size]["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))

    def step(model, opt):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    model, opt = build(0)
    step(model, opt)
    times = {"step": min(timed(lambda: step(model, opt))[0] for _ in range(3))}
    path = os.path.join(directory, "ckpt")
    save_state(model, path, opt, step=1)                 # warm-up: the page cache, DCP's imports
    times["save (block)"] = min(timed(lambda: save_state(model, path, opt, step=2))[0] for _ in range(2))
    blocked, handle = timed(lambda: save_state(model, path, opt, step=3, async_save=True))
    t0, steps = time.perf_counter(), 0
    while not handle.done():
        step(model, opt)
        steps += 1
    handle.wait()
    times.update({"save (async): blocked": blocked, "save (async): until in place": blocked + time.perf_counter() - t0,
                  "save (async): steps meanwhile": steps})
    fresh, fresh_opt = build(1)
    times["load"] = timed(lambda: load_state(fresh, path, fresh_opt))[0]
    byte_count = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) if rank == 0 else 0
    return {**times, "bytes": byte_count}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1g")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    from shardformer.launch import spawn

    directory = tempfile.mkdtemp(prefix="shardformer-ckpt-", dir=args.dir)
    try:
        per_rank = spawn(_work, args.tp, (args.size, directory), timeout_s=3600.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    result.update(size=args.size, tp=args.tp, cpus=os.cpu_count(), load_average=os.getloadavg()[0],
                  time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(f"save_state / load_state, Llama {args.size} at TP={args.tp}, {result['bytes'] / 1e9:.2f} GB on disk "
          f"(model + AdamW), {result['cpus']} CPUs, load average {result['load_average']:.1f}")
    for k in ("step", "save (block)", "save (async): blocked", "save (async): until in place", "load"):
        print(f"  {k:32s} {result[k]:8.3f} s")
    print(f"  {'save (async): steps meanwhile':32s} {result['save (async): steps meanwhile']:8d}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"checkpoint_state_{args.size}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
