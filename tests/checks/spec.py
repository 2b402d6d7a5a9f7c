"""Rank-side checks of a policy written as a PolicySpec (tests/test_spec.py):
a user's hand-written spec of Llama, run by SpecPolicy, shards like the
unsharded model under TP and split-gather SP, and its refusals fire before
the model changes.  Each function runs on every rank of the pool."""
from __future__ import annotations

import copy
import dataclasses

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.family import SpecPolicy
from shardformer.layer.sequence_layout import BLOCK
from shardformer.spec import Capabilities, Entry, HeadsFrom, ModuleSpec, PolicySpec, Refusal, SplitGatherSpec

NAME = "LlamaForCausalLM"
# Uneven sizes: 5 query / 5 KV heads and a vocabulary of 77 over 2 or 4 ranks; the LM head tied.
UNEVEN = dict(num_attention_heads=5, num_key_value_heads=5, head_dim=12, hidden_size=60, intermediate_size=70,
              vocab_size=77, num_hidden_layers=3, tie_word_embeddings=True)


def user_llama_spec() -> PolicySpec:
    """Llama as a user would write it, every piece as data."""
    layer = (Entry("self_attn.q_proj", "colwise_heads"), Entry("self_attn.k_proj", "colwise_kv_heads"),
             Entry("self_attn.v_proj", "colwise_kv_heads"), Entry("self_attn.o_proj", "rowwise_heads"),
             Entry("mlp.gate_proj", "colwise"), Entry("mlp.up_proj", "colwise"), Entry("mlp.down_proj", "rowwise"))
    return PolicySpec(
        name="user-llama",
        modules=(ModuleSpec("LlamaDecoderLayer", layer, attributes=(("self_attn.num_key_value_groups", "groups"),)),
                 ModuleSpec("LlamaModel", (Entry("embed_tokens", "embedding_rowwise"),)),
                 ModuleSpec("LlamaForCausalLM", (Entry("lm_head", "vocab_lm_head"),))),
        heads=HeadsFrom(),
        split_gather=SplitGatherSpec("LlamaModel", "layers", "LlamaDecoderLayer",
                                     (("self_attn", BLOCK), ("mlp", BLOCK)), skip=("self_attn", "mlp")),
        ties=(("model.embed_tokens", "lm_head"),),
        capabilities=Capabilities(sp_modes=("split_gather",), sequence_overlap=True, sequence_recompute=True),
        refusals=(Refusal("pretraining_tp", allowed=(None, 1), default=1,
                          message="{model}: {attribute}={value} is not supported by user-llama (set it to 1)"),),
    )


#: The configurations of user_spec_shards, by name ("untied": TP on a model whose LM head is not tied).
CONFIGS = {"tp": {}, "split_gather": {"enable_sequence_parallelism": True},
           "overlap": {"enable_sequence_parallelism": True, "enable_sequence_overlap": True}, "untied": {}}
#: Model overrides of a configuration: the spec's tie is the model's own, kept only where the model has it.
OVERRIDES = {"untied": {"tie_word_embeddings": False}}


def user_spec_shards(ctx, default_group: bool, tags: tuple[str, ...]) -> dict:
    """The user's spec under the configurations `tags` (CONFIGS: TP,
    split-gather SP, SP with overlap): each the unsharded model's forward,
    loss, gradients and SGD step; the LM head re-tied to the embedding
    (spec.ties)."""
    group = {} if default_group else {"tensor_parallel_process_group": ctx.group}
    inputs = {k: v % UNEVEN["vocab_size"] if k in ("input_ids", "labels") else v
              for k, v in zoo.make_inputs(NAME).items()}
    reports = {}
    for tag in tags:
        extra = CONFIGS[tag]
        model = zoo.build(NAME, **dict(UNEVEN, **OVERRIDES.get(tag, {}))).train()
        ref = copy.deepcopy(model)
        ShardFormer(shard_config=ShardConfig(**group, **extra)).optimize(model, policy=SpecPolicy(user_llama_spec()))
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied is (tag not in OVERRIDES), f"{tag}: LM head {'tied' if tied else 'not re-tied'}"
        reports[tag] = parity.compare_sharded(model, ref, inputs, f"user spec {tag}")
    return reports


