"""The optimizations, applied by the sharder to every model by module type.

No policy writes them: with the ShardConfig switch on, every module of the
model that has one of these forms gets it, in every family.

    enable_fused_normalization (see NORM_FORMS)
        LayerNorm  y = (x - mean) / sqrt(var + eps) * w + b     -> FusedLayerNorm
                   the same over dimension 1 (channels first)   -> FusedLayerNorm(channels_first)
        RMSNorm    y = x / sqrt(mean(x^2) + eps) * w             -> FusedRMSNorm
                   y = x / sqrt(mean(x^2) + eps) * (1 + w)       -> FusedRMSNorm(offset=1)  (Gemma)
    enable_jit_fused (a forward, or feed-forward method, replacement on the class)
        gated      down(silu(gate(x)) * up(x)), gate/up separate or one
                   [gate | up] projection                        -> swiglu kernel
        gated GeLU down(gelu(gate(x)) * up(x)) (Gemma, T5 v1.1)  -> bias_gelu kernel
        GeLU       [down](gelu(up(x))) [then dropout], GeLU exact or tanh
                                                                 -> bias_gelu kernel
        GeLU feed-forward methods (METHOD_GELU_FORMS: ALBERT's AlbertLayer.ff_chunk)
                                                                 -> bias_gelu kernel
        one GeLU structure, per-instance activations (SAM's SamMLPBlock: GeLU
                   and ReLU instances)  -> bias_gelu kernel where GeLU, the
                   instance's own activation elsewhere (_InstanceActMlp)
        residual   [norm](r + dropout(dense(h))) (BERT-style *Output, ViTOutput),
                   r + dropout_p(down(gelu(up(h)))) (BLOOM's MLP) -> bias_dropout_add kernel
                   (the dropout's own p, in training mode too: the kernel draws its mask)
        sublayer   r + dropout(sublayer(norm(r), ...)) (T5's T5LayerSelfAttention,
                   T5LayerCrossAttention, T5LayerFF; SUBLAYER_DROPOUT_ADD_FORMS)
                   -> bias_dropout_add kernel
        layer      a layer whose residual blocks are inline in its forward (OPT's,
                   Whisper's; RESIDUAL_LAYER_FORMS): every r + dropout_p(block(h))
                   -> bias_dropout_add kernel, a GeLU activation -> bias_gelu kernel
                   (shardformer.layer.fused_residual)
    enable_flash_attention
        every layer that looks its attention up in transformers' registry
        (shardformer.attention.enable); a family whose attention is outside
        it, at its seam when the seam has a kernel (shardformer.attention.enable_seam)

A module is a candidate by its structure (attribute names, parameter shapes;
see NORM_FORMS, GELU_FORMS, GATED_FORMS, GATED_GELU_FORMS, FUSED_GATED_FORMS,
METHOD_GELU_FORMS, DROPOUT_ADD_FORMS, GELU_DROPOUT_ADD_FORMS, RESIDUAL_LAYER_FORMS,
SUBLAYER_DROPOUT_ADD_FORMS) and is switched
only after a probe: the module's own forward and the fused one run on the same random input
(norms: every instance, with random weights, so that Gemma's (1 + w) scaling is
told apart from w, with rows small enough that eps matters, last-dimension
inputs first and channels-first [B, C, H, W] ones next; MLPs: one
instance per class, after checking every instance has the same form; residual
forms in eval mode, the kernel's dropout masks not being torch's) and must
agree.  A module whose probe disagrees keeps its own forward.  Nothing
here splits a tensor, so the same rules hold at any tensor-parallel size.

A probe that raises is not a silent skip.  A module whose own computation
raises one of PROBE_ERRORS on the probe input (a structural look-alike fed an
input it does not take) is not of that form; a fused form that raises one of
them where the module's own forward ran is refused too (Falcon's MLP has the
children of a fused gated form, not its shapes).  Each refusal is logged
(INFO, logger "shardformer.optimizations"), naming the class, the form and
the exception.  Any other exception is a bug and propagates out of
optimize(), before the model changes.

Modules that the policy itself replaces (or that sit inside one it replaces)
are left to the policy.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from collections import OrderedDict
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .attention import enable, enable_seam, uses_registry
from .layer import FusedLayerNorm, FusedRMSNorm
from .layer.fused_residual import RESIDUAL_LAYER_FORMS, ResidualLayerForward
from .policy import ModulePolicyDescription
from .policy import SubModuleReplacementDescription as Sub

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
log = logging.getLogger(__name__)

# What a module (or a fused form) raises on a probe input it does not take:
# a wrong shape or dtype (RuntimeError, ValueError, IndexError), a missing or
# extra argument or attribute (TypeError, AttributeError), an unsupported
# configuration (NotImplementedError).  Caught, the form refused and logged;
# any other exception propagates.
PROBE_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, AttributeError, NotImplementedError)


def _refused(module, form: str, whose: str, error: BaseException) -> None:
    """Log why `module`'s class does not get `form`: `whose` computation
    raised `error` on the probe input."""
    name = type(module).__qualname__ if isinstance(module, nn.Module) else getattr(
        module, "__qualname__", type(module).__qualname__)
    log.info("%s: fused form %s not used: %s raised %s: %s on the probe input",
            name, form, whose, type(error).__name__, error)


def _run_probe(module, form: str, own, fused):
    """(want, got) = (own(), fused()) under no_grad and the same seed, or None
    when either raises one of PROBE_ERRORS (logged, see _refused)."""
    results = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for whose, call in (("its own forward", own), ("the fused form", fused)):
            torch.manual_seed(0)
            try:
                results.append(call())
            except PROBE_ERRORS as e:
                _refused(module, form, whose, e)
                return None
    return tuple(results)


def _form_name(fused) -> str:
    return getattr(fused, "__qualname__", repr(fused))


def _eps(module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _param(module, name):
    p = module._parameters.get(name) if hasattr(module, "_parameters") else None
    return p if isinstance(p, torch.Tensor) else None


def _probe_ok(module) -> bool:
    """Parameters on a device we can compute on (not meta)."""
    return all(p.device.type != "meta" for p in module.parameters())


def _close(a, b, dtype) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _with_params(module, **params):
    """A shallow stand-in of `module` whose parameters `params` differ (the
    module itself is untouched; hooks are not called: forward is called unbound)."""
    clone = object.__new__(type(module))
    clone.__dict__ = dict(module.__dict__)
    clone._parameters = OrderedDict(module._parameters, **params)
    return clone


# ---------------------------------------------------------------- norms


# form -> (fused class, from_native_module kwargs)
NORM_FORMS = {
    "layer": ("FusedLayerNorm", {}),
    "layer_channels_first": ("FusedLayerNorm", {"channels_first": True}),
    "rms": ("FusedRMSNorm", {}),
    "rms_one_plus_w": ("FusedRMSNorm", {"offset": 1.0}),
}


def _norm_form(module) -> str | None:
    """The key of NORM_FORMS of `module` when it is a normalization of that
    form (probed), else None:

        layer                  LayerNorm over the last dimension
        layer_channels_first   LayerNorm over dimension 1 of [B, C, H, W] (SAM's
                               channels_first SamLayerNorm, vision LayerNorm2d)
        rms                    x / sqrt(mean(x^2) + eps) * w
        rms_one_plus_w         x / sqrt(mean(x^2) + eps) * (1 + w)   (Gemma 1-3)
    """
    if not isinstance(module, nn.Module) or list(module.children()):
        return None
    weight, bias = _param(module, "weight"), _param(module, "bias")
    if type(module) is nn.LayerNorm:
        return "layer"
    eps = _eps(module)
    if eps is None or weight is None or weight.dim() != 1 or not _probe_ok(module):
        return None
    n = weight.shape[0]
    gen = torch.Generator().manual_seed(1234)
    # Two rows at unit scale, one small enough that eps matters (where an
    # x / (rms + eps) look-alike parts from x / sqrt(ms + eps)).
    x = (torch.randn(3, 2, n, generator=gen) * torch.tensor([1.0, 1.0, 1e-3]).view(3, 1, 1)).to(weight.dtype)
    w = torch.randn(n, generator=gen).to(weight.dtype)
    b = torch.randn(n, generator=gen).to(weight.dtype) if bias is not None else None
    params = {"weight": nn.Parameter(w.to(weight.device), requires_grad=False)}
    if b is not None:
        if bias.shape != weight.shape:
            return None
        params["bias"] = nn.Parameter(b.to(bias.device), requires_grad=False)
    clone = _with_params(module, **params)

    def run(inp):
        try:
            with torch.no_grad():
                return type(module).forward(clone, inp.to(weight.device)).cpu()
        except PROBE_ERRORS as e:  # cannot run on this probe: not a norm of ours
            _refused(module, "norm", "its own forward", e)
            return None

    xf = x.float()
    got = run(x)
    if got is not None:
        if b is not None:
            want = F.layer_norm(xf, (n,), w.float(), b.float(), eps)
            if _close(got, want, weight.dtype):
                return "layer"
        else:
            if _close(got, F.rms_norm(xf, (n,), None, eps).to(x.dtype) * w, weight.dtype):
                return "rms"
            if _close(got, F.rms_norm(xf, (n,), None, eps) * (1.0 + w.float()), weight.dtype):
                return "rms_one_plus_w"
            if _close(got, F.layer_norm(xf, (n,), w.float(), None, eps), weight.dtype):
                return "layer"
    # Channels first: the same rows laid out as [B, C, H, W], normalized over C.
    x4 = x.reshape(3, 2, 1, n).permute(0, 3, 1, 2)
    got = run(x4)
    if got is not None and b is not None:
        want = F.layer_norm(xf, (n,), w.float(), b.float(), eps).reshape(3, 2, 1, n).permute(0, 3, 1, 2)
        if _close(got, want, weight.dtype):
            return "layer_channels_first"
    return None


# ---------------------------------------------------------------- MLPs

# (up, activation, down or None, dropout after down or None); GeLU forms
GELU_FORMS = (
    ("c_fc", "act", "c_proj", "dropout"),              # GPT-2, GPT-Neo
    ("fc_in", "act", "fc_out", "dropout"),             # GPT-J
    ("dense_h_to_4h", "act", "dense_4h_to_h", None),   # Falcon
    ("fc1", "activation_fn", "fc2", None),             # SigLIP, CLIP-style
    ("lin1", "act", "lin2", None),                     # SAM's vision MLP
    ("dense", "intermediate_act_fn", None, None),      # BERT-style intermediate
)
# (method, up, activation, down): a GeLU feed-forward that is a method of a larger
# module rather than an MLP module's forward
METHOD_GELU_FORMS = (("ff_chunk", "ffn", "activation", "ffn_output"),)   # ALBERT's AlbertLayer.ff_chunk
# (gate, up, down, activation) for separate projections; (gate_up, down, activation) fused
GATED_FORMS = (("gate_proj", "up_proj", "down_proj", "act_fn"),)
# (gate, up, down, activation, dropout before down or None): down([dropout](gelu(gate(x)) * up(x)))
GATED_GELU_FORMS = (
    ("gate_proj", "up_proj", "down_proj", "act_fn", None),   # Gemma 1-3 (GeLU-tanh)
    ("wi_0", "wi_1", "wo", "act", "dropout"),                 # T5 v1.1 / Flan-T5 (T5DenseGatedActDense)
)
# (an activation None: the module's forward applies silu(gate) * up to the halves
# itself, as ChatGLM2's MLP does with its swiglu function; the probe decides)
FUSED_GATED_FORMS = (("gate_up_proj", "down_proj", "activation_fn"), ("gate_up_proj", "down_proj", "act_fn"),
                     ("dense_h_to_4h", "dense_4h_to_h", None))


def _act_kind(act) -> str | None:
    """"silu", "gelu" (exact) or "gelu_tanh" when the callable `act` computes it."""
    if not callable(act):
        return None
    x = torch.linspace(-6, 6, 97)
    try:
        with torch.no_grad():
            y = act(x)
    except PROBE_ERRORS as e:  # not an elementwise activation of a tensor
        _refused(act, "activation", "its own forward", e)
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    for kind, ref in (("silu", F.silu(x)), ("gelu", F.gelu(x)), ("gelu_tanh", F.gelu(x, approximate="tanh"))):
        if torch.allclose(y, ref, rtol=1e-5, atol=1e-6):
            return kind
    return None


def _linear_in(module) -> int | None:
    w = _param(module, "weight") if isinstance(module, nn.Module) else None
    if w is None or w.dim() != 2:
        return None
    return w.shape[0] if type(module).__name__ == "Conv1D" else w.shape[1]


class _FusedForward:
    """A fused replacement of a module method, called as fused(module, ...)
    (bound to the module by the sharder).  The attributes are the names of
    the module's children it calls; a module-level class rather than a
    closure so that a model holding it pickles.  `__qualname__` names the
    form (what the probes report), `approximate` the GeLU form ("" when none)."""

    approximate = ""

    def __init__(self, qualname: str, **names):
        self.__dict__.update(names)
        self.__qualname__ = qualname


class _GeluMlp(_FusedForward):
    def __call__(self, module, hidden_states):
        h = getattr(module, self.up)(hidden_states)
        h = ops.bias_gelu(h, None, self.approximate) if ops.fused_input(h) else getattr(module, self.act)(h)
        if self.down is not None:
            h = getattr(module, self.down)(h)
        if self.dropout is not None:
            h = getattr(module, self.dropout)(h)
        return h


class _InstanceActMlp(_FusedForward):
    """[dropout](down(act(up(x)))) for a class whose instances differ in their
    activation (SAM's SamMLPBlock: GeLU in the vision encoder, ReLU in the
    mask decoder): each instance's own activation, probed at its first call
    (kind): GeLU (exact or tanh) by the bias_gelu kernel, any
    other activation (ReLU) by the module's own callable (torch's; no C
    kernel fuses a lone ReLU)."""

    def __call__(self, module, hidden_states):
        h = getattr(module, self.up)(hidden_states)
        kind = self.kind(getattr(module, self.act))
        if kind in ("gelu", "gelu_tanh") and ops.fused_input(h):
            h = ops.bias_gelu(h, None, "tanh" if kind == "gelu_tanh" else "none")
        else:
            h = getattr(module, self.act)(h)
        if self.down is not None:
            h = getattr(module, self.down)(h)
        if self.dropout is not None:
            h = getattr(module, self.dropout)(h)
        return h


    def kind(self, fn) -> str | None:
        """_act_kind(fn), probed once per activation object (weakly kept)."""
        kinds = self.__dict__.get("_kinds")
        if kinds is None:
            kinds = self.__dict__["_kinds"] = weakref.WeakKeyDictionary()
        try:
            found = kinds.get(fn, _UNSEEN)
        except TypeError:                   # not weakly referable: probed every call
            return _act_kind(fn)
        if found is _UNSEEN:
            found = kinds[fn] = _act_kind(fn)
        return found

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_kinds"}


_UNSEEN = object()


def instance_act_mlp_forward(up: str, act: str, down: str | None, dropout: str | None):
    """forward = [dropout](down(act(up(x)))), each instance's GeLU by the C kernel."""
    return _InstanceActMlp(f"instance_act_mlp_forward[{up}->{act}->{down}]", up=up, act=act, down=down,
                           dropout=dropout)


