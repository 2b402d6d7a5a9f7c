"""The sharder: custom policies, error reporting, and the promise that a failed
optimize() leaves the model exactly as it was."""
import pytest
import torch
from torch import nn

from checks import sharder
from shardformer import ModulePolicyDescription, Policy, ShardConfig, ShardFormer
from shardformer import SubModuleReplacementDescription as Sub
from shardformer.layer import Linear1D_Col
from zoo import custom


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("which", ["block", "star"])
def test_custom_policy_on_user_module(pool, which, tp):
    reports = pool.run(sharder.custom_policy, tp, which)
    assert all(r["param_fraction"] < 0.75 for r in reports)


@pytest.mark.parametrize(
    "name, overrides, tp, expected",
    [
        ("LlamaForCausalLM", dict(num_attention_heads=6, num_key_value_heads=3), 4,
         ["LlamaForCausalLM", "model.layers.0.self_attn", "num_key_value_heads=3", "tensor_parallel_size=4"]),
        ("LlamaForCausalLM", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=48), 4,
         ["LlamaForCausalLM", "model.layers.0", "num_attention_heads=2", "tensor_parallel_size=4"]),
        ("GPT2LMHeadModel", dict(n_head=3, n_embd=48), 4,
         ["GPT2LMHeadModel", "transformer.h.0.attn", "num_attention_heads=3", "tensor_parallel_size=4"]),
        ("BertForMaskedLM", dict(num_attention_heads=3), 4,
         ["BertForMaskedLM", "bert.encoder.layer.0.attention.self", "num_attention_heads=3"]),
    ],
)
def test_heads_that_cannot_be_split(pool, name, overrides, tp, expected):
    messages = pool.run(sharder.bad_shard_leaves_model_unchanged, tp, name, overrides)
    for text in expected:
        assert text in messages[0], f"{text!r} not in {messages[0]!r}"


def test_missing_suffix_is_reported_and_model_unchanged(pool):
    messages = pool.run(sharder.bad_shard_leaves_model_unchanged, 2, "LlamaForCausalLM", {}, "missing_suffix")
    assert "LlamaForCausalLM" in messages[0] and "embed_tokens" in messages[0] and "'missing'" in messages[0]


def test_unknown_model_class_lists_supported():
    """The error leads with the two routes (plan dict, Policy) and points to
    supported_models() for the class list, which is not printed."""
    import shardformer

    with pytest.raises(ValueError) as err:
        ShardFormer(ShardConfig()).optimize(nn.Sequential(nn.Linear(2, 2)))
    text = str(err.value)
    assert "Sequential" in text and "plan=" in text and "policy=" in text and "supported_models()" in text
    assert "LlamaForCausalLM" not in text
    assert any(name.endswith("LlamaForCausalLM") for name in shardformer.supported_models())


def test_policy_matching_nothing_is_an_error():
    class Nothing(Policy):
        def module_policy(self):
            return {nn.Conv2d: ModulePolicyDescription(sub_module_replacement=[Sub("x", Linear1D_Col)])}

    model = custom.ToyModel()
    with pytest.raises(ValueError, match="matched no module"):
        ShardFormer(ShardConfig()).optimize(model, policy=Nothing())


def test_attribute_that_does_not_exist():
    class BadAttr(Policy):
        def module_policy(self):
            return {custom.ToyBlock: ModulePolicyDescription(attribute_replacement={"attn.headz": 1})}

    model = custom.ToyModel()
    before = repr(model)
    with pytest.raises(ValueError, match=r"ToyModel: blocks\.0\.attn\.headz: .*'headz'"):
        ShardFormer(ShardConfig()).optimize(model, policy=BadAttr())
    assert repr(model) == before


def test_optimize_twice_is_an_error():
    model = custom.ToyModel()
    sf = ShardFormer(ShardConfig())
    sf.optimize(model, policy=custom.ToyPolicy())
    with pytest.raises(ValueError, match="already been sharded"):
        sf.optimize(model, policy=custom.ToyPolicy())


