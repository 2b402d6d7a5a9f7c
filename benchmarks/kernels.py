"""Benchmark of the C kernels (shardformer.ops) against torch, in one run.

For each op, forward + backward through autograd is timed (time.perf_counter,
median of --reps runs after one warm-up, ours and the torch reference
alternating, on the same inputs, at 1 and 2 threads (torch.set_num_threads and
shardformer.ops.set_num_threads set together).  ratio = torch / ours
(> 1: ours is faster).

  cross_entropy      cross_entropy_1d (TP=1)  vs F.cross_entropy, [rows x 32000] fp32
  cross_entropy_tp2  one rank's work at TP=2: cross_entropy_1d on a [rows x 16000]
                     shard vs the Megatron-style composed torch ops (max, exp,
                     sum, gather, softmax kept for backward, softmax - onehot);
                     no communication (a single process), so local compute only
  layer_norm         ops.layer_norm vs F.layer_norm, [rows x hidden]
  rms_norm           ops.rms_norm vs F.rms_norm
  bias_gelu          ops.bias_gelu (erf, tanh) vs F.gelu(x + b)
  swiglu             ops.swiglu vs F.silu(g) * u
  bias_dropout_add   ops.bias_dropout_add vs r + F.dropout(x + b), p = 0.1
  vocab_embedding    ops.vocab_embedding vs masked F.embedding (the torch path
                     VocabParallelEmbedding1D had), 32000 x 1024 table, half ours
  attention_causal   ops.attention(causal) vs F.scaled_dot_product_attention(is_causal),
                     [1 x 8 heads x S x 64], S = 512, 1024, 2048
  attention_alibi    ops.attention(causal, alibi_slopes) vs SDPA with the ALiBi +
                     causal bias materialized as a float [1, 8, S, S] mask
  attention_alibi_eager     ... vs HF's eager attention (llama's eager_attention_forward)
                     on the same materialized mask
  attention_window   ops.attention(causal, window=S/8) vs SDPA with a materialized
                     boolean sliding-window mask; attention_window_eager: vs HF eager
                     on the additive mask HF builds for it

Peak memory of cross-entropy (largest size): the growth of peak RSS (VmHWM,
reset through /proc/self/clear_refs) over one fwd+bwd in a fresh process
whose logits are already allocated -- the temporaries plus the gradient.
The attention rows at the largest S (1 thread) carry the same measure (after
one warm-up step, whose gradients are dropped at the start of the measured
one), with the reference's materialized mask counted (built inside the step).

At 2 threads the C kernels hand rows to their persistent worker pool while
torch's OpenMP workers may still spin after the torch op before
(OMP_WAIT_POLICY unset): on a 2-core machine that costs ours the second core.
Setting OMP_WAIT_POLICY=PASSIVE shows the kernels' own scaling (see the
policy comment in shardformer/ops.py).  attention_causal_fwd times the
forward alone (no grad).  --load N measures with N busy-loop processes
running; --threads and --att-sizes pick the thread counts and sequence
lengths (e.g. --att-sizes 2048,4096).

Writes benchmarks/results/kernels.json and, when matplotlib is installed,
kernels.png (time vs size, ours vs torch).  From the repository root, in the
venv `bash scripts/setup_env.sh` makes:

    .venv/bin/python benchmarks/kernels.py [--reps 5] [--quick] [--ops attention,...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from shardformer import ops
from shardformer.layer.loss import cross_entropy_1d

HERE = os.path.dirname(os.path.abspath(__file__))


def timed_pair(ours, ref, reps):
    """Medians of ours and ref, run alternately (after one warm-up each) so
    that load from other processes hits both alike."""
    ours()
    ref()
    a, b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        ours()
        a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref()
        b.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def fwd_bwd(f, *leaves):
    def run():
        for t in leaves:
            t.grad = None
        out = f(*leaves)
        out.backward(torch.ones_like(out) if out.dim() else None)
    return run


def megatron_ce(z, y):
    """The composed torch ops of a Megatron-style vocab-parallel cross-entropy
    (one rank, no communication): softmax kept for backward."""
    class _Ce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z, y):
            m = z.max(dim=-1).values
            e = (z - m.unsqueeze(-1)).exp()
            s = e.sum(dim=-1)
            target = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - m
            e.div_(s.unsqueeze(-1))
            ctx.save_for_backward(e, y)
            return (s.log() - target).mean()

        @staticmethod
        def backward(ctx, g):
            sm, y = ctx.saved_tensors
            grad = sm.clone()
            grad.scatter_add_(-1, y.unsqueeze(-1), -torch.ones(y.shape[0], 1))
            return grad.mul_(g / y.shape[0]), None
    return _Ce.apply(z, y)


_PEAK_SCRIPT = """
import sys, torch, torch.nn.functional as F
from shardformer.layer.loss import cross_entropy_1d
def status():
    with open('/proc/self/status') as f:
        return {l.split(':')[0]: int(l.split()[1]) for l in f if l.startswith(('VmHWM', 'VmRSS'))}
