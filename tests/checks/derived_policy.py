"""Rank-side checks of policies derived from a model's tensor-parallel plan
(shardformer.derived_policy): tiny random models of transformers
architectures that have no built-in policy but carry a plan (hidden 64,
2 layers, 4 query heads over 2 KV heads, 90 MLP features, a vocabulary of
101), sharded by optimize() without a policy, against the unsharded model
from the same seed (checks.parity)."""
from __future__ import annotations

import pytest
import torch
import transformers

from checks import parity
from shardformer import ShardConfig, ShardFormer

BATCH, SEQ = 2, 8
BASE = dict(hidden_size=64, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)
MOE = dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=32, router_jitter_noise=0.0)

# {name: (ForCausalLM class, config overrides)}
MODELS = {
    "Apertus": ("ApertusForCausalLM", {}),
    "Arcee": ("ArceeForCausalLM", {}),
    "Cohere": ("CohereForCausalLM", {}),
    "Cohere2": ("Cohere2ForCausalLM", {"sliding_window": 4}),
    "Ernie4_5": ("Ernie4_5ForCausalLM", {}),
    "Exaone4": ("Exaone4ForCausalLM", {"sliding_window": 4}),
    "GPTNeoX": ("GPTNeoXForCausalLM", {"num_key_value_heads": None, "head_dim": None, "hidden_dropout": 0.0,
                                       "rotary_pct": 0.5}),
    "Glm4": ("Glm4ForCausalLM", {}),
    "Granite": ("GraniteForCausalLM", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                       "logits_scaling": 4.0, "attention_multiplier": 0.2}),
    "Helium": ("HeliumForCausalLM", {}),
    "Jais2": ("Jais2ForCausalLM", {}),
    "Ministral": ("MinistralForCausalLM", {"sliding_window": 4, "layer_types": ["full_attention",
                                                                                "sliding_attention"]}),
    "Olmo": ("OlmoForCausalLM", {"clip_qkv": 5.0}),
    "Olmo2": ("Olmo2ForCausalLM", {}),
    "Olmo3": ("Olmo3ForCausalLM", {"sliding_window": 4}),
    "Phi": ("PhiForCausalLM", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "partial_rotary_factor": 0.5}),
    "SeedOss": ("SeedOssForCausalLM", {"residual_dropout": 0.0}),
    "SmolLM3": ("SmolLM3ForCausalLM", {}),
    "Starcoder2": ("Starcoder2ForCausalLM", {"residual_dropout": 0.0, "embedding_dropout": 0.0}),
    "VaultGemma": ("VaultGemmaForCausalLM", {"query_pre_attn_scalar": 16, "sliding_window": 4}),
    "Olmoe": ("OlmoeForCausalLM", dict(MOE, intermediate_size=32)),
    "Qwen3Moe": ("Qwen3MoeForCausalLM", dict(MOE, decoder_sparse_step=1, mlp_only_layers=[1])),
}
MODELS.update({n: (f"{n}ForCausalLM", dict(MOE)) for n in (
    "Cwm", "Ernie4_5_Moe", "Gemma4Unified", "Glm4Moe", "HYV3", "HrmText", "HyperCLOVAX", "Mellum",
    "Ministral3", "NanoChat", "SolarOpen",
    # plans that leave part of the model replicated (e.g. Qwen2-MoE's experts, OLMo-Hybrid's
    # linear-attention layers): sharded as the plan says, no more
    "ExaoneMoe", "OlmoHybrid", "Qwen2Moe")})
# Experts whose grouped matmul wants 16-byte aligned strides: 96 features.
MODELS.update({n: (f"{n}ForCausalLM", dict(MOE, intermediate_size=96))
               for n in ("AriaText", "Cohere2Moe", "FlexOlmo", "MiniMax")})
# Heads that do not divide the ranks: 6 query heads over 2 KV heads (uneven at TP=4),
# one KV head (replicated on every rank), and GPT-NeoX's fused per-head qkv with 6 heads.
MODELS.update({
    "Arcee-6heads": ("ArceeForCausalLM", {"hidden_size": 48, "num_attention_heads": 6}),
    "SmolLM3-1kv": ("SmolLM3ForCausalLM", {"num_key_value_heads": 1}),
    "GPTNeoX-6heads": ("GPTNeoXForCausalLM", dict(MODELS["GPTNeoX"][1], hidden_size=48, num_attention_heads=6)),
})
# Multi-head latent attention (mla_kv_a_proj): latent ranks, rotary, no-rope and value widths
# that all differ, so a per-head block cut in the wrong place shows; every head its own keys.
MLA = dict(q_lora_rank=24, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, head_dim=8,
           num_key_value_heads=4)