def _mixed_act_forward(modules: list):
    """The forward of a class whose instances (`modules`) share one GELU_FORMS
    structure but not one activation (some GeLU, the others anything
    elementwise, such as ReLU): _InstanceActMlp, if on every instance it
    equals the instance's own forward on a random input; else None."""
    if not all(_probe_ok(m) for m in modules):
        return None
    for up, act, down, dropout in GELU_FORMS:
        names = [n for n in (up, down, dropout) if n is not None]
        if not all(n in dict(m.named_children()) and hasattr(m, act) for m in modules for n in names):
            continue
        if not any(_act_kind(getattr(m, act)) in ("gelu", "gelu_tanh") for m in modules):
            continue
        fused = instance_act_mlp_forward(up, act, down, dropout)
        ok = True
        for m in modules:
            n, params = _linear_in(getattr(m, up)), list(m.parameters())
            if n is None or not params:
                ok = False
                break
            x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(4321)).to(params[0].dtype)
            ran = _run_probe(m, _form_name(fused), lambda: type(m).forward(m, x), lambda: fused(m, x))
            if ran is None or isinstance(ran[0], tuple) or not _close(ran[1], ran[0], params[0].dtype):
                ok = False
                break
        if ok:
            return fused
    return None


def gelu_mlp_forward(up: str, act: str, down: str | None, dropout: str | None, approximate: str):
    """forward = [dropout](down(gelu(up(x)))) with the GeLU by the C kernel."""
    return _GeluMlp(f"gelu_mlp_forward[{up}->{act}->{down}]", up=up, act=act, down=down, dropout=dropout,
                    approximate=approximate)


