"""Rank-side checks: a sharded model against the unsharded one from the same seed.

Each function runs on every rank of the tensor-parallel group (see
dist_pool.RankPool) and raises AssertionError with the numbers on mismatch.
"""
from __future__ import annotations

import copy

import torch

from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import _shard_info
from shardformer.layer.parallel_module import shard_of

import model_zoo

# Pass when max|a - b| <= rtol * max|b| + atol (atol only matters for tensors
# whose exact value is ~0, e.g. a QA bias gradient, where rounding noise remains).
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-2)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, 1e-12) if a.numel() else 0.0


def assert_close(what: str, a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(b.shape)}")
    rtol, atol = tol
    diff = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    scale = b.detach().abs().max().item() if b.numel() else 0.0
    if not diff <= rtol * scale + atol:
        raise AssertionError(f"{what}: max abs error {diff:.3g} > {rtol:g} * max|ref| ({scale:.3g}) + {atol:g}")
    return rel_err(a, b)


def output_tensors(out) -> dict[str, torch.Tensor]:
    items = out.items() if hasattr(out, "items") else enumerate(out if isinstance(out, tuple) else (out,))
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor) and v.is_floating_point()}


def loss_of(out, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's loss(es) if it computed any, else a fixed random projection
    of its float outputs (so every output gets a gradient)."""
    tensors = output_tensors(out)
    losses = [v for k, v in tensors.items() if k.endswith("loss")]
    if losses:
        return sum(losses)
    total = 0.0
    for k, v in tensors.items():
        if k not in probe:
            g = torch.Generator().manual_seed(1234 + len(probe))
            probe[k] = torch.randn(v.shape, generator=g, dtype=torch.float32)
        total = total + (v.float() * probe[k]).sum()
    return total


def check_outputs(tag, out, ref, tol):
    got, exp = output_tensors(out), output_tensors(ref)
    if set(got) != set(exp):
        raise AssertionError(f"{tag}: output fields {sorted(got)} != expected {sorted(exp)}")
    return {k: assert_close(f"{tag} output '{k}'", got[k], exp[k], tol) for k in exp}


def check_model(ctx, name: str, dtype_name: str = "float32", steps: int = 1, config=None) -> dict:
    """check_sharded for the model-zoo class `name`."""
    dtype = getattr(torch, dtype_name)
    return check_sharded(ctx, lambda: model_zoo.build(name, dtype), model_zoo.make_inputs(name), name=name,
                         dtype=dtype, steps=steps, config=config)


def check_sharded(ctx, build, inputs: dict, name: str, dtype=torch.float32, steps: int = 1, config=None,
                  policy=None) -> dict:
    """Forward, loss, every gradient and the outputs after SGD steps of
    build() sharded over ctx.group, against build() unsharded.  Returns the
    max relative errors seen; raises AssertionError on any mismatch."""
    tol = TOL[dtype]
    torch.manual_seed(0)
    model = build()
    model.train()
    ref = copy.deepcopy(model)
    full_numel = sum(p.numel() for p in ref.parameters())
    shard_config = ShardConfig(tensor_parallel_process_group=ctx.group, **(config or {}))
    sharded, _ = ShardFormer(shard_config=shard_config).optimize(model, policy=policy)
    local_numel = sum(p.numel() for p in sharded.parameters())
    report = {"tp": ctx.tp_size, "param_fraction": local_numel / full_numel}
    if ctx.tp_size > 1 and shard_config.enable_tensor_parallelism and not local_numel < full_numel:
        raise AssertionError(f"{name}: rank holds {local_numel} of {full_numel} parameters: nothing was sharded")

    out, exp = sharded(**inputs), ref(**inputs)
    report["forward"] = max(check_outputs(name, out, exp, tol).values())
    if dtype != torch.float32:
        return report

    probe = {}
    loss, ref_loss = loss_of(out, probe), loss_of(exp, probe)
    report["loss"] = assert_close(f"{name} loss", loss, ref_loss, tol)
    loss.backward()
    ref_loss.backward()

    info = _shard_info(sharded)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for pname, p in sharded.named_parameters():
        rp = ref_params[pname]
        if rp.grad is None:
            if p.grad is not None and p.grad.abs().max() > 0:
                raise AssertionError(f"{name}: {pname} has a gradient but the reference has none")
            continue
        if p.grad is None:
            raise AssertionError(f"{name}: {pname} has no gradient")
        expected = rp.grad
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(rp.grad, dim, shard)
        worst = max(worst, assert_close(f"{name} grad of {pname}", p.grad, expected, tol))
    report["grad"] = worst

    opt, ref_opt = torch.optim.SGD(sharded.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        opt.step()
        ref_opt.step()
    with torch.no_grad():
        out2, exp2 = sharded(**inputs), ref(**inputs)
    report["after_step"] = max(check_outputs(f"{name} after step", out2, exp2, tol).values())
    return report