DEEPSEEK = dict(MLA, **MOE, n_routed_experts=3, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
DSA = dict(index_topk=5, index_head_dim=16, index_n_heads=4)
MODELS.update({
    "DeepseekV2": ("DeepseekV2ForCausalLM", DEEPSEEK),
    # no query LoRA (q_proj split by heads), 6 heads: uneven at TP=4
    "DeepseekV2-qproj-6heads": ("DeepseekV2ForCausalLM", dict(DEEPSEEK, q_lora_rank=None, hidden_size=48,
                                                              num_attention_heads=6, num_key_value_heads=6)),
    # the experts' grouped_gemm entries of DeepSeek-V2's expert-parallel plan, its ep_router left out
    "DeepseekV2-grouped_gemm": ("DeepseekV2ForCausalLM", DEEPSEEK),
    # DeepSeek-V3's own plan leaves the attention replicated; "-mla" adds DeepSeek-V2's attention entries
    "DeepseekV3": ("DeepseekV3ForCausalLM", DEEPSEEK),
    "DeepseekV3-mla": ("DeepseekV3ForCausalLM", DEEPSEEK),
    "MiniCPM3": ("MiniCPM3ForCausalLM", MLA),
    "Glm4MoeLite": ("Glm4MoeLiteForCausalLM", dict(DEEPSEEK)),
    # DeepSeek Sparse Attention: latent attention with a token indexer (kept whole) that keeps
    # 5 of the keys, fewer than the 8 tokens, so its mask matters
    "DeepseekV32": ("DeepseekV32ForCausalLM", dict(DEEPSEEK, **DSA)),
    "GlmMoeDsa": ("GlmMoeDsaForCausalLM", dict(DEEPSEEK, **DSA)),
    # latent attention whose q_gate_proj holds per head [q_nope | q_pe | output gate] blocks, with an indexer
    "AXK2": ("AXK2ForCausalLM", dict(DEEPSEEK, **DSA)),
    # Mistral 4 and Kimi Linear: plans that leave their latent attention out (as DeepSeek-V3's), split by
    # heads by derived_policy.latent_attention_supplement.  Mistral 4 derives head_dim (qk_nope + qk_rope)
    # and its rotary fraction (qk_rope / head_dim) itself; a head_dim passed in is set after that and
    # shrinks the rotary width (int(8 * 0.4) = 3 features against q's 8): left out.
    "Mistral4": ("Mistral4ForCausalLM", dict(DEEPSEEK, head_dim=None)),
    # Kimi Linear: layer 1 Kimi Delta Attention (linear attention, 4 heads of 16, left replicated by the
    # plan), layer 2 latent attention.  Its default makes every layer linear attention, at any size; then
    # the model's own forward fails with its cache on (transformers 5.18: Cache.get_seq_length raises on
    # a cache of linear-attention layers only), so the test config keeps one full-attention layer.
    "KimiLinear": ("KimiLinearForCausalLM", dict(DEEPSEEK, linear_attn_config={
        "full_attn_layers": [2], "kda_layers": [1], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4})),
})

# Latent attention keeps its low-rank path (q_a_proj, kv_a_proj_with_mqa, their norms) whole on
# every rank: at this tiny size that is about 5% of the model, so a rank holds a bit over 0.6.
LATENT_ATTENTION = tuple(n for n in MODELS if n.startswith(("Deepseek", "MiniCPM3", "Glm4MoeLite", "GlmMoeDsa", "AXK2",
                                                            "Mistral4", "KimiLinear")))
# The plans that leave latent attention out (latent_attention_supplement splits it).
LATENT_SUPPLEMENTED = ("DeepseekV3", "Mistral4", "KimiLinear")


def _deepseek_v2_plan(kind: str) -> dict:
    """Entries of DeepSeek-V2's config plans, prefixed like a resolved plan:
    `attention` its attention entries, `grouped_gemm` its expert-parallel
    plan's expert entries (ep_router left out), `ep` that whole plan."""
    cfg = transformers.DeepseekV2Config
    if kind == "attention":
        return {f"model.{k}": v for k, v in cfg.base_model_tp_plan.items() if ".self_attn." in k}
    ep = {f"model.{k}": v for k, v in cfg.base_model_ep_plan.items()}
    return ep if kind == "ep" else {k: v for k, v in ep.items() if v != "ep_router"}


# {name: plan kind}: plans edited before optimize() (the model's resolved plan updated)
PLAN_EDITS = {"DeepseekV2-grouped_gemm": "grouped_gemm", "DeepseekV3-mla": "attention"}
# Checked only at the pinned transformers version: {name: (version, why)}.
PINNED_ONLY = {
    "Gemma4Unified": ("5.18.0", "transformers 5.15's Gemma4 config sets its layer types per process "
                                "(the ranks build different models: the replica check refuses them)"),
    "Llama4": ("5.18.0", "transformers 5.15's Llama4 plan has no moe_tp_experts style to refuse"),
    "MiMoV2Flash": ("5.18.0", "transformers 5.15 registers the rotary buffers in a per-process order (a set): "
                              "the replica check refuses the ranks' models before the plan is read"),
}
PARTIAL_PLANS = ("AriaText", "Cohere2Moe", "ExaoneMoe", "OlmoHybrid", "Qwen2Moe", "KimiLinear")
# Reductions in another order: allow the unsharded float32 model's own distance from float64.
FP64_FLOOR = ("Gemma4Unified",)
# Plans (or modules) that cannot be honoured: {name: (class, overrides, what the refusal names)}.
REFUSED = {
    "Doge": ("DogeForCausalLM", dict(MOE), ("'colwise'", "model.layers.0.self_attn.A", "DogeForCausalLM")),
    "GraniteSWA": ("GraniteSWAForCausalLM", dict(MOE),
                   ("'colwise'", "model.layers.0.self_attn.sinks", "GraniteSWAForCausalLM")),
    "Laguna": ("LagunaForCausalLM", dict(MOE), ("'colwise'", "model.layers.0.self_attn.g_proj", "LagunaForCausalLM")),
    "MiMoV2Flash": ("MiMoV2FlashForCausalLM", dict(MOE),
                    ("'colwise'", "model.layers.0.self_attn.v_proj", "MiMoV2FlashForCausalLM")),
    "Llama4": ("Llama4ForCausalLM", dict(MOE),
               ("'moe_tp_experts'", "model.layers.0.feed_forward.experts", "Llama4ForCausalLM")),
    # latent attention with attention sinks split by heads (a parameter the plan calls colwise)
    "HYV4": ("HYV4ForCausalLM", dict(MOE), ("'colwise'", "model.layers.0.self_attn.sinks", "HYV4ForCausalLM")),
    # zero-compute experts (moe_identity_expert) have no shardformer mapping
    "LongcatFlash": ("LongcatFlashForCausalLM", dict(DEEPSEEK, expert_ffn_hidden_size=32, ffn_hidden_size=90,
                                                     zero_expert_num=2, num_layers=2),
                     ("'moe_identity_expert'", "LongcatFlashForCausalLM")),
    "Inkling": ("InklingForCausalLM", dict(MOE), ("'all_reduce'", "InklingForCausalLM")),
}

# Overrides whose None is meant (elsewhere None drops the key: the config's default applies).
KEEP_NONE = ("q_lora_rank",)


def available(names, table) -> list:
    """The names whose class this transformers has (the lower end of the supported range has
    fewer architectures, and some plans differ there)."""
    out = []
    for name in names:
        cls = table[name][0]
        if not hasattr(transformers, cls):
            out.append(pytest.param(name, marks=pytest.mark.skip(
                reason=f"transformers {transformers.__version__} has no {cls}")))
        elif name in PINNED_ONLY and transformers.__version__ != PINNED_ONLY[name][0]:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=PINNED_ONLY[name][1])))
        else:
            out.append(name)
    return out


