"""Sequence parallelism against tensor parallelism alone: per-rank memory of
a training step and its time, same run.

A LlamaModel (default: hidden 1024, 16 heads / 16 KV heads, intermediate
2816, 4 layers, vocab 32000, fp32, batch 1; --head: LlamaForCausalLM and its
loss) on --ranks (2) CPU processes (one thread each), for each sequence
length and configuration (--modes):

    tp            tensor parallelism alone over the ranks (the baseline)
    split_gather  TP + split-gather SP over the same group
    overlap       split_gather with enable_sequence_overlap=True (a block's
                  input all-gather in flight while this rank's rows are
                  multiplied by the column layers; backward likewise)
    selective     split_gather with sequence_parallel_recompute="selective"
                  (the norms' x_hat and outputs, the SiLU output and the
                  SwiGLU product recomputed in backward, bit for bit)
    all_to_all    Ulysses SP over the ranks, TP off (full weights per rank)
    ring_attn     ring attention SP over the ranks, TP off

forward + backward of a fixed random projection of the last hidden state,
after `--warmup` untimed steps, `--iters` timed steps (the slowest rank's
time, median).  "activations": heap bytes alive after the forward (what it
keeps for backward; glibc mallinfo2).  "peak": the kernel's peak-RSS counter
(VmHWM) over the RSS before the timed steps.  "state": the heap after the
warmup (parameters, gradients).  Every configuration runs in fresh
processes, from the same seed; the losses are compared.  "max seq": the
longest sequence whose state + activations fit --budget-gib per rank,
extrapolated linearly from the longest measured sequence (activations grow
linearly in S here: every attention path keeps O(S) per head).

    .venv/bin/python benchmarks/sequence_parallel.py --seq 1024 2048 4096
Results: benchmarks/results/sequence_parallel_<ranks>.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(name, __import__("ctypes").c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_in_use() -> int:
    """Bytes malloc has handed out and not taken back (glibc mallinfo2:
    in-use arena chunks + mmapped chunks), what torch's CPU tensors live in;
    unlike RSS it drops as soon as a tensor is freed."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def shard_config(mode: str):
    from shardformer import ShardConfig

    if mode == "tp":
        return ShardConfig()
    if mode == "split_gather":
        return ShardConfig(enable_sequence_parallelism=True)
    if mode == "overlap":
        return ShardConfig(enable_sequence_parallelism=True, enable_sequence_overlap=True)
    if mode == "selective":
        return ShardConfig(enable_sequence_parallelism=True, sequence_parallel_recompute="selective")
    return ShardConfig(enable_tensor_parallelism=False, enable_sequence_parallelism=True,
                       sequence_parallelism_mode=mode)


def rank_main(rank: int, args, mode: str, seq: int) -> dict:
    """One configuration in fresh processes (memory freed by an earlier one
    would otherwise be reused and hide this one's peak)."""
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    from shardformer import ShardFormer

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, vocab_size=32000,
                                   max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if args.head else transformers.LlamaModel
    model = cls(cfg)
    ShardFormer(shard_config(mode)).optimize(model)
    model.train()
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(seq))
    probe = torch.randn(1, seq, args.hidden, generator=torch.Generator().manual_seed(1))

    saved = []

    def step():
        model.zero_grad(set_to_none=True)
        before = _heap_in_use()
        if args.head:
            loss = model(input_ids=ids, labels=ids).loss
        else:                     # the decoder layers alone: a fixed projection of the last hidden state
            loss = (model(input_ids=ids).last_hidden_state * probe).sum()
        saved.append(_heap_in_use() - before)     # what the forward keeps alive for backward
        loss.backward()
        return loss.item()

    for _ in range(args.warmup):
        step()
    gc.collect()
    state = _heap_in_use()                         # parameters and their gradients
    model.zero_grad(set_to_none=True)
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times, loss = [], None
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    peak = _status("VmHWM") - base
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"seconds": statistics.median(slowest.tolist()), "step_peak": peak, "loss": loss,
            "activations": statistics.median(saved[-args.iters:]), "state": state}


MODES = ("tp", "split_gather", "overlap", "selective", "all_to_all", "ring_attn")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head", action="store_true",
                   help="LlamaForCausalLM with its loss (default: LlamaModel, so the full-vocabulary logits, "
                        "the same with and without SP, do not dominate the peak)")
    p.add_argument("--ranks", "--tp", type=int, default=2, dest="ranks")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--budget-gib", type=float, default=4.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    modes = ["tp"] + [m for m in args.modes if m != "tp"]      # the baseline first

    from shardformer.launch import spawn

    results = {}                                   # (mode, seq) -> the largest rank's figures
    for seq in args.seq:
        for mode in modes:
            ranks = spawn(rank_main, args.ranks, (args, mode, seq), threads_per_rank=1)
            results[(mode, seq)] = {k: max(r[k] for r in ranks) for k in ("seconds", "step_peak", "activations",
                                                                           "state")}
            results[(mode, seq)]["loss"] = ranks[0]["loss"]
    print(f"{'LlamaForCausalLM' if args.head else 'LlamaModel'} hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads, vocab 32000, fp32, batch 1, {args.ranks} CPU ranks (1 thread each); medians of "
          f"{args.iters} steps; largest rank")
    print(f"{'seq':>6} {'mode':>13} {'step s':>8} {'x tp':>6} {'act MiB':>8} {'x tp':>6} {'peak MiB':>9} "
          f"{'state MiB':>10} {'loss':>10}")
    rows = []
    for seq in args.seq:
        base = results[("tp", seq)]
        for mode in modes:
            r = results[(mode, seq)]
            rows.append({"seq": seq, "mode": mode, **r})
            print(f"{seq:>6} {mode:>13} {r['seconds']:>8.3f} {r['seconds'] / base['seconds']:>6.2f} "
                  f"{r['activations'] / 2**20:>8.0f} {r['activations'] / max(base['activations'], 1):>6.2f} "
                  f"{r['step_peak'] / 2**20:>9.0f} {r['state'] / 2**20:>10.0f} {r['loss']:>10.5f}")
    longest = max(args.seq)
    budget = args.budget_gib * 2**30
    print(f"longest sequence fitting {args.budget_gib:g} GiB per rank (state + activations, linear from S={longest}):")
    fits = {}
    for mode in modes:
        r = results[(mode, longest)]
        per_token = r["activations"] / longest
        fits[mode] = int((budget - r["state"]) / per_token) if budget > r["state"] else 0
        print(f"  {mode:>13}: {fits[mode]:>8}  ({fits[mode] / max(fits['tp'], 1):.2f}x tp)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sequence_parallel_{args.ranks}ranks.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "max_seq_in_budget": fits}, f, indent=1)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
