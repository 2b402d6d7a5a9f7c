"""Policies derived from a model's own tensor-parallel plan
(shardformer.derived_policy), for transformers architectures without a
built-in policy: outputs, loss, every gradient and the outputs after an SGD
step equal to the unsharded model at TP=2 and TP=4, parameters per rank
well below the full model, greedy generate() equal, and plans that cannot
be honoured refused before the model changes."""
from __future__ import annotations

import pytest
import transformers

from checks import derived_policy as D


NAMES = D.available(sorted(D.MODELS), D.MODELS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_step(pool, name, tp):
    reports = pool.run(D.check, tp, name)
    assert all(r["tp"] == tp for r in reports)
    if name in D.PARTIAL_PLANS:     # the plan itself leaves experts / layers replicated
        assert all(r["param_fraction"] < 1 for r in reports)
    elif tp == 2:
        bound = 0.65 if name in D.LATENT_ATTENTION else 0.6
        assert all(r["param_fraction"] < bound for r in reports), [r["param_fraction"] for r in reports]
    calls = reports[0]["calls"]
    if name in D.LATENT_ATTENTION:
        assert calls["rope_grad"] >= D.BASE["num_hidden_layers"], calls
    if name in D.LATENT_ATTENTION and name != "MiniCPM3":       # (MiniCPM3 is dense)
        assert calls["experts"] > 0, calls


GENERATE = D.available(["Cohere", "Exaone4", "GPTNeoX", "Olmo2", "Qwen3Moe", "DeepseekV2", "MiniCPM3", "DeepseekV3",
                        "Mistral4", "Olmoe"], D.MODELS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", GENERATE)
def test_generate_matches_unsharded(pool, name, tp):
    tokens = pool.run(D.generate_matches, tp, name)
    assert all(t == tokens[0] for t in tokens)


@pytest.mark.parametrize("name", D.available(sorted(D.REFUSED), D.REFUSED))
def test_plan_refused_naming_style_path_class(pool, name):
    messages = pool.run(D.refused, 2, name, D.REFUSED[name][2])
    assert all("cannot be honoured" in m for m in messages)


@pytest.mark.parametrize("style", ["bogus_style", "sequence_parallel", "grouped_gemm"])
def test_unknown_or_unmapped_style_refused_before_change(pool, style):
    path = "model.layers.*.mlp.down_proj"
    expect = (repr(style), "model.layers.0.mlp.down_proj", "ArceeForCausalLM")
    pool.run(D.refused, 2, "Arcee", expect, {path: style})


def test_style_on_wrong_module_refused(pool):
    expect = ("'embedding_rowwise'", "model.layers.0.mlp.down_proj", "Glm4ForCausalLM", "nn.Embedding")
    pool.run(D.refused, 2, "Glm4", expect, {"model.layers.*.mlp.down_proj": "embedding_rowwise"})


def test_builtin_policy_wins_and_plan_fallback():
    from shardformer.autopolicy import get_autopolicy
    from shardformer.derived_policy import DerivedPolicy

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in D.BASE.items()}))
    assert type(get_autopolicy(llama)).__name__ == "LlamaForCausalLMPolicy"
    assert isinstance(get_autopolicy(D.build("Olmo2")), DerivedPolicy)


def test_no_plan_keeps_clear_error():
    from shardformer.autopolicy import get_autopolicy

    cfg = transformers.NemotronConfig(hidden_size=64, intermediate_size=90, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    model = transformers.NemotronForCausalLM(cfg)
    with pytest.raises(ValueError) as e:
        get_autopolicy(model)
    message = str(e.value)
    assert "no built-in policy" in message and "NemotronForCausalLM" in message
    assert "tensor-parallel plan" in message and "Policy subclass" in message


def test_resolved_plan_prefixes_base_model():
    from shardformer.derived_policy import resolve_tp_plan

    plan = resolve_tp_plan(D.build("GPTNeoX"))
    assert plan["lm_head"] == "colwise_gather_output"      # (GPT-NeoX's head is embed_out: unused)
    assert plan["gpt_neox.layers.*.attention.query_key_value"] == "colwise"


@pytest.mark.parametrize("name", ["Olmo2", "Cohere", "Qwen3Moe", "SmolLM3"])
def test_all_optimizations_on_derived_plans(pool, name):
    reports = pool.run(D.with_all_optimizations, 2, name)
    calls = reports[0]["calls"]
    assert calls.get("attention", 0) > 0 and (calls.get("rms_norm", 0) + calls.get("layer_norm", 0)) > 0, calls


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["Olmo2", "Cohere", "Qwen3Moe", "GPTNeoX", "Granite"])
def test_parallel_output_on_derived_plans(pool, name, tp):
    pool.run(D.parallel_output, tp, name)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["Olmo2", "Cohere", "Qwen3Moe", "GPTNeoX", "Starcoder2"])
