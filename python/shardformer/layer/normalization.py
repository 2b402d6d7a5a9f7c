"""Normalization layers backed by the C kernels (shardformer.ops).

These replace HF's LayerNorms and hand-composed RMSNorms (e.g. LlamaRMSNorm's
pow-mean-rsqrt chain) by one fused C kernel over the same parameters, forward
and backward; nothing is sharded.  On CUDA the same ops run the CUDA kernels
(shardformer._cuda, docs/cuda.md).  Inputs the kernels do not take (a
normalized shape of several dimensions, another device, CUDA in a build
without shardformer._cuda) go through F.layer_norm / F.rms_norm instead.

Two variants keep HF's parameters as they are stored (so checkpoints stay HF's):

* FusedRMSNorm(offset=1.0): Gemma 1-3's RMSNorm, y = x / rms(x) * (1 + w) with
  w stored as the offset from one (initialized to zeros).  The kernel gets the
  float32 scale 1 + w; its gradient flows back to w through the addition.
* FusedLayerNorm(channels_first=True): a LayerNorm over dimension 1 of
  [B, C, ...] inputs (SAM's channels_first SamLayerNorm, the LayerNorm2d of
  vision necks): the channels are moved last for the kernel and back.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .. import ops


def _kernel_ok(x, normalized_shape) -> bool:
    return len(normalized_shape) == 1 and ops.fused_input(x)


def _eps_of(module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise TypeError(f"cannot find the epsilon of {type(module).__name__} "
                    "(looked for eps, variance_epsilon, epsilon)")


class FusedLayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimensions."""

    def __init__(self, normalized_shape, eps: float = 1e-5, weight=None, bias=None, channels_first: bool = False):
        super().__init__()
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.weight = weight
        self.bias = bias
        # normalize over dimension 1 of [B, C, ...] (normalized_shape = (C,))
        self.channels_first = bool(channels_first)
        if self.channels_first and len(self.normalized_shape) != 1:
            raise ValueError(f"a channels-first LayerNorm normalizes one dimension, got {self.normalized_shape}")

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, channels_first: bool = False, **kwargs):
        weight = getattr(module, "weight", None)
        shape = getattr(module, "normalized_shape", None) or (weight.shape if weight is not None else None)
        if shape is None:
            raise TypeError(f"FusedLayerNorm cannot infer the normalized shape of {type(module).__name__}")
        return cls(shape, _eps_of(module), weight, getattr(module, "bias", None), channels_first=channels_first)

    def _last(self, x):
        if _kernel_ok(x, self.normalized_shape):
            return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def forward(self, x):
        if self.channels_first:
            return self._last(x.movedim(1, -1)).movedim(-1, 1)
        return self._last(x)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}" + (", channels_first" if self.channels_first else "")


class FusedRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back
    (as HF's Llama-family RMSNorms do); with offset (Gemma 1-3: 1.0),
    y = x / sqrt(mean(x^2) + eps) * (offset + weight), the scale in float32."""

    def __init__(self, normalized_shape, eps: float = 1e-6, weight=None, offset: float = 0.0):
        super().__init__()
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.weight = weight
        self.offset = float(offset)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, offset: float = 0.0, **kwargs):
        weight = getattr(module, "weight", None)
        if weight is None:
            raise TypeError(f"FusedRMSNorm needs a module with a 'weight', got {type(module).__name__}")
        return cls(weight.shape, _eps_of(module), weight, offset=offset)

    def forward(self, x):
        if self.offset:
            # (offset + w) in float32, applied before the cast back (as Gemma does)
            scale = self.weight.float() + self.offset
            if _kernel_ok(x, self.normalized_shape):
                return ops.rms_norm(x, self.normalized_shape, scale, self.eps)
            return (F.rms_norm(x.float(), self.normalized_shape, None, self.eps) * scale).to(x.dtype)
        if _kernel_ok(x, self.normalized_shape):
            if self.weight.dtype == x.dtype:   # one kernel, weight applied in float32
                return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)
            return ops.rms_norm(x, self.normalized_shape, None, self.eps) * self.weight
        dtype = x.dtype
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps).to(dtype)
        return y * self.weight

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}" + (f", offset={self.offset:g}" if self.offset else "")
