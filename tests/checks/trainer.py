"""Rank-side checks of shardformer.integrations.ShardedTrainer (tests/test_trainer.py).

The reference is the plain transformers.Trainer on the unsharded model from
the same seed, run in the test's own (non-distributed) process over the
same global batches (reference()); the ranks run ShardedTrainer and hand back
the logged losses and grad norms and the gathered full weights.
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch
import torch.distributed as dist

import zoo
from shardformer import ShardConfig, ShardFormer, mesh
from shardformer.checkpoint import gather_full_state_dict

MODEL = "LlamaForCausalLM"        # 6 heads over 2 KV heads, 90 MLP features, 101 words: uneven over 4
SEQ, STEPS, GLOBAL_BATCH = 8, 3, 4


def dataset(n: int = STEPS * GLOBAL_BATCH) -> list[dict]:
    """n sequences of SEQ tokens (labels = inputs: a causal LM loss)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 101, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(out_dir: str, batch: int, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=out_dir, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=1e-2,
              max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
              disable_tqdm=True, use_cpu=True, dataloader_drop_last=True)
    kw.update(overrides)
    return TrainingArguments(**kw)


def _history(trainer) -> dict:
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"loss": np.array([e["loss"] for e in logs]), "grad_norm": np.array([e["grad_norm"] for e in logs])}


def reference(out_dir: str, dtype=torch.float32) -> dict:
    """The plain Trainer on the unsharded model, one process, the global batch
    per step.  The tests run it (and the sharded run) in float64: AdamW's
    update lr * m / sqrt(v) turns float32 rounding noise in near-zero
    gradients into weight differences near 1e-5 relative, however exact the
    sharded arithmetic; in float64 the two runs agree to ~1e-14."""
    from transformers import Trainer

    model = zoo.build(MODEL, dtype)
    trainer = Trainer(model=model, args=training_args(out_dir, GLOBAL_BATCH), train_dataset=dataset())
    trainer.train()
    out = _history(trainer)
    out["weights"] = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return out


def _sharded(layout: str, dtype=torch.float32):
    """(sharded model, the mesh given to ShardedTrainer or None)."""
    model = zoo.build(MODEL, dtype)
    if layout == "default":                 # ShardConfig(): TP over the world, no DP
        return ShardFormer(ShardConfig()).optimize(model)[0], None
    if layout == "sp":                      # all_to_all sequence parallelism over its own group, DP over the rest
        m = mesh(sp=2)
        return ShardFormer(m.shard_config()).optimize(model)[0], None     # the trainer finds the mesh itself
    m = mesh(tp=2)                          # dp = world / 2
    return ShardFormer(m.shard_config()).optimize(model)[0], m


def _full_weights(model) -> dict:
    full = gather_full_state_dict(model)
    return {k: v.detach().numpy().copy() for k, v in full.items()}


def sharded_run(ctx, layout: str, out_dir: str, dtype_name: str = "float32") -> dict:
    """ShardedTrainer at this world size (layout "default": ShardConfig(); "mesh":
    shardformer.mesh(tp=2)): train STEPS steps, checkpoint after step 2; then a
    fresh sharded model resumes from that checkpoint and must end where the
    uninterrupted run ended; save_model() writes a checkpoint that plain
    from_pretrained() loads with the sharded model's outputs."""
    from transformers import AutoModelForCausalLM

    from shardformer.integrations import ShardedTrainer

    dtype = getattr(torch, dtype_name)
    model, m = _sharded(layout, dtype)
    dp = dist.get_world_size() // 2 if layout != "default" else 1
    args = training_args(out_dir, GLOBAL_BATCH // dp, save_strategy="steps", save_steps=2)
    trainer = ShardedTrainer(model=model, args=args, train_dataset=dataset(), mesh=m)
    trainer.train()
    out = _history(trainer)
    out["weights"] = _full_weights(model)
    ckpt = os.path.join(out_dir, "checkpoint-2")
    out["checkpoint"] = sorted(os.listdir(ckpt))

    resumed, m2 = _sharded(layout, dtype)
    again = ShardedTrainer(model=resumed, args=args, train_dataset=dataset(), mesh=m2)
    again.train(resume_from_checkpoint=ckpt)
    out["resumed_loss"] = _history(again)["loss"]
    out["resumed_weights"] = _full_weights(resumed)

    saved = os.path.join(out_dir, "final")
    trainer.save_model(saved)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if dist.get_rank() == 0:
        plain = AutoModelForCausalLM.from_pretrained(saved).eval()
        with torch.no_grad():
            out["reload_error"] = float((plain(input_ids=ids).logits - logits).abs().max() / logits.abs().max())
    dist.barrier()
    return out


def plain_trainer_refused(ctx, out_dir: str) -> str:
    """transformers.Trainer with a DP=2 x TP=2 model: refused by the DDP guard
    (accelerate's DDP over the whole world), before any step."""
    from transformers import Trainer

    model, _ = _sharded("mesh")
    trainer = Trainer(model=model, args=training_args(out_dir, 2), train_dataset=dataset())
    try:
        trainer.train()
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("plain Trainer on a sharded model trained without an error")
    assert trainer.state.global_step == 0, trainer.state.global_step
    return message


def accelerate_prepare_refused(ctx) -> str:
    """accelerate's prepare() of a DP=2 x TP=2 model: refused by the DDP guard."""
    from accelerate import Accelerator

    model, _ = _sharded("mesh")
    try:
        Accelerator(cpu=True).prepare(model)
    except ValueError as e:
        return str(e)
    raise AssertionError("accelerate's prepare() wrapped a sharded model in DDP over the world without an error")


def refusals(ctx, out_dir: str) -> dict:
    """ShardedTrainer refuses, by name, a model optimize() did not shard and a
    mesh that did not shard the model."""
    from shardformer.integrations import ShardedTrainer

    out = {}
    args = training_args(out_dir, 2)
    try:
        ShardedTrainer(model=zoo.build(MODEL), args=args, train_dataset=dataset())
    except ValueError as e:
        out["unsharded"] = str(e)
    model, _ = _sharded("mesh")
    try:
        ShardedTrainer(model=model, args=args, train_dataset=dataset(), mesh=mesh(tp=4))
    except ValueError as e:
        out["mesh"] = str(e)
    pipelined = ShardFormer(mesh(pp=2, tp=2).shard_config()).optimize(zoo.build(MODEL))[0]
    try:
        ShardedTrainer(model=pipelined, args=args, train_dataset=dataset())
    except NotImplementedError as e:
        out["pipeline"] = str(e)
    return out


def python_blocks(markdown: str) -> list[str]:
    """The fenced ```python blocks of a Markdown page, in order."""
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def run_doc_block(ctx, code: str, workdir: str) -> dict:
    """Run a docs block as written (exec, in `workdir`); returns the names it
    binds that the docs promise (losses, reload error)."""
    here = os.getcwd()
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    try:
        scope: dict = {"__name__": "__main__"}
        exec(compile(code, "docs/trainer.md", "exec"), scope)
    finally:
        os.chdir(here)
    return {k: scope[k] for k in ("losses", "reload_error") if k in scope}