def config_of(name: str, **extra):
    cls_name, overrides = MODELS[name] if name in MODELS else REFUSED[name][:2]
    cls = getattr(transformers, cls_name)
    kwargs = {k: v for k, v in {**BASE, **overrides, **extra}.items() if v is not None or k in KEEP_NONE}
    if name == "GPTNeoX":
        kwargs.pop("num_key_value_heads", None)
    config = cls.config_class(**kwargs)
    config._attn_implementation = "eager"
    return cls, config

def build(name: str, seed: int = 0, **extra):
    cls, config = config_of(name, **extra)
    torch.manual_seed(seed)
    model = cls(config)
    if name in PLAN_EDITS:
        model._tp_plan = dict(model._tp_plan, **_deepseek_v2_plan(PLAN_EDITS[name]))
    return model

def make_inputs(name: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, BASE["vocab_size"], (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}

# ---- rank functions ----

def counting_layers():
    """Count the forwards of the layers the MoE and latent-attention styles map
    to: FusedExperts1D (moe_tp_experts, grouped_gemm) and the rotary-key
    gradient hook of SharedRopeKeyProjection (mla_kv_a_proj)."""
    from checks.optimizations import counting_calls
    from shardformer.layer import replicated
    from shardformer.layer.moe import FusedExperts1D

    return counting_calls({"experts": (FusedExperts1D, "forward"), "rope_grad": (replicated._RopeGradSync, "_hook")})


def check(ctx, name: str):
    with counting_layers() as calls:
        report = parity.check_sharded(ctx, lambda: build(name), make_inputs(name), name=name,
                                      fp64_floor=name in FP64_FLOOR)
    report["calls"] = dict(calls)
    return report

def generate_matches(ctx, name: str, new_tokens: int = 5):
    model, ref = parity.sharded_pair(ctx, build(name))
    return parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, new_tokens).tolist()

