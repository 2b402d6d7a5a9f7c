"""A policy as one frozen declarative spec (shardformer.spec.PolicySpec),
interpreted in one place (shardformer.plan.interpret): the built-in shapes'
specs are data (frozen, hashable, printable, equal when built twice), bad
specs are refused by name, and a user's hand-written spec shards Llama like
the unsharded model (TP=2 over an explicit group, TP=4 with the plain
ShardConfig(); uneven heads and vocabulary; TP, split-gather SP, overlap)."""
from __future__ import annotations

import dataclasses

import pytest

import zoo
from checks import spec as S
from shardformer import ShardConfig
from shardformer.family import SpecPolicy
from shardformer.plan import PlanError, interpret, refuse
from shardformer.policy import OptimizeState
from shardformer.spec import Capabilities, Entry, ModuleSpec, PolicySpec, Refusal, SpecError, SplitGatherSpec

#: every family whose policies are DecoderShape's spec factory
DECODERS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
            "Gemma2ForCausalLM", "GlmForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM")
#: and EncoderShape's
ENCODERS = ("BertForMaskedLM", "RobertaForMaskedLM", "ErnieForMaskedLM")
#: and GPTBlockShape's: (model, its layer class, the owner of split_attention_at's layers)
GPT_BLOCKS = {"GPT2LMHeadModel": ("GPT2Block", "GPT2Model"), "GPTNeoForCausalLM": ("GPTNeoBlock", "GPTNeoModel"),
              "GPTJForCausalLM": ("GPTJBlock", "GPTJModel")}


def _policy(name: str):
    from shardformer.autopolicy import get_autopolicy

    model = zoo.build(name)
    policy = get_autopolicy(model)
    policy.set_model(model)
    policy.set_shard_config(ShardConfig())
    return policy


@pytest.mark.parametrize("name", DECODERS + ENCODERS + tuple(GPT_BLOCKS))
def test_builtin_spec_is_frozen_data(name):
    """A family's spec: built from its options alone, equal and of equal hash
    when built twice, immutable, printed with its styles and class names;
    the policy's capability answers are the spec's fields."""
    policy = _policy(name)
    spec = policy.build_spec()
    assert spec == type(policy)().build_spec() and hash(spec) == hash(type(policy)().build_spec())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
    prefix = name.removesuffix("ForCausalLM").removesuffix("ForMaskedLM")
    layer, at = ((f"{prefix}DecoderLayer", (f"{prefix}Model", "layers")) if name in DECODERS else
                 (f"{prefix}Layer", (f"{prefix}Encoder", "layer")) if name in ENCODERS else
                 (GPT_BLOCKS[name][0], (GPT_BLOCKS[name][1], "h")))
    assert f"ModuleSpec(key='{layer}'" in repr(spec) and "rowwise" in repr(spec)
    assert spec.capabilities.sequence_overlap is (name != "MixtralForCausalLM")
    assert policy.supports_sequence_overlap() is spec.capabilities.sequence_overlap
    assert policy.sequence_parallel_modes() == ("split_gather", "all_to_all", "ring_attn")
    assert spec.capabilities.split_attention_at == at


def test_interpret_is_the_shapes_body():
    """DecoderShape's body is interpret(its spec): the same descriptions."""
    policy = _policy("LlamaForCausalLM")
    ours = interpret(policy.build_spec(), policy.model, policy.shard_config, OptimizeState())
    body = policy.body_policy()
    assert list(ours) == list(body) == ["LlamaDecoderLayer", "LlamaModel"]
    for key in ours:
        assert [(s.suffix, s.target_module, s.style) for s in ours[key].sub_module_replacement] == \
            [(s.suffix, s.target_module, s.style) for s in body[key].sub_module_replacement]