class _GatedMlp(_FusedForward):
    def __call__(self, module, x):
        g, u = getattr(module, self.gate)(x), getattr(module, self.up)(x)
        h = ops.swiglu(g, u) if ops.fused_input(g) else getattr(module, self.act)(g) * u
        return getattr(module, self.down)(h)


def gated_mlp_forward(gate: str, up: str, down: str, act: str):
    """forward = down(silu(gate(x)) * up(x)) with silu * up in one C kernel."""
    return _GatedMlp(f"gated_mlp_forward[{gate},{up}->{down}]", gate=gate, up=up, down=down, act=act)


class _GatedGeluMlp(_FusedForward):
    def __call__(self, module, x):
        g, u = getattr(module, self.gate)(x), getattr(module, self.up)(x)
        h = (ops.bias_gelu(g, None, self.approximate) if ops.fused_input(g) else getattr(module, self.act)(g)) * u
        if self.dropout is not None:
            h = getattr(module, self.dropout)(h)
        w = getattr(getattr(module, self.down), "weight", None)
        if self.dropout is not None and isinstance(w, torch.Tensor) and w.dtype.is_floating_point \
                and h.dtype != w.dtype:
            h = h.to(w.dtype)
        return getattr(module, self.down)(h)


def gated_gelu_mlp_forward(gate: str, up: str, down: str, act: str, dropout: str | None, approximate: str):
    """forward = down([dropout](gelu(gate(x)) * up(x))) with the GeLU by the C kernel
    (the product cast to down's weight dtype first, as T5 keeps `wo` in float32)."""
    return _GatedGeluMlp(f"gated_gelu_mlp_forward[{gate},{up}->{down}]", gate=gate, up=up, down=down, act=act,
                         dropout=dropout, approximate=approximate)