def user_spec_refuses(ctx) -> dict:
    """A spec's Refusal raised with its numbers, and a mode its capabilities
    lack refused naming the modes it has, both before the model changes."""
    shard = ShardFormer(shard_config=ShardConfig(tensor_parallel_process_group=ctx.group))
    model = zoo.build(NAME, pretraining_tp=2)
    data = parity.refused_unchanged(model, lambda: shard.optimize(model, policy=SpecPolicy(user_llama_spec())),
                                    "a refusal as data", structure=True,
                                    names=("LlamaForCausalLM", "pretraining_tp=2", "user-llama"))
    sp = ShardFormer(shard_config=ShardConfig(tensor_parallel_process_group=ctx.group,
                                              enable_sequence_parallelism=True))
    tp_only = dataclasses.replace(user_llama_spec(), split_gather=None, capabilities=Capabilities())
    model = zoo.build(NAME)
    mode = parity.refused_unchanged(model, lambda: sp.optimize(model, policy=SpecPolicy(tp_only)),
                                    "a mode the capabilities lack", NotImplementedError, structure=True,
                                    names=("'split_gather'", "it implements: none"))
    return {"data": data, "mode": mode}


# ---- user subclasses of the fused-QKV and vision shapes (issue 33: their specs built from the shape's methods) ----

#: (zoo name, config overrides) per shape: 5 heads (uneven over 2 and 4 ranks; Swin's first stage has 5)
SHAPE_MODELS = {"fused_qkv": ("BloomForCausalLM", dict(n_head=5, hidden_size=60)),
                "vision": ("ViTForImageClassification", dict(num_attention_heads=5, hidden_size=40)),
                "stage": ("SwinForImageClassification", {}),
                # the bespoke families' spec factories: 6 heads over 2 KV groups (ChatGLM2), 6 heads in SAM's
                # mask decoder: uneven over 4 ranks; SAM's vision layers run split-gather SP through a Method row
                "chatglm2": ("ChatGLMForConditionalGeneration", {}),
                "sam": ("SamModel", {}),
                # BLIP-2's spec factory: its vision encoder and its Q-Former split segment by segment under SP
                "blip2": ("Blip2ForImageTextRetrieval", {})}


def shape_subclasses(called: list) -> dict:
    """{shape: a user subclass of its family's policy} each overriding one
    method the shape's spec factory reads, recording its calls in `called`:
    FusedQKVShape.qkv_layout (the fused projection's split), VisionShape.heads_layout
    and StageShape.block_attributes (which the Swin family leaves empty: the
    subclass sets every block's attention.num_attention_heads to this rank's count)."""
    from shardformer.policies.swin import SwinForImageClassificationPolicy
    from shardformer.policies.bloom import BloomForCausalLMPolicy
    from shardformer.policies.vit import ViTForImageClassificationPolicy

    class MyBloom(BloomForCausalLMPolicy):
        def qkv_layout(self):
            called.append("qkv_layout")
            return super().qkv_layout()

    class MyViT(ViTForImageClassificationPolicy):
        def heads_layout(self):
            called.append("heads_layout")
            return super().heads_layout()

    class MySwin(SwinForImageClassificationPolicy):
        def block_attributes(self, heads):
            called.append("block_attributes")
            return heads.attributes({"attention.num_attention_heads": "heads"})

    return {"fused_qkv": MyBloom, "vision": MyViT, "stage": MySwin, **bespoke_subclasses(called)}


def bespoke_subclasses(called: list) -> dict:
    """User subclasses of two bespoke families' policies, each overriding one
    spec row: ChatGLM2's packed [gate | up] projection (the block_entries()
    its spec factory reads) as packed_colwise, a Linear1D_Col, in place of
    fused_packed_colwise; SAM's vision attn.qkv (a row of build_spec()'s
    spec, replaced with dataclasses.replace) as fused_colwise_qkv, a
    FusedLinear1D_Col, in place of colwise_qkv.  The same split either way.
    BLIP-2's Q-Former text embeddings (a ModuleSpec of the qformer_modules()
    its spec factory reads) kept whole: replicated on every rank."""
    from shardformer.policies.chatglm2 import ChatGLMForConditionalGenerationPolicy
    from shardformer.policies.sam import SamModelPolicy
    from shardformer.policies.blip2 import Blip2ForImageTextRetrievalPolicy

    class MyChatGLM2(ChatGLMForConditionalGenerationPolicy):
        def block_entries(self):
            called.append("block_entries")
            return tuple(Entry(e.suffix, "packed_colwise") if e.suffix == "mlp.dense_h_to_4h" else e
                         for e in super().block_entries())

    class MySam(SamModelPolicy):
        def build_spec(self):
            called.append("build_spec")
            spec = super().build_spec()
            layer = spec.module("SamVisionLayer")
            entries = tuple(dataclasses.replace(e, style="fused_colwise_qkv") if e.suffix == "attn.qkv" else e
                            for e in layer.entries)
            return dataclasses.replace(spec, modules=tuple(dataclasses.replace(m, entries=entries) if m is layer
                                                           else m for m in spec.modules))

    class MyBlip2(Blip2ForImageTextRetrievalPolicy):
        def qformer_modules(self, qformer_cfg):
            called.append("qformer_modules")
            return tuple(m for m in super().qformer_modules(qformer_cfg) if m.key != "Blip2TextEmbeddings")

    return {"chatglm2": MyChatGLM2, "sam": MySam, "blip2": MyBlip2}


