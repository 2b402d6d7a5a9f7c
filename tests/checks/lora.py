"""Rank-side checks of PEFT LoRA on sharded models (shardformer.lora): a
sharded PeftModel against the unsharded one built from the same seed."""
from __future__ import annotations

import copy
import os

import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model

import zoo
from checks.parity import TOL, assert_close, check_outputs, compare_grads, loss_of, refused_unchanged
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import _shard_info
from shardformer.layer.parallel_module import shard_of

NAME = "LlamaForCausalLM"        # 6 heads, 2 KV heads (replicated at TP=4), 90 MLP features (uneven)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(**kw) -> LoraConfig:
    """Both factors random (init_lora_weights=False), so A and B both get gradients."""
    return LoraConfig(**dict(dict(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False), **kw))


#: per model: LoRA targets on its column- and row-parallel layers (GPT-2: HF Conv1D, fused [q|k|v] c_attn)
MODEL_TARGETS = {NAME: {}, "GPT2LMHeadModel": dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)}


def build(dropout: float = 0.0, second: bool = False, name: str = NAME, **kw):
    """The zoo's model `name` with LoRA (a second adapter, rsLoRA with other r/alpha, with second=True)."""
    model = zoo.build(name)
    torch.manual_seed(7)
    peft_model = get_peft_model(model, lora_config(lora_dropout=dropout, **dict(MODEL_TARGETS[name], **kw)))
    if second:
        peft_model.add_adapter("second", lora_config(r=3, lora_alpha=5, use_rslora=True, lora_dropout=dropout))
    return peft_model


def shard_config(ctx, default_group: bool, **config) -> ShardConfig:
    """ShardConfig() (the world group: the pool's 4 ranks) or the pool's group of ctx.tp_size ranks."""
    if default_group:
        assert ctx.world_size == ctx.tp_size, "the default group is the world"
        return ShardConfig(**config)
    return ShardConfig(tensor_parallel_process_group=ctx.group, **config)


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _compare_params(sharded, ref, what: str, tol) -> float:
    """Every trainable parameter of `sharded` against this rank's shard of `ref`'s."""
    info, ref_params, worst = _shard_info(sharded), dict(ref.named_parameters()), 0.0
    for name, p in sharded.named_parameters():
        if not p.requires_grad:
            continue
        expected = ref_params[name].detach()
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(expected, dim, shard)
        worst = max(worst, assert_close(f"{what} {name}", p.detach(), expected, tol))
    return worst


def _assert_sharded(peft_model, ref) -> float:
    """The adapters were cut (column and row LoRA layers, fewer LoRA
    parameters on this rank); returns the local fraction."""
    full, local = (sum(p.numel() for p in _trainable(m)) for m in (ref, peft_model))
    assert local < full, f"{type(ref.get_base_model()).__name__}: {local} of {full} LoRA parameters on this rank: the adapters were not sharded"
    kinds = sorted({type(m).__name__ for m in peft_model.modules() if hasattr(m, "lora_A")})
    assert kinds == ["ColumnLoraLinear", "RowLoraLinear"], kinds
    return local / full


def train_matches(ctx, default_group: bool = False, steps: int = 2, name: str = NAME, config=None) -> dict:
    """Loss, every LoRA gradient (the base frozen) and the outputs and LoRA
    weights after AdamW steps equal the unsharded PeftModel's."""
    tol = TOL[torch.float32]
    peft_model = build(name=name)
    ref = copy.deepcopy(peft_model)
    ShardFormer(shard_config(ctx, default_group, **(config or {}))).optimize(peft_model)
    fraction = _assert_sharded(peft_model, ref)
    inputs = zoo.make_inputs(name)
    peft_model.train(), ref.train()
    opts = [torch.optim.AdamW(_trainable(m), lr=1e-2) for m in (peft_model, ref)]
    report = {"tp": ctx.tp_size, "lora_fraction": fraction, "loss": 0.0, "grad": 0.0, "weights": 0.0}
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        probe = {}
        out, exp = peft_model(**inputs), ref(**inputs)
        loss, ref_loss = loss_of(out, probe), loss_of(exp, probe)
        report["loss"] = max(report["loss"], assert_close(f"{name} step {step} loss", loss, ref_loss, tol))
        loss.backward()
        ref_loss.backward()
        with_grad = sum(1 for p in _trainable(peft_model) if p.grad is not None and p.grad.abs().max() > 0)
        assert with_grad == len(_trainable(peft_model)), f"{with_grad} of the LoRA parameters got a gradient"
        report["grad"] = max(report["grad"], compare_grads(peft_model, ref, f"{name} step {step}", tol))
        for opt in opts:
            opt.step()
        report["weights"] = max(report["weights"], _compare_params(peft_model, ref, f"after AdamW step {step}", tol))
    with torch.no_grad():
        check_outputs(f"{name} after AdamW", peft_model(**inputs), ref(**inputs), tol)
    return report