class _FusedGatedMlp(_FusedForward):
    def __call__(self, module, x):
        g, u = getattr(module, self.gate_up)(x).chunk(2, dim=-1)
        if ops.fused_input(g):
            h = ops.swiglu(g.contiguous(), u.contiguous())
        else:
            h = (F.silu(g) if self.act is None else getattr(module, self.act)(g)) * u
        return getattr(module, self.down)(h)


def fused_gated_mlp_forward(gate_up: str, down: str, act: str):
    """forward = down(silu(g) * u) with [g | u] = gate_up(x) (this rank's halves)."""
    return _FusedGatedMlp(f"fused_gated_mlp_forward[{gate_up}->{down}]", gate_up=gate_up, down=down, act=act)


# Residual forms, forward(hidden_states, residual):
#   (dense, dropout module, norm or None): [norm](residual + dropout(dense(h)))   BERT-style *Output, ViTOutput
#   (up, activation, down, dropout probability attribute):
#       residual + dropout_p(down(gelu(up(h))))                                   BLOOM's MLP
DROPOUT_ADD_FORMS = (("dense", "dropout", "LayerNorm"), ("dense", "dropout", None))
GELU_DROPOUT_ADD_FORMS = (("dense_h_to_4h", "gelu_impl", "dense_4h_to_h", "hidden_dropout"),)