torch.set_num_threads(1)
rows, V, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
z = torch.randn(rows, V, requires_grad=True)
y = torch.randint(0, V, (rows,))
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status()['VmRSS']
loss = cross_entropy_1d(z, y, vocab_size=V) if which == 'ours' else F.cross_entropy(z, y)
loss.backward()
print((status()['VmHWM'] - before) / 1024)
"""


def ce_peak_growth_mib(rows, vocab, which):
    """Growth of peak RSS over one cross-entropy fwd+bwd in a fresh process
    (the logits already allocated), in MiB; None where /proc cannot say."""
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(rows), str(vocab), which],
                             capture_output=True, text=True, check=True, timeout=600)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


_ATT_PEAK_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[4])
import kernels
def status():
    with open('/proc/self/status') as f:
        return {l.split(':')[0]: int(l.split()[1]) for l in f if l.startswith(('VmHWM', 'VmRSS'))}
torch.set_num_threads(1)
S, op, which = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ours, ref = kernels.attention_pair(op, S)
run = ours if which == 'ours' else ref
run()  # warm-up: one-time allocations of torch's autograd and thread pools
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status()['VmRSS']
run()
print((status()['VmHWM'] - before) / 1024)
"""

ATT_B, ATT_H, ATT_D = 1, 8, 64


def _hf_eager():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class _M(torch.nn.Module):
        num_key_value_groups = 1
    return eager_attention_forward, _M()


