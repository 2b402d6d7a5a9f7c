"""Comparing a sharded tensor with the unsharded one it stands for.

A rank of the sharded model holds either the whole tensor or its shard: the
`ranges` of a split dimension that the sharder recorded (a DimShard, see
shardformer.layout), laid back to back, then zero padding.  The comparison
cuts the same ranges out of the reference and drops the padding, so each
rank checks its own part and the ranks together check every element.

Two tensors agree when

    max |a - b|  <=  rtol * max |b| + atol,     atol = rtol / 10,

the absolute floor only mattering where the reference is ~0 everywhere.
The reported relative difference is max|a - b| / max|b|.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Diff:
    """The numbers of one comparison: max abs difference, the reference's
    max abs value, the relative difference, the shapes, and whether it passed."""

    max_abs: float
    scale: float
    max_rel: float
    shape: tuple
    expected_shape: tuple
    ok: bool

    def text(self) -> str:
        shapes = (f"shape {list(self.shape)}" if self.shape == self.expected_shape
                  else f"shape {list(self.shape)} (full {list(self.expected_shape)})")
        return (f"max abs diff {self.max_abs:.3g}, max rel diff {self.max_rel:.3g} (max |ref| {self.scale:.3g}), "
                f"{shapes}")


def cut(full: torch.Tensor, dim: int, shard) -> torch.Tensor:
    """This rank's real (unpadded) part of `full` along `dim`: its ranges of the layout."""
    parts = [full.narrow(dim, off, n) for off, n in shard.ranges]
    if not parts:                       # this rank holds padding only
        return full.narrow(dim, 0, 0)
    return torch.cat(parts, dim) if len(parts) != 1 else parts[0]


def diff(got: torch.Tensor, ref: torch.Tensor, rtol: float, full_shape: tuple | None = None) -> Diff:
    """Compare `got` with `ref` (same shape) at `rtol`; `full_shape` is the
    unsharded shape to report when `got` is a shard."""
    a, b = got.detach().double(), ref.detach().double()
    shape = tuple(got.shape)
    full = tuple(full_shape) if full_shape is not None else shape
    if a.shape != b.shape:
        return Diff(float("inf"), 0.0, float("inf"), shape, tuple(ref.shape) if full_shape is None else full, False)
    if not a.numel():
        return Diff(0.0, 0.0, 0.0, shape, full, True)
    d = (a - b).abs()
    # NaN/inf in one and not the other is a mismatch; in both at the same place, not.
    both = ~torch.isfinite(a) & ~torch.isfinite(b) & ((a == b) | (a.isnan() & b.isnan()))
    d = torch.where(both, torch.zeros_like(d), d)
    max_abs = d.max().item() if not d.isnan().any() else float("nan")
    finite = b[torch.isfinite(b)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    ok = max_abs <= rtol * scale + rtol / 10        # False for NaN
    return Diff(max_abs, scale, max_abs / max(scale, 1e-30), shape, full, bool(ok))


def float_tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """The floating-point tensors of a module's output (a tensor, a tuple, a
    dict or a ModelOutput, nested), by position or key: "0", "logits", "1.0"."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out[prefix or "0"] = value
    elif hasattr(value, "items"):
        for k, v in value.items():
            out.update(float_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            out.update(float_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def layout_for(got: torch.Tensor, ref: torch.Tensor, layouts) -> tuple[int, object] | None:
    """(dim, DimShard) under which `got` is this rank's shard of `ref`: the
    one dimension where their shapes differ, and the first of `layouts`
    (nearest recorded layouts first) of that full length and this rank's
    length; None if the shapes differ otherwise or no layout fits."""
    if got.dim() != ref.dim():
        return None
    dims = [d for d in range(got.dim()) if got.shape[d] != ref.shape[d]]
    if len(dims) != 1:
        return None
    d = dims[0]
    for shard in layouts:
        if shard.full == ref.shape[d] and shard.length in (got.shape[d], shard.real) and shard.real <= got.shape[d]:
            return d, shard
    return None


def compare_maybe_sharded(got: torch.Tensor, ref: torch.Tensor, rtol: float, layouts) -> Diff | None:
    """Compare a tensor that may be this rank's shard of `ref`; None when it
    is a shard of a layout no layer recorded (then it cannot be compared)."""
    if got.shape == ref.shape:
        return diff(got, ref, rtol)
    found = layout_for(got, ref, layouts)
    if found is None:
        return None
    d, shard = found
    return diff(got.narrow(d, 0, shard.real), cut(ref, d, shard), rtol, full_shape=tuple(ref.shape))


def loss_of(out, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's loss when its output has one, else a fixed random
    projection sum(out_k * P_k) of its float outputs (P_k from a seeded
    generator, kept in `probe` so both models get the same), so that every
    output receives a gradient."""
    tensors = float_tensors(out)
    losses = [v for k, v in tensors.items() if k.split(".")[-1] == "loss" and v.dim() == 0]
    if losses:
        return sum(losses)
    total = None
    for k, v in tensors.items():
        if k not in probe:
            g = torch.Generator().manual_seed(1234 + len(probe))
            probe[k] = torch.randn(v.shape, generator=g, dtype=torch.float32)
        term = (v.float() * probe[k].to(v.device)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("verify: the model's output has no floating-point tensor to take a loss of")
    return total
