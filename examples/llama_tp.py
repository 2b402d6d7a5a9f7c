"""Shard a HuggingFace Llama over local CPU processes with tensor parallelism.

    python examples/llama_tp.py                 # a small Llama built from a config
    python examples/llama_tp.py --model DIR     # a local HF checkpoint directory
    python examples/llama_tp.py --tp 4 --steps 5

Each rank builds (or loads) the same model, shards it with one call to
ShardFormer.optimize(), and then:
  1. rank 0 checks the sharded logits against the unsharded model's;
  2. every rank runs greedy generation (the KV cache holds local heads only);
  3. every rank runs a few AdamW training steps;
and each rank reports the parameter memory it holds, the fraction of the full
model that is, and tokens/s.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HuggingFace checkpoint directory (default: build from a config)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of local processes")
    p.add_argument("--seq", type=int, default=64, help="sequence length of the check and training batches")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8, help="greedy generation steps")
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--all-optimization", action="store_true",
                   help="also switch on the C kernels (fused norms, SwiGLU, flash attention)")
    return p.parse_args()


def default_config():
    """A small Llama (about 60M parameters) with grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512,
                       tie_word_embeddings=False)


def build_model(path: str | None):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if path:
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(default_config())


def prompt_ids(path: str | None, vocab: int, batch: int, seq: int) -> torch.Tensor:
    if path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            text = "Tensor parallelism splits every layer of a transformer across devices, so"
            ids = tok(text, return_tensors="pt").input_ids
            return ids.repeat(batch, max(1, seq // ids.shape[1]) + 1)[:, :seq]
        except (OSError, ValueError):
            pass
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def run(rank: int, args, port: int) -> None:
    from shardformer import ShardConfig, ShardFormer

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(minutes=10))
    model = build_model(args.model)
    model.eval()
    ids = prompt_ids(args.model, model.config.vocab_size, args.batch, args.seq)
    full_bytes = param_bytes(model)

    reference = None
    if rank == 0:
        with torch.no_grad():
            model(ids)                                   # warm-up
            t0 = time.perf_counter()
            reference = model(ids).logits
            ref_s = time.perf_counter() - t0
        log(rank, f"unsharded {type(model).__name__}: {full_bytes / 2**20:.1f} MiB of parameters, "
                  f"forward {ids.numel() / ref_s:,.0f} tokens/s on this rank's {torch.get_num_threads()} thread(s)")

    t0 = time.perf_counter()
    model, _ = ShardFormer(shard_config=ShardConfig(enable_all_optimization=args.all_optimization)).optimize(model)
    shard_s = time.perf_counter() - t0
    local_bytes = param_bytes(model)

    # 1. logits (the first call also sets up the group's communicator: warm up)
    with torch.no_grad():
        model(ids)
        t0 = time.perf_counter()
        logits = model(ids).logits
        fwd_s = time.perf_counter() - t0
    if rank == 0:
        err = ((logits - reference).abs().max() / reference.abs().max()).item()
        ok = err < 1e-4
        log(rank, f"logits vs unsharded: max relative error {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit(1)

    # 2. generation
    prompt = ids[:, : min(16, ids.shape[1])]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=model.config.pad_token_id or 0)
    gen_s = time.perf_counter() - t0
    gen_tokens = (out.shape[1] - prompt.shape[1]) * out.shape[0]
    if rank == 0:
        log(rank, f"generated {out.shape[1] - prompt.shape[1]} tokens per sequence: {out[0, prompt.shape[1]:].tolist()}")

    # 3. training
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, t0 = [], time.perf_counter()
    for _ in range(args.steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    train_tokens = args.steps * ids.numel()

    log(rank, f"holds {local_bytes / 2**20:.1f} MiB of parameters = {local_bytes / full_bytes:.3f} of the full "
              f"model (sharded in {shard_s:.2f} s)")
    log(rank, f"forward {ids.numel() / fwd_s:,.0f} tokens/s | generate {gen_tokens / gen_s:,.1f} tokens/s | "
              f"train {train_tokens / train_s:,.0f} tokens/s | losses {', '.join(f'{x:.3f}' for x in losses)}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    if args.model and not os.path.isdir(args.model):
        raise SystemExit(f"--model {args.model}: not a directory")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
