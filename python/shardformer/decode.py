"""The decode fast path: one lean step per generated token of a sharded Llama-shaped model.

A decode step of HF's LlamaForCausalLM enters ~15 module forwards per layer
(norms, projections, attention interface, MLP, activations), each through
nn.Module.__call__ and its hook machinery, on every rank, for every token.
The math is small: for one new token x (hidden h, batch B, rank i of p, the
attention heads H_i and MLP features F_i of rank i):

    a   = rms(x) * g1                       rms(v) = v / sqrt(mean(v^2) + eps)
    q_i = a Wq_i^T (+ bq_i), k_i, v_i alike    column shards: this rank's heads
    q_i, k_i <- rope(q_i, k_i; cos, sin)      HF's own rotary module gives cos, sin
    K_i, V_i = cache.update(k_i, v_i, layer)  HF's cache object (generate's bookkeeping holds)
    o_i = softmax(q_i K_i^T * scale + mask) V_i    per head, KV heads repeated for GQA
    x   = x + all_reduce_i(o_i Wo_i^T) (+ bo)  row shard: one all-reduce
    m   = rms(x) * g2
    x   = x + all_reduce_i((silu(m Wg_i^T) * (m Wu_i^T)) Wd_i^T)   one all-reduce

and after the layers the final norm and the vocabulary-parallel LM head
(all-gathered logits).  Qwen3's per-head q/k norms (rms over head_dim, before
rope) and Qwen2's q/k/v biases are part of the same step.

DecodeFastPath replaces the model's forward (as an instance attribute, like
lockstep's generate) and runs that step, reading the shards of the model's
own modules, for calls that are a decode step inside generate() on a
supported model; every other call (prefill, training, a forward outside
generate(), an option the step does not compute) goes to HF's forward,
counted with its reason.  The step is HF's math in the same order and
dtypes, so its logits equal HF's up to float rounding (tests/test_decode.py
checks every step's logits and the tokens against the unsharded model).

The norms run through their modules' own forward (HF's RMSNorm, or
FusedRMSNorm of enable_fused_normalization / enable_all_optimization),
without nn.Module.__call__.

What switches it off for the model (`stats(model)["off"]`, every decode step
then counted under that reason): a model type other than llama / mistral /
qwen2 / qwen3, layers whose modules are not the plain sharded ones (LoRA,
sequence parallelism, ...), an activation other than SiLU, and on the
modules the step does not call as modules (the base model and everything
under it but the embedding and the rotary module): forward hooks of the
user's, global module forward hooks, a forward set on an instance, training
mode.  That check holds for every generate() call: a fingerprint of the
modules (identity, class, hooks, training flag, parameters' identity, dtype
and device) and of the global hooks is taken at each call's first step, and
the model is checked again, its modules taken afresh, where it changed (a
hook added after a first generate(), LoRA wrapped in, .half()).  Per call: gradients enabled or training mode,
inputs_embeds, more than one new token, no cache or an empty one (prefill),
a cache layer other than HF's DynamicLayer / DynamicSlidingWindowLayer, a
full cache layer whose sliding window the sequence has outgrown,
output_attentions / output_hidden_states, other keywords.

See docs/decode.md.
"""
from __future__ import annotations

import collections
import inspect

import torch
import torch.nn.functional as F

from .decode_native import NativeStep, norm_refusal
from .distributed import collectives as C
from .distributed import communicator as _comm
from .layer.embedding import VocabParallelEmbedding1D
from .layer.linear import Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D

