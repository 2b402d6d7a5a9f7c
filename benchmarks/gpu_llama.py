"""The headline on a GPU: original vs sharded Llama at N_CTX 4096, step time and
peak memory per rank.  Needs a CUDA GPU (refuses on CPU, saying so).

The model: a transformers LlamaForCausalLM from a LlamaConfig (default: hidden
2048, 16 heads / 8 KV heads, intermediate 5504, 8 layers, vocab 32000, about
0.5 B parameters), bfloat16, attention through torch's SDPA, weights from seed 0,
batch 1 x N_CTX 4096 tokens (--seq).  A size that fits one GPU twice over, as
its two ranks share it.

  original      the unsharded model, one process on the GPU
  tp2           TP=2: two processes sharing the one GPU, gloo with CUDA tensors
                (NCCL refuses two ranks on one device): the collectives gloo
                runs on CUDA (all_reduce, broadcast) directly, the others
                staged through pinned CPU memory (docs/gpu.md)
  tp2-sp        TP=2 with split_gather sequence parallelism (activations
                between the blocks split along the sequence)

One step = forward + backward of model(input_ids, labels=input_ids).loss
(gradients set to None between steps, no optimizer).  After --warmup untimed
steps, --iters steps are timed (torch.cuda.synchronize, time.perf_counter); a
TP step's time is the slowest rank's (ranks start each step together after a
barrier).  Median, min and max are reported.  Memory per rank:
torch.cuda.max_memory_allocated over the timed steps (the peak statistics
reset after the warm-up, so the model's construction is not counted), and
the rank's parameter bytes.  The ranks share the GPU, so a TP step is NOT
expected to be faster than the original here (two processes take turns on
one device, and the staged collectives cross PCIe): the memory per rank is
the point, and the time is what it costs on one card.

Correctness in the same run: every configuration's step-0 loss against the
original's (relative tolerance 2e-2, bf16).

Run (from the repository root, with a CUDA build of torch):

    python benchmarks/gpu_llama.py                 # results -> benchmarks/results/gpu_llama.json
    python benchmarks/gpu_llama.py --quick         # 1 layer, N_CTX 512: a smoke run

--out writes the JSON elsewhere as well (scripts/device_check.sh passes $OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "gpu_llama.json")
LOSS_RTOL = 2e-2
CONFIGS = ("original", "tp2", "tp2-sp")


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers, vocab_size=args.vocab,
                       max_position_embeddings=args.seq, attn_implementation="sdpa", tie_word_embeddings=False)


def _steps(model, ids, args, barrier) -> tuple[list[float], float, float]:
    """(timed step seconds, step-0 loss, peak bytes over the timed steps)."""
    import torch

    losses = []
    for _ in range(args.warmup):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times, losses[0] if losses else loss.item(), torch.cuda.max_memory_allocated()


def run_config(rank: int, name: str, args) -> dict:
    """One configuration on this rank (launch.spawn's entry)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from shardformer import ShardConfig, ShardFormer

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(model_config(args)).to(torch.bfloat16)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    if name != "original":
        cfg = ShardConfig(enable_sequence_parallelism=name.endswith("-sp"))
        model, _ = ShardFormer(cfg).optimize(model)
    torch.cuda.empty_cache()
    model.train()
    barrier = dist.barrier if dist.is_initialized() and dist.get_world_size() > 1 else (lambda: None)
    times, loss, peak = _steps(model, ids, args, barrier)
    return {"times": times, "loss": loss, "peak_bytes": peak,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "device": torch.cuda.get_device_name(device)}


def measure(name: str, args) -> dict:
    from shardformer.launch import spawn

    ranks = 1 if name == "original" else 2
    per_rank = spawn(run_config, ranks, args=(name, args), threads_per_rank=4, timeout_s=args.timeout)
    steps = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]     # the slowest rank's step
    return {"ranks": ranks, "step_s": {"median": statistics.median(steps), "min": min(steps), "max": max(steps)},
            "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
            "param_bytes_per_rank": [r["param_bytes"] for r in per_rank],
            "loss": per_rank[0]["loss"], "device": per_rank[0]["device"]}


def document(results: dict, args, shape: dict, torch) -> dict:
    """The JSON: every configuration measured so far, with its ratios to the original."""
    base = results["original"]
    for r in results.values():
        r["step_ratio"] = r["step_s"]["median"] / base["step_s"]["median"]
        r["peak_ratio"] = max(r["peak_bytes_per_rank"]) / max(base["peak_bytes_per_rank"])
        r["loss_rel_err"] = abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
        r["loss_ok"] = r["loss_rel_err"] <= LOSS_RTOL
    return {"benchmark": "gpu_llama", "device": base["device"], "torch": torch.__version__,
            "cuda": torch.version.cuda, "dtype": "bfloat16", "config": shape, "quick": args.quick,
            "loss_rtol": LOSS_RTOL, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="1 layer, N_CTX 512, 3 steps: a smoke run")
    p.add_argument("--out", action="append", default=[], help="also write the JSON here (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.seq, args.warmup, args.iters = 1, 512, 1, 3

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_llama: needs a CUDA GPU; torch.cuda.is_available() is False (torch {torch.__version__}"
              f"{', a CPU-only build' if torch.version.cuda is None else ''}). Run it on a GPU machine: "
              f"scripts/device_check.sh (docs/gpu.md).", file=sys.stderr)
        return 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs or configs[0] != "original":
        p.error(f"--configs: {unknown or 'the baseline, original, must come first'}; choose among {', '.join(CONFIGS)}")
    shape = {k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "intermediate", "layers", "vocab", "seq",
                                           "batch", "warmup", "iters")}
    outs = [DEFAULT_OUT] + args.out
    results = {}
    for name in configs:              # the JSON is rewritten after each: a run cut short keeps what it measured
        t0 = time.perf_counter()
        results[name] = measure(name, args)
        print(f"gpu_llama: {name} measured in {time.perf_counter() - t0:.0f} s", flush=True)
        doc = document(results, args, shape, torch)
        for path in outs:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
    base = results["original"]
    gib = 2 ** 30
    print(f"\nLlama {args.layers} layers, hidden {args.hidden}, N_CTX {args.seq}, batch {args.batch}, bf16 on "
          f"{base['device']} (step: median of {args.iters}; peak: max_memory_allocated per rank)")
    print(f"{'config':<10} {'ranks':>5} {'step ms':>9} {'x orig':>7} {'peak GiB/rank':>14} {'x orig':>7} "
          f"{'params GiB/rank':>16} {'loss ok':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r['ranks']:>5} {r['step_s']['median'] * 1e3:>9.1f} {r['step_ratio']:>7.2f} "
              f"{max(r['peak_bytes_per_rank']) / gib:>14.2f} {r['peak_ratio']:>7.2f} "
              f"{max(r['param_bytes_per_rank']) / gib:>16.2f} {str(r['loss_ok']):>8}")
    print(f"gpu_llama: wrote {', '.join(outs)}")
    return 0 if all(r["loss_ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
