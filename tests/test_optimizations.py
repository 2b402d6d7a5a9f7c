"""The optimizations the sharder applies by module type (shardformer.optimizations):
which modules qualify (structure, then a probe against the module's own forward),
that policies' own replacements win, that a model with no policy lines gets them,
and, for every family, that the fused model equals the unsharded one at TP=2 with
the fused kernels counted as having run."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import zoo
from checks import optimizations
from shardformer import ModulePolicyDescription, Policy, ShardConfig, ShardFormer
from shardformer import SubModuleReplacementDescription as Sub
from shardformer.layer import FusedLayerNorm, FusedRMSNorm, Linear1D_Col, Linear1D_Row
from shardformer.optimizations import optimization_policy
from zoo import decoders

FUSED = ShardConfig(enable_fused_normalization=True, enable_jit_fused=True)


def _switched(model: nn.Module) -> tuple[set[str], set[str]]:
    """(classes whose norms are replaced, classes whose forward is replaced)."""
    policy = optimization_policy(model, FUSED, set(), set())
    norms = {f"{k.__name__}.{s.suffix}" for k, v in policy.items() for s in v.sub_module_replacement}
    mlps = {k.__name__ for k, v in policy.items() if v.method_replacement}
    return norms, mlps


def test_llama_shaped_decoders_all_get_swiglu():
    # The drift the hand-written policies had: only Llama got the fused SwiGLU.
    for name in ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "GlmForCausalLM"):
        prefix = name[: -len("ForCausalLM")]
        norms, mlps = _switched(decoders.build(name))
        assert mlps == {f"{prefix}MLP"}, (name, mlps)
        assert f"{prefix}DecoderLayer.input_layernorm" in norms, (name, norms)


def test_gemma_norms_get_the_one_plus_w_form():
    # GemmaRMSNorm scales by (1 + w): FusedRMSNorm(offset=1) over the same stored w.
    model = decoders.build("GemmaForCausalLM")
    norms, _ = _switched(model)
    assert "GemmaDecoderLayer.input_layernorm" in norms and "GemmaModel.norm" in norms, norms
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_()                     # w != 0, so (1 + w) differs from w
    ref = copy.deepcopy(model)
    sharded, _ = ShardFormer(ShardConfig(enable_fused_normalization=True)).optimize(model)
    norm = sharded.model.norm
    assert isinstance(norm, FusedRMSNorm) and norm.offset == 1.0
    assert norm.weight is ref.model.norm.weight or torch.equal(norm.weight, ref.model.norm.weight)
    assert set(sharded.state_dict()) == set(ref.state_dict())      # HF's names and values
    x = torch.randn(2, 3, norm.weight.shape[0], requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with optimizations.counting_kernels() as calls:
        y = norm(x)
    y_ref = ref.model.norm(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert calls["rms_norm"] == 1, calls
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad, ref.model.norm.weight.grad, rtol=1e-5, atol=1e-6)


def test_channels_first_layer_norm():
    # SAM's SamLayerNorm(data_format="channels_first") normalizes dimension 1 of [B, C, H, W].
    from transformers.models.sam.modeling_sam import SamLayerNorm

    class Neck(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = SamLayerNorm(6, eps=1e-6, data_format="channels_first")
            self.last = SamLayerNorm(6, eps=1e-6)

    torch.manual_seed(0)
    model = Neck()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    assert _switched(model)[0] == {"Neck.first", "Neck.last"}
    ref = copy.deepcopy(model)
    sharded, _ = ShardFormer(ShardConfig(enable_fused_normalization=True)).optimize(model, policy=_EmptyPolicy())
    assert sharded.first.channels_first and not sharded.last.channels_first
    x = torch.randn(2, 6, 3, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with optimizations.counting_kernels() as calls:
        y = sharded.first(x)
    y_ref = ref.first(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert calls["layer_norm"] == 1, calls
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for a, b in ((sharded.first.weight, ref.first.weight), (sharded.first.bias, ref.first.bias)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


class _EmptyPolicy(Policy):
    def module_policy(self):
        return {}


class _Block(nn.Module):
    def __init__(self, n=24, wrong=False):
        super().__init__()
        self.norm = nn.LayerNorm(n)
        self.rms = _EpsOutsideRMS(n) if wrong else _RMS(n)
        self.mlp = _SwappedGate(n) if wrong else _Gated(n)

    def forward(self, x):
        return self.mlp(self.rms(self.norm(x)))


class _RMS(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _EpsOutsideRMS(_RMS):
    def forward(self, x):   # eps outside the root: looks like an RMSNorm, is not one
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight


class _Gated(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(n, 2 * n), nn.Linear(n, 2 * n), nn.Linear(2 * n, n)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _SwappedGate(_Gated):
    def forward(self, x):   # the activation on up, not gate
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


class _Model(nn.Module):
    def __init__(self, wrong=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(wrong=wrong) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _BlockPolicy(Policy):
    def module_policy(self):
        return {_Gated: ModulePolicyDescription(sub_module_replacement=[
            Sub("gate_proj", Linear1D_Col), Sub("up_proj", Linear1D_Col), Sub("down_proj", Linear1D_Row)])}


def test_lookalikes_are_refused_by_the_probe():
    norms, mlps = _switched(_Model(wrong=True))
    assert norms == {"_Block.norm"} and mlps == set()
    norms, mlps = _switched(_Model())
    assert norms == {"_Block.norm", "_Block.rms"} and mlps == {"_Gated"}


class _NeedsMask(_Gated):
    def forward(self, x, mask):   # the gated children, but a forward the probe input cannot call
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * mask


class _Broken(_Gated):
    def forward(self, x):          # a bug, not a shape the probe guessed wrong
        raise KeyError("no such cache entry")


def _with_mlp(cls) -> nn.Module:
    model = _Model()
    for block in model.blocks:
        block.mlp = cls(24)
    return model


def test_a_form_whose_probe_raises_is_logged_not_skipped_silently(caplog):
    """A form refused because its probe raised is logged with the class, the
    form and the exception; an exception that is not a probe mismatch
    (PROBE_ERRORS) propagates instead of switching the kernel off."""
    with caplog.at_level("INFO", logger="shardformer.optimizations"):
        _, mlps = _switched(_with_mlp(_NeedsMask))
    assert mlps == set()
    said = [r.getMessage() for r in caplog.records if r.name == "shardformer.optimizations"]
    assert any(m.startswith("_NeedsMask: fused form gated_mlp_forward") and "its own forward raised TypeError" in m
               and "mask" in m for m in said), said
    with pytest.raises(KeyError, match="no such cache entry"):
        _switched(_with_mlp(_Broken))


def test_a_custom_policy_gets_the_optimizations_without_a_line():
    model, ref = _Model(), _Model()
    sharded, _ = ShardFormer(FUSED).optimize(model, policy=_BlockPolicy())
    x = torch.randn(3, 5, 24)
    with optimizations.counting_kernels() as calls:
        torch.testing.assert_close(sharded(x), ref(x), rtol=1e-5, atol=1e-5)
    assert isinstance(sharded.blocks[0].norm, FusedLayerNorm) and isinstance(sharded.blocks[1].rms, FusedRMSNorm)
    assert isinstance(sharded.blocks[0].mlp.gate_proj, Linear1D_Col)
    assert calls["layer_norm"] == 2 and calls["rms_norm"] == 2 and calls["swiglu"] == 2, calls


def test_one_class_with_two_activations_keeps_its_forward():
    # SAM's SamMLPBlock is GeLU in the vision tower and ReLU in the mask decoder.
    model = _Model()
    model.blocks[1].mlp.act_fn = nn.ReLU()
    assert _switched(model)[1] == set()
    model.blocks[1].mlp.act_fn = nn.SiLU()
    assert _switched(model)[1] == {"_Gated"}


def test_the_policy_replacement_wins():
    # Qwen3's q_norm / k_norm are the policy's (kept replicated, gradients all-reduced).
    model = decoders.build("Qwen3ForCausalLM")
    sharded, _ = ShardFormer(FUSED).optimize(model)
    attn = sharded.model.layers[0].self_attn
    assert not isinstance(attn.q_norm, FusedRMSNorm) and not isinstance(attn.k_norm, FusedRMSNorm)
    assert isinstance(sharded.model.layers[0].input_layernorm, FusedRMSNorm)


def test_switches_off_means_nothing_changes():
    assert optimization_policy(_Model(), ShardConfig(), set(), set()) == {}


def test_training_mode_dropout_does_not_defeat_the_probe():
    # GPT-2's MLP ends in dropout; in training mode the probe draws the same mask twice.
    model = zoo.build("GPT2LMHeadModel", resid_pdrop=0.3)
    model.train()
    _, mlps = _switched(model)
    assert mlps == {"GPT2MLP"}


def test_residual_forms_and_their_lookalikes():
    # BERT's *Output: dense -> dropout -> LayerNorm(h + residual): bias_dropout_add.
    # ViT's ViTSelfOutput has the same children but adds no residual: refused by the probe.
    _, mlps = _switched(zoo.build("BertModel"))
    assert {"BertSelfOutput", "BertOutput", "BertIntermediate"} <= mlps, mlps
    _, mlps = _switched(zoo.build("ViTModel"))
    assert "ViTSelfOutput" not in mlps and "ViTMLP" in mlps, mlps
    _, mlps = _switched(zoo.build("BloomModel"))
    assert mlps == {"BloomMLP"}, mlps


def test_fused_dropout_add_drops_in_training_mode():
    # The kernel draws its own mask: in training mode the output is dropped (p = the
    # module's dropout p), in eval mode it equals HF's forward.
    from transformers.models.bert.modeling_bert import BertSelfOutput

    model = zoo.build_with_dropout("BertModel", 0.5)
    ref = copy.deepcopy(model)
    sharded, _ = ShardFormer(FUSED).optimize(model)
    out, out_ref = sharded.encoder.layer[0].attention.output, ref.encoder.layer[0].attention.output
    assert isinstance(out, BertSelfOutput)
    h, r = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    out.eval(), out_ref.eval()
    with optimizations.counting_kernels() as calls:
        torch.testing.assert_close(out(h, r), out_ref(h, r), rtol=1e-5, atol=1e-5)
    assert calls["bias_dropout_add"] == 1, calls
    out.train()
    torch.manual_seed(0)
    assert not torch.allclose(out(h, r), out_ref(h, r))


@pytest.fixture
def one_thread():
    """torch and the kernels on one thread for this in-process test: tiny tensors gain nothing from
    more, and on the loaded 2-core CI machine the idle workers' spinning costs seconds a pass."""
    from shardformer import ops

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    ops.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
        ops.set_num_threads(None)