def shape_overrides_shard(ctx, default_group: bool, config: dict) -> dict:
    """Each shape's user subclass (shape_subclasses) under `config`: its
    override is read by the shape's spec factory (check_shape_specs) and the
    model shards like the unsharded one (forward, loss, every gradient, an
    SGD step); Swin's blocks hold this rank's head count."""
    check_shape_specs()
    reports = {}
    for shape, (name, overrides) in SHAPE_MODELS.items():
        called: list = []
        cls = shape_subclasses(called)[shape]
        reports[shape] = parity.check_sharded(ctx, lambda: zoo.build(name, **overrides), zoo.make_inputs(name),
                                              name=f"{name} ({cls.__name__})", config=config, policy=cls(),
                                              default_group=default_group)
        assert called, f"{cls.__name__}: the override was never called"
    return reports


def check_shape_specs() -> None:
    """Each shape's spec of its user subclass (shape_subclasses), bound to
    one model: the override's rows are in it (BLOOM's qkv entry with the
    override's heads, ViT's heads, a Setting per Swin block); the window
    overlap and the stages' split-gather are Stack rows, frozen."""
    import dataclasses

    from shardformer.spec import Setting, Stack

    specs = {}
    for shape, (name, overrides) in SHAPE_MODELS.items():
        called: list = []
        policy = shape_subclasses(called)[shape]()
        policy.set_model(zoo.build(name, **overrides))
        policy.set_shard_config(ShardConfig())
        specs[shape] = (policy.build_spec(), called)
    (bloom, c1), (vit, c2), (swin, c3) = specs["fused_qkv"], specs["vision"], specs["stage"]
    (glm, c4), (sam, c5), (blip2, c6) = specs["chatglm2"], specs["sam"], specs["blip2"]
    assert (c1, c2, c3[:1], c4, c5, c6) == (["qkv_layout"], ["heads_layout"], ["block_attributes"], ["block_entries"],
                                            ["build_spec"], ["qformer_modules"]), (c1, c2, c3, c4, c5, c6)
    check_blip2_spec(blip2)
    assert [(e.suffix, e.style) for e in glm.module("GLMBlock").entries] == [
        ("self_attention.query_key_value", "fused_colwise_qkv"), ("self_attention.dense", "rowwise_heads"),
        ("mlp.dense_h_to_4h", "packed_colwise"), ("mlp.dense_4h_to_h", "rowwise")]
    assert (glm.split_gather.dim, glm.split_gather.marks, glm.heads.kv_heads) == (0, False, "multi_query_group_num")
    vision = sam.module("SamVisionLayer")
    assert [e.style for e in vision.entries[:2]] == ["fused_colwise_qkv", "rowwise_heads"], vision.entries
    assert [(type(a).__name__, a.name) for a in vision.attributes] == [("Attribute", "attn.num_attention_heads"),
                                                                      ("Method", "forward")]
    assert sam.split_gather.when == ("tensor_parallel_ranks",)
    qkv = bloom.module("BloomBlock").entries[0]
    assert (qkv.suffix, qkv.style, qkv.heads.num_heads) == ("self_attention.query_key_value", "colwise_per_head", 5)
    assert [r.name for r in bloom.module("BloomBlock").attributes] == [
        "self_attention.num_heads", "self_attention.hidden_dropout", "mlp.hidden_dropout"]
    assert vit.module("ViTLayer").entries[0].heads.num_heads == 5
    encoder = swin.module("SwinEncoder")
    stacks = [e for e in encoder.entries if isinstance(e, Stack)]
    assert [(s.path, s.depth, s.overlap.gather_at) for s in stacks] == [("layers.0.blocks", 2, "layernorm_before"),
                                                                       ("layers.1.blocks", 2, "layernorm_before")]
    assert [a.name for a in encoder.attributes if isinstance(a, Setting)] == [
        f"layers.{i}.blocks.{j}.attention.num_attention_heads" for i in (0, 1) for j in (0, 1)]
    assert "bias_table_heads" in repr(encoder)
    from shardformer.policies.vit import ViTModelPolicy

    try:
        type("Old", (ViTModelPolicy,), {"layer_replacements": lambda self, heads: []})
    except TypeError as e:
        assert "Old.layer_replacements() is no longer read" in str(e) and "layer_entries()" in str(e), e
    else:
        raise AssertionError("a subclass overriding a removed hook was not refused")
    try:
        stacks[0].depth = 3
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("a Stack row is not frozen")