def test_single_process_shards_to_size_one():
    """Without torch.distributed, optimize() shards to TP=1 and the model is unchanged numerically."""
    torch.manual_seed(0)
    model = custom.ToyModel()
    inputs = custom.toy_inputs()
    ref = model(**inputs)["logits"].detach()
    ShardFormer(ShardConfig()).optimize(model, policy=custom.ToyPolicy())
    assert isinstance(model.blocks[0].fc1, Linear1D_Col)
    torch.testing.assert_close(model(**inputs)["logits"], ref, rtol=1e-6, atol=1e-6)


def test_bad_policy_description_types():
    class Bad(Policy):
        def module_policy(self):
            return {custom.ToyBlock: {"sub_module_replacement": []}}

    with pytest.raises(TypeError, match="ModulePolicyDescription"):
        ShardFormer(ShardConfig()).optimize(custom.ToyModel(), policy=Bad())

    class NoFactory(Policy):
        def module_policy(self):
            return {custom.ToyBlock: ModulePolicyDescription(sub_module_replacement=[Sub("fc1", nn.Linear)])}

    with pytest.raises(TypeError, match="from_native_module"):
        ShardFormer(ShardConfig()).optimize(custom.ToyModel(), policy=NoFactory())


def test_shard_config_validation():
    with pytest.raises(ValueError, match="enable_sequence_parallelism"):
        ShardConfig(enable_sequence_overlap=True)
    with pytest.raises(TypeError, match="enable_fused_normalization"):
        ShardConfig(enable_fused_normalization="yes")
    with pytest.raises(ValueError, match="unknown keys"):
        ShardConfig(extra_kwargs={"make_vocab_divisible": 8})
    every = ShardConfig(enable_all_optimization=True)
    assert every.enable_fused_normalization and every.enable_flash_attention and every.enable_jit_fused
    assert ShardConfig(enable_sequence_parallelism=True).sequence_parallelism_mode == "split_gather"
    for mode in ("all_to_all", "ring_attn"):
        with pytest.raises(ValueError, match="of its own"):     # with TP: an SP group beside the TP group
            ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
        solo = ShardConfig(enable_tensor_parallelism=False, enable_sequence_parallelism=True,
                           sequence_parallelism_mode=mode)
        assert solo.split_attention_mode == mode and not solo.sequence_parallel
        with pytest.raises(ValueError, match="applies to split_gather"):
            ShardConfig(enable_tensor_parallelism=False, enable_sequence_parallelism=True,
                        sequence_parallelism_mode=mode, enable_sequence_overlap=True)
    with pytest.raises(ValueError, match="needs enable_tensor_parallelism=True"):
        ShardConfig(enable_tensor_parallelism=False, enable_sequence_parallelism=True)
    with pytest.raises(ValueError, match="one of"):
        ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="ring")
    with pytest.raises(ValueError, match="enable_sequence_parallelism is False"):
        ShardConfig(sequence_parallelism_mode="split_gather")
    assert ShardConfig(enable_sequence_parallelism=True, enable_sequence_overlap=True).enable_sequence_overlap
    with pytest.raises(TypeError, match="PipelineStageManager"):
        ShardConfig(pipeline_stage_manager=object())
    from shardformer.pipeline import PipelineStageManager

    both = ShardConfig(pipeline_stage_manager=PipelineStageManager(), enable_sequence_parallelism=True)
    assert both.enable_sequence_parallelism and both.pipeline_stage_manager is not None   # PP + SP compose
    cfg = ShardConfig(enable_fused_normalization=True)
    assert cfg.enable_tensor_parallelism and cfg.tensor_parallel_size == 1


# ---------------------------------------------------------------------------
# The shard plan: decided once, resolved in C, handed to the layers
# ---------------------------------------------------------------------------