def attention_pair(op, S):
    """(ours, ref) fwd+bwd closures of attention case `op` at sequence S; the
    reference builds its materialized mask inside the step (as a model does
    once per forward)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(ATT_B, ATT_H, S, ATT_D, generator=g).requires_grad_() for _ in range(3))
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / ATT_H) for h in range(ATT_H)])
    window = S // 8
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    if op == "attention_causal_fwd":
        def fwd(f):
            def run():
                with torch.no_grad():
                    f(q, k, v)
            return run
        return (fwd(lambda q, k, v: ops.attention(q, k, v, causal=True)),
                fwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    if op == "attention_causal":
        return (fwd_bwd(lambda q, k, v: ops.attention(q, k, v, causal=True), q, k, v),
                fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v))
    if op.startswith("attention_alibi"):
        def mask():
            bias = -slopes.view(1, ATT_H, 1, 1) * (i - j).abs().float()
            return bias.masked_fill(j > i, torch.finfo(torch.float32).min)
        ours = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, causal=True, alibi_slopes=slopes), q, k, v)
    else:
        def mask():
            vis = (j <= i) & (i - j < window)
            if op.endswith("_eager"):
                return torch.zeros(1, 1, S, S).masked_fill(~vis, torch.finfo(torch.float32).min)
            return vis.view(1, 1, S, S)
        ours = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, causal=True, window=window), q, k, v)
    if op.endswith("_eager"):
        eager, module = _hf_eager()
        ref = fwd_bwd(lambda q, k, v: eager(module, q, k, v, mask(), scaling=ATT_D ** -0.5)[0], q, k, v)
    else:
        ref = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask()), q, k, v)
    return ours, ref


def att_peak_growth_mib(S, op, which):
    """Growth of peak RSS over one attention fwd+bwd in a fresh process, in MiB."""
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", _ATT_PEAK_SCRIPT, str(S), op, which, HERE],
                             capture_output=True, text=True, check=True, timeout=600)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


ATT_OPS = ("attention_causal_fwd", "attention_causal", "attention_alibi", "attention_alibi_eager", "attention_window",
           "attention_window_eager")


_ATT_SIZES = None     # --att-sizes


def att_sizes(quick):
    if _ATT_SIZES:
        return _ATT_SIZES
    return [512, 1024] if quick else [512, 1024, 2048]


def cases(quick, want=lambda op: True):
    """(op, numel, size, ours, ref) of every case `want` accepts (inputs built lazily)."""
    for S in att_sizes(quick):
        for op in ATT_OPS:
            if not want(op):
                continue
            ours, ref = attention_pair(op, S)
            yield (op, ATT_B * ATT_H * S * S, f"S={S}", ours, ref)
    V = 32000
    ce_rows = [512, 1024, 2048] if quick else [512, 1024, 2048, 4096]
    for rows in ce_rows if want("cross_entropy") else []:
        z = torch.randn(rows, V, requires_grad=True)
        y = torch.randint(0, V, (rows,))
        yield ("cross_entropy", rows * V, f"{rows}x{V}",
               fwd_bwd(lambda z: cross_entropy_1d(z, y, vocab_size=V), z),
               fwd_bwd(lambda z: F.cross_entropy(z, y), z))
    for rows in ce_rows if want("cross_entropy_tp2") else []:
        z = torch.randn(rows, V // 2, requires_grad=True)
        y = torch.randint(0, V // 2, (rows,))
        yield ("cross_entropy_tp2", rows * V // 2, f"{rows}x{V // 2}",
               fwd_bwd(lambda z: cross_entropy_1d(z, y, vocab_size=V, vocab_start=0), z),
               fwd_bwd(lambda z: megatron_ce(z, y), z))
    norm_sizes = [(2048, 1024), (4096, 1024), (4096, 4096)] if not quick else [(2048, 1024), (4096, 1024)]
    for rows, h in norm_sizes if want("layer_norm") or want("rms_norm") else []:
        x = torch.randn(rows, h, requires_grad=True)
        w, b = torch.randn(h, requires_grad=True), torch.randn(h, requires_grad=True)
        yield ("layer_norm", rows * h, f"{rows}x{h}",
               fwd_bwd(lambda x, w, b: ops.layer_norm(x, (h,), w, b), x, w, b),
               fwd_bwd(lambda x, w, b: F.layer_norm(x, (h,), w, b), x, w, b))
        yield ("rms_norm", rows * h, f"{rows}x{h}",
               fwd_bwd(lambda x, w: ops.rms_norm(x, (h,), w, 1e-6), x, w),
               fwd_bwd(lambda x, w: F.rms_norm(x, (h,), w, 1e-6), x, w))
    ew_sizes = [(1024, 4096), (4096, 4096)] if not quick else [(1024, 4096)]
    for rows, h in ew_sizes if any(want(o) for o in ("bias_gelu_none", "swiglu", "bias_dropout_add")) else []:
        x, r = torch.randn(rows, h, requires_grad=True), torch.randn(rows, h, requires_grad=True)
        b = torch.randn(h, requires_grad=True)
        for appr in ("none", "tanh"):
            yield (f"bias_gelu_{appr}", rows * h, f"{rows}x{h}",
                   fwd_bwd(lambda x, b: ops.bias_gelu(x, b, appr), x, b),
                   fwd_bwd(lambda x, b: F.gelu(x + b, approximate=appr), x, b))
        yield ("swiglu", rows * h, f"{rows}x{h}",
               fwd_bwd(ops.swiglu, x, r), fwd_bwd(lambda g, u: F.silu(g) * u, x, r))
        yield ("bias_dropout_add", rows * h, f"{rows}x{h}",
               fwd_bwd(lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.1), x, b, r),
               fwd_bwd(lambda x, b, r: r + F.dropout(x + b, 0.1), x, b, r))
    if not want("vocab_embedding"):
        return
    w = torch.randn(V // 2, 1024, requires_grad=True)
    for n in ([2048, 8192] if not quick else [2048]):
        ids = torch.randint(0, V, (n,))

        def torch_emb(w):
            outside = (ids < 0) | (ids >= V // 2)
            out = F.embedding((ids).masked_fill(outside, 0), w)
            return out.masked_fill(outside.unsqueeze(-1), 0.0)
        yield ("vocab_embedding", n * 1024, f"{n} ids",
               fwd_bwd(lambda w: ops.vocab_embedding(ids, w, 0, V // 2), w), fwd_bwd(torch_emb, w))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller sizes")
    ap.add_argument("--ops", default="", help="comma-separated op-name prefixes to run (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kernels.json"))
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--att-sizes", default="", help="comma-separated attention S (default 512,1024,2048)")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--load", type=int, default=0,
                    help="run N busy-loop processes in the background while measuring (a loaded machine)")
    args = ap.parse_args()
    global _ATT_SIZES
    _ATT_SIZES = [int(x) for x in args.att_sizes.split(",") if x]
    busy = []
    if args.load:
        import subprocess
        import sys
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        run_all(args)
    finally:
        for p in busy:
            p.kill()
            p.wait()


def run_all(args):
    wanted = [w for w in args.ops.split(",") if w]

    def want(op):
        return not wanted or any(op.startswith(w) for w in wanted)
    torch.manual_seed(0)
    rows = []
    ce_rows_max = 2048 if args.quick else 4096
    for threads in [int(t) for t in args.threads.split(",") if t]:
        torch.set_num_threads(threads)
        ops.set_num_threads(threads)
        for op, numel, size, ours, ref in cases(args.quick, want):
            if not want(op):
                continue
            t_ours, t_torch = timed_pair(ours, ref, args.reps)
            row = {"op": op, "size": size, "numel": numel, "threads": threads, "ours_s": t_ours,
                   "torch_s": t_torch, "ratio": t_torch / t_ours}
            if args.no_peak:
                pass
            elif op == "cross_entropy" and threads == 1 and size == f"{ce_rows_max}x32000":
                rows_n = int(size.split("x")[0])
                row["peak_growth_mib_ours"] = ce_peak_growth_mib(rows_n, 32000, "ours")
                row["peak_growth_mib_torch"] = ce_peak_growth_mib(rows_n, 32000, "torch")
                row["logits_mib"] = numel * 4 / 2**20
            if not args.no_peak and op.startswith("attention") and threads == 1 and size == f"S={att_sizes(args.quick)[-1]}":
                S = att_sizes(args.quick)[-1]
                row["peak_growth_mib_ours"] = att_peak_growth_mib(S, op, "ours")
                row["peak_growth_mib_torch"] = att_peak_growth_mib(S, op, "torch")
            rows.append(row)
            print(f"{op:18s} {size:>12s} thr={threads} ours {t_ours * 1e3:9.2f} ms  torch {t_torch * 1e3:9.2f} ms  "
                  f"x{t_torch / t_ours:5.2f}" + (f"  peak+ ours {row['peak_growth_mib_ours']:.0f} MiB torch "
                                               f"{row['peak_growth_mib_torch']:.0f} MiB (logits "
                                               f"{row['logits_mib']:.0f} MiB)" if "logits_mib" in row and
                                               row["peak_growth_mib_ours"] is not None else "")
                  + (f"  peak+ ours {row['peak_growth_mib_ours']:.0f} MiB torch {row['peak_growth_mib_torch']:.0f} MiB"
                     if op.startswith("attention") and row.get("peak_growth_mib_ours") is not None
                     and row.get("peak_growth_mib_torch") is not None else ""), flush=True)
    ops.set_num_threads(1)
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "avx2": bool(__import__("shardformer._C", fromlist=["x"]).cpu_has_avx2()), "reps": args.reps,
            "timing": "median seconds of forward+backward (attention_causal_fwd: forward only, "
                      "no grad); ratio = torch / ours",
            "load_procs": args.load, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "loadavg": os.getloadavg()}
    stats = getattr(__import__("shardformer._C", fromlist=["x"]), "kernel_pool_stats", None)
    if stats is not None:
        meta["kernel_pool"] = stats()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    print("wrote", args.out)
    plot(rows, args.out[:-5] + ".png")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot")
        return
    names = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(4 * ((len(names) + 1) // 2), 7))
    for ax, name in zip(axes.flat, names):
        for threads, style in ((1, "-"), (2, "--")):
            pts = sorted((r["numel"], r["ours_s"], r["torch_s"]) for r in rows
                         if r["op"] == name and r["threads"] == threads)
            if not pts:
                continue
            n = [p[0] for p in pts]
            ax.plot(n, [p[1] * 1e3 for p in pts], "o" + style, color="C0", label=f"ours, {threads} thr")
            ax.plot(n, [p[2] * 1e3 for p in pts], "s" + style, color="C1", label=f"torch, {threads} thr")
        ax.set_title(name, fontsize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("elements")
        ax.set_ylabel("ms (fwd+bwd)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print("wrote", path)


if __name__ == "__main__":
    main()
