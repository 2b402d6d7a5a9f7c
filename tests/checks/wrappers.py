"""Rank-side checks: wrappers optimize() does not see through are refused by
name before anything changes (shardformer.wrappers), and plan dicts work on
a model of one's own that has no HF config."""
from __future__ import annotations

import torch
from torch import nn

from shardformer import ShardConfig, ShardFormer, mesh

import zoo
from checks import parity
from zoo.custom import ToyModel, toy_inputs


class PlainMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class PlainNet(nn.Module):
    """A model of one's own without an HF config: embedding, pre-norm MLP
    blocks, head (70 MLP features and a 77-word vocabulary: uneven over 4 ranks)."""

    def __init__(self, vocab: int = 77, dim: int = 40, hidden: int = 70, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlps = nn.ModuleList(PlainMLP(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        logits = self.head(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


PLAIN_PLAN = {"embed": "embedding_rowwise", "mlps.*.up": "colwise", "mlps.*.down": "rowwise",
              "head": "colwise_gather_output"}
#: ToyModel's MLP linears, direct children of its block beside the pre-norm and the attention
#: (which run on the replicated activations: their gradients must not be all-reduced).
TOY_MLP_PLAN = {"embed": "embedding_rowwise", "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
#: ToyModel's attention, which the plan splits by heads.
TOY_PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.out": "rowwise"}


def _shard_config(ctx, layout: str) -> ShardConfig:
    if layout == "dp_tp":
        return mesh(dp=2, tp=2).shard_config()
    return ShardConfig(tensor_parallel_process_group=ctx.group)


def _wrapped(kind: str, ctx):
    """(what optimize() is given, the module whose state must not change, the names the refusal must carry)."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    if kind == "peft_ia3":      # a PeftModel of another tuner than LoRA (LoRA is sharded: test_lora.py)
        from peft import IA3Config, get_peft_model

        peft_model = get_peft_model(model, IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[]))
        return peft_model, peft_model, ("PeftModel", "IA3", "LoRA (LoraConfig) only")
    if kind == "lora_inside":
        from peft import LoraConfig, get_peft_model

        inner = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).base_model.model
        return inner, inner, ("LlamaForCausalLM", "holds PEFT modules", "optimize() the PeftModel itself")
    if kind == "compiled":
        compiled = torch.compile(model)
        return compiled, model, ("OptimizedModule", "torch.compile", "compiled._orig_mod")
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, process_group=ctx.group)
        return ddp, model, ("DistributedDataParallel", "shardformer.data_parallel")
    if kind == "data_parallel":
        return nn.DataParallel(model), model, ("nn.DataParallel", "optimize() the bare model first")
    if kind == "compiled_child":
        model.model.layers[1] = torch.compile(model.model.layers[1])
        return model, model, ("'model.layers.1'", "OptimizedModule")
    raise ValueError(kind)


def wrapper_refused(ctx, kind: str, layout: str = "tp") -> str:
    """optimize() of a wrapped model is refused naming the wrapper and the
    fix; no tensor and no module of the model changed."""
    cfg = _shard_config(ctx, layout)
    given, model, names = _wrapped(kind, ctx)
    error = NotImplementedError if kind in ("peft_ia3", "lora_inside") else ValueError   # shardformer.lora's refusals
    return parity.refused_unchanged(model, lambda: ShardFormer(cfg).optimize(given), kind, error=error, structure=True,
                                    names=names)


def plain_plan(ctx) -> dict:
    """PlainNet (no config) sharded by a plan dict equals the unsharded model:
    forward, loss, every gradient, outputs after a step."""
    return parity.check_sharded(ctx, PlainNet, toy_inputs(), name="PlainNet", plan=PLAIN_PLAN)


def toy_mlp_plan(ctx) -> dict:
    """ToyModel (no config) with its block's MLP linears split: equal to the unsharded model."""
    return parity.check_sharded(ctx, ToyModel, toy_inputs(), name="ToyModel", plan=TOY_MLP_PLAN)


def toy_plan_attention_refused(ctx) -> str:
    """A plan splitting ToyModel's attention, whose heads no config and no
    num_heads attribute name: refused naming the module, nothing changed."""
    torch.manual_seed(0)
    model = ToyModel()
    plan = TOY_PLAN
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group)
    return parity.refused_unchanged(model, lambda: ShardFormer(cfg).optimize(model, plan=plan), "toy attention",
                                    structure=True, names=("blocks.0.attn", "ToyAttention", "num_heads", "no config"))
