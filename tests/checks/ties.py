"""Rank-side checks of tied parameters (tests/test_ties.py): a parameter
reachable under several names is one parameter on every rank after
optimize(), eager and under lazy_init(), and the model trains like the
unsharded one (logits, loss, every gradient, the weights after one SGD and
one AdamW step); ties the plan would split differently are refused."""
from __future__ import annotations

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer, lazy_init
from shardformer.checkpoint import _shard_info
from shardformer.layer.parallel_module import shard_of

# Each tie: (kind, destination, source).  "param": destination's parameter is
# the source's; "module": the destination module is the source module.
TIES = {
    # Llama: a row-parallel weight (down_proj) and a column-parallel one split
    # by heads (q_proj) shared by two layers, a column-parallel module (up_proj)
    # shared by two layers, a replicated norm weight, and two tied pairs at once.
    "LlamaForCausalLM": [
        ("param", "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
        ("param", "model.layers.2.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("module", "model.layers.2.mlp.up_proj", "model.layers.1.mlp.up_proj"),
        ("param", "model.layers.2.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ],
    # Mistral: a whole MLP shared by two layers, a KV projection shared.
    "MistralForCausalLM": [
        ("module", "model.layers.1.mlp", "model.layers.0.mlp"),
        ("param", "model.layers.1.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.weight"),
    ],
    # Qwen3: its q_norm is replicated in the TP region (gradient all-reduced
    # once per backward): shared by two layers, and one module as q_norm and k_norm.
    "Qwen3ForCausalLM": [
        ("param", "model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
        ("module", "model.layers.1.self_attn.k_norm", "model.layers.1.self_attn.q_norm"),
    ],
}


def _set(model, path: str, value) -> None:
    owner, _, attr = path.rpartition(".")
    setattr(model.get_submodule(owner), attr, value)


def tie(model, ties):
    """Apply `ties` (TIES entries) to `model`; returns it."""
    for kind, dst, src in ties:
        _set(model, dst, model.get_parameter(src) if kind == "param" else model.get_submodule(src))
    return model


def build_tied(name: str, layers: int = 3, lazy: bool = False, dtype=torch.float32):
    """The zoo's `name` with `layers` layers, seed 0, in `dtype`, with its TIES applied."""
    if lazy:
        with lazy_init():
            model = zoo.build(name, num_hidden_layers=layers)
    else:
        model = zoo.build(name, num_hidden_layers=layers)
    return tie(model.to(dtype), TIES[name])


def assert_tied(model, name: str, ties) -> int:
    """Every tie holds: one object under both names."""
    for kind, dst, src in ties:
        get = model.get_parameter if kind == "param" else model.get_submodule
        assert get(dst) is get(src), f"{name}: {dst} is no longer {src} after optimize()"
    return len(ties)


def _weights_match(sharded, ref, what: str) -> float:
    """Every parameter of `sharded` equals this rank's part of `ref`'s."""
    info = _shard_info(sharded)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for pname, p in sharded.named_parameters():
        expected = ref_params[pname].detach()
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(expected, dim, shard)
        worst = max(worst, parity.assert_close(f"{what}: {pname}", p, expected, parity.TOL[torch.float32]))
    return worst


def trains_like_unsharded(ctx, name: str, lazy: bool, default_group: bool) -> dict:
    """A tied model sharded over ctx.group (or ShardConfig()'s default group,
    the world) against the unsharded tied model from the same seed: logits,
    loss, every gradient; weights and logits after one SGD step, then after
    one AdamW step; the ties hold on the sharded model.

    In float64, compared with float32's tolerances, and AdamW with eps=1e-3:
    AdamW's first step moves each weight by lr * g / (|g| + eps), about
    lr * sign(g), so with the default eps (1e-8) a weight whose gradient is
    at the rounding floor would move by its rounding, not by its value (HF's
    RMSNorms compute in float32 even in a float64 model).  With eps=1e-3 the
    step is within lr / eps = 10 times the gradient's error, and a broken
    tie (a gradient missing a use) still moves weights by O(lr)."""
    torch.manual_seed(0)
    ref = build_tied(name, dtype=torch.float64)
    model = build_tied(name, lazy=lazy, dtype=torch.float64)
    ties = TIES[name]
    cfg = ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)
    full = sum(p.numel() for p in ref.parameters())
    ShardFormer(cfg).optimize(model)
    report = {"ties": assert_tied(model, name, ties), "params": sum(p.numel() for p in model.parameters()) / full}
    assert report["params"] < 1, f"{name}: nothing was sharded"
    assert len(list(model.parameters())) == len(list(ref.parameters())), \
        f"{name}: {len(list(model.parameters()))} distinct parameters sharded, {len(list(ref.parameters()))} unsharded"
    inputs = zoo.make_inputs(name)
    tol = parity.TOL[torch.float32]
    for step, make_opt in (("SGD", lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
                           ("AdamW", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3))):
        opts = [make_opt(model), make_opt(ref)]
        for opt in opts:
            opt.zero_grad()
        out, exp = model(**inputs), ref(**inputs)
        report[f"logits before {step}"] = max(parity.check_outputs(name, out, exp, tol).values())
        report[f"loss before {step}"] = parity.assert_close(f"{name} loss", out.loss, exp.loss, tol)
        out.loss.backward()
        exp.loss.backward()
        report[f"grad before {step}"] = parity.compare_grads(model, ref, name, tol)
        for opt in opts:
            opt.step()
        report[f"weights after {step}"] = _weights_match(model, ref, f"{name} after {step}")
    with torch.no_grad():
        report["logits after both"] = max(parity.check_outputs(name, model(**inputs), ref(**inputs), tol).values())
    assert_tied(model, name, ties)
    return report


def lazy_equals_eager_tied(ctx, name: str) -> int:
    """The tied model built under lazy_init() and sharded equals the eager
    one sharded, tensor for tensor, with as many distinct parameters, its
    ties held."""
    models = []
    for lazy in (False, True):
        model = build_tied(name, lazy=lazy)
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
        assert_tied(model, name, TIES[name])
        models.append(model)
    eager, lazy_model = models
    e, z = eager.state_dict(), lazy_model.state_dict()
    differ = [k for k in e if not torch.equal(e[k], z[k])]
    assert not differ, f"{name}: lazy differs from eager at {differ[:5]}"
    assert len(list(eager.parameters())) == len(list(lazy_model.parameters()))
    return len(list(eager.parameters()))


def different_styles_refused(ctx, dst: str, src: str) -> str:
    """A tie between modules the plan splits differently is refused, naming
    both, before anything changes."""
    model = tie(zoo.build("LlamaForCausalLM"), [("param", dst, src)])
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group)
    return parity.refused_unchanged(model, lambda: ShardFormer(cfg).optimize(model), "a tie split two ways",
                                    structure=True, names=(dst.rpartition(".")[0], src.rpartition(".")[0],
                                                           "Linear1D_Col", "Linear1D_Row"))



# Pipeline parallelism, 4 layers on 2 stages (layers 0-1 | 2-3): ties inside a stage.
PP_TIES = [
    ("param", "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ("module", "model.layers.3.self_attn.q_proj", "model.layers.2.self_attn.q_proj"),
]


def pipelined_ties_within_a_stage(ctx, tp: int) -> dict:
    """PP=2 (x TP=tp over the 4 ranks) of a Llama whose ties stay inside a
    stage: the pipelined loss and the state dict after one SGD step equal
    the unsharded tied model's (pipeline.equals_unsharded on the tied
    model), and every tie this rank holds is one object."""
    from checks import pipeline

    build, pipelined = pipeline.build, pipeline.pipelined

    def tied_build(name, layers, **overrides):
        return tie(build(name, layers, **overrides), PP_TIES)

    held = []

    def checked(*args, **kwargs):
        ref, model, sm, shared = pipelined(*args, **kwargs)
        for kind, dst, src in PP_TIES:
            get = model.get_parameter if kind == "param" else model.get_submodule
            try:
                a, b = get(dst), get(src)
            except AttributeError:
                continue                          # the other stage's layers
            assert a is b, f"{dst} is no longer {src} on pipeline stage {sm.stage}"
            held.append(dst)
        return ref, model, sm, shared

    pipeline.build, pipeline.pipelined = tied_build, checked
    try:
        report = pipeline.equals_unsharded(ctx, "LlamaForCausalLM", 2, "1f1b", 2, tp=tp)
    finally:
        pipeline.build, pipeline.pipelined = build, pipelined
    assert len(held) == 1, f"this rank holds {held}, expected one of the two ties"
    return report


def pipelined_tie_across_stages_refused(ctx) -> str:
    """A tie between layers on different pipeline stages is refused by name
    (both parameters, both stages), before anything changes."""
    from checks import pipeline
    from shardformer.pipeline import PipelineStageManager

    tp_group, pp_group = pipeline.groups(ctx, 2, 2)
    dst, src = "model.layers.2.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"
    model = tie(pipeline.build("LlamaForCausalLM", 4), [("param", dst, src)])
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group))
    return parity.refused_unchanged(model, lambda: ShardFormer(cfg).optimize(model), "a tie across stages",
                                    structure=True, names=(dst, src, "pipeline stages (0 and 1)"))