def test_pipeline_from_pp_plan(pool, name, tp):
    """The stage split comes from the config's base_model_pp_plan (PP=2, 1F1B; TP=2 inside the stages)."""
    pool.run(D.pipelined, 4, name, tp)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", D.available(["Olmoe", "NanoChat"], D.MODELS))
def test_pipeline_without_pp_plan(pool, name, tp):
    """Configs without base_model_pp_plan: the stage split comes from the module tree, the layer
    list the tensor-parallel plan indexes (PP=2, 1F1B; TP=2 inside the stages)."""
    pool.run(D.pipelined, 4, name, tp)


@pytest.mark.parametrize("name", D.available(["Olmoe", "NanoChat", "Olmo2"], D.MODELS))
def test_layer_list_from_the_module_tree(name):
    """The layer list and what runs after it: from the module tree when the config has no
    base_model_pp_plan, the same as the pp plan gives where it has one (Olmo2)."""
    from shardformer.derived_policy import DerivedPolicy

    model = D.build(name)
    if name != "Olmo2" and getattr(model.config, "base_model_pp_plan", None):
        pytest.skip(f"transformers {transformers.__version__}'s {name} config carries a base_model_pp_plan")
    policy = DerivedPolicy()
    policy.set_model(model)
    assert bool(getattr(model.config, "base_model_pp_plan", None)) == (name == "Olmo2")
    split = policy.pipeline_split
    last = ("norm",) if name != "NanoChat" else ()      # (NanoChat's final norm has no weight: on every stage)
    assert (split.owner, split.layers, split.last) == (type(model.model).__name__, "layers", last)
    assert policy.pipeline_refusal == ""


@pytest.mark.skipif(not hasattr(transformers, "HrmTextForCausalLM"), reason="this transformers has no HrmText")
def test_ambiguous_layer_lists_refused_by_name(pool):
    """HRM-Text: its pp plan names a `layers` it lacks, and its tensor-parallel plan indexes two
    stacks (L_module.layers, H_module.layers, run in recurrent cycles): pipeline refused naming both."""
    expect = ("HrmTextForCausalLM", "model.L_module.layers", "model.H_module.layers", "ambiguous")
    pool.run(D.pipeline_refused, 4, "HrmText", expect)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", D.available(list(D.LATENT_SUPPLEMENTED), D.MODELS))
def test_latent_attention_supplement_lowers_params(pool, name, tp):
    """DeepSeek-V3, Mistral 4, Kimi Linear: their plans leave the latent attention replicated;
    the supplement splits it by heads (equal to unsharded: test_forward_backward_step), so a rank
    holds fewer parameters than under the plan as it is."""
    for f in pool.run(D.supplemented_fractions, tp, name):
        assert f["supplemented"] < f["own_plan"] - 0.01, f


def test_latent_attention_supplement_found_by_shape():
    """The supplement adds DeepSeek-V2's attention entries at each latent attention's own path,
    and nothing where the plan already names them (V2) or there is no latent attention (Olmo2)."""
    from shardformer.derived_policy import MLA_ENTRIES, latent_attention_supplement, resolve_tp_plan

    def supplement(name):
        model = D.build(name)
        return latent_attention_supplement(model, resolve_tp_plan(model))

    v3 = supplement("DeepseekV3")
    assert v3 == {f"model.layers.{i}.self_attn.{c}": s for i in range(2) for c, s in MLA_ENTRIES.items()
                  if c != "q_proj"}         # (q_lora_rank set: q_a_proj / q_b_proj, no q_proj)
    assert supplement("DeepseekV2") == {} and supplement("Olmo2") == {}
    if hasattr(transformers, "KimiLinearForCausalLM"):
        assert {k.rsplit(".self_attn.", 1)[0] for k in supplement("KimiLinear")} == {"model.layers.1"}


def test_expert_parallel_router_refused(pool):
    """DeepSeek-V2's whole expert-parallel plan without an expert-parallel
    group: its ep_router is refused, naming the style, the router's path and
    the class (with a group: tests/test_expert_parallel.py)."""
    expect = ("'ep_router'", "model.layers.1.mlp.gate", "DeepseekV2ForCausalLM", "drop ep_router")
    pool.run(D.refused, 2, "DeepseekV2", expect, D._deepseek_v2_plan("ep"))