class _DropoutAdd(_FusedForward):
    def __call__(self, module, hidden_states, input_tensor):
        h = getattr(module, self.dense)(hidden_states)
        drop = getattr(module, self.dropout)
        if ops.fused_input(h) and ops.fused_input(input_tensor) and h.shape == input_tensor.shape \
                and h.dtype == input_tensor.dtype:
            h = ops.bias_dropout_add(h, None, input_tensor, drop.p, drop.training)
        else:
            h = drop(h) + input_tensor
        return getattr(module, self.norm)(h) if self.norm is not None else h


def dropout_add_forward(dense: str, dropout: str, norm: str | None):
    """forward(h, residual) = [norm](residual + dropout(dense(h))), the dropout and
    the residual add in one C kernel (bias_dropout_add)."""
    return _DropoutAdd(f"dropout_add_forward[{dense}->{dropout}->{norm}]", dense=dense, dropout=dropout, norm=norm)


class _GeluDropoutAdd(_FusedForward):
    def __call__(self, module, hidden_states, residual):
        h = getattr(module, self.up)(hidden_states)
        h = ops.bias_gelu(h, None, self.approximate) if ops.fused_input(h) else getattr(module, self.act)(h)
        h = getattr(module, self.down)(h)
        p = float(getattr(module, self.prob))
        if ops.fused_input(h) and ops.fused_input(residual) and h.shape == residual.shape \
                and h.dtype == residual.dtype:
            return ops.bias_dropout_add(h, None, residual, p, module.training)
        return residual + F.dropout(h, p=p, training=module.training)


def gelu_dropout_add_forward(up: str, act: str, down: str, prob: str, approximate: str):
    """forward(h, residual) = residual + dropout_p(down(gelu(up(h)))): the GeLU and
    the dropout-add by the C kernels (bias_gelu, bias_dropout_add)."""
    return _GeluDropoutAdd(f"gelu_dropout_add_forward[{up}->{act}->{down}]", up=up, act=act, down=down, prob=prob,
                           approximate=approximate)


# (norm, sublayer, dropout module, {the layer's argument: the sublayer's}): a layer whose forward is
#       r + dropout(sublayer(norm(r), ...))  [, the sublayer's other outputs]      T5's T5LayerSelfAttention,
# T5LayerCrossAttention (their attention_mask is T5Attention's mask), T5LayerFF.  The sublayer is called
# as the layer calls it; its own forms (T5 v1.1's gated GeLU) are switched on their own.  T5 v1.0's
# DenseReluDense (wo(dropout(relu(wi(x))))) has no kernel: its projections have no bias to fuse and ReLU none.
SUBLAYER_DROPOUT_ADD_FORMS = (("layer_norm", "SelfAttention", "dropout", (("attention_mask", "mask"),)),
                              ("layer_norm", "EncDecAttention", "dropout", (("attention_mask", "mask"),)),
                              ("layer_norm", "DenseReluDense", "dropout", ()))


class _SublayerDropoutAdd(_FusedForward):
    def __call__(self, module, *args, **kwargs):
        sig = inspect.signature(type(module).forward)
        params = sig.bind(module, *args, **kwargs).arguments
        names = list(params)
        residual = params[names[1]]                  # the parameter after self: the layer's input
        call = {}
        for name in names[2:]:
            if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(params[name])
            else:
                call[dict(self.renames).get(name, name)] = params[name]
        out = getattr(module, self.sublayer)(getattr(module, self.norm)(residual), **call)
        h, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)
        drop = getattr(module, self.dropout)
        if ops.fused_input(h) and ops.fused_input(residual) and h.shape == residual.shape \
                and h.dtype == residual.dtype:
            h = ops.bias_dropout_add(h, None, residual, drop.p, drop.training)
        else:
            h = residual + drop(h)
        return h if rest is None else (h, *rest)


def sublayer_dropout_add_forward(norm: str, sublayer: str, dropout: str, renames: tuple):
    """forward(r, ...) = r + dropout(sublayer(norm(r), ...)) [, the sublayer's other outputs]:
    the dropout and the residual add in one C kernel (bias_dropout_add)."""
    return _SublayerDropoutAdd(f"sublayer_dropout_add_forward[{norm}->{sublayer}->{dropout}]", norm=norm,
                               sublayer=sublayer, dropout=dropout, renames=renames)


def _sublayer_candidates(module):
    """The fused forward of every SUBLAYER_DROPOUT_ADD_FORMS form whose structure `module` has (not yet probed)."""
    children = dict(module.named_children())
    for norm, sublayer, dropout, renames in SUBLAYER_DROPOUT_ADD_FORMS:
        if norm in children and sublayer in children and isinstance(children.get(dropout), nn.Dropout):
            yield sublayer_dropout_add_forward(norm, sublayer, dropout, renames)