#: model_type values whose decoder layer is the Llama layer (RMSNorm,
#: rope attention, SwiGLU MLP), the only layer the step computes
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: decode-step keywords the step understands; any other goes to HF's forward
_KNOWN_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache",
                           "return_dict", "logits_to_keep", "cache_position", "output_attentions",
                           "output_hidden_states"})


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1] (HF's rope)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _own_forward(module):
    """The module's own forward, bound, without nn.Module.__call__ (whose
    hooks the check found absent): HF's RMSNorm computes rms(x) * g in
    float32 as the module doc says, shardformer's FusedRMSNorm the same math
    through its kernel; the step computes exactly what the layer would."""
    return type(module).forward.__get__(module)


class _Layer:
    """What the step reads of one decoder layer: its modules and sizes,
    taken afresh at each generate() call (DecodeFastPath._refresh)."""

    __slots__ = ("ln1", "ln2", "q", "k", "v", "o", "gate", "up", "down", "q_norm", "k_norm",
                 "head_dim", "groups", "scaling", "window", "index")

    def __init__(self, layer, config, index: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = _own_forward(layer.input_layernorm), _own_forward(layer.post_attention_layernorm)
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        self.q_norm, self.k_norm = [_own_forward(m) if m is not None else None for m in norms]
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.groups = attn.num_key_value_groups
        self.index = attn.layer_idx
        if hasattr(attn, "sliding_window"):
            self.window = attn.sliding_window
        else:
            self.window = getattr(config, "sliding_window", None)


def _rms_norm_refusal(path: str, norm) -> str | None:
    """None where `norm` is an RMS norm whose own forward the step may call:
    HF's (a class named *RMSNorm with variance_epsilon) or shardformer's
    FusedRMSNorm (enable_fused_normalization)."""
    from .layer.normalization import FusedRMSNorm

    if type(norm) is FusedRMSNorm:
        return None
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        return None
    return f"{path} is {type(norm).__name__}, not HF's RMSNorm or FusedRMSNorm"


def _structure_refusal(model) -> str | None:
    """Why the step cannot compute this model (None: it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} is not one of {SUPPORTED_TYPES}"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} has no .model with embed_tokens, layers, norm and rotary_emb"
    head = getattr(model, "lm_head", None)
    if type(head) is not VocabParallelLMHead1D or not head.gather_output:
        return f"lm_head is {type(head).__name__}, not a VocabParallelLMHead1D gathering the logits"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not 'silu'"
    if len(base.layers) != config.num_hidden_layers:
        return f"{len(base.layers)} layers held, config says {config.num_hidden_layers}"
    for n, layer in enumerate(base.layers):
        where = f"model.layers.{n}"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for path, module, cls in (("self_attn.q_proj", getattr(attn, "q_proj", None), Linear1D_Col),
                                  ("self_attn.k_proj", getattr(attn, "k_proj", None), Linear1D_Col),
                                  ("self_attn.v_proj", getattr(attn, "v_proj", None), Linear1D_Col),
                                  ("self_attn.o_proj", getattr(attn, "o_proj", None), Linear1D_Row),
                                  ("mlp.gate_proj", getattr(mlp, "gate_proj", None), Linear1D_Col),
                                  ("mlp.up_proj", getattr(mlp, "up_proj", None), Linear1D_Col),
                                  ("mlp.down_proj", getattr(mlp, "down_proj", None), Linear1D_Row)):
            if type(module) is not cls:
                return f"{where}.{path} is {type(module).__name__}, not a plain {cls.__name__}"
            if cls is Linear1D_Col and (module.gather_output or module.sequence_parallel or module.conv1d_layout):
                return f"{where}.{path} gathers its output or is sequence-parallel"
            if cls is Linear1D_Row and (module.sequence_parallel or not module.input_is_parallel
                                        or module.input_dropout is not None or module.conv1d_layout):
                return f"{where}.{path} is sequence-parallel, scatters its input or has an input dropout"
        norms = [("input_layernorm", getattr(layer, "input_layernorm", None)),
                 ("post_attention_layernorm", getattr(layer, "post_attention_layernorm", None))]
        norms += [(f"self_attn.{a}", getattr(attn, a)) for a in ("q_norm", "k_norm") if hasattr(attn, a)]
        for path, norm in norms:
            why = _rms_norm_refusal(f"{where}.{path}", norm)
            if why is not None:
                return why
        if not type(mlp.act_fn).__name__.startswith("SiLU"):
            return f"{where}.mlp.act_fn is {type(mlp.act_fn).__name__}, not SiLU"
        if attn.q_proj.weight.shape[0] != attn.k_proj.weight.shape[0] * attn.num_key_value_groups:
            return (f"{where}.self_attn: {attn.q_proj.weight.shape[0]} local query rows are not "
                    f"{attn.num_key_value_groups} x {attn.k_proj.weight.shape[0]} key rows")
    why = _rms_norm_refusal("model.norm", base.norm)
    if why is not None:
        return why
    return _skipped_refusal(model)


def _inert(hook) -> bool:
    """A hook of the sharder's own that a decode step may skip (the per-layer
    random streams, inert in eval; the attention-weights gathering, whose
    weights a decode step discards; the re-registration of gradient hooks of
    replicated parameters, which a step without gradients does not need):
    the hook classes say so themselves (INERT_IN_DECODE)."""
    return getattr(type(getattr(hook, "__self__", hook)), "INERT_IN_DECODE", False)


def _sharders(forward) -> bool:
    """A forward the sharder set on an instance (a policy's method
    replacement, enable_jit_fused's fused MLP): a shardformer BoundMethod of
    a shardformer function, the same math as the class's forward."""
    from .pickling import BoundMethod

    return isinstance(forward, BoundMethod) and \
        getattr(forward.__func__, "__module__", "").startswith("shardformer.")


def _skipped(model):
    """(path, module) of every module whose __call__ the step does not enter:
    the base model and everything under it but the embedding and the rotary
    module (called as modules, hooks and all).  The generating model itself
    and its lm_head are called as modules too."""
    for name, module in model.model.named_modules():
        if name.split(".")[0] in ("embed_tokens", "rotary_emb"):
            continue
        yield ("model." + name).rstrip("."), module


def _skipped_refusal(model) -> str | None:
    """Why the step, which enters no __call__ of the skipped modules, would
    compute something else than HF's forward (None: it would not): forward
    (pre-)hooks on them or global module hooks (torch.nn.modules.module.
    register_module_forward_hook / _pre_hook) other than the sharder's inert
    ones, a forward set on a module instance other than the sharder's, a
    module in training mode (dropout)."""
    from torch.nn.modules import module as nn_module

    global_hooks = [*nn_module._global_forward_pre_hooks.values(), *nn_module._global_forward_hooks.values()]
    if any(not _inert(h) for h in global_hooks):
        return ("global module forward hooks (torch.nn.modules.module.register_module_forward_hook / _pre_hook; "
                "the step would skip them)")
    hooked, patched, training = [], [], []
    for path, module in _skipped(model):
        if any(not _inert(h) for h in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())):
            hooked.append(path)
        if "forward" in module.__dict__ and not _sharders(module.__dict__["forward"]):
            patched.append(path)
        if module.training:
            training.append(path)
    if hooked:
        return f"forward hooks on {hooked[:3]} (the step would skip them)"
    if patched:
        return f"a forward set on the instances {patched[:3]} (the step would skip it)"
    if training:
        return f"training mode of {training[:3]}"
    return None


def _fingerprint(model) -> tuple[tuple, list]:
    """What the step's check depends on, taken once per generate() call:
    every module of the generating model (identity, class, instance forward,
    training flag, the handles of its forward (pre-)hooks) with its
    parameters (identity, dtype, device), and the global module hooks.
    Returns (key, objects): equal keys, the same check result; `objects`
    keeps the modules and parameters alive so that no id is reused while the
    key is held."""
    from torch.nn.modules import module as nn_module

    key = [tuple(nn_module._global_forward_pre_hooks), tuple(nn_module._global_forward_hooks)]
    objects = []
    for name, module in model.named_modules():
        params = [p for p in module._parameters.values() if p is not None]
        objects.append(module)
        objects.extend(params)
        key.append((name, id(module), type(module), id(module.__dict__.get("forward")), module.training,
                    tuple(module._forward_pre_hooks), tuple(module._forward_hooks),
                    tuple((id(p), p.dtype, p.device) for p in params)))
    return tuple(key), objects


def _call_refusal(model, kwargs: dict) -> str | None:
    """Why this call is not a decode step the fast path computes (None: it is)."""
    from transformers.cache_utils import DynamicCache

    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        return f"keywords {unknown}"
    if torch.is_grad_enabled() or model.training:
        return "gradients enabled or training mode"
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return "output_attentions / output_hidden_states"
    if kwargs.get("return_dict") is False:
        return "return_dict=False"
    ids, cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
        return "not one new token per sequence (prefill, or inputs_embeds)"
    if type(cache) is not DynamicCache or kwargs.get("use_cache") is False:
        return f"cache is {type(cache).__name__}, not a DynamicCache in use"
    if len(cache.layers) != model.config.num_hidden_layers or any(type(c) not in _cache_layers() for c in cache.layers):
        return "cache layers are not HF's DynamicLayer / DynamicSlidingWindowLayer (one per layer)"
    past = cache.get_seq_length()
    if past == 0:
        return "empty cache (prefill)"
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (ids.shape[0], past + 1)):
        return f"attention_mask of shape {tuple(mask.shape)}, not [batch, cached + 1]"
    pos = kwargs.get("position_ids")
    if pos is not None and (pos.dim() != 2 or pos.shape[1] != 1):
        return f"position_ids of shape {tuple(pos.shape)}"
    return None