def test_inline_residual_layers_get_the_fused_layer_form(one_thread):
    # OPT's and Whisper's layers write their residual blocks inline: the whole layer's
    # forward is switched (RESIDUAL_LAYER_FORMS); a look-alike whose forward differs is refused.
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    _, mlps = _switched(zoo.build("OPTForCausalLM"))
    assert mlps == {"OPTDecoderLayer"}, mlps
    _, mlps = _switched(zoo.build("WhisperForConditionalGeneration"))
    assert mlps == {"WhisperEncoderLayer", "WhisperDecoderLayer"}, mlps

    class ScaledResidual(OPTDecoderLayer):
        def forward(self, hidden_states, **kwargs):
            return 2 * super().forward(hidden_states, **kwargs)

    model = zoo.build("OPTForCausalLM")
    model.model.decoder.layers[0] = ScaledResidual(model.config, 0)
    _, mlps = _switched(model)
    assert "ScaledResidual" not in mlps and "OPTDecoderLayer" in mlps, mlps


@pytest.mark.parametrize("name", ["OPTForCausalLM", "WhisperForConditionalGeneration"])
def test_fused_layer_form_in_training_mode(name, one_thread):
    # Training mode, every dropout at 0.5: the kernel draws the residual masks from torch's
    # generator (the same seed, the same output and gradients), drops (differs from eval),
    # and at p = 0 equals HF's layer in training mode, gradients too.
    model = zoo.build_with_dropout(name, 0.5)
    for m in model.modules():
        if isinstance(getattr(m, "layerdrop", None), float):
            m.layerdrop = 0.0                  # every layer runs (LayerDrop would skip whole layers)
    ref = copy.deepcopy(model)
    # TP off: one process, the vocabulary unpadded, so every gradient compares as it is
    sharded, _ = ShardFormer(ShardConfig(enable_tensor_parallelism=False, enable_jit_fused=True)).optimize(model)
    inputs = zoo.make_inputs(name)
    sharded.train()
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        sharded.zero_grad()
        with optimizations.counting_kernels() as calls:
            loss = sharded(**inputs).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in sharded.parameters() if p.grad is not None]))
        assert calls["bias_dropout_add"] > 0, calls
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    sharded.eval()
    assert not torch.allclose(runs[0][0], sharded(**inputs).loss.detach())
    for m in (*sharded.modules(), *ref.modules()):
        for attr in ("dropout", "activation_dropout", "attention_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
            elif isinstance(getattr(m, attr, None), nn.Dropout):
                getattr(m, attr).p = 0.0
    sharded.train(), ref.train()
    sharded.zero_grad()
    out, out_ref = sharded(**inputs), ref(**inputs)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    for (n, p), q in zip(sharded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_sam_vision_attention_kernel_and_its_fallbacks(one_thread):
    # SamVisionAttention at its seam: the decomposed relative positions are the kernel's additive
    # bias (equal outputs and gradients, the tables' too); weights recorded by transformers' output
    # capturing (output_attentions=True never reaches the layer) and attention dropout in training
    # run the layer's own attention, one fallback per layer.
    from shardformer import attention as sf_attention

    torch.manual_seed(0)
    model = zoo.build_with_dropout("SamVisionModel", 0.2).eval()
    ref = copy.deepcopy(model)
    sharded, _ = ShardFormer(ShardConfig(enable_tensor_parallelism=False, enable_flash_attention=True)).optimize(model)
    inputs = zoo.make_inputs("SamVisionModel")
    layers = len(ref.vision_encoder.layers) if hasattr(ref, "vision_encoder") else ref.config.num_hidden_layers
    with optimizations.counting_kernels(("attention",)) as calls:
        out = sharded(**inputs).last_hidden_state
    assert calls["attention"] == layers, calls
    out_ref = ref(**inputs).last_hidden_state
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    for (n, p), q in zip(sharded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert any("rel_pos" in n and p.grad.abs().sum() > 0 for n, p in sharded.named_parameters())
    with warnings.catch_warnings(), torch.no_grad():     # (warned once per reason and process)
        warnings.simplefilter("ignore")
        fallback = sf_attention.CALLS["fallback"]
        got, want = sharded(**inputs, output_attentions=True), ref(**inputs, output_attentions=True)
    assert sf_attention.CALLS["fallback"] - fallback == layers
    assert len(got.attentions) == layers
    torch.testing.assert_close(got.attentions, want.attentions, rtol=1e-5, atol=1e-6)
    sharded.train()
    fallback = sf_attention.CALLS["fallback"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        sharded(**inputs)
    assert sf_attention.CALLS["fallback"] - fallback == layers
    # the SDPA implementation (from_pretrained's default) is served alike
    config = copy.deepcopy(ref.config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    sdpa = type(ref)(config).eval()
    assert "SamVisionSdpaAttention" in {type(m).__name__ for m in sdpa.modules()}
    sdpa_ref = copy.deepcopy(sdpa)
    sharded, _ = ShardFormer(ShardConfig(enable_tensor_parallelism=False, enable_flash_attention=True)).optimize(sdpa)
    with optimizations.counting_kernels(("attention",)) as calls, torch.no_grad():
        out = sharded(**inputs).last_hidden_state
    assert calls["attention"] == layers, calls
    torch.testing.assert_close(out, sdpa_ref(**inputs).last_hidden_state, rtol=1e-5, atol=1e-5)


FAMILIES = zoo.family_classes()
FIRST = {family: classes[0] for family, classes in sorted(FAMILIES.items())}
# Second configurations that show a form a family's default test config does not
# reach: T5 v1.1's gated GeLU (the zoo's T5 classes are v1.0, ReLU, but for QA);
# Falcon's parallel norms (new decoder architecture; optimizations.VARIANTS); OPT's post-norm
# layers (the fused layer form's other branch).
VARIANTS = {"t5": ["T5ForConditionalGeneration/v1.1"], "falcon": ["FalconForCausalLM/parallel_norms"],
            "opt": ["OPTForCausalLM/post_norm"]}
FAMILY_OF = {name: family for family, classes in FAMILIES.items() for name in classes + VARIANTS.get(family, [])}
# Every class at TP=2, the first class of each family (and the variants) at TP=4.
CASES = [(name, 2) for name in FAMILY_OF] + [(name, 4) for name in list(FIRST.values()) +
                                             [v for vs in VARIANTS.values() for v in vs]]
IDS = [f"{name.replace('/', '-')}-tp{tp}" for name, tp in CASES]


def _matrix_notes():
    """scripts/support_matrix.py's NOT_SUPPORTED: {(family, column): why}."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "support_matrix.py")
    spec = importlib.util.spec_from_file_location("_support_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NOT_SUPPORTED


NOT_SUPPORTED = _matrix_notes()
# Classes of a footnoted (family, column) that do get the kernel (the footnote says which).
PARTIAL: dict[tuple[str, str], set[str]] = {}
KERNELS = {"fused normalization": ("layer_norm", "rms_norm"),
           "jit fused": ("swiglu", "bias_gelu", "bias_dropout_add"),
           "flash attention": ("attention",)}
_REPORTS: dict[tuple[str, int], dict] = {}


def _report(pool, name: str, tp: int) -> dict:
    """optimizations.optimized_matches of `name` at `tp` (every switch on, eval mode with
    dropout > 0, against the unsharded model: forward, loss, gradients, a step), once:
    {"calls": kernel calls in the two compared forwards, "fallback": attention calls
    that kept the model's own attention}.  All ranks count alike."""
    if (name, tp) not in _REPORTS:
        reports = pool.run(optimizations.optimized_matches, tp, [name])
        counts = [r[name]["calls"] for r in reports[:tp]]
        assert all(c == counts[0] for c in counts), (name, tp, counts)
        _REPORTS[(name, tp)] = reports[0][name]
    return _REPORTS[(name, tp)]


def _expected(name: str, column: str) -> bool:
    """Whether `name` gets `column`'s kernels (not footnoted, or one the footnote names)."""
    key = (FAMILY_OF[name], column)
    return key not in NOT_SUPPORTED or name in PARTIAL.get(key, ())


def _cases(column: str, expected: bool = True):
    return [pytest.param(name, tp, id=i) for (name, tp), i in zip(CASES, IDS) if _expected(name, column) == expected]


def test_the_expectations_name_real_families_and_classes():
    names = set(FAMILY_OF)
    for (family, column), classes in PARTIAL.items():
        assert (family, column) in NOT_SUPPORTED and classes <= names, (family, column, classes)
    for family, column in NOT_SUPPORTED:
        assert family in FAMILIES, family


@pytest.mark.parametrize("name, tp", _cases("fused normalization"))
def test_fused_normalization_every_family(pool, name, tp):
    calls = _report(pool, name, tp)["calls"]
    assert calls["layer_norm"] + calls["rms_norm"] > 0, (name, calls)


@pytest.mark.parametrize("name, tp", _cases("jit fused"))
def test_jit_fused_every_family(pool, name, tp):
    calls = _report(pool, name, tp)["calls"]
    assert calls["swiglu"] + calls["bias_gelu"] + calls["bias_dropout_add"] > 0, (name, calls)


# T5's residual sublayers (T5LayerSelfAttention, T5LayerCrossAttention, T5LayerFF) end in
# r + dropout(sublayer(norm(r))): one bias_dropout_add each per forward, in v1.0 (ReLU feed-forward) and
# v1.1 (gated GeLU) alike, so exactly two per sublayer over the two compared forwards.
T5_SUBLAYERS = ("T5LayerSelfAttention", "T5LayerCrossAttention", "T5LayerFF")


@pytest.mark.parametrize("name, tp", [c for c in CASES if FAMILY_OF[c[0]] == "t5"],
                         ids=[i for c, i in zip(CASES, IDS) if FAMILY_OF[c[0]] == "t5"])
def test_jit_fused_t5_residual_adds(pool, name, tp):
    sublayers = sum(type(m).__name__ in T5_SUBLAYERS for m in optimizations.build(name).modules())
    calls = _report(pool, name, tp)["calls"]
    assert sublayers and calls["bias_dropout_add"] == 2 * sublayers, (name, tp, sublayers, calls)


# SamModel's SamMLPBlock: GeLU (the kernel) in the vision encoder, ReLU (torch's) in the mask decoder
@pytest.mark.parametrize("tp", [2, 4])
def test_jit_fused_sam_mlp_each_activation(pool, tp):
    pool.run(optimizations.sam_mlp_each_activation, tp)


@pytest.mark.parametrize("name, tp", _cases("flash attention"))
def test_flash_attention_every_family(pool, name, tp):
    report = _report(pool, name, tp)
    assert report["calls"]["attention"] > 0 and report["fallback"] == 0, (name, report)


@pytest.mark.parametrize("column", sorted(KERNELS))
def test_nothing_fused_where_no_kernel_fits(pool, column):
    # Keeps the footnotes honest: a class they say does not get a kernel calls none of it.
    for name, tp in CASES:
        if not _expected(name, column):
            calls = _report(pool, name, tp)["calls"]
            assert sum(calls[k] for k in KERNELS[column]) == 0, (name, tp, column, calls)


# ---- attention outside transformers' registry: the kernel at the family's seam (AttentionSeam.kernel) ---------
# The zoo's Falcon is multi-query, parallel attention, rotary; its other fused layouts, SDPA, and ALiBi (refused
# with TP by the policy: TP off).
FALCON_KERNEL_VARIANTS = [({"new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": False}, True),
                          ({"multi_query": False}, True), ({"attn_implementation": "sdpa"}, True),
                          ({"alibi": True}, False), ({"alibi": True, "multi_query": False}, False),
                          ({"alibi": True, "attn_implementation": "sdpa"}, False)]
SEAM_LMS = ["GPTNeoForCausalLM", "GPTJForCausalLM", "BloomForCausalLM", "FalconForCausalLM"]


@pytest.mark.parametrize("overrides, tensor_parallel", FALCON_KERNEL_VARIANTS,
                         ids=["new_arch", "per_head", "sdpa", "alibi", "alibi_per_head", "alibi_sdpa"])
@pytest.mark.parametrize("tp", [2, 4])
def test_seam_kernel_falcon_variants(pool, overrides, tensor_parallel, tp):
    pool.run(optimizations.seam_kernel_matches, tp, "FalconForCausalLM", overrides, False, tensor_parallel)


@pytest.mark.parametrize("name, overrides", [(n, None) for n in SEAM_LMS] + [("FalconForCausalLM", {"alibi": True})])
def test_seam_kernel_padded_batch(pool, name, overrides):
    # a left-padded row: its padding queries see no real key; every row compared
    alibi = bool((overrides or {}).get("alibi"))
    pool.run(optimizations.seam_kernel_matches, 2, name, overrides, True, not alibi)


@pytest.mark.parametrize("name, dropout_key, overrides", [
    ("GPTNeoForCausalLM", "attention_dropout", None), ("GPTJForCausalLM", "attn_pdrop", None),
    ("BloomForCausalLM", "attention_dropout", None), ("FalconForCausalLM", "attention_dropout", {"alibi": True}),
    ("Swinv2ForImageClassification", "attention_probs_dropout_prob", None)])
def test_seam_kernel_training_dropout(pool, name, dropout_key, overrides):
    pool.run(optimizations.seam_kernel_training, 1, name, dropout_key, overrides)


@pytest.mark.parametrize("name", SEAM_LMS)
def test_seam_kernel_output_attentions_fall_back(pool, name):
    pool.run(optimizations.seam_weights_fall_back, 2, name)


@pytest.mark.parametrize("name, overrides", [(n, None) for n in SEAM_LMS] + [("FalconForCausalLM", {"alibi": True})])
def test_seam_kernel_generate(pool, name, overrides):
    pool.run(optimizations.seam_kernel_generate, 2, name, overrides)