def _sublayer_forward(module):
    """The fused forward for `module`'s class, or None: the first SUBLAYER_DROPOUT_ADD_FORMS
    form whose outputs equal the layer's own forward (eval mode; [2, 3, H] hidden states,
    H the norm's width, and [2, 4, H] states for each other tensor argument it requires:
    T5LayerCrossAttention's key_value_states)."""
    params = list(module.parameters())
    if not params:
        return None
    dtype, device = params[0].dtype, params[0].device
    for fused in _sublayer_candidates(module):
        w = _param(getattr(module, fused.norm), "weight")
        if w is None or w.dim() != 1:
            continue
        gen = torch.Generator().manual_seed(4321)
        x = torch.randn(2, 3, w.shape[0], generator=gen).to(dtype=dtype, device=device)
        required = [p for p in list(inspect.signature(type(module).forward).parameters.values())[2:]
                    if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        kwargs = {p.name: torch.randn(2, 4, w.shape[0], generator=gen).to(dtype=dtype, device=device)
                  for p in required}
        with _eval_mode(module):
            ran = _run_probe(module, _form_name(fused), lambda: type(module).forward(module, x, **kwargs),
                             lambda: fused(module, x, **kwargs))
        if ran is None:
            continue
        want, got = ran
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        if not isinstance(got, tuple) or len(got) != len(want) or not isinstance(want[0], torch.Tensor):
            continue
        if all((a is None and b is None) or _close(b, a, dtype) for a, b in zip(want, got)):
            return fused
    return None


def _residual_candidates(module):
    """(fused forward(h, residual), input projection, output projection) for
    every residual form whose structure `module` has (not yet probed)."""
    children = dict(module.named_children())
    for up, act, down, prob in GELU_DROPOUT_ADD_FORMS:
        if up not in children or down not in children:
            continue
        p = getattr(module, prob, None)
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            continue
        kind = _act_kind(getattr(module, act, None))
        if kind in ("gelu", "gelu_tanh"):
            yield gelu_dropout_add_forward(up, act, down, prob, "tanh" if kind == "gelu_tanh" else "none"), up, down
    for dense, dropout, norm in DROPOUT_ADD_FORMS:
        if dense not in children or not isinstance(children.get(dropout), nn.Dropout):
            continue
        if norm is not None and norm not in children:
            continue
        if norm is None and any(n in children for _, _, n in DROPOUT_ADD_FORMS if n is not None):
            continue      # a norm is there: the form with it, or none
        yield dropout_add_forward(dense, dropout, norm), dense, dense


def _mlp_candidates(module):
    """(fused forward, name of its input projection) for every form whose
    structure `module` has (not yet probed)."""
    children = dict(module.named_children())
    for gate, up, down, act in GATED_FORMS:
        if all(n in children for n in (gate, up, down)) and _act_kind(getattr(module, act, None)) == "silu":
            yield gated_mlp_forward(gate, up, down, act), gate
    for gate_up, down, act in FUSED_GATED_FORMS:
        if gate_up in children and down in children and (
                act is None or _act_kind(getattr(module, act, None)) == "silu"):
            yield fused_gated_mlp_forward(gate_up, down, act), gate_up
    for gate, up, down, act, dropout in GATED_GELU_FORMS:
        if not all(n in children for n in (gate, up, down)) or (dropout is not None and dropout not in children):
            continue
        kind = _act_kind(getattr(module, act, None))
        if kind in ("gelu", "gelu_tanh"):
            approximate = "tanh" if kind == "gelu_tanh" else "none"
            yield gated_gelu_mlp_forward(gate, up, down, act, dropout, approximate), gate
    for up, act, down, dropout in GELU_FORMS:
        if up not in children or (down is not None and down not in children):
            continue
        if dropout is not None and dropout not in children:
            continue
        kind = _act_kind(getattr(module, act, None))
        if kind in ("gelu", "gelu_tanh"):
            yield gelu_mlp_forward(up, act, down, dropout, "tanh" if kind == "gelu_tanh" else "none"), up


def _method_candidates(module):
    """(method name, fused method, name of its input projection) for every
    METHOD_GELU_FORMS form whose structure `module` has (not yet probed)."""
    children = dict(module.named_children())
    for method, up, act, down in METHOD_GELU_FORMS:
        if up not in children or down not in children or not callable(getattr(type(module), method, None)):
            continue
        kind = _act_kind(getattr(module, act, None))
        if kind in ("gelu", "gelu_tanh"):
            fused = gelu_mlp_forward(up, act, down, None, "tanh" if kind == "gelu_tanh" else "none")
            fused.__qualname__ = f"{method}:{fused.__qualname__}"
            yield method, fused, up


def _method_forwards(module) -> dict:
    """{method name: fused method} for the METHOD_GELU_FORMS of `module` whose
    output equals the module's own method on a random input."""
    out = {}
    params = list(module.parameters())
    if not params or not _probe_ok(module):
        return out
    dtype, device = params[0].dtype, params[0].device
    for method, fused, first in _method_candidates(module):
        n = _linear_in(getattr(module, first))
        if n is None or method in out:
            continue
        x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(4321)).to(dtype=dtype, device=device)
        ran = _run_probe(module, _form_name(fused), lambda: getattr(type(module), method)(module, x),
                         lambda: fused(module, x))
        if ran is None:
            continue
        want, got = ran
        if _close(got, want, dtype):
            out[method] = fused
    return out