def test_bad_specs_refused_by_name():
    with pytest.raises(SpecError, match=r"Entry\('q'\): unknown condition\(s\) \['sometimes'\]"):
        Entry("q", "colwise", when=("sometimes",))
    with pytest.raises(SpecError, match=r"Attribute\('a.n'\): kind 'halves' not in"):
        ModuleSpec("L", attributes=(("a.n", "halves"),))
    with pytest.raises(SpecError, match=r"Entry\('q'\): sp='rows' is not one of"):
        Entry("q", "colwise", sp="rows")
    with pytest.raises(SpecError, match=r"ModuleSpec\('L'\): sp_linear='cols' is not one of"):
        ModuleSpec("L", sp_linear="cols")
    with pytest.raises(SpecError, match=r"module class\(es\) \['L'\] given more than once"):
        PolicySpec("x", (ModuleSpec("L"), ModuleSpec("L")))
    with pytest.raises(SpecError, match="does not name 'split_gather'"):
        PolicySpec("x", (), split_gather=SplitGatherSpec("M", "layers", "L", ()))
    with pytest.raises(SpecError, match="error must be ValueError or NotImplementedError, got 'KeyError'"):
        Refusal("a", error="KeyError")
    with pytest.raises(TypeError, match="expected a shardformer.spec.PolicySpec, got dict"):
        SpecPolicy({"q_proj": "colwise"})
    model = zoo.build("LlamaForCausalLM")
    bad = PolicySpec("typo", (ModuleSpec("LlamaDecoderLayer", (Entry("mlp.up_proj", "colwize"),)),))
    with pytest.raises(PlanError, match="unknown tensor-parallel style 'colwize'.*colwise"):
        interpret(bad, model, ShardConfig(), OptimizeState())
    bad = PolicySpec("no-heads", (ModuleSpec("LlamaDecoderLayer", attributes=(("self_attn.n", "heads"),)),))
    with pytest.raises(PlanError, match="'no-heads': LlamaDecoderLayer sets head attributes"):
        interpret(bad, model, ShardConfig(), OptimizeState())
    no_po = PolicySpec("no-po", (), capabilities=Capabilities(parallel_output=False))
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM: parallel_output=True is not available for policy "
                                                  "spec 'no-po'"):
        refuse(no_po, model, ShardConfig(parallel_output=True))
    refuse(no_po, model, ShardConfig())
    sp = ShardConfig(enable_sequence_parallelism=True)
    bad = PolicySpec("absent", (), split_gather=SplitGatherSpec("OPTDecoder", "layers", "L", ()),
                     capabilities=Capabilities(sp_modes=("split_gather",)))
    with pytest.raises(PlanError, match="LlamaForCausalLM: policy spec 'absent' names OPTDecoder"):
        interpret(bad, model, sp, OptimizeState())


@pytest.mark.parametrize("tp,default_group,tags", [(2, False, ("tp", "overlap", "untied")),
                                                   (4, True, ("tp", "split_gather"))])
def test_user_spec_matches_unsharded(pool, tp, default_group, tags):
    """TP=2 over an explicit group (TP; SP with overlap; TP on a model whose LM head is untied, which the spec's
    tie must leave untied), TP=4 with the plain ShardConfig() (TP; SP)."""
    reports = pool.run(S.user_spec_shards, tp, default_group, tags)
    assert len(reports) == tp and all(set(r) == set(tags) for r in reports)


def test_user_spec_refusals(pool):
    reports = pool.run(S.user_spec_refuses, 2)
    assert "sequence parallelism mode 'split_gather' is not available for SpecPolicy" in reports[0]["mode"]


def test_ties_taken_from_the_model_once():
    """One way to record a tie (shardformer.plan.record_ties): a spec's ties and a family's LM-head rule both
    keep a tie only where the model holds one Parameter, once; a tie naming no module is refused by name
    before anything changes."""
    from shardformer.autopolicy import get_autopolicy

    pair = ("model.embed_tokens", "lm_head")
    for tie in (True, False):
        model = zoo.build("LlamaForCausalLM", tie_word_embeddings=tie)
        base = type(get_autopolicy(model))

        class Declared(base):              # the built-in policy, its spec also naming the LM head's tie
            def build_spec(self):
                return dataclasses.replace(super().build_spec(), ties=(pair,))

        for policy in (Declared(), SpecPolicy(S.user_llama_spec())):
            policy.set_model(model)
            policy.set_shard_config(ShardConfig())
            policy.begin()
            policy.module_policy()
            policy.preprocess()
            assert policy.state.ties == ([pair] if tie else []), (type(policy).__name__, tie, policy.state.ties)
    missing = dataclasses.replace(S.user_llama_spec(), ties=(("model.embed", "lm_head"),))
    policy = SpecPolicy(missing)
    policy.set_model(model)
    policy.set_shard_config(ShardConfig())
    policy.begin()
    with pytest.raises(PlanError, match="LlamaForCausalLM: policy spec 'user-llama' ties 'lm_head' to "
                                        "'model.embed', but 'model.embed' is not a module"):
        policy.module_policy()
@pytest.mark.parametrize("tp,default_group,config", [
    (2, False, {"enable_sequence_parallelism": True, "enable_sequence_overlap": True}), (4, True, {})])