def _cache_layers() -> tuple:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return DynamicLayer, DynamicSlidingWindowLayer


def _plain_refusal(path: str, module) -> str | None:
    """Why the C step (decode_native.py) may not run `module`'s math itself (None: it may): it
    carries forward (pre-)hooks other than the sharder's inert ones, a
    forward set on the instance, or is in training mode."""
    if any(not _inert(h) for h in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())):
        return f"forward hooks on {path}"
    if "forward" in module.__dict__ and not _sharders(module.__dict__["forward"]):
        return f"a forward set on {path}"
    if module.training:
        return f"{path} in training mode"
    return None


def _ends_refusals(model, group, dtype) -> tuple[str | None, str | None]:
    """(why the embedding, why the final norm + LM head cannot run in the C
    step), None where they can (decode_native.py's module doc)."""
    base, head = model.model, model.lm_head
    comm = _comm.communicator_for(base.embed_tokens.weight, group)
    embed = base.embed_tokens
    why_embed = (_plain_refusal("model.model.embed_tokens", embed) or _plain_refusal("model.model.rotary_emb",
                                                                                     base.rotary_emb))
    if why_embed is None and type(embed) is not VocabParallelEmbedding1D:
        why_embed = f"model.model.embed_tokens is {type(embed).__name__}, not a VocabParallelEmbedding1D"
    elif why_embed is None and embed.embed_scale is not None:
        why_embed = f"model.model.embed_tokens scales its rows by {embed.embed_scale}"
    elif why_embed is None and (embed.weight.dtype != dtype or
                                _comm.communicator_for(embed.weight, embed.process_group) is not comm):
        why_embed = "model.model.embed_tokens: another dtype or another group than the layers'"
    why_head = _plain_refusal("model.lm_head", head) or norm_refusal(base.norm)
    if why_head is None and (type(head) is not VocabParallelLMHead1D or not head.gather_output):
        why_head = f"model.lm_head is {type(head).__name__}, not a VocabParallelLMHead1D gathering the logits"
    elif why_head is None and (head.weight.dtype != dtype or base.norm.weight.dtype != dtype or
                               _comm.communicator_for(head.weight, head.process_group) is not comm):
        why_head = "model.lm_head or model.model.norm: another dtype or another group than the layers'"
    return why_embed, why_head


