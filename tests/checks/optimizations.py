"""Rank-side checks of the optimizations the sharder applies by module type
(shardformer.optimizations, shardformer.attention): each function runs on
every rank of the pool."""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager

import torch

import zoo
from checks import parity
from shardformer import attention as sf_attention
from shardformer import ops

# The Python entry points of the C kernels in shardformer.ops the optimizations call.
COUNTED = ("layer_norm", "rms_norm", "swiglu", "bias_gelu", "bias_dropout_add", "attention")
# Every optimization switch on, as a user turns them on.
ALL_ON = {"enable_fused_normalization": True, "enable_jit_fused": True, "enable_flash_attention": True}
DROPOUT = 0.1


@contextmanager
def counting_calls(targets: dict):
    """Count the calls of each attribute `targets` names, {label: (owner,
    attribute)} (a module's function, a class's method), under its label."""
    calls = dict.fromkeys(targets, 0)
    saved = {label: getattr(owner, attr) for label, (owner, attr) in targets.items()}

    def wrap(label):
        def counted(*args, **kwargs):
            calls[label] += 1
            return saved[label](*args, **kwargs)
        return counted

    for label, (owner, attr) in targets.items():
        setattr(owner, attr, wrap(label))
    try:
        yield calls
    finally:
        for label, (owner, attr) in targets.items():
            setattr(owner, attr, saved[label])


def counting_kernels(names: tuple[str, ...] = COUNTED):
    """Count the calls of the C kernels' Python entry points `names` in shardformer.ops."""
    return counting_calls({name: (ops, name) for name in names})


# Second configurations of a class the zoo does not name: name -> (zoo name, config overrides)
VARIANTS = {
    # Falcon's new decoder architecture: two norms in parallel (ln_attn, ln_mlp), 2 KV heads
    "FalconForCausalLM/parallel_norms": ("FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2,
                                                               "multi_query": False}),
    # OPT-350m's post-norm layers (do_layer_norm_before=False): the fused layer form's other branch
    "OPTForCausalLM/post_norm": ("OPTForCausalLM", {"do_layer_norm_before": False}),
}


def zoo_name(name: str) -> str:
    return VARIANTS[name][0] if name in VARIANTS else name


def overrides(name: str) -> dict:
    """Config changes of the optimization runs: the VARIANTS'; Mistral's sliding
    window below the 8 tokens (the kernel's window); Gemma-2's attention logit
    soft-capping at 0.05, a cap that changes a tiny model's logits (the zoo's 50
    does not), computed by the kernel."""
    if name in VARIANTS:
        return dict(VARIANTS[name][1])
    if name.startswith("Mistral"):
        return {"sliding_window": 4}
    if name.startswith("Gemma2"):
        return {"attn_logit_softcapping": 0.05}
    return {}


def build(name: str):
    """`name` with every dropout probability of its config at DROPOUT (where it has any)."""
    try:
        return zoo.build_with_dropout(zoo_name(name), DROPOUT, **overrides(name))
    except AssertionError:            # a config without dropout probabilities
        return zoo.build(zoo_name(name), **overrides(name))


def optimized_matches(ctx, names: list[str]) -> dict:
    """For each of `names`: the model in eval mode with dropout > 0 in its config,
    sharded over ctx.group with every optimization switch on, equals the
    unsharded HF model from the same seed (forward, loss, every gradient, the
    outputs after an SGD step; parity.compare_sharded).  Returns, per name, the
    kernel calls counted during those sharded forwards (two: before and after the
    step) and the attention calls that fell back to the model's own attention."""
    from shardformer import ShardConfig, ShardFormer

    report = {}
    for name in names:
        torch.manual_seed(0)
        model = build(name).eval()
        ref = copy.deepcopy(model)
        fp64 = name in getattr(zoo.module_of(zoo_name(name)), "FP64_FLOOR", ())
        ref64 = copy.deepcopy(ref).double() if fp64 else None
        inputs = zoo.make_inputs(zoo_name(name))
        inputs64 = parity._double(inputs) if fp64 else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sharded, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **ALL_ON)).optimize(model)
            training = [n for n, m in sharded.named_modules() if m.training]
            assert not training, f"{name}: modules in training mode after optimize(): {training[:4]}"
            fallback = sf_attention.CALLS["fallback"]
            with counting_kernels() as calls:
                errors = parity.compare_sharded(sharded, ref, inputs, name, ref64=ref64, inputs64=inputs64)
        report[name] = {"calls": dict(calls), "fallback": sf_attention.CALLS["fallback"] - fallback,
                        "errors": errors}
    return report