def test_shape_subclass_overrides_match_unsharded(pool, tp, default_group, config):
    """FusedQKVShape, VisionShape and StageShape are spec factories too: a
    user subclass's override of the method each reads (qkv_layout,
    heads_layout, block_attributes) is in its spec, and the subclass shards
    like the unsharded model: TP=2 over an explicit group with split-gather
    SP and overlap (Swin's window-overlap pass), TP=4 with the plain
    ShardConfig(); 5 heads (uneven).  Two bespoke families too (ChatGLM2,
    SAM: spec factories since issue 33's spec6 branch; BLIP-2 since its
    blip2spec branch: vision encoder and Q-Former split segment by segment),
    each subclass overriding one row of its spec (checks/spec.py
    bespoke_subclasses)."""
    reports = pool.run(S.shape_overrides_shard, tp, default_group, config)
    assert len(reports) == tp and all(set(r) == {"fused_qkv", "vision", "stage", "chatglm2", "sam", "blip2"}
                                      for r in reports)


def test_bespoke_rows_as_data():
    """The rows issue 33's spec6 branch added, on one process: Falcon's two
    dropouts refused by one Refusal row (Refusal.also) naming both values
    before anything changes; SAM's layer forward a Method row, made only on a
    group of two or more ranks (tensor_parallel_ranks: nothing on one rank);
    BLOOM's build_alibi_tensor a Method row on BloomModel.  Whisper's
    refusals as Refusal rows (blip2spec branch); a SpecPolicy refuses a spec
    that composes other models' policies (BLIP-2's)."""
    from shardformer.autopolicy import get_autopolicy
    from shardformer.plan import conditions
    from shardformer.spec import Method

    def bound(name, shard_config, **overrides):
        model = zoo.build(name, **overrides)
        policy = get_autopolicy(model)
        policy.set_model(model)
        policy.set_shard_config(shard_config)
        policy.begin()
        return policy, model

    sp = ShardConfig(enable_sequence_parallelism=True)
    policy, model = bound("FalconForCausalLM", sp, hidden_dropout=0.25, attention_dropout=0.5)
    with pytest.raises(NotImplementedError, match=r"FalconForCausalLM: sequence parallelism \(split_gather\) with "
                                                  r"hidden_dropout=0.25 / attention_dropout=0.5 is not available"):
        refuse(policy.build_spec(), model, sp)
    refuse(policy.build_spec(), model, ShardConfig())          # under TP alone: nothing refused
    policy, model = bound("SamVisionModel", sp)
    rows = policy.build_spec().module("SamVisionLayer").attributes
    assert [(r.name, r.when) for r in rows if isinstance(r, Method)] == [
        ("forward", ("sequence_parallel", "tensor_parallel_ranks"))]
    assert "tensor_parallel_ranks" not in conditions(sp, model)
    assert policy.module_policy()["SamVisionLayer"].method_replacement == {}
    policy, _ = bound("BloomForCausalLM", ShardConfig())
    assert [r.name for r in policy.build_spec().module("BloomModel").attributes] == ["build_alibi_tensor"]
    assert list(policy.module_policy()["BloomModel"].method_replacement) == ["build_alibi_tensor"]
    # issue 33 blip2spec: Whisper's refusals as Refusal rows (model:<attribute>, split_attention, {mode})
    ring = ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="ring_attn",
                       enable_tensor_parallelism=False)
    policy, model = bound("WhisperForAudioClassification", ring, use_weighted_layer_sum=True)
    rows = [(r.attribute, r.when) for r in policy.build_spec().refusals if r.attribute == "use_weighted_layer_sum"]
    assert rows == [("use_weighted_layer_sum", ("pipeline_stages", "model:layer_weights")),
                    ("use_weighted_layer_sum", ("split_attention", "model:layer_weights"))], rows
    with pytest.raises(NotImplementedError, match=r"WhisperForAudioClassification: sequence parallelism \(ring_attn\) "
                                                  r"with use_weighted_layer_sum=True"):
        refuse(policy.build_spec(), model, ring)
    policy, model = bound("WhisperForConditionalGeneration", ring, use_weighted_layer_sum=True)
    refuse(policy.build_spec(), model, ring)                   # no layer_weights: nothing refused
    from shardformer.family import SpecPolicy
    with pytest.raises(TypeError, match="policy spec 'blip2' composes \\['language_model'\\]; .*ComposedPolicy"):
        policy, model = bound("Blip2ForConditionalGeneration", ShardConfig())
        SpecPolicy(policy.build_spec())


