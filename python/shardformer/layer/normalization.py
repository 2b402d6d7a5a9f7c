"""Normalization layers as single fused calls (F.layer_norm / F.rms_norm).

These replace HF's hand-composed normalizations (e.g. LlamaRMSNorm's
pow-mean-rsqrt chain) by one fused op over the same parameters; nothing is
sharded.  The C kernels behind `enable_fused_normalization` plug in here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        dtype = x.dtype
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps).to(dtype)
        return y * self.weight

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"