def refused(ctx, name: str, expect: tuple[str, ...], plan_edit: dict | None = None):
    """optimize() refuses the model (its plan edited by `plan_edit`,
    {path: style}), leaving it unchanged; the message names each of `expect`."""
    model = build(name)
    if plan_edit:
        model._tp_plan = dict(model._tp_plan, **plan_edit)
    shard_config = ShardConfig(tensor_parallel_process_group=ctx.group)
    message = parity.refused_unchanged(model, lambda: ShardFormer(shard_config).optimize(model), f"{name} plan",
                                       names=tuple(expect))
    assert not any(type(m).__module__.startswith("shardformer") for m in model.modules()), "a module was swapped"
    return message


def with_all_optimizations(ctx, name: str) -> dict:
    """A derived plan with enable_all_optimization: the fused norms, MLP
    activation and attention apply by module type as on built-in policies
    (their C kernels counted), and the model still equals the unsharded one."""
    from checks.optimizations import counting_kernels

    with counting_kernels() as calls:
        report = parity.check_sharded(ctx, lambda: build(name), make_inputs(name), name=name,
                                      config={"enable_all_optimization": True})
    report["calls"] = dict(calls)
    return report


def parallel_output(ctx, name: str) -> dict:
    """parallel_output=True on a derived plan: the head keeps its vocabulary
    shard and HF's loss_function runs on it (shardformer.lm_loss), equal to
    the unsharded model (checks.lm_loss.compare)."""
    from checks import lm_loss

    torch.manual_seed(0)
    return lm_loss.compare(ctx, build(name), make_inputs(name), name)


def pipelined(ctx, name: str, tp: int = 2, sp_mode: str | None = None, seq: int | None = None) -> dict:
    """TP=tp x PP=2 (1F1B, 2 micro-batches) on a derived plan, its stage split
    from the config's base_model_pp_plan: the loss equals the unsharded
    model's, and the gathered state dict after an SGD step too.  sp_mode:
    sequence parallelism inside the stages (split_gather with TP; all_to_all /
    ring_attn over the stage's tp ranks with TP off), the split path
    counted; seq: the batch cut to its first `seq` tokens."""
    import copy

    from checks import pipeline as pipeline_check
    from shardformer.pipeline import OneForwardOneBackwardSchedule, PipelineStageManager

    tp_group, pp_group = pipeline_check.groups(ctx, 2, tp)
    torch.manual_seed(0)
    model = build(name, num_hidden_layers=4)
    model.train()
    ref = copy.deepcopy(model)
    sm = PipelineStageManager(pp_group)
    sp = {} if sp_mode is None else {"enable_sequence_parallelism": True, "sequence_parallelism_mode": sp_mode}
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                      enable_tensor_parallelism=tp > 1 and sp_mode in (None, "split_gather"), **sp)
    model, _ = ShardFormer(cfg).optimize(model)
    batch = {k: torch.cat([v, make_inputs(name, seed=2)[k]]) for k, v in make_inputs(name).items()}
    if seq is not None:
        batch = {k: v[:, :seq].contiguous() for k, v in batch.items()}
    from shardformer.layer import sequence_attention as sa
    from shardformer.layer.sequence import _Regathered

    counter = (lambda: _Regathered.gathers) if sp_mode == "split_gather" else (lambda: sa.CALLS.get(sp_mode, 0))
    before = counter()
    out = OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward_backward_step(model, batch)
    assert sp_mode is None or counter() > before, f"{name}: the {sp_mode} path never ran on stage {sm.stage}"
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    err = parity.assert_close(f"{name} pipelined loss", out["loss"], ref_loss.detach(), (1e-5, 1e-6))
    pipeline_check.stepped_states_equal(model, ref, name)
    return {"loss": err}