def adapters_match(ctx) -> dict:
    """Eval with lora_dropout > 0, two adapters (set_adapter, rsLoRA scaling,
    another alpha), disable_adapter(): the outputs equal the unsharded model's."""
    tol = TOL[torch.float32]
    peft_model = build(dropout=0.3, second=True)
    ref = copy.deepcopy(peft_model)
    ShardFormer(shard_config(ctx, False)).optimize(peft_model)
    _assert_sharded(peft_model, ref)
    peft_model.eval(), ref.eval()
    inputs = zoo.make_inputs(NAME)
    report = {}
    with torch.no_grad():
        for adapter in ("default", "second", "default"):
            peft_model.set_adapter(adapter), ref.set_adapter(adapter)
            report[adapter] = max(check_outputs(f"{NAME} adapter {adapter}", peft_model(**inputs),
                                                ref(**inputs), tol).values())
        with peft_model.disable_adapter(), ref.disable_adapter():
            base = check_outputs(f"{NAME} adapters disabled", peft_model(**inputs), ref(**inputs), tol)
            report["disabled"] = max(base.values())
        again = check_outputs(f"{NAME} re-enabled", peft_model(**inputs), ref(**inputs), tol)
        report["enabled"] = max(again.values())
        try:
            peft_model(**inputs, adapter_names=["default", "second"])
        except NotImplementedError as e:
            assert "adapter_names" in str(e), str(e)
        else:
            raise AssertionError("adapter_names= (mixed batches) was not refused")
    return report


def save_and_merge(ctx, directory: str) -> dict:
    """save_pretrained on every rank writes (rank 0) the full adapter that
    PeftModel.from_pretrained loads into the unsharded base with the same
    outputs; merge_and_unload of the sharded model gives the shards of the
    unsharded merged weights, and the same outputs."""
    tol = TOL[torch.float32]
    peft_model = build()
    ref = copy.deepcopy(peft_model)
    ShardFormer(shard_config(ctx, False)).optimize(peft_model)
    _assert_sharded(peft_model, ref)
    inputs = zoo.make_inputs(NAME)
    peft_model.eval(), ref.eval()
    peft_model.save_pretrained(directory)
    files = sorted(os.listdir(directory))
    loaded = PeftModel.from_pretrained(zoo.build(NAME), directory).eval()
    with torch.no_grad():
        report = {"files": files, "loaded": max(check_outputs("loaded adapter", loaded(**inputs),
                                                              ref(**inputs), tol).values())}
    with torch.no_grad():
        peft_model.merge_adapter(), ref.merge_adapter()
        report["merge_adapter"] = max(check_outputs("merge_adapter", peft_model(**inputs), ref(**inputs),
                                                    tol).values())
        peft_model.unmerge_adapter(), ref.unmerge_adapter()
        report["unmerge_adapter"] = max(check_outputs("unmerge_adapter", peft_model(**inputs), ref(**inputs),
                                                      tol).values())
    merged, ref_merged = peft_model.merge_and_unload(), ref.merge_and_unload()
    assert not any(hasattr(m, "lora_A") for m in merged.modules()), "merge_and_unload left LoRA layers"
    info, ref_params, worst = _shard_info(merged), dict(ref_merged.named_parameters()), 0.0
    for name, p in merged.named_parameters():
        expected = ref_params[name].detach()
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(expected, dim, shard)
        worst = max(worst, assert_close(f"merged {name}", p.detach(), expected, tol))
    report["merged_weights"] = worst
    with torch.no_grad():
        report["merged"] = max(check_outputs("merged", merged(**inputs), ref_merged(**inputs), tol).values())
    return report


def after_optimize_matches(ctx, directory: str) -> dict:
    """shardformer.lora.get_peft_model on an already-sharded model: the same
    adapters (rank 0's initialization) as peft.get_peft_model on the
    unsharded one, the same loss and LoRA gradients, and a save_pretrained
    that the unsharded base loads."""
    from shardformer.lora import get_peft_model as sharded_get_peft_model

    tol = TOL[torch.float32]
    model = zoo.build(NAME)
    ref_base = copy.deepcopy(model)
    ShardFormer(shard_config(ctx, False)).optimize(model)
    torch.manual_seed(7)
    peft_model = sharded_get_peft_model(model, lora_config(lora_dropout=0.1))
    torch.manual_seed(7)
    ref = get_peft_model(ref_base, lora_config(lora_dropout=0.1))
    _assert_sharded(peft_model, ref)
    report = {"weights": _compare_params(peft_model, ref, "initial", tol)}
    peft_model.eval(), ref.eval()        # lora_dropout > 0: eval
    inputs, probe = zoo.make_inputs(NAME), {}
    loss, ref_loss = loss_of(peft_model(**inputs), probe), loss_of(ref(**inputs), probe)
    report["loss"] = assert_close("loss", loss, ref_loss, tol)
    loss.backward()
    ref_loss.backward()
    report["grad"] = compare_grads(peft_model, ref, NAME, tol)
    peft_model.save_pretrained(directory)
    loaded = PeftModel.from_pretrained(zoo.build(NAME), directory).eval()
    with torch.no_grad():
        report["loaded"] = max(check_outputs("loaded", loaded(**inputs), ref(**inputs), tol).values())
    return report


