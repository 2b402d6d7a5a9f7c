"""python -m shardformer verify --model DIR [--tp 2] [--plan plan.json] [--seq N] [--batch N]

verify() on a checkpoint directory: the model is loaded (the class named by
config.json's `architectures`, else AutoModel) once as the reference and
once to shard over `--tp` local ranks, and run on random token ids of the
model's vocabulary (with themselves as labels for a causal LM, so its loss is
the model's own).  Prints the report; exit status 0 when it matches, 1 on a
mismatch, 2 on bad arguments or when the models could not be compared.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

PROG = "python -m shardformer verify"


def load_model(path: str, class_name: str):
    """The checkpoint at `path` as `class_name` (a transformers class), float32."""
    import torch
    import transformers

    cls = getattr(transformers, class_name)
    return cls.from_pretrained(path, dtype=torch.float32)


def token_inputs(vocab_size: int, batch: int, seq: int, labels: bool, seed: int = 0) -> dict:
    """Random token ids in [0, vocab_size) of shape [batch, seq] (and the same as labels)."""
    import torch

    ids = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()} if labels else {"input_ids": ids}


def read_plan(path: str) -> dict:
    """A plan dict {module path pattern: style} from a JSON file."""
    try:
        with open(path) as f:
            plan = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--plan {path}: cannot read a JSON plan: {e}") from None
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise ValueError(f"--plan {path}: expected a JSON object {{\"module.path.pattern\": \"style\"}} of strings")
    return plan


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Compare a checkpoint sharded over local CPU ranks with the "
                                "unsharded model, module by module (docs/verify.md).")
    p.add_argument("--model", required=True, metavar="DIR", help="a transformers checkpoint directory")
    p.add_argument("--tp", type=_positive, default=2, help="tensor-parallel ranks to start (default 2)")
    p.add_argument("--plan", metavar="plan.json", help="a plan dict in transformers' notation, as JSON "
                   "(default: the model's built-in policy or its own plan)")
    p.add_argument("--seq", type=_positive, default=16, help="sequence length of the random input (default 16)")
    p.add_argument("--batch", type=_positive, default=2, help="batch size of the random input (default 2)")
    p.add_argument("--steps", type=int, default=1, help="SGD steps before the parameters are compared (default 1)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    return p


def _model_class(config) -> str:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        if hasattr(transformers, name):
            return name
    return "AutoModel"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"--model {args.model}: not a checkpoint directory (no config.json)")
        plan = read_plan(args.plan) if args.plan else None
        from functools import partial

        import transformers

        from . import verify

        config = transformers.AutoConfig.from_pretrained(args.model)
        class_name = _model_class(config)
        vocab = getattr(config.get_text_config(), "vocab_size", None)
        if not vocab:
            raise ValueError(f"--model {args.model}: its config has no vocab_size to draw token ids from")
        causal = class_name.endswith(("ForCausalLM", "LMHeadModel"))
        inputs = token_inputs(vocab, args.batch, args.seq, labels=causal)
        report = verify(partial(load_model, args.model, class_name), inputs, plan=plan, world_size=args.tp,
                        steps=args.steps, rtol=args.rtol)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1