def test_grouped_gemm_plan_is_the_expert_parallel_plans():
    """The grouped_gemm model runs the experts entries of DeepSeek-V2's own
    expert-parallel plan (so the style reaches the policy as transformers spells it)."""
    plan = D.build("DeepseekV2-grouped_gemm")._tp_plan
    assert plan["model.layers.*.mlp.experts.gate_up_proj"] == "grouped_gemm"
    assert plan["model.layers.*.mlp.experts.down_proj"] == "grouped_gemm"
    assert "ep_router" not in plan.values()


@pytest.mark.parametrize("case", ["kv_a_unnamed", "heads_unsplit"])
def test_latent_attention_half_plans_refused(pool, case):
    """Latent attention split by heads without mla_kv_a_proj (the shared rotary
    key's gradient would stay partial), and mla_kv_a_proj without the head
    split (nothing to reduce over), are refused before the model changes."""
    attention = D._deepseek_v2_plan("attention")
    if case == "kv_a_unnamed":
        edit = {k: ("colwise" if v == "mla_kv_a_proj" else v) for k, v in attention.items()}
        edit["model.layers.*.self_attn.kv_a_proj_with_mqa"] = "replicated_with_grad_allreduce"
        expect = ("'colwise'", "model.layers.0.self_attn", "DeepseekV3ForCausalLM", "mla_kv_a_proj")
    else:
        edit = {k: v for k, v in attention.items() if v == "mla_kv_a_proj"}
        expect = ("'mla_kv_a_proj'", "model.layers.0.self_attn.kv_a_proj_with_mqa", "DeepseekV3ForCausalLM")
    pool.run(D.refused, 2, "DeepseekV3", expect, edit)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", D.available(["DeepseekV2", "DeepseekV2-qproj-6heads", "DeepseekV3", "Mistral4"],
                                             D.MODELS))
def test_latent_attention_eval_with_dropout(pool, name, tp):
    pool.run(D.eval_with_dropout, tp, name)


@pytest.mark.parametrize("name", ["DeepseekV2", "MiniCPM3"])
def test_all_optimizations_on_latent_attention(pool, name):
    """enable_all_optimization on latent attention: the fused RMSNorms (the
    latent norms included) and SwiGLU run and the model still equals the
    unsharded one; attention stays on transformers' path (its key and value
    heads differ in size, which the C kernel does not take)."""
    calls = pool.run(D.with_all_optimizations, 2, name)[0]["calls"]
    assert calls["rms_norm"] > 0 and calls["swiglu"] > 0, calls


# A derived policy is a translation: the model's plan (and the rules of shardformer.derived_rules) become a
# PolicySpec, which SpecPolicy runs alone: latent attention (its rope_dim kwarg), 6 heads uneven at TP=4,
# experts, a scaled embedding tied to the LM head, GPT-NeoX's fused per-head qkv.
SPEC_NAMES = tuple(D.available(["DeepseekV2-qproj-6heads", "VaultGemma"], D.MODELS))


