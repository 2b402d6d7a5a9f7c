"""Many short multi-rank runs under CPU load, counting the ones that abort (issue 30, class 7).

Each run starts `--ranks` processes (multiprocessing spawn, as a user's
script would) that join one gloo group, shard a small Llama at TP=ranks
three ways (plain; split-gather sequence parallelism with
enable_sequence_overlap, whose collectives run on the shm worker thread;
ring attention), run forward, backward and generate(), call
`dist.destroy_process_group()` and return.  `--busy` busy-loop processes
run beside every run (each bounded by the whole script's deadline).

Every rank runs with faulthandler on and, when --trace names a shared
library (see --help), with it preloaded (a SIGABRT handler printing the
native stack), so an abort shows where it came from.  A run counts as an
abort when a rank exits by a signal or prints "terminate called"; its
output is printed.  Exit status: 0 when no run aborted (or failed).

    .venv/bin/python scripts/abort_under_load.py --runs 50 --busy 2

What the abort was (issue 30): "terminate called without an active
exception" is CPython stopping a daemon thread with pthread_exit when it
takes the GIL back during interpreter finalization while inside a torch op
(torch releases the GIL in every op); the forced unwinding through torch's
C++ frames calls std::terminate.  The daemon thread was the shm
communicator's async worker; shardformer.distributed.shm._close_all stops it
before finalization.  tests/test_exit_abort.py reproduces it every time on
the code before the fix; this script is the statistical check under load.

A second cause of the same message: a group that outlived
dist.destroy_process_group() (its default argument captured by
torch.distributed.nn.functional, imported after init by transformers here)
so gloo's threads were joined during finalization or not at all;
shardformer.distributed.teardown releases the groups at exit
(tests/test_exit_abort.py::test_no_backend_thread_left_at_exit, docs/exit.md).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

RANK_BODY = r'''
import os, sys, faulthandler
faulthandler.enable()
import torch, torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
from transformers import LlamaConfig, LlamaForCausalLM
from shardformer import ShardConfig, ShardFormer
cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(1))
for switches in ({}, {"enable_sequence_parallelism": True, "enable_sequence_overlap": True},
                 {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring_attn",
                  "enable_tensor_parallelism": False}):
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ShardFormer(ShardConfig(**switches)).optimize(model)
    model(input_ids=ids, labels=ids).loss.backward()
    if not switches:
        with torch.no_grad():
            model.eval().generate(ids, max_new_tokens=3, do_sample=True, pad_token_id=0)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
'''


def _busy(deadline: float) -> None:
    x = 0
    while time.time() < deadline:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(ranks: int, timeout: float, env: dict) -> tuple[str, str]:
    """('ok' | 'abort' | 'failed' | 'timeout', the ranks' output)."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK_BODY, str(r), str(ranks), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(ranks)]
    outputs, verdict = [], "ok"
    deadline = time.time() + timeout
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            verdict = "timeout"
        outputs.append(f"--- rank {r} (exit {p.returncode}) ---\n{out}")
        if p.returncode is not None and p.returncode < 0 or "terminate called" in out:
            verdict = "abort"
        elif p.returncode and verdict == "ok":
            verdict = "failed"
    return verdict, "\n".join(outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the runs")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds for the whole script")
    parser.add_argument("--trace", default="", help="a shared library to LD_PRELOAD into the ranks "
                        "(e.g. one installing a SIGABRT handler that prints backtrace_symbols_fd)")
    args = parser.parse_args()
    end = time.time() + args.budget
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if args.trace:
        env["LD_PRELOAD"] = args.trace
    busy = [mp.Process(target=_busy, args=(end,), daemon=True) for _ in range(args.busy)]
    for b in busy:
        b.start()
    counts: dict[str, int] = {}
    try:
        for i in range(args.runs):
            if time.time() > end:
                print(f"budget of {args.budget:.0f} s spent after {i} runs")
                break
            start = time.time()
            verdict, out = one_run(args.ranks, args.timeout, env)
            counts[verdict] = counts.get(verdict, 0) + 1
            print(f"run {i + 1}: {verdict} ({time.time() - start:.1f} s)", flush=True)
            if verdict != "ok":
                print(out, flush=True)
    finally:
        for b in busy:
            b.terminate()
            b.join()
    print(f"runs: {sum(counts.values())}; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 0 if set(counts) <= {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