def eval_with_dropout(ctx, name: str, p: float = 0.3) -> float:
    """In eval mode with attention dropout p configured, the sharded model's
    logits equal the unsharded model's (dropout off on both)."""
    model, ref = parity.sharded_pair(ctx, build(name, attention_dropout=p))
    inputs = {"input_ids": make_inputs(name)["input_ids"]}
    with torch.no_grad():
        got, exp = model(**inputs).logits, ref(**inputs).logits
    return parity.assert_close(f"{name} eval logits (dropout {p})", got, exp, parity.TOL[torch.float32])


def pipeline_refused(ctx, name: str, expect: tuple[str, ...]) -> str:
    """optimize() with PP=2 (TP=2 inside the stages) raises
    NotImplementedError naming each of `expect`, the model unchanged."""
    from checks import pipeline as pipeline_check
    from shardformer.pipeline import PipelineStageManager

    tp_group, pp_group = pipeline_check.groups(ctx, 2, 2)
    model = build(name)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group))
    message = parity.refused_unchanged(model, lambda: ShardFormer(cfg).optimize(model), f"{name} pipeline",
                                       error=NotImplementedError, structure=True, names=tuple(expect))
    return message


def supplemented_fractions(ctx, name: str) -> dict:
    """Parameters per rank / full model of `name` sharded by its own plan as
    it is (DerivedPolicy given resolve_tp_plan: no supplement) and by the
    default derived policy (its latent attention split by
    latent_attention_supplement)."""
    from shardformer.derived_policy import DerivedPolicy, resolve_tp_plan

    fractions = {}
    for which in ("own_plan", "supplemented"):
        model = build(name)
        full = sum(p.numel() for p in model.parameters())
        policy = DerivedPolicy(resolve_tp_plan(model)) if which == "own_plan" else None
        sharded, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model, policy=policy)
        fractions[which] = sum(p.numel() for p in sharded.parameters()) / full
    return fractions


def translated_spec(name: str, shard_config=None):
    """DerivedPolicy.translate() of zoo-less model `name` (MODELS): the
    PolicySpec its plan becomes, built on a model of its own (a spec is
    data: paths, styles, Heads, attribute rows, ties)."""
    from shardformer.derived_policy import DerivedPolicy

    policy = DerivedPolicy()
    policy.set_model(build(name))
    policy.set_shard_config(shard_config or ShardConfig())
    return policy.translate()


def spec_policy_matches(ctx, names: tuple[str, ...], default_group: bool = False,
                        split_gather: tuple[str, ...] = (), seq: int = 7) -> dict:
    """Each model of `names` sharded by SpecPolicy(its translated spec), with
    no DerivedPolicy involved, against the unsharded model: forward, loss,
    every gradient and an SGD step (parity.check_sharded).  Those of
    `split_gather` also with split-gather sequence parallelism from the same
    spec data (a [2, seq] batch), the split path run on every region.
    {name or "<name> split_gather": report}."""
    from checks import derived_sequence as S
    from shardformer.family import SpecPolicy

    out = {name: parity.check_sharded(ctx, lambda: build(name), make_inputs(name), name=f"{name} (translated spec)",
                                      policy=SpecPolicy(translated_spec(name)), fp64_floor=name in FP64_FLOOR,
                                      default_group=default_group)
           for name in names}
    sp = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}
    for name in split_gather:
        spec, holder = translated_spec(name, ShardConfig(**sp)), {}
        assert spec.split_gather is not None, f"{name}: its translated spec has no split-gather regions"

        def fresh():
            holder["model"] = build(name)
            return holder["model"]

        before = S._split_calls("split_gather")
        report = parity.check_sharded(ctx, fresh, S.inputs_of(name, seq), name=f"{name} split_gather (translated "
                                      f"spec)", policy=SpecPolicy(spec), config=sp, fp64_floor=name in FP64_FLOOR,
                                      default_group=default_group)
        calls, expected = S._split_calls("split_gather") - before, S._expected_calls(holder["model"], "split_gather")
        assert expected > 0 and calls == expected, f"{name}: the split path ran {calls} times, expected {expected}"
        out[f"{name} split_gather"] = dict(report, split_calls=calls)
    return out
