"""Split-gather sequence parallelism against tensor parallelism alone: peak
memory of a training step and its time, per rank, same run.

A LlamaModel (default: hidden 1024, 16 heads / 16 KV heads, intermediate
2816, 4 layers, vocab 32000, fp32, batch 1; --head: LlamaForCausalLM and its
loss) at TP=--tp (2) on that many CPU processes (one thread each), for each sequence length:
forward + backward of a fixed random projection of the last hidden state, after `--warmup` untimed steps,
`--iters` timed steps (the slowest rank's time, median).  Peak memory: the
kernel's peak-RSS counter is reset (/proc/self/clear_refs) before the timed
steps and read after (VmHWM); "step peak" is VmHWM minus the RSS before the
steps, i.e. what the step's activations and gradients add on top of the
sharded model.  Both configurations run one after the other, each in fresh
processes, from the same seed; their losses are compared.

    .venv/bin/python benchmarks/sequence_parallel.py --seq 1024 2048 4096
Results: benchmarks/results/sequence_parallel_tp<N>.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


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


def rank_main(rank: int, args, sp: bool, seq: int) -> dict:
    """One configuration in fresh processes (memory freed by an earlier one
    would otherwise be reused and hide this one's peak)."""
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    from shardformer import ShardConfig, ShardFormer

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, vocab_size=32000,
                                   max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if args.head else transformers.LlamaModel
    model = cls(cfg)
    ShardFormer(ShardConfig(enable_sequence_parallelism=sp)).optimize(model)
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
            "activations": statistics.median(saved[-args.iters:])}


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
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)

    from shardformer.launch import spawn

    ranks = [{} for _ in range(args.tp)]
    for seq in args.seq:
        for sp in (False, True):
            for r, result in enumerate(spawn(rank_main, args.tp, (args, sp, seq), threads_per_rank=1)):
                ranks[r][f"{'sp' if sp else 'tp'}_{seq}"] = result
    print(f"{'LlamaForCausalLM' if args.head else 'LlamaModel'} hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab 32000, fp32, batch 1, "
          f"TP={args.tp} on {args.tp} CPU ranks (1 thread each); medians of {args.iters} steps; step peak = VmHWM over the "
          f"RSS before the steps (largest rank)")
    print("activations = heap bytes alive after the forward (what it keeps for backward); "
          "peak = VmHWM over the RSS before the steps (noisy: the allocator reuses what warmup freed)")
    print(f"{'seq':>6} {'TP step s':>10} {'SP step s':>10} {'SP/TP':>6} {'TP act MiB':>11} {'SP act MiB':>11} "
          f"{'SP/TP':>6} {'TP peak MiB':>12} {'SP peak MiB':>12} {'SP/TP':>6}  loss TP / SP")
    rows = []
    for seq in args.seq:
        tp = {k: max(r[f"tp_{seq}"][k] for r in ranks) for k in ("seconds", "step_peak", "activations")}
        sp = {k: max(r[f"sp_{seq}"][k] for r in ranks) for k in ("seconds", "step_peak", "activations")}
        lt, ls = ranks[0][f"tp_{seq}"]["loss"], ranks[0][f"sp_{seq}"]["loss"]
        rows.append({"seq": seq, "tp": tp, "sp": sp, "loss_tp": lt, "loss_sp": ls})
        print(f"{seq:>6} {tp['seconds']:>10.3f} {sp['seconds']:>10.3f} {sp['seconds'] / tp['seconds']:>6.2f} "
              f"{tp['activations'] / 2**20:>11.0f} {sp['activations'] / 2**20:>11.0f} "
              f"{sp['activations'] / max(tp['activations'], 1):>6.2f} "
              f"{tp['step_peak'] / 2**20:>12.0f} {sp['step_peak'] / 2**20:>12.0f} "
              f"{sp['step_peak'] / max(tp['step_peak'], 1):>6.2f}  {lt:.5f} / {ls:.5f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sequence_parallel_tp{args.tp}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