class DecodeFastPath:
    """model.forward of a sharded Llama-shaped model: decode steps inside
    generate() run `step` (the module doc's math), everything else HF's
    forward.  A module-level class held in the model's __dict__, so the
    model still pickles and deep-copies (the copy's forward is its own)."""

    def __init__(self, model, group, name: str):
        self.model, self.group, self.name = model, group, name
        self.inner = model.__dict__.get("forward")   # what other calls run (None: the class's forward)
        self.enabled = True                 # set_fast_decode: False sends every call to HF's forward
        self.fast = 0
        self.fallback: collections.Counter = collections.Counter()
        self._layers: list | None = None
        self._off: str | None = None
        self._key: tuple | None = None      # _fingerprint of the last check, and what keeps its ids unique
        self._objects: list = []
        self._call = None                   # the lockstep.generate_call() the check was made for
        self.native = NativeStep()          # the C layer loop (decode_native.py)
        self.native_enabled = True          # set_native_decode: False runs every fast step in Python
        self.c_steps = 0                    # fast steps the C loop ran
        self.python_steps: collections.Counter = collections.Counter()   # reason -> fast steps run in Python
        self.python_ends: collections.Counter = collections.Counter()    # reason -> C steps whose end ran in Python

    def __getstate__(self) -> dict:
        """A copy (pickle, deepcopy) checks its model afresh at its first call."""
        return dict(self.__dict__, _layers=None, _off=None, _key=None, _objects=[], _call=None,
                    native=NativeStep())

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own forward's: generate() reads forward's parameters to
        choose the inputs it builds (e.g. position_ids, which RoBERTa computes
        itself from the padding when not given)."""
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def _hf(self, args, kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def refresh(self) -> str | None:
        """Check the model again where its fingerprint changed (a hook
        registered, a module replaced or wrapped, a training flag, dtype or
        device changed since the last check) and take the layers' modules
        afresh; returns why the step cannot run (None: it can)."""
        key, objects = _fingerprint(self.model)
        if key != self._key:
            self._off = _structure_refusal(self.model)
            self._key, self._objects = key, objects
        self._layers = None
        return self._off

    def __call__(self, *args, **kwargs):
        from .lockstep import generate_call

        call = generate_call() if self.enabled else 0
        if not call:
            return self._hf(args, kwargs)
        if call != self._call:                # once per generate() call, not per step
            if self.refresh() is None:
                weight = self.model.model.embed_tokens.weight
                self.native.prepare(self.layers(), weight, self.model,
                                    _ends_refusals(self.model, self.group, weight.dtype))
            self._call = call
        why = self._off or ("positional arguments" if args else _call_refusal(self.model, kwargs))
        if why is None:
            why = self._window_refusal(kwargs)
        if why is not None:
            self.fallback[why] += 1
            return self._hf(args, kwargs)
        self.fast += 1
        args = (kwargs["input_ids"], kwargs["past_key_values"], kwargs.get("attention_mask"),
                kwargs.get("position_ids"))
        why = self.native.refusal(self.layers(), self.group, self.model.model.embed_tokens.weight, args[1]) \
            if self.native_enabled else "the C step switched off (set_native_decode)"
        if why is not None:
            self.python_steps[why] += 1
            return self.step(*args)
        self.c_steps += 1
        for why in self.native.ends_refusal:
            if why is not None:
                self.python_ends[why] += 1
        x, logits = self.native.run(self, *args)
        if logits is None:
            return self.finish(x, args[1])
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=logits, past_key_values=args[1])

    def layers(self) -> list[_Layer]:
        if self._layers is None:
            config = self.model.config
            self._layers = [_Layer(layer, config, n) for n, layer in enumerate(self.model.model.layers)]
        return self._layers

    def _window_refusal(self, kwargs) -> str | None:
        """A sliding window w sees the last w positions (HF: key j visible from
        query i when i - w < j <= i).  HF's DynamicSlidingWindowLayer keeps
        the last w - 1 and returns them with the new one: exactly those, so
        the step attends to what update() returns.  A full DynamicLayer
        returns everything: exact only while the sequence fits the window."""
        full, sliding = _cache_layers()
        cache = kwargs["past_key_values"]
        total = cache.get_seq_length() + 1
        for layer in self.layers():
            held = cache.layers[layer.index]
            if type(held) is sliding:
                if getattr(held, "record_past", False) or getattr(held, "sliding_window", None) != layer.window:
                    return (f"layer {layer.index}: cache window {getattr(held, 'sliding_window', None)} "
                            f"(or recording its past) where the attention's is {layer.window}")
            elif layer.window is not None and total > layer.window:
                return f"sequence of {total} past the sliding window of {layer.window} of a full cache layer"
        return None

    @torch.no_grad()
    def step(self, ids: torch.Tensor, cache, mask: torch.Tensor | None, position_ids: torch.Tensor | None):
        """One token per sequence through every layer (module doc); returns
        HF's CausalLMOutputWithPast with the gathered logits [B, 1, vocab]."""
        base, group = self.model.model, self.group
        past = cache.get_seq_length()
        if position_ids is None:       # HF's LlamaModel: positions continue the cache
            position_ids = torch.full((1, 1), past, dtype=torch.long, device=ids.device)
        x = base.embed_tokens(ids)                                         # [B, 1, h]
        cos, sin = base.rotary_emb(x, position_ids=position_ids)           # [B or 1, 1, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        bias = None
        if mask is not None and not bool(mask.all()):                      # padding: additive mask [B, 1, 1, L]
            bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
            bias.masked_fill_(mask == 0, torch.finfo(x.dtype).min)
            bias = bias[:, None, None, :]
        batch = ids.shape[0]
        for L in self.layers():
            d = L.head_dim
            a = L.ln1(x)
            q = L.q._matmul(a, L.q.weight, L.q.bias).view(batch, 1, -1, d)
            k = L.k._matmul(a, L.k.weight, L.k.bias).view(batch, 1, -1, d)
            v = L.v._matmul(a, L.v.weight, L.v.bias).view(batch, 1, -1, d).transpose(1, 2)
            if L.q_norm is not None:
                q = L.q_norm(q)
                k = L.k_norm(k)
            q, k = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)
            keys, values = cache.update(k, v, L.index)                      # [B, kv_i, L, d]
            kv = keys.shape[1]
            qg = q.reshape(batch, kv, L.groups, d)                             # query heads of each KV head
            scores = torch.matmul(qg, keys.transpose(2, 3)) * L.scaling       # [B, kv_i, groups, L]
            if bias is not None:                                            # the positions update() returned
                scores = scores + bias[..., -keys.shape[2]:]
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(probs, values).reshape(batch, 1, -1)           # [B, 1, H_i d]
            y = C.all_reduce(L.o._matmul(o, L.o.weight, None), group)
            x = x + (y if L.o.bias is None else y + L.o.bias)
            m = L.ln2(x)
            g = F.silu(L.gate._matmul(m, L.gate.weight, L.gate.bias)) * L.up._matmul(m, L.up.weight, L.up.bias)
            y = C.all_reduce(L.down._matmul(g, L.down.weight, None), group)
            x = x + (y if L.down.bias is None else y + L.down.bias)
        return self.finish(x, cache)

    def finish(self, x: torch.Tensor, cache):
        """The final norm and the LM head on the last hidden states [B, 1, h]:
        HF's CausalLMOutputWithPast with the gathered logits [B, 1, vocab]."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        x = _own_forward(self.model.model.norm)(x)
        return CausalLMOutputWithPast(logits=self.model.lm_head(x), past_key_values=cache)


def _wrappable(forward) -> bool:
    """Whether the fast path may take the model's forward: the class's own
    (None), or a forward tagged WRAPPABLE_IN_DECODE (lm_loss.GatheringForward:
    the loss on vocabulary shards when called with labels, which a decode
    step never has), which the fast path's other calls go through."""
    return forward is None or getattr(type(forward), "WRAPPABLE_IN_DECODE", False)