# ---- attention outside transformers' registry: the kernel at the family's seam ----------------------------

def _seam_config(ctx, tensor_parallel: bool):
    from shardformer import ShardConfig

    return ShardConfig(tensor_parallel_process_group=ctx.group, enable_tensor_parallelism=tensor_parallel, **ALL_ON)


def _padded(inputs: dict, pad: int = 2) -> dict:
    """inputs with the first row left-padded by `pad` tokens (attention_mask),
    labels -100 where a padding query predicts.  The forward of a padding
    query (every key it may see hidden: the model spreads it over those keys)
    is the model's; its gradient is not (at scores of the dtype's minimum the
    kernel's log-sum-exp cannot resolve the spread), and reaches nothing
    real: no loss is taken there."""
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :pad] = 0
    labels = inputs["labels"].clone()
    labels[0, : pad + 1] = -100                      # label t is predicted at t - 1
    return {**inputs, "attention_mask": mask, "labels": labels}


def seam_kernel_matches(ctx, name: str, overrides: dict | None = None, padded: bool = False,
                        tensor_parallel: bool = True) -> dict:
    """`name` (a zoo config changed by `overrides`; its key
    "attn_implementation" set on the built model's config), eval mode with
    dropout > 0 configured, every optimization on (TP over ctx.group, or TP
    off), equals the unsharded model (compare_sharded: forward, loss, every
    gradient, after a step); the attention ran in the kernel (counted) and
    never fell back.  padded: a left-padded row (every row compared)."""
    from shardformer import ShardFormer

    overrides = dict(overrides or {})
    implementation = overrides.pop("attn_implementation", None)
    torch.manual_seed(0)
    model = zoo.build_with_dropout(name, DROPOUT, **overrides).eval()
    if implementation is not None:
        model.config._attn_implementation = implementation
    ref = copy.deepcopy(model)
    inputs = zoo.make_inputs(name)
    if padded:
        inputs = _padded(inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ShardFormer(_seam_config(ctx, tensor_parallel)).optimize(model)
        before = dict(sf_attention.CALLS)
        with counting_kernels(("attention",)) as calls:
            report = parity.compare_sharded(model, ref, inputs, name)
    assert calls["attention"] > 0, f"{name}: the kernel never ran"
    assert sf_attention.CALLS["fallback"] == before["fallback"], f"{name}: the attention fell back"
    report["kernel_calls"] = calls["attention"]
    return report


def seam_kernel_training(ctx, name: str, dropout_key: str, overrides: dict | None = None) -> dict:
    """Training mode, TP off, every optimization on.  Attention dropout 0:
    the kernel runs (counted) and the logits and every gradient equal the
    unsharded model's.  Attention dropout 0.3: the model's own attention
    runs (a fallback where the kernel ran at p = 0, no kernel call), so with the same seed the
    logits equal the unsharded model's exactly as its dropout draws them, and
    the draws are in force (another seed changes them)."""
    from shardformer import ShardFormer

    report, kernel_calls = {}, 0
    for p in (0.0, 0.3):
        torch.manual_seed(0)
        model = zoo.build(name, **{dropout_key: p, **(overrides or {})}).train()
        ref = copy.deepcopy(model)
        inputs = zoo.make_inputs(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ShardFormer(_seam_config(ctx, False)).optimize(model)
            fallback = sf_attention.CALLS["fallback"]
            with counting_kernels(("attention",)) as calls:
                torch.manual_seed(5)
                got = model(**inputs)
            torch.manual_seed(5)
            exp = ref(**inputs)
        fell_back = sf_attention.CALLS["fallback"] - fallback
        tol = parity.TOL[torch.float32]
        report[p] = parity.assert_close(f"{name} p={p} logits", got.logits, exp.logits, tol)
        if p == 0.0:
            kernel_calls = calls["attention"]
            assert kernel_calls > 0 and fell_back == 0, (name, p, calls, fell_back)
            got.loss.backward()
            exp.loss.backward()
            parity.compare_grads(model, ref, name, tol)
        else:
            assert calls["attention"] == 0 and fell_back == kernel_calls, (name, calls, fell_back)
            torch.manual_seed(6)
            assert not torch.allclose(model(**inputs).logits, got.logits), f"{name}: dropout {p} changes nothing"
    return report


def seam_weights_fall_back(ctx, name: str) -> dict:
    """output_attentions=True with the kernel on: the model's own attention
    returns its weights (one fallback per layer), equal to the unsharded
    model's."""
    from shardformer import ShardFormer

    torch.manual_seed(0)
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    inputs = zoo.make_inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ShardFormer(_seam_config(ctx, True)).optimize(model)
        fallback = sf_attention.CALLS["fallback"]
        with torch.no_grad():
            got, exp = model(**inputs, output_attentions=True), ref(**inputs, output_attentions=True)
    assert sf_attention.CALLS["fallback"] - fallback == model.config.num_hidden_layers
    assert got.attentions is not None and all(a is not None for a in got.attentions), name
    return {"layers": len(got.attentions), "logits": parity.assert_close(
        f"{name} logits", got.logits, exp.logits, parity.TOL[torch.float32])}


def seam_kernel_generate(ctx, name: str, overrides: dict | None = None) -> list:
    """Greedy generate() (a KV cache: the kernel on one query row over the
    cached keys, bottom-right aligned) at TP over ctx.group with the kernel
    equals the unsharded model's; the kernel ran (counted)."""
    from shardformer import ShardFormer

    model = zoo.build(name, **(overrides or {})).eval()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ShardFormer(_seam_config(ctx, not (overrides or {}).get("alibi"))).optimize(model)
    with counting_kernels(("attention",)) as calls:
        got = parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, 5)
    assert calls["attention"] >= 5 * model.config.num_hidden_layers, (name, calls)
    return got.tolist()


def sam_mlp_each_activation(ctx) -> dict:
    """SamModel with enable_jit_fused (at TP = the world: the plain
    ShardConfig()): its MLP class SamMLPBlock, GeLU in the vision encoder and
    ReLU in the mask decoder, gets one forward that runs each instance's own
    activation, the GeLU by the bias_gelu kernel: exactly one kernel call per
    vision layer per forward (two forwards: before and after the step), none
    for the mask decoder's ReLU blocks; equal to the unsharded model (forward,
    loss, every gradient, after a step)."""
    from shardformer import ShardConfig, ShardFormer

    torch.manual_seed(0)
    model = zoo.build("SamModel").train()
    ref = copy.deepcopy(model)
    group = {} if ctx.tp_size == ctx.world_size else {"tensor_parallel_process_group": ctx.group}
    sharded, _ = ShardFormer(ShardConfig(enable_jit_fused=True, **group)).optimize(model)
    mlps = [m for m in sharded.modules() if type(m).__name__ == "SamMLPBlock"]
    relu = [m for m in mlps if isinstance(m.act, torch.nn.ReLU)]
    assert relu and len(relu) < len(mlps), f"SamModel: {len(relu)} ReLU MLPs of {len(mlps)}"
    with counting_kernels(("bias_gelu",)) as calls:
        errors = parity.compare_sharded(sharded, ref, zoo.make_inputs("SamModel"), "SamModel (jit fused)")
    layers = sharded.config.vision_config.num_hidden_layers
    assert calls["bias_gelu"] == 2 * layers, f"SamModel: {calls['bias_gelu']} bias_gelu calls, expected 2 x {layers}"
    return {"calls": dict(calls), "errors": errors}