@pytest.mark.parametrize("tp,default_group", [(2, False), (4, True)])
def test_bespoke_family_subclass_matches_unsharded(pool, tp, default_group):
    """OPT, ALBERT, T5 and Whisper are spec factories: a user subclass of each
    overriding one row of its spec (one MLP kept whole) shards like the
    unsharded model, at TP=2 over an explicit group and TP=4 with the plain
    ShardConfig() (6 heads and vocabularies of 99 / 101: uneven); and every
    tie of these four and of a model of each other family with ties holds
    after optimize() with Policy.tie_weight unavailable (the engine keeps
    ties; no policy re-ties)."""
    reports = pool.run(S.bespoke_overrides_shard, tp, default_group)
    assert len(reports) == tp and all(set(r) == {"opt", "albert", "t5", "whisper", "ties"} for r in reports)
    assert len(reports[0]["ties"]) == len(S.TIED_MODELS) and reports[0]["ties"]["BertForMaskedLM"] == 2


def test_bespoke_specs_are_data():
    """Each bespoke family's spec (bound to its model): frozen and hashable,
    equal when built twice, with the rows of the vocabulary it added: T5's
    two split-gather stacks (encoder, decoder: each its own SequenceState)
    and its shared embeddings' ties, Whisper's stacks with each layer's
    own heads, ALBERT's attention forward (Method, only under split-gather SP)
    and the split / gather around its encoder (ends="module"), OPT's fc1
    gathering its own rows (sp="gather_rows")."""
    from shardformer.layer.sequence_ends import EncoderEnds
    from shardformer.spec import Method

    specs = {}
    for name in S.BESPOKE_MODELS.values():
        policy = _policy(name)
        spec = policy.build_spec()
        assert spec == policy.build_spec() and hash(spec) == hash(policy.build_spec())
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.name = "other"
        assert spec.capabilities.sequence_overlap and policy.supports_sequence_overlap(), name
        specs[name] = spec
    opt, albert, t5, whisper = specs.values()
    assert [e.sp for e in opt.module("OPTDecoderLayer").entries if e.suffix == "fc1"] == ["gather_rows"]
    assert [(s.owner, s.layers) for s in (t5.split_gather,) + t5.stacks] == [
        ("T5ForConditionalGeneration", "encoder.block"), ("T5ForConditionalGeneration", "decoder.block")]
    assert t5.ties == (("shared", "encoder.embed_tokens"), ("shared", "decoder.embed_tokens"))
    assert [(s.owner, s.layer) for s in (whisper.split_gather,) + whisper.stacks] == [
        ("WhisperEncoder", "WhisperEncoderLayer"), ("WhisperDecoder", "WhisperDecoderLayer")]
    assert whisper.module("WhisperDecoderLayer").entries[0].heads.num_heads == 6
    assert [(r.owner, r.layers, dict(r.options)["cross"]) for r in whisper.capabilities.split_attention_stacks] == [
        ("WhisperEncoder", "layers", ()), ("WhisperDecoder", "layers", ("encoder_attn",))]
    assert [(r.layers, r.base) for r in t5.capabilities.split_attention_stacks] == [
        ("encoder.block", "encoder"), ("decoder.block", "decoder")]
    method = albert.module("AlbertAttention")
    assert method.when == ("sequence_parallel",) and isinstance(method.attributes[0], Method)
    assert albert.split_gather.ends == "module"
    policy = _policy("AlbertForMaskedLM")
    policy.begin()
    assert "AlbertAttention" not in policy.module_policy()
    policy.set_shard_config(ShardConfig(enable_sequence_parallelism=True))
    described = policy.module_policy()
    assert list(described["AlbertAttention"].method_replacement) == ["forward"]
    assert [s.target_module for s in described["AlbertModel"].sub_module_replacement] == [EncoderEnds]
    with pytest.raises(SpecError, match=r"SplitGatherSpec\('M'\): ends='list' is not one of"):
        SplitGatherSpec("M", "layers", "L", (), ends="list")
    with pytest.raises(SpecError, match=r"Method\('forward'\): function must be callable"):
        Method.fixed("forward", "albert_attention_forward")
    with pytest.raises(SpecError, match="stacks are given but split_gather"):
        PolicySpec("x", (), stacks=(SplitGatherSpec("M", "layers", "L", ()),))