def install(model, group, name: str) -> int:
    """Put a DecodeFastPath as the forward of every model in the tree that
    generates (has generate() and generation_config) and whose config is of a
    SUPPORTED_TYPES model; returns how many.  Other models keep their forward
    untouched."""
    count = 0
    for module in model.modules():
        if callable(getattr(type(module), "generate", None)) and hasattr(module, "generation_config") \
                and getattr(getattr(module, "config", None), "model_type", None) in SUPPORTED_TYPES \
                and _wrappable(module.__dict__.get("forward")):
            module.__dict__["forward"] = DecodeFastPath(module, group, name)
            count += 1
    return count


def stats(model) -> dict:
    """{"fast": decode steps the fast path ran, "c_step": those of them the C
    step ran (decode_native.py), "python_step": {reason: those the
    Python step ran instead}, "python_ends": {reason: C steps whose embedding
    or final norm + LM head ran as modules instead}, "fallback": {reason: calls
    inside generate() sent to HF's forward}, "off": why the model never
    takes it (None: it can)} for the generating model `model`."""
    path = model.__dict__.get("forward")
    if not isinstance(path, DecodeFastPath):
        return {"fast": 0, "c_step": 0, "python_step": {}, "python_ends": {}, "fallback": {},
                "off": "not installed (a model_type outside SUPPORTED_TYPES, ShardConfig(enable_fast_decode=False), "
                       "pipeline stages, or a group of one rank)"}
    return {"fast": path.fast, "c_step": path.c_steps, "python_step": dict(path.python_steps),
            "python_ends": dict(path.python_ends), "fallback": dict(path.fallback), "off": path.refresh()}


