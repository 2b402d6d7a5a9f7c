"""The optimizations the sharder applies by module type (shardformer.optimizations):
which modules qualify (structure, then a probe against the module's own forward),
that policies' own replacements win, that a model with no policy lines gets them,
and, for every family, that the fused model equals the unsharded one at TP=2 with
the fused kernels counted as having run."""
from __future__ import annotations

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


def test_gemma_norms_and_gelu_gated_mlp_keep_their_forward():
    # GemmaRMSNorm scales by (1 + w); GemmaMLP gates with GeLU-tanh, not SiLU.
    norms, mlps = _switched(decoders.build("GemmaForCausalLM"))
    assert norms == set() and mlps == set()


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


FAMILIES = zoo.family_classes()
FIRST = {family: classes[0] for family, classes in sorted(FAMILIES.items())}
# Gemma 1-3 (text): RMSNorm scales by (1 + w); no kernel of ours computes it,
# and the probe says so.
NO_FUSED_NORM = {"gemma", "gemma2", "gemma3"}
# Families whose MLP has a form with a kernel (SwiGLU, or GeLU after one
# projection).  Not here: the gated GeLU-tanh MLPs (Gemma), MLPs written
# inline in the layer (ALBERT, OPT, Whisper), forwards taking more than the
# hidden states (BLOOM), ReLU (T5 v1.0), the fused ChatGLM2 / Mixtral experts,
# and SAM's MLP class, GeLU in one tower and ReLU in the other.
FUSED_MLP = {"beit", "bert", "blip2", "ernie", "falcon", "glm", "gpt2", "gpt_neo", "gptj", "llama", "mistral",
             "phi3", "qwen2", "qwen3", "roberta", "swin", "swinv2", "vit"}
_CALLS: dict[str, dict] = {}


def _kernel_calls(pool, name: str) -> dict:
    """Kernel calls of one forward of `name` sharded at TP=2 with fused norms and
    MLPs, after checking it equals the unsharded model (once per class)."""
    if name not in _CALLS:
        _CALLS[name] = pool.run(optimizations.fused_matches, 2, name)[0]
    return _CALLS[name]


def test_the_expectations_name_real_families():
    assert NO_FUSED_NORM <= set(FAMILIES) and FUSED_MLP <= set(FAMILIES)


@pytest.mark.parametrize("name", [c for f, c in FIRST.items() if f not in NO_FUSED_NORM])
def test_fused_normalization_every_family(pool, name):
    calls = _kernel_calls(pool, name)
    assert calls["layer_norm"] + calls["rms_norm"] > 0, (name, calls)


@pytest.mark.parametrize("name", [c for f, c in FIRST.items() if f in FUSED_MLP])
def test_jit_fused_every_family(pool, name):
    calls = _kernel_calls(pool, name)
    assert calls["swiglu"] + calls["bias_gelu"] > 0, (name, calls)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nothing_fused_where_no_kernel_fits(pool, family):
    # Keeps the two lists above honest: a family outside them fuses nothing of that kind.
    calls = _kernel_calls(pool, FIRST[family])
    if family in NO_FUSED_NORM:
        assert calls["layer_norm"] + calls["rms_norm"] == 0, (family, calls)
    if family not in FUSED_MLP:
        assert calls["swiglu"] + calls["bias_gelu"] == 0, (family, calls)