def refusals(ctx) -> dict:
    """What is not supported is refused by name before anything changes."""
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group)
    messages = {}

    def refused(key, model, names, config=cfg):
        messages[key] = refused_unchanged(model, lambda: ShardFormer(config).optimize(model), key,
                                          NotImplementedError, structure=True, names=names)

    torch.manual_seed(7)
    refused("ia3", get_peft_model(zoo.build(NAME), IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                               feedforward_modules=["down_proj"])), ("IA3",))
    refused("lm_head", build(target_modules=["q_proj", "lm_head"]), ("lm_head", "VocabParallelLMHead1D"))
    refused("embedding", build(target_modules=["q_proj", "embed_tokens"]), ("embed_tokens", "Embedding"))
    refused("dora", build(use_dora=True), ("DoRA",))
    refused("modules_to_save", build(modules_to_save=["lm_head"]), ("modules_to_save",))
    inner = build()
    refused("inner", inner.base_model.model, ("PeftModel",))
    refused("all_to_all", build(), ("all_to_all",), ShardConfig(
        tensor_parallel_process_group=ctx.group, enable_tensor_parallelism=False,
        enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all"))
    from shardformer.lora import get_peft_model as sharded_get_peft_model

    model = zoo.build(NAME)
    ShardFormer(cfg).optimize(model)
    for key, config, names in (("pissa", lora_config(init_lora_weights="pissa"), ("pissa", "shard")),
                               ("after_ia3", IA3Config(target_modules=["k_proj"], feedforward_modules=[]), ("IA3",))):
        messages[key] = refused_unchanged(model, lambda: sharded_get_peft_model(model, config), key,
                                          NotImplementedError, structure=True, names=names)
    messages["peft_itself"] = refused_unchanged(model, lambda: get_peft_model(model, lora_config()), "peft",
                                                ValueError, structure=True, names=("Linear1D_Col",))
    return messages


class _Replayed(torch.nn.Module):
    """The unsharded model's dropout of one LoRA layer, replaying the full
    mask the sharded layer drew (x * keep / (1 - p))."""

    def __init__(self, keep: torch.Tensor, p: float):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return x * self.keep / (1.0 - self.p)


def dropout_matches(ctx, p: float = 0.4) -> dict:
    """Training with lora_dropout > 0: the sharded layers' masks are one
    unsharded mask (column layers: the same mask over X on every rank; row
    layers: each rank's own over its features), so the unsharded model fed
    those masks has the same loss and LoRA gradients."""
    from shardformer.distributed.mappings import gather_along

    tol = TOL[torch.float32]
    peft_model = build(dropout=p)
    ref = copy.deepcopy(peft_model)
    ShardFormer(shard_config(ctx, False)).optimize(peft_model)
    _assert_sharded(peft_model, ref)
    peft_model.train(), ref.train()
    kept, hooks = {}, []
    for path, m in peft_model.named_modules():
        if hasattr(m, "lora_A"):
            drop = m.lora_dropout["default"]
            hooks.append(drop.register_forward_hook(
                lambda mod, args, out, path=path: kept.__setitem__(path, (out != 0).to(out.dtype))))
    inputs, probe = zoo.make_inputs(NAME), {}
    loss = loss_of(peft_model(**inputs), probe)
    for h in hooks:
        h.remove()
    same = {}
    ref_layers = dict(ref.named_modules())
    for path, keep in kept.items():
        layer = peft_model.get_submodule(path)
        flat = keep.flatten().double()       # a fingerprint: the shapes of row layers' masks differ (uneven)
        mine = torch.stack([flat.new_tensor(flat.numel()), (flat * torch.arange(flat.numel()).double()).sum()])
        gathered = [torch.empty_like(mine) for _ in range(ctx.tp_size)]
        torch.distributed.all_gather(gathered, mine, group=ctx.group)
        same[type(layer).__name__] = same.get(type(layer).__name__, True) and \
            all(torch.equal(g, gathered[0]) for g in gathered)
        if type(layer).__name__ == "RowLoraLinear":          # this rank's features: the full mask gathered
            base = layer.get_base_layer()
            keep = gather_along(keep, keep.dim() - 1, base.shard, base.process_group)
        ref_layers[path].lora_dropout["default"] = _Replayed(keep, p)
    assert same == {"ColumnLoraLinear": True, "RowLoraLinear": False}, \
        f"masks equal across ranks by layer kind: {same} (expected column: the same, row: per rank)"
    ref_loss = loss_of(ref(**inputs), probe)
    report = {"loss": assert_close("loss with dropout", loss, ref_loss, tol)}
    loss.backward()
    ref_loss.backward()
    report["grad"] = compare_grads(peft_model, ref, f"{NAME} with lora_dropout={p}", tol)
    return report



def gather_input_refused(ctx, name: str, config: dict) -> str:
    """An adapter on a column layer that gathers its input rows itself
    (GPT-2's c_attn with sequence overlap) is refused by path before
    anything changes."""
    peft_model = build(name=name)
    cfg = shard_config(ctx, False, **config)
    return refused_unchanged(peft_model, lambda: ShardFormer(cfg).optimize(peft_model), "gather_input",
                             NotImplementedError, structure=True, names=("c_attn", "gather_input"))
