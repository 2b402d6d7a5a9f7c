"""Normalization layers backed by the C kernels (shardformer.ops).

These replace HF's LayerNorms and hand-composed RMSNorms (e.g. LlamaRMSNorm's
pow-mean-rsqrt chain) by one fused C kernel over the same parameters, forward
and backward; nothing is sharded.  Inputs the kernels do not take (a
normalized shape of several dimensions, a non-CPU device) go through
F.layer_norm / F.rms_norm instead.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .. import ops


def _kernel_ok(x, normalized_shape) -> bool:
    return len(normalized_shape) == 1 and ops.kernel_input(x)


def _eps_of(module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise TypeError(f"cannot find the epsilon of {type(module).__name__} "
                    "(looked for eps, variance_epsilon, epsilon)")


class FusedLayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimensions."""

    def __init__(self, normalized_shape, eps: float = 1e-5, weight=None, bias=None):
        super().__init__()
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, **kwargs):
        weight = getattr(module, "weight", None)
        shape = getattr(module, "normalized_shape", None) or (weight.shape if weight is not None else None)
        if shape is None:
            raise TypeError(f"FusedLayerNorm cannot infer the normalized shape of {type(module).__name__}")
        return cls(shape, _eps_of(module), weight, getattr(module, "bias", None))

    def forward(self, x):
        if _kernel_ok(x, self.normalized_shape):
            return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class FusedRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back
    (as HF's Llama-family RMSNorms do)."""

    def __init__(self, normalized_shape, eps: float = 1e-6, weight=None):
        super().__init__()
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.weight = weight

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, **kwargs):
        weight = getattr(module, "weight", None)
        if weight is None:
            raise TypeError(f"FusedRMSNorm needs a module with a 'weight', got {type(module).__name__}")
        return cls(weight.shape, _eps_of(module), weight)

    def forward(self, x):
        if _kernel_ok(x, self.normalized_shape):
            if self.weight.dtype == x.dtype:   # one kernel, weight applied in float32
                return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)
            return ops.rms_norm(x, self.normalized_shape, None, self.eps) * self.weight
        dtype = x.dtype
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps).to(dtype)
        return y * self.weight

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"