def _layer_candidates(module):
    """The ResidualLayerForward of every RESIDUAL_LAYER_FORMS form whose structure
    `module` has (not yet probed): the attention, feed-forward and norm children,
    a float residual dropout probability, and an activation module (GeLU: by the
    kernel; any other: the layer's own)."""
    children = dict(module.named_children())
    for form in RESIDUAL_LAYER_FORMS:
        norm_a, attn, norm_c, cross, norm_f, fc1, act, act_p, fc2, p, pre_flag = form
        if not all(n in children for n in (norm_a, attn, norm_f, fc1, fc2)) or not callable(getattr(module, act, None)):
            continue
        if not _is_prob(getattr(module, p, None)):
            continue
        kind = _act_kind(getattr(module, act))
        approximate = {"gelu": "none", "gelu_tanh": "tanh"}.get(kind, "")
        yield ResidualLayerForward(form, cross=norm_c in children and cross in children,
                                   act_dropout=_is_prob(getattr(module, act_p, None)),
                                   pre_norm_flag=isinstance(getattr(module, pre_flag, None), bool),
                                   approximate=approximate)


def _is_prob(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _form_names(module) -> tuple[str, ...]:
    """The forms `module`'s structure and activations match, by name."""
    return (tuple(f.__qualname__ + repr(getattr(f, "approximate", "")) for f, _ in _mlp_candidates(module))
            + tuple(f.__qualname__ + repr(getattr(f, "approximate", "")) for f, _, _ in _residual_candidates(module))
            + tuple(f.__qualname__ + repr(f.approximate) for f in _layer_candidates(module))
            + tuple(f.__qualname__ for f in _sublayer_candidates(module))
            + tuple(f.__qualname__ + repr(getattr(f, "approximate", "")) for _, f, _ in _method_candidates(module)))


def _mlp_forward(module):
    """The fused forward for `module`'s class, or None: the first candidate
    whose output equals the module's own forward on a random input."""
    if not _probe_ok(module):
        return None
    for fused, first in _mlp_candidates(module):
        n = _linear_in(getattr(module, first))
        params = list(module.parameters())
        if n is None or not params:
            continue
        dtype, device = params[0].dtype, params[0].device
        x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(4321)).to(dtype=dtype, device=device)
        ran = _run_probe(module, _form_name(fused), lambda: type(module).forward(module, x), lambda: fused(module, x))
        if ran is None:
            continue
        want, got = ran
        if isinstance(want, tuple):
            continue
        if _close(got, want, dtype):
            return fused
    return _residual_forward(module) or _layer_forward(module) or _sublayer_forward(module)


def _linear_out(module) -> int | None:
    w = _param(module, "weight") if isinstance(module, nn.Module) else None
    if w is None or w.dim() != 2:
        return None
    return w.shape[1] if type(module).__name__ == "Conv1D" else w.shape[0]


@contextmanager
def _eval_mode(module):
    """`module` and its sub-modules in eval mode for the probe (the kernel's dropout
    masks are not torch's: the forms are compared without dropout), then as before."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _residual_forward(module):
    """The fused forward(h, residual) for `module`'s class, or None: the first
    residual form whose output equals the module's own forward (in eval mode)."""
    params = list(module.parameters())
    if not params:
        return None
    dtype, device = params[0].dtype, params[0].device
    for fused, first, last in _residual_candidates(module):
        n, m = _linear_in(getattr(module, first)), _linear_out(getattr(module, last))
        if n is None or m is None:
            continue
        gen = torch.Generator().manual_seed(4321)
        x = torch.randn(2, 3, n, generator=gen).to(dtype=dtype, device=device)
        r = torch.randn(2, 3, m, generator=gen).to(dtype=dtype, device=device)
        with _eval_mode(module):
            ran = _run_probe(module, _form_name(fused), lambda: type(module).forward(module, x, r),
                             lambda: fused(module, x, r))
        if ran is None:
            continue
        want, got = ran
        if isinstance(want, tuple):
            continue
        if _close(got, want, dtype):
            return fused
    return None