def _count_planning(monkeypatch):
    """Wrap every plan_shard of the layer classes, the (tp_size, rank) lookup
    and the Python-side layout entry points; return the call records."""
    import shardformer.config as config
    import shardformer.sharder as sharder_mod
    from shardformer import layout
    from shardformer.layer import dropout, embedding, linear, moe, param_shard, parallel_module, replicated

    calls = {"plan_shard": [], "group_size_and_rank": 0, "python_layout": 0}
    owners = [parallel_module.ParallelModule, linear._LinearShard, embedding._EmbeddingShard,
              dropout._SeededDropout, moe.FusedExperts1D, param_shard.ShardParams,
              replicated.ReplicatedInParallelRegion]
    for owner in owners:
        original = owner.__dict__["plan_shard"].__func__

        def counted(cls, module, tp_size, rank, _original=original, **kwargs):
            calls["plan_shard"].append((cls, id(module), tp_size, rank))
            return _original(cls, module, tp_size, rank, **kwargs)

        monkeypatch.setattr(owner, "plan_shard", classmethod(counted))
    real_group = config.group_size_and_rank

    def group(process_group):
        calls["group_size_and_rank"] += 1
        return real_group(process_group)

    monkeypatch.setattr(sharder_mod, "group_size_and_rank", group)
    monkeypatch.setattr(parallel_module, "group_size_and_rank", group)

    def python_layout(*args, **kwargs):   # the C planner must not come back here
        calls["python_layout"] += 1
        raise AssertionError("layout resolved from Python while the sharder planned")

    monkeypatch.setattr(layout.SplitSpec, "resolve", python_layout)
    monkeypatch.setattr(layout.HeadCount, "_count", python_layout)
    monkeypatch.setattr(parallel_module, "plan_directly", python_layout)
    return calls


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM"])
def test_plan_computed_once_per_optimize(monkeypatch, name):
    """One optimize(): (tp_size, rank) looked up once, every replacement
    planned exactly once (by the sharder, before any change), its layouts
    resolved by the C planner with no call back into Python's layout code,
    and every parallel layer built from that plan."""
    import zoo
    from shardformer.layer import ParallelModule

    model = zoo.build(name)
    natives = {id(m): m for m in model.modules()}
    calls = _count_planning(monkeypatch)
    ShardFormer(ShardConfig()).optimize(model)
    assert calls["group_size_and_rank"] == 1
    assert calls["python_layout"] == 0
    planned = [module_id for _, module_id, _, _ in calls["plan_shard"]]
    assert planned and len(planned) == len(set(planned)), "a replacement was planned twice"
    assert all(module_id in natives for module_id in planned)
    assert all((tp, rank) == (1, 0) for _, _, tp, rank in calls["plan_shard"])
    layers = [m for m in model.modules() if isinstance(m, ParallelModule)]
    assert layers and len(layers) <= len(planned)
    assert all(m.shard_plan.resolved is not None and m.tp_size == 1 for m in layers)


def test_directly_built_layers_plan_in_one_place(monkeypatch):
    """Outside the sharder, plan_for is the one place that plans: once per
    layer, for the constructor and for from_native_module alike."""
    from shardformer.layer import Linear1D_Row, VocabParallelEmbedding1D, parallel_module

    planned = []
    real = parallel_module.plan_directly

    def counted(target, module, process_group=None, **kwargs):
        planned.append(target)
        return real(target, module, process_group, **kwargs)

    monkeypatch.setattr(parallel_module, "plan_directly", counted)
    col = Linear1D_Col(8, 6)
    assert col.weight.shape == (6, 8) and col.shard_plan.tp_size == 1 and planned == [Linear1D_Col]
    lin = nn.Linear(6, 4)
    row = Linear1D_Row.from_native_module(lin, None, input_is_parallel=False)
    assert planned == [Linear1D_Col, Linear1D_Row]
    torch.testing.assert_close(row(torch.ones(2, 6)), lin(torch.ones(2, 6)))
    emb = VocabParallelEmbedding1D.from_native_module(nn.Embedding(10, 4), None, make_vocab_size_divisible_by=8)
    assert emb.weight.shape == (16, 4) and emb.sharded_params["weight"][1].real == 10
    assert len(planned) == 3


@pytest.mark.parametrize("spec", [
    ("heads", "Heads(huge)", 2 ** 62, 2 ** 62, 4, 0),
    ("grouped", "Grouped(huge)", 2 ** 62, 2 ** 62, 4),
    ("fused", "Fused(huge)", (("heads", "a", 2 ** 61, 1, 2, 0), ("heads", "b", 2 ** 61, 1, 2, 0))),
])
def test_split_spec_lengths_are_overflow_checked(spec):
    from shardformer import _C

    with pytest.raises(OverflowError, match=r"split spec .*huge.*: its length overflows int64"):
        _C.resolve_split(spec, 8, 2, 0, "dim")
