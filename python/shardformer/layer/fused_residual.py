"""The fused form of a transformer layer whose residual blocks are written
inline in its own forward (OPT's decoder layer, Whisper's encoder and decoder
layers): no MLP or output module to switch, so the whole layer's forward is
replaced, calling the layer's own children.

A layer of this form has, by attribute name (RESIDUAL_LAYER_FORMS):

    attention block        h = r + dropout_p(attn(norm_a(r)))
    cross-attention block  h = r + dropout_p(cross(norm_c(r), key_value_states=enc))
                           (when the layer has one and is given encoder states)
    feed-forward block     h = r + dropout_p(fc2(dropout_act(act(fc1(norm_f(r))))))

with p the layer's residual dropout probability (an attribute, read at every
call: the sequence-parallel policies move it into their row layers and set it
to 0).  Where the layer's pre-norm flag is False (OPT-350m), each block is
post-norm instead: h = norm(r + dropout_p(sublayer(r))).

The fused forward computes the same sums with the residual dropout-add by the C
kernel (ops.bias_dropout_add: the kernel draws its keep mask from a seed and
redraws it in backward, never storing it) and a GeLU activation by the
bias_gelu kernel (erf or tanh form, as the probe found); any other activation
(OPT's ReLU) is the layer's own module.  Inputs the kernels do not take (other
devices) and float16 run the layer's own forward: Whisper's encoder layer
clamps float16 outputs inline, which no probe in another dtype can see.

The sharder binds it only after shardformer.optimizations' probe found it equal
to the layer's own forward (eval mode, with and without encoder states).
"""
from __future__ import annotations

import inspect

import torch

from .. import ops

# (attention norm, attention, cross norm, cross-attention, feed-forward norm, fc1,
#  activation, activation dropout probability, fc2, residual dropout probability, pre-norm flag)
# Children / attributes a layer does not have are optional where the form says so:
# the cross-attention pair, the activation dropout and the pre-norm flag (absent: pre-norm).
RESIDUAL_LAYER_FORMS = (
    ("self_attn_layer_norm", "self_attn", "encoder_attn_layer_norm", "encoder_attn", "final_layer_norm",
     "fc1", "activation_fn", "activation_dropout", "fc2", "dropout", "do_layer_norm_before"),
)
# Arguments of the layer's forward that are not the attention's: the layer's input, the
# cross-attention's, and use_cache (the cache object itself goes to the attention).
_LAYER_ONLY = ("encoder_hidden_states", "encoder_attention_mask", "use_cache")


class ResidualLayerForward:
    """forward(layer, hidden_states, ...) of a RESIDUAL_LAYER_FORMS layer, the
    residual dropout-adds (and a GeLU) by the C kernels; bound to the layer by
    the sharder.  A module-level class (not a closure) so a model holding it
    pickles.  `approximate`: "none" / "tanh" for a GeLU activation, "" for
    another one (the layer's own module)."""

    def __init__(self, form: tuple, cross: bool, act_dropout: bool, pre_norm_flag: bool, approximate: str):
        (self.norm_a, self.attn, self.norm_c, self.cross, self.norm_f, self.fc1, self.act, self.act_p,
         self.fc2, self.p, self.pre_flag) = form
        self.has_cross, self.has_act_p, self.has_pre_flag = cross, act_dropout, pre_norm_flag
        self.approximate = approximate
        self.__qualname__ = f"residual_layer_forward[{self.attn}{'+' + self.cross if cross else ''}->" \
                            f"{self.fc1}->{self.fc2}]"

    def _block(self, module, residual, norm, sublayer, pre: bool):
        """[norm](r + dropout_p(sublayer([norm](r)))), the dropout-add by the kernel."""
        h = sublayer(getattr(module, norm)(residual) if pre else residual)
        p = float(getattr(module, self.p))
        if h.shape == residual.shape and h.dtype == residual.dtype:
            h = ops.bias_dropout_add(h, None, residual, p, module.training)
        else:
            h = residual + torch.nn.functional.dropout(h, p=p, training=module.training)
        return h if pre else getattr(module, norm)(h)

    def _ffn(self, module, x):
        h = getattr(module, self.fc1)(x)
        h = ops.bias_gelu(h, None, self.approximate) if self.approximate else getattr(module, self.act)(h)
        if self.has_act_p:
            h = torch.nn.functional.dropout(h, p=float(getattr(module, self.act_p)), training=module.training)
        return getattr(module, self.fc2)(h)

    def __call__(self, module, *args, **kwargs):
        own = type(module).forward
        sig = inspect.signature(own)
        params = sig.bind(module, *args, **kwargs).arguments
        names = list(params)
        hidden = params[names[1]]                    # the parameter after self: the layer's input
        if not ops.kernel_input(hidden) or hidden.dtype == torch.float16:
            return own(module, *args, **kwargs)
        extra = {}
        kinds = sig.parameters
        for name, value in list(params.items())[2:]:
            kind = kinds[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                extra.update(value)
            elif name not in _LAYER_ONLY:
                extra[name] = value
        pre = bool(getattr(module, self.pre_flag)) if self.has_pre_flag else True
        enc = params.get("encoder_hidden_states")
        cross_kwargs = {k: v for k, v in extra.items() if k not in ("attention_mask", "position_ids")}

        h = self._block(module, hidden, self.norm_a, lambda x: getattr(module, self.attn)(x, **extra)[0], pre)
        if self.has_cross and enc is not None:
            h = self._block(module, h, self.norm_c, lambda x: getattr(module, self.cross)(
                x, key_value_states=enc, attention_mask=params.get("encoder_attention_mask"), **cross_kwargs)[0],
                pre)
        return self._block(module, h, self.norm_f, lambda x: self._ffn(module, x), pre)