def set_fast_decode(model, on: bool = True) -> None:
    """Switch the fast path of the generating model `model` on or off (off:
    every call HF's forward, uncounted), e.g. to time both on one model
    (benchmarks/generate.py's tp2-hf).  Raises ValueError where it is not
    installed."""
    path = model.__dict__.get("forward")
    if not isinstance(path, DecodeFastPath):
        raise ValueError(f"{type(model).__name__} has no decode fast path: {stats(model)['off']}")
    path.enabled = bool(on)


def set_native_decode(model, on: bool = True, ends: bool = True) -> None:
    """Let the fast path of `model` run its steps through the C step (on, the
    default) or always through the Python step (off, counted under
    stats()["python_step"]), e.g. to time both (benchmarks/generate.py's
    tp2-py); ends=False keeps the embedding, final norm and LM head out of
    the C step (run as modules, counted under stats()["python_ends"]; the
    C step of the layers alone: benchmarks/generate.py's tp2-layers).
    Raises ValueError where the fast path is not installed."""
    path = model.__dict__.get("forward")
    if not isinstance(path, DecodeFastPath):
        raise ValueError(f"{type(model).__name__} has no decode fast path: {stats(model)['off']}")
    path.native_enabled = bool(on)
    if path.native.ends_enabled != bool(ends):
        path.native.ends_enabled = bool(ends)
        path._call = None                    # the next step prepares the C step's ends afresh


def reset_stats(model) -> None:
    """Zero the counters of stats(model)."""
    path = model.__dict__.get("forward")
    if isinstance(path, DecodeFastPath):
        path.fast = path.c_steps = 0
        path.fallback.clear()
        path.python_steps.clear()
        path.python_ends.clear()
