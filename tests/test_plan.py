"""One plan structure (shardformer.plan) for the built-in families and the
plans derived from transformers: the built-in shapes' descriptions are the
ones they produced before they were written as plans (policy_snapshot),
their plans in transformers' notation agree with transformers' own
(refinements listed with their reasons), and a plan dict passed to
optimize(model, plan=...) shards a model whose config has none, with bad
plans refused before the model changes."""
from __future__ import annotations

import json
import re

import pytest

import policy_snapshot
import zoo
from checks import plan as P


def test_builtin_descriptions_match_the_snapshot():
    """Every built-in family's zoo models, under TP, parallel_output and
    split-gather SP with and without overlap: the same replacements (suffix,
    layer class, kwargs, order) and attributes as before the shapes were
    written as plans; every sequence-parallel region in typed layouts
    (layouts=, no role string: docs/sequence-layouts.md)."""
    old = policy_snapshot.load()
    policy_snapshot.ROLE_SPELLED.clear()
    new = json.loads(json.dumps(policy_snapshot.snapshot()))
    assert not policy_snapshot.ROLE_SPELLED, f"regions spelled by role: {policy_snapshot.ROLE_SPELLED[:5]}"
    assert set(new) == set(old), sorted(set(new) ^ set(old))[:10]
    differ = [k for k in old if old[k] != new[k]]
    assert not differ, f"{len(differ)} descriptions changed, e.g. {differ[:5]}"
    assert len(old) >= 600


def test_snapshot_comparison_sees_a_changed_style(monkeypatch):
    """The snapshot compares kwargs: a query projection split evenly instead
    of by heads is a difference."""
    from shardformer.policies.shapes import DecoderShape

    plan = DecoderShape.attention_plan
    monkeypatch.setattr(DecoderShape, "attention_plan", lambda self: {**plan(self), "self_attn.q_proj": "colwise"})
    name = "tp/LlamaForCausalLM"
    assert policy_snapshot.snapshot({"LlamaForCausalLM"})[name] != policy_snapshot.load()[name]


def test_style_vocabulary():
    """Every style builds its layer; head styles need heads; an unknown style
    is refused by name; every transformers style DerivedPolicy maps has a
    style of ours exporting to it."""
    from shardformer import ShardConfig
    from shardformer.derived_policy import SUPPORTED_STYLES
    from shardformer.layout import Heads
    from shardformer.plan import STYLES, PlanContext, PlanError, realize, replacement
    from shardformer.policies.llama import LlamaForCausalLMPolicy

    policy = LlamaForCausalLMPolicy()
    policy.set_shard_config(ShardConfig())
    ctx = PlanContext(policy, Heads(6, 2, 8), embed_scale=2.0)
    subs = realize({f"m{i}": name for i, name in enumerate(STYLES)}, ctx)
    assert [s.style for s in subs] == list(STYLES)
    by_style = {s.style: s for s in subs}
    assert by_style["colwise_kv_heads"].kwargs["split"] == Heads(6, 2, 8).kv
    assert by_style["colwise_per_head"].kwargs["split"] == Heads(6, 6, 24).q
    assert by_style["embedding_rowwise"].kwargs["embed_scale"] == 2.0
    assert by_style["dropout_residual"].target_module.__name__ == "DropoutForReplicatedInput"
    with pytest.raises(PlanError, match="'colwise_heads' splits by attention heads"):
        replacement("q", "colwise_heads", PlanContext(policy))
    with pytest.raises(PlanError, match="unknown tensor-parallel style 'colwize'"):
        replacement("q", "colwize", ctx)
    exported = {s.hf for s in STYLES.values()} | {hf for s in STYLES.values() for _, hf in s.hf_params}
    missing = set(SUPPORTED_STYLES) - exported - {"colwise_rep", "rowwise_rep", "grouped_gemm"}
    assert not missing, missing


# Where our built-in policies split more (or differently) than transformers'
# own plan: (path pattern, transformers' style, ours, why).  Each must be
# seen at least once; any other difference fails.
REFINEMENTS = (
    (r"(^|\.)embed_tokens$", None, "embedding_rowwise",
     "vocabulary-parallel input embedding (padded vocabulary) where transformers replicates it"),
    (r"^(score|qa_outputs)$", None, "colwise_gather_output",
     "classifier heads split by labels and gathered; transformers replicates them"),
    (r"^lm_head$", None, "colwise_gather_output",
     "Gemma 3 multimodal: transformers' plan leaves the LM head whole; ours is vocabulary-parallel"),
    (r"vision_tower\.encoder\.layers\.\*\.self_attn\.(q_proj|k_proj|v_proj)$", None, "colwise",
     "Gemma 3 multimodal: the SigLIP tower split by heads; transformers' plan covers the language model only"),
    (r"vision_tower\.encoder\.layers\.\*\.self_attn\.out_proj$", None, "rowwise",
     "Gemma 3 multimodal: the SigLIP tower's output projection, input split by the same heads"),
    (r"vision_tower\.encoder\.layers\.\*\.mlp\.fc1$", None, "colwise",
     "Gemma 3 multimodal: the SigLIP tower's MLP features (its spec names the style, so the export shows it)"),
    (r"vision_tower\.encoder\.layers\.\*\.mlp\.fc2$", None, "rowwise",
     "Gemma 3 multimodal: the SigLIP tower's MLP down projection, input split by the same features"),
    (r"self_attn\.qkv_proj$", "colwise_gather_output", "colwise",
     "Phi-3: the fused [q | k | v] split per part by heads (colwise_qkv); transformers gathers the "
     "projection and keeps its output whole"),
    (r"self_attn\.o_proj$", "rowwise_split_input", "rowwise",
     "Phi-3: o_proj's input arrives split by the query heads (transformers: whole, split here)"),
    (r"mlp\.gate_up_proj$", "colwise_gather_output", "packed_colwise",
     "Phi-3, GLM: the packed [gate | up] split half by half (packed_colwise); transformers gathers it"),
    (r"mlp\.down_proj$", "rowwise_split_input", "rowwise",
     "Phi-3, GLM: down_proj's input arrives split (transformers: whole, split here)"),
)