def test_last_code_paths_as_data():
    """Issue 33's leftovers as spec rows, on one process: specs holding Method
    (a functools.partial make) and Setting (a per-rank head count) rows equal
    across builds, a changed row unequal; BLIP-2's and Gemma 3's sequence-mode
    refusals as Refusal rows (conditions mode:<mode>, composed / not_composed),
    raised with their messages; ALBERT's row marking and BEiT's full-length
    kwarg as Hook rows, recorded per module under split-gather SP only; the
    pipeline splits of T5 / Whisper / BLIP-2 as SplitWhen rows giving the
    bound model's StageSplit, BEiT's in its spec with its refusal a row."""
    import types

    from shardformer.family import ComposedPolicy
    from shardformer.plan import stage_split
    from shardformer.spec import Hook, Method, Partial, Setting, SplitWhen

    for name, key in (("BloomForCausalLM", "BloomModel"), ("FalconForCausalLM", "FalconDecoderLayer"),
                      ("Swinv2ForImageClassification", "Swinv2Encoder")):
        a, b = _policy(name).build_spec(), _policy(name).build_spec()
        assert a == b and hash(a) == hash(b), name
        rows = a.module(key).attributes
        assert any(isinstance(r, (Method, Setting)) for r in rows), name
        changed = tuple(dataclasses.replace(r, name=r.name + "_x") if i == 0 else r for i, r in enumerate(rows))
        other = dataclasses.replace(a, modules=tuple(dataclasses.replace(m, attributes=changed) if m.key == key
                                                     else m for m in a.modules))
        assert other != a, name
    alibi = _policy("BloomForCausalLM").build_spec().module("BloomModel").attributes[0]
    assert isinstance(alibi.make, Partial) and alibi != dataclasses.replace(
        alibi, make=dataclasses.replace(alibi.make, args=alibi.make.args[:1] + (None,)))

    def checked(name, mode, stages=False, tp=False):
        policy = _policy(name)
        cfg = ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode=mode, enable_tensor_parallelism=tp)
        if stages:
            object.__setattr__(cfg, "pipeline_stage_manager", types.SimpleNamespace(num_stages=2))
        policy.set_shard_config(cfg)
        assert isinstance(policy, ComposedPolicy)
        policy.config_sanity_check()

    with pytest.raises(NotImplementedError, match=r"^Blip2VisionModel: sequence_parallelism_mode='split_gather' with "
                                                  r"pipeline parallelism is not available: the vision encoder's"):
        checked("Blip2VisionModel", "split_gather", stages=True, tp=True)
    with pytest.raises(NotImplementedError, match=r"^Blip2QFormerModel: sequence_parallelism_mode='ring_attn' is not "
                                                  r"available for vision_model / qformer: ring_attn applies to the "
                                                  r"language model, and this class has none \(split_gather"):
        checked("Blip2QFormerModel", "ring_attn")
    checked("Blip2ForConditionalGeneration", "all_to_all")               # composed: the language model takes it
    with pytest.raises(NotImplementedError, match=r"^Gemma3Model: sequence_parallelism_mode='ring_attn' is not "
                                                  r"available for language_model: Gemma 3 lets the tokens"):
        checked("Gemma3Model", "ring_attn")
    whens = [r.when for r in _policy("Blip2VisionModel").build_spec().refusals]
    assert whens == [("mode:split_gather", "pipeline_stages"), ("split_attention", "not_composed")]

    albert = _policy("AlbertForMaskedLM")
    assert Hook("", "mark_layer_rows") in albert.build_spec().module("AlbertLayer").entries
    beit = _policy("BeitForImageClassification")
    assert [e.hook for e in beit.build_spec().module("BeitLayer").entries if isinstance(e, Hook)] == [
        "full_length_kwarg"]
    for policy in (albert, beit):
        policy.begin()
        policy.module_policy()
        assert policy.state.hooks == [], type(policy).__name__           # TP alone: no hooks
    with pytest.raises(SpecError, match=r"Hook\('x'\): hook 'wrap' is not one of"):
        Hook("x", "wrap")

    for name in ("T5ForConditionalGeneration", "T5EncoderModel", "WhisperForConditionalGeneration",
                 "WhisperForAudioClassification", "Blip2QFormerModel", "Blip2ForConditionalGeneration"):
        policy = _policy(name)
        rows = policy.build_spec().capabilities.pipeline_split
        assert all(isinstance(r, SplitWhen) for r in rows), name
        split = stage_split(rows, policy.model)
        assert split is not None and split == policy.pipeline_split, name
    seg = _policy("BeitForSemanticSegmentation")            # the decode head's reads in the spec's split, its refusal a row
    assert seg.build_spec().capabilities.pipeline_split.reads == seg.pipeline_split.reads == (0, 1, 2, 3)
    assert [r.when for r in seg.build_spec().refusals] == [("pipeline_stages", "model:decode_head", "mode:split_gather")]
    assert _policy("BeitModel").build_spec().refusals == ()
    assert _policy("T5EncoderModel").pipeline_split.then is None
    assert _policy("Blip2QFormerModel").pipeline_split.owner == "Blip2QFormerModel"