def _layer_forward(module):
    """The fused ResidualLayerForward for `module`'s class, or None: the first
    RESIDUAL_LAYER_FORMS form whose output equals the layer's own forward (eval
    mode; [2, 3, H] hidden states, no mask, no cache; a layer with a
    cross-attention also with [2, 4, H] encoder states)."""
    params = list(module.parameters())
    if not params:
        return None
    dtype, device = params[0].dtype, params[0].device
    for fused in _layer_candidates(module):
        n = _linear_in(getattr(module, fused.fc1))
        if n is None:
            continue
        gen = torch.Generator().manual_seed(4321)
        x = torch.randn(2, 3, n, generator=gen).to(dtype=dtype, device=device)
        # attention_mask=None where the forward names one (Whisper's encoder layer has no default)
        base = {"attention_mask": None} if "attention_mask" in inspect.signature(type(module).forward).parameters \
            else {}
        probes = [base]
        if fused.has_cross:
            enc = torch.randn(2, 4, n, generator=gen).to(dtype=dtype, device=device)
            probes.append({**base, "encoder_hidden_states": enc})
        ok = True
        for kwargs in probes:
            with _eval_mode(module):
                ran = _run_probe(module, _form_name(fused), lambda: type(module).forward(module, x, **kwargs),
                                 lambda: fused(module, x, **kwargs))
            ok = ok and ran is not None and not isinstance(ran[0], tuple) and _close(ran[1], ran[0], dtype)
        if ok:
            return fused
    return None


# ---------------------------------------------------------------- the plan


def _under(path: str, roots: set[str]) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:i]) in roots for i in range(1, len(parts) + 1))


def optimization_policy(model: nn.Module, shard_config, replaced_paths: set[str],
                        method_paths: set[str]) -> dict:
    """{class: ModulePolicyDescription} switching every qualifying module of
    `model` to its fused form, leaving alone the paths the policy replaces
    (`replaced_paths`, with everything under them) and the modules whose
    methods it replaces (`method_paths`).

    Entries are keyed by class, so a (parent class, child name) slot is used
    only when the child is of one qualifying class under every instance of
    the parent, and an MLP class only when none of its instances is excluded."""
    norms = shard_config.enable_fused_normalization
    jit = shard_config.enable_jit_fused
    if not (norms or jit):
        return {}

    policy: dict = {}
    if norms:
        slots: dict[tuple[type, str], set] = {}     # (parent class, child name) -> {child class or None}
        form_of: dict[int, str | None] = {}
        parents_by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for path, parent in model.named_modules():
            parents_by_class.setdefault(type(parent), []).append((path, parent))
        for cls, instances in parents_by_class.items():
            names = dict.fromkeys(name for _, p in instances for name, _ in p.named_children())
            for name in names:
                kinds = set()
                for path, parent in instances:
                    child = parent._modules.get(name)
                    child_path = f"{path}.{name}" if path else name
                    if child is None:
                        kinds.add(None)
                        continue
                    if _under(child_path, replaced_paths):
                        kinds.add("excluded")
                        continue
                    # Probed per instance: a norm's form can hang on its attributes
                    # (SamLayerNorm's data_format), not only on its class.
                    if id(child) not in form_of:
                        form_of[id(child)] = _norm_form(child)
                    kinds.add((type(child), form_of[id(child)]))
                slots[(cls, name)] = kinds
        for (cls, name), kinds in slots.items():
            real = {k for k in kinds if k is not None}
            if len(real) != 1:
                continue
            (k,) = real
            if k == "excluded" or k[1] is None:
                continue
            target, kwargs = NORM_FORMS[k[1]]
            target = {"FusedLayerNorm": FusedLayerNorm, "FusedRMSNorm": FusedRMSNorm}[target]
            entry = policy.setdefault(cls, ModulePolicyDescription())
            entry.sub_module_replacement.append(Sub(name, target, ignore_if_not_exist=None in kinds,
                                                    kwargs=dict(kwargs) or None))
    if jit:
        by_class: dict[type, list[str]] = {}
        for path, module in model.named_modules():
            if list(module.children()):
                by_class.setdefault(type(module), []).append(path)
        for cls, paths in by_class.items():
            if any(_under(p, replaced_paths) or p in method_paths for p in paths):
                continue
            # One forward replaces the class's: every instance must have the
            # same form, or (SAM's MLP class, GeLU in one tower, ReLU in the
            # other) one structure whose forward reads each instance's activation.
            forms = {_form_names(model.get_submodule(p)) for p in paths}
            if len(forms) != 1:             # instances of one MLP structure, GeLU and not: each its own
                mixed = _mixed_act_forward([model.get_submodule(p) for p in paths])
                if mixed is not None:
                    policy.setdefault(cls, ModulePolicyDescription()).method_replacement["forward"] = mixed
                continue
            if not next(iter(forms)):
                continue
            first = model.get_submodule(paths[0])
            fused = _mlp_forward(first)
            methods = {"forward": fused} if fused is not None else _method_forwards(first)
            if methods:
                policy.setdefault(cls, ModulePolicyDescription()).method_replacement.update(methods)
    return policy


def enable_attention(model: nn.Module, shard_config, seam=None) -> None:
    """Route the model's attention through the C kernel (enable_flash_attention):
    at the family's seam (`seam`, an AttentionSeam with a kernel) when the
    model has its modules, and through transformers' registry when it has none
    or has layers that look their attention up there too."""
    if shard_config.enable_flash_attention:
        # a model with both (SAM: the vision encoder's attention at its seam, the
        # mask decoder's in the registry) gets both
        if not enable_seam(model, seam) or any(uses_registry(m) for m in model.modules()):
            enable(model)