def check_blip2_spec(spec) -> None:
    """BLIP-2's spec (issue 33 item 1): the user subclass dropped the Q-Former
    text embeddings; the vision encoder is the first split-gather stack, the
    Q-Former a second one split segment by segment, whose regions stand among
    the layer's entries, each naming its segment; the vision attention's
    forward a Method row."""
    from shardformer.spec import GATHER_ORDER, Method, Region

    keys = [m.key for m in spec.modules]
    assert "Blip2TextEmbeddings" not in keys and "Blip2QFormerLayer" in keys, keys
    assert (spec.split_gather.owner, spec.split_gather.ends) == ("Blip2VisionModel", "layers"), spec.split_gather
    (qformer,) = spec.stacks
    assert (qformer.owner, qformer.ends, qformer.segments) == ("Blip2QFormerEncoder", "segments", ("query", "text"))
    regions = [(r.path, r.segment) for r in spec.module("Blip2QFormerLayer").entries
               if isinstance(r, Region) and r.layouts is not None]
    assert regions == [("intermediate_query", "query"), ("attention.attention", None), ("attention.output", None),
                       ("intermediate", "text"), ("crossattention.attention", "query")], regions
    order = [r for r in spec.module("Blip2QFormerLayer").entries if getattr(r, "layouts", None) == GATHER_ORDER]
    assert [r.path for r in order] == ["attention.output"], order
    assert [type(a).__name__ for a in spec.module("Blip2Attention").attributes] == ["Attribute", "Method"]
    assert isinstance(spec.module("Blip2Attention").attributes[1], Method)


# ---- the bespoke families as specs (issue 33: OPT, ALBERT, T5, Whisper) and ties kept without re-tying ----

#: the model of each bespoke family a user subclass shards (each ties its LM head / shared embeddings;
#: 6 heads: uneven over 4 ranks; vocabularies 99 / 101: uneven over 2 and 4)
BESPOKE_MODELS = {"opt": "OPTForCausalLM", "albert": "AlbertForMaskedLM", "t5": "T5ForConditionalGeneration",
                  "whisper": "WhisperForConditionalGeneration"}
#: per family: the module paths the user subclass leaves whole (its MLP of the first layer's class)
KEPT_WHOLE = {"opt": ("model.decoder.layers.0.fc1", "model.decoder.layers.1.fc2"),
              "albert": ("albert.encoder.albert_layer_groups.0.albert_layers.0.ffn",),
              "t5": ("encoder.block.0.layer.1.DenseReluDense.wi", "decoder.block.1.layer.2.DenseReluDense.wo"),
              "whisper": ("model.encoder.layers.0.fc1", "model.encoder.layers.1.fc2")}


def bespoke_family_subclasses(called: list) -> dict:
    """{family: a user subclass of its built-in policy} overriding one row
    of its spec, each keeping one MLP whole (replicated): OPT's mlp_entries(),
    ALBERT's layer_entries() (ffn / ffn_output dropped), Whisper's layer_spec()
    of the encoder layer, T5's build_spec() (the ReLU feed-forward's ModuleSpec
    dropped).  Each records its call in `called`."""
    from shardformer.policies.albert import AlbertForMaskedLMPolicy
    from shardformer.policies.opt import OPTForCausalLMPolicy
    from shardformer.policies.t5 import T5ForConditionalGenerationPolicy
    from shardformer.policies.whisper import WhisperForConditionalGenerationPolicy

    class MyOPT(OPTForCausalLMPolicy):
        def mlp_entries(self):
            called.append("mlp_entries")
            return ()

    class MyAlbert(AlbertForMaskedLMPolicy):
        def layer_entries(self):
            called.append("layer_entries")
            return tuple(e for e in super().layer_entries() if e.suffix not in ("ffn", "ffn_output"))

    class MyT5(T5ForConditionalGenerationPolicy):
        def build_spec(self):
            called.append("build_spec")
            spec = super().build_spec()
            return dataclasses.replace(spec, modules=tuple(m for m in spec.modules if m.key != "T5DenseActDense"))

    class MyWhisper(WhisperForConditionalGenerationPolicy):
        def layer_spec(self, layer_cls, heads, attns):
            called.append("layer_spec")
            spec = super().layer_spec(layer_cls, heads, attns)
            if layer_cls != "WhisperEncoderLayer":
                return spec
            return dataclasses.replace(spec, entries=tuple(e for e in spec.entries if e.suffix not in ("fc1", "fc2")))

    return {"opt": MyOPT, "albert": MyAlbert, "t5": MyT5, "whisper": MyWhisper}