def _refinement(path: str, theirs, ours):
    for i, (pattern, t, o, _) in enumerate(REFINEMENTS):
        theirs_fits = theirs == t
        if re.search(pattern, path) and theirs_fits and ours == o:
            return i
    return None


def _plan_classes():
    """(family, model class) of every zoo model of a built-in family whose
    transformers config carries a tensor-parallel plan."""
    from shardformer.autopolicy import families
    from shardformer.derived_policy import resolve_tp_plan

    out = []
    for fam in families():
        for cls in fam.heads:
            if cls in zoo.names() and resolve_tp_plan(zoo.build(cls)):
                out.append((fam, cls))
    return out


def test_builtin_plans_agree_with_transformers():
    """Family.tp_plan (our split in transformers' notation) against
    transformers' own resolved plan, for every built-in class that has one:
    the same modules split the same way, except the listed refinements."""
    from shardformer.autopolicy import get_autopolicy
    from shardformer.derived_policy import resolve_tp_plan

    seen, families, disagreements = set(), set(), []
    pairs = _plan_classes()
    for fam, cls in pairs:
        model = zoo.build(cls)
        theirs, ours = resolve_tp_plan(model), fam.tp_plan(model, policy_of=get_autopolicy)
        families.add(fam.name)
        for path in sorted(set(theirs) | set(ours)):
            if theirs.get(path) == ours.get(path):
                continue
            which = _refinement(path, theirs.get(path), ours.get(path))
            if which is None:
                disagreements.append((cls, path, theirs.get(path), ours.get(path)))
            else:
                seen.add(which)
    assert not disagreements, disagreements
    assert seen == set(range(len(REFINEMENTS))), [REFINEMENTS[i][3] for i in set(range(len(REFINEMENTS))) - seen]
    assert {"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "glm"} <= families


def test_exported_plan_names_modules_and_styles():
    from shardformer.policies.llama import FAMILY

    plan = FAMILY.tp_plan(zoo.build("LlamaForCausalLM"))
    assert plan["model.layers.*.self_attn.k_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    with pytest.raises(ValueError, match="Family 'llama' has no policy for MistralModel"):
        FAMILY.tp_plan(zoo.build("MistralModel"))


# ---- a plan passed to optimize() ----

@pytest.mark.parametrize("tp", [2, 4])
def test_user_plan_on_a_model_without_one(pool, tp):
    reports = pool.run(P.user_plan, tp)
    layers = P.CONFIG["num_hidden_layers"]
    for r in reports:
        assert r["param_fraction"] < 0.65, r["param_fraction"]
        calls = r["calls"]      # forward + recomputed step: at least one per layer each
        assert calls["col"] >= 5 * layers and calls["row"] >= 2 * layers, calls
        assert calls["embedding"] >= 1 and calls["lm_head"] >= 1, calls


def test_user_plan_swaps_exactly_the_planned_modules(pool):
    swapped = pool.run(P.swapped, 2)[0]
    expect = {"model.embed_tokens": "VocabParallelEmbedding1D", "lm_head": "VocabParallelLMHead1D"}
    for i in range(P.CONFIG["num_hidden_layers"]):
        expect.update({f"model.layers.{i}.self_attn.{p}": "Linear1D_Col" for p in ("q_proj", "k_proj", "v_proj")})
        expect.update({f"model.layers.{i}.self_attn.o_proj": "Linear1D_Row",
                       f"model.layers.{i}.mlp.up_proj": "Linear1D_Col", f"model.layers.{i}.mlp.down_proj": "Linear1D_Row"})
    assert swapped == expect


def test_user_plan_eval_with_dropout(pool):
    pool.run(P.eval_with_dropout, 2)


@pytest.mark.parametrize("edit, expect", [
    ({"model.layers.*.mlp.up_proj": "colwize"}, ("'colwize'", "model.layers.0.mlp.up_proj", "NemotronForCausalLM")),
    ({"model.layers.*.mlp.up_proj": "ep_router"}, ("'ep_router'", "model.layers.0.mlp.up_proj", "NemotronForCausalLM")),
    ({"model.layers.*.mlp.act_fn": "colwise"}, ("'colwise'", "model.layers.0.mlp.act_fn", "NemotronForCausalLM")),
    ({"model.layers.*.mlp.upproj": "colwise"}, ("'colwise'", "model.layers.*.mlp.upproj", "NemotronForCausalLM",
                                                "matches no module")),
])
def test_bad_user_plan_refused_naming_style_path_class(pool, edit, expect):
    pool.run(P.refused, 2, dict(P.NEMOTRON_PLAN, **edit), expect)


def test_plan_and_policy_together_refused(pool):
    pool.run(P.refused, 2, P.NEMOTRON_PLAN, ("NemotronForCausalLM", "a policy or a plan, not both"), "TypeError",
             True)
    pool.run(P.refused, 2, {"model.layers.*.mlp.up_proj": 3}, ("NemotronForCausalLM", "str: str"), "TypeError")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"])
def test_exported_plan_round_trip(pool, name, tp):
    """Family.tp_plan given back to optimize(plan=...): DerivedPolicy makes
    the same shards as the built-in policy (KV heads replicated at TP=4)."""
    counts = pool.run(P.exported_plan_round_trip, tp, name)
    assert all(c == counts[0] and c > 10 for c in counts), counts