def test_translated_plan_is_a_policy_spec():
    from shardformer.layout import Heads
    from shardformer.spec import PolicySpec

    spec = D.translated_spec("DeepseekV2-qproj-6heads")
    assert isinstance(spec, PolicySpec) and spec == D.translated_spec("DeepseekV2-qproj-6heads")
    assert hash(spec) == hash(D.translated_spec("DeepseekV2-qproj-6heads"))      # frozen data, by value
    (module,) = spec.modules
    assert module.key == "DeepseekV2ForCausalLM" and "derived" in spec.name
    by_path = {e.suffix: e for e in module.entries}
    kv_a = by_path["model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert (kv_a.style, kv_a.kwargs) == ("mla_kv_a_proj", (("rope_dim", 8),))
    assert by_path["model.layers.0.self_attn.q_proj"].heads == Heads(6, 6, 20)       # qk_nope 12 + qk_rope 8
    assert {a.name: a.kind for a in module.attributes if a.name.startswith("model.layers.0.")} == {
        "model.layers.0.self_attn.num_heads": "heads", "model.layers.0.self_attn.num_key_value_groups": "groups"}
    assert all(a.heads == Heads(6, 6, 20) for a in module.attributes)
    tied = D.translated_spec("VaultGemma")
    assert tied.ties == (("model.embed_tokens", "lm_head"),)
    embed = next(e for e in tied.modules[0].entries if e.suffix == "model.embed_tokens")
    assert (embed.style, embed.kwargs) == ("embedding_rowwise", (("embed_scale", 8.0),))


# Split-gather SP from the translated spec alone: SolarOpen at TP=4 over 9 rows (uneven; BLOCK regions, its
# router and shared expert beside the experts), GPT-NeoX at TP=2 with the plain ShardConfig() (ENTER: biased rows).
SP_SPEC_NAMES = tuple(D.available(["SolarOpen"], D.MODELS))


@pytest.mark.parametrize("tp,names,sp", [(2, SPEC_NAMES[1:], ()), (4, SPEC_NAMES[:1], SP_SPEC_NAMES)])
def test_translated_spec_runs_as_spec_policy(pool, tp, names, sp):
    reports = pool.run(D.spec_policy_matches, tp, names, False, sp, 9)
    keys = set(names) | {f"{n} split_gather" for n in sp}
    assert all(set(r) == keys and all(v["tp"] == tp for v in r.values()) for r in reports)


def test_translated_spec_default_group(pool2):
    reports = pool2.run(D.spec_policy_matches, 2, ("GPTNeoX-6heads",), True, ("GPTNeoX-6heads",))
    assert all(r["GPTNeoX-6heads"]["tp"] == 2 and r["GPTNeoX-6heads split_gather"]["split_calls"] > 0
               for r in reports)


def test_translated_split_gather_and_capabilities_are_spec_data():
    """translate() under split-gather SP: its regions, the modules beside the split layers and the SP kwargs
    of the split layers are spec data (Region, SplitGatherSpec.beside, Entry.sp), its capabilities the
    spec's Capabilities, equal to what DerivedPolicy answers; no state is left on the policy."""
    from shardformer import ShardConfig
    from shardformer.derived_policy import DerivedPolicy
    from shardformer.family import SpecPolicy
    from shardformer.layer.sequence_layout import BLOCK, ENTER

    sp = ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    neox = D.translated_spec("GPTNeoX-6heads", sp)
    sg = neox.split_gather
    assert (sg.owner, sg.layers, sg.layer, sg.overlap) == ("GPTNeoXForCausalLM", "gpt_neox.layers",
                                                           "GPTNeoXForCausalLM", False)
    regions = {r.path: r.layouts for r in sg.regions}
    assert regions["gpt_neox.layers.1.attention"] == ENTER and regions["gpt_neox.layers.0.mlp"] == ENTER
    assert regions["gpt_neox.layers.0.input_layernorm"] is None          # a norm on this rank's rows
    sp_of = {e.suffix: e.sp for e in neox.modules[0].entries}
    assert (sp_of["gpt_neox.layers.0.mlp.dense_h_to_4h"], sp_of["gpt_neox.layers.0.mlp.dense_4h_to_h"]) == (
        "col", "row")
    assert neox.capabilities.sp_modes == ("split_gather",) and neox.capabilities.pipeline_split.layers == "layers"
    assert neox.capabilities.split_attention_at == ("GPTNeoXModel", "layers")
    assert D.translated_spec("GPTNeoX-6heads").split_gather is None      # SP off: no regions
    if SP_SPEC_NAMES:
        solar = D.translated_spec("SolarOpen", sp).split_gather
        assert {r.layouts for r in solar.regions if r.layouts is not None} == {BLOCK}
        assert {e.suffix: e.style for e in solar.beside if ".0." in e.suffix} == {
            "model.layers.0.mlp.gate": "moe_router_sequence_parallel",
            "model.layers.0.mlp.shared_experts": "moe_shared_expert_sequence_parallel"}
    for name in D.available(["GPTNeoX-6heads", "HrmText"], D.MODELS):     # HrmText: two layer lists
        policy = DerivedPolicy()
        policy.set_model(D.build(name))
        policy.set_shard_config(ShardConfig())
        policy.begin()                                                  # the state lives in OptimizeState
        before = set(vars(policy))
        spec = policy.translate()
        policy.module_policy()
        assert set(vars(policy)) == before, f"{name}: state left on the policy: {set(vars(policy)) - before}"
        spec_policy = SpecPolicy(spec)
        spec_policy.set_model(policy.model)
        spec_policy.set_shard_config(policy.shard_config)
        for ask in ("sequence_parallel_modes", "split_attention_modes"):
            assert getattr(spec_policy, ask)() == getattr(policy, ask)(), (name, ask)
        assert spec_policy.sequence_parallel_refusal("split_gather") == policy.sequence_parallel_refusal("x")
        assert (spec_policy.pipeline_split, spec_policy.pipeline_refusal) == (policy.pipeline_split,
                                                                             policy.pipeline_refusal)
    if "HrmText" in D.available(["HrmText"], D.MODELS):
        assert "H_module.layers" in spec.capabilities.sp_refusal and spec.capabilities.sp_modes == ()
        with pytest.raises(NotImplementedError, match="HrmTextForCausalLM.*split_gather.*L_module.layers"):
            D.translated_spec("HrmText", sp)