def bespoke_overrides_shard(ctx, default_group: bool) -> dict:
    """Each bespoke family's user subclass (bespoke_family_subclasses): its override
    is read by the family's spec factory, the modules it keeps whole stay
    nn.Linear, the rest is split, and the model shards like the unsharded one
    (forward, loss, every gradient, an SGD step), its ties held; then
    ties_kept_without_retying for the other families.  Policy.tie_weight is
    unavailable throughout (no policy re-ties: issue 33 item 2)."""
    from torch import nn

    from shardformer.layer import Linear1D_Col

    reports = {}
    with no_retying():
        for family, name in BESPOKE_MODELS.items():
            called: list = []
            cls = bespoke_family_subclasses(called)[family]
            kept: dict = {}

            def build():
                kept["model"] = model = zoo.build(name)
                kept["ties"] = ties_of(model)
                return model

            reports[family] = parity.check_sharded(ctx, build, zoo.make_inputs(name), name=f"{name} ({cls.__name__})",
                                                   policy=cls(), default_group=default_group)
            assert called, f"{cls.__name__}: the override was never called"
            model = kept["model"]
            whole = [p for p in KEPT_WHOLE[family] if type(model.get_submodule(p)) is not nn.Linear]
            assert not whole, f"{cls.__name__}: {whole} were split, though the subclass's spec keeps them whole"
            assert any(isinstance(m, Linear1D_Col) for m in model.modules()), f"{cls.__name__}: nothing was split"
            assert kept["ties"] and not untied(model, kept["ties"]), f"{name}: untied {untied(model, kept['ties'])}"
        reports["ties"] = ties_kept_without_retying(ctx, default_group)
    return reports


#: one model with ties (one Parameter under several names) of every other built-in family that has one
#: (OPT, ALBERT, T5, Whisper: BESPOKE_MODELS)
TIED_MODELS = ("BertForMaskedLM", "Blip2ForConditionalGeneration", "BloomForCausalLM", "ErnieForCausalLM",
               "FalconForCausalLM", "GPT2DoubleHeadsModel", "GPTNeoForCausalLM", "Gemma2ForCausalLM",
               "Gemma3ForCausalLM", "GemmaForCausalLM", "Qwen2ForCausalLM", "RobertaForCausalLM", "SamModel")


class no_retying:
    """Within it, Policy.tie_weight raises (naming the policy and the names it would re-tie)."""

    def __enter__(self):
        from shardformer.policy import Policy

        def refuse(policy, source, target, name="weight"):
            raise AssertionError(f"{type(policy).__name__} re-tied {target}.{name} to {source}.{name}")

        self.saved, Policy.tie_weight = Policy.tie_weight, refuse

    def __exit__(self, *exc):
        from shardformer.policy import Policy

        Policy.tie_weight = self.saved


def ties_of(model) -> list[list[str]]:
    """The parameter names of `model` that share one Parameter, per Parameter held under two or more."""
    names: dict = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(path)
    return [paths for paths in names.values() if len(paths) > 1]


def untied(model, ties) -> list:
    """The groups of `ties` (ties_of before optimize()) that `model` no longer holds as one Parameter."""
    after = dict(model.named_parameters(remove_duplicate=False))
    return [paths for paths in ties if len({id(after[p]) for p in paths}) != 1]


def ties_kept_without_retying(ctx, default_group: bool) -> dict:
    """Every tie of every model of TIED_MODELS (the names holding one
    Parameter before optimize()) holds one Parameter after it, under
    no_retying(): the engine binds ties by Parameter identity (shardformer.ties)."""
    group = {} if default_group else {"tensor_parallel_process_group": ctx.group}
    counts = {}
    for name in TIED_MODELS:
        model = zoo.build(name)
        ties = ties_of(model)
        assert ties, f"{name}: the zoo model has no tie"
        ShardFormer(shard_config=ShardConfig(**group)).optimize(model)
        assert not untied(model, ties), f"{name}: untied after optimize(): {untied(model, ties)}"
        counts[name] = len(ties)
    return counts
