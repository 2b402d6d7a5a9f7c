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

import zoo

# Pass when max|a - b| <= rtol * max|b| + atol (atol only matters for tensors
# whose exact value is ~0, e.g. a QA bias gradient, where rounding noise remains).
# float16: bfloat16's bound scaled to float16's finer rounding (2^-11 against 2^-8; ~5 of its units)
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-2), torch.float16: (3e-3, 1.5e-3)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, 1e-12) if a.numel() else 0.0


def assert_close(what: str, a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float],
                 b64: torch.Tensor | None = None) -> float:
    """max|a - b| <= rtol * max|b| + atol, plus, when the float64 value b64 of
    the reference is given, twice the reference's own float32 error |b - b64|:
    for models whose float32 result is itself that far from exact."""
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(b.shape)}")
    rtol, atol = tol
    b = b.to(a.device)                       # a gathered CPU copy against a model's CUDA tensor, or back
    b64 = None if b64 is None else b64.to(a.device)
    diff = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    scale = b.detach().abs().max().item() if b.numel() else 0.0
    own = 0.0 if b64 is None or not b.numel() else (b.detach().double() - b64.detach()).abs().max().item()
    if not diff <= rtol * scale + atol + 2 * own:
        raise AssertionError(f"{what}: max abs error {diff:.3g} > {rtol:g} * max|ref| ({scale:.3g}) + {atol:g}"
                             + (f" + 2 * the reference's own float32 error ({own:.3g})" if b64 is not None else ""))
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
        dt = torch.float64 if v.dtype == torch.float64 else torch.float32
        total = total + (v.to(dt) * probe[k].to(v.device, dt)).sum()
    return total


def check_outputs(tag, out, ref, tol, ref64=None):
    got, exp = output_tensors(out), output_tensors(ref)
    if set(got) != set(exp):
        raise AssertionError(f"{tag}: output fields {sorted(got)} != expected {sorted(exp)}")
    exp64 = output_tensors(ref64) if ref64 is not None else {}
    return {k: assert_close(f"{tag} output '{k}'", got[k], exp[k], tol, exp64.get(k)) for k in exp}


def _double(inputs: dict) -> dict:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()}


def refused_unchanged(model, call, what: str, error: type = ValueError, structure: bool = False,
                      names: tuple = ()) -> str:
    """call() must raise `error` naming each of `names` and leave every tensor
    of model.state_dict() (with structure=True: every module's name and class
    too) as it was; returns the message."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [(n, type(m)) for n, m in model.named_modules()]
    try:
        call()
    except error as e:
        message = str(e)
    else:
        raise AssertionError(f"{what} was not refused")
    changed = [k for k, v in model.state_dict().items() if k not in before or not torch.equal(v, before[k])]
    assert not changed, f"the refused {what} changed {changed}"
    if structure:
        assert [(n, type(m)) for n, m in model.named_modules()] == modules, f"the refused {what} replaced modules"
    missing = [n for n in names if n not in message]
    assert not missing, f"the refusal of {what} does not name {missing}: {message}"
    return message


def check_model(ctx, name: str, dtype_name: str = "float32", steps: int = 1, config=None) -> dict:
    """check_sharded for the zoo's model `name` (a zoo module whose build takes a dtype)."""
    dtype = getattr(torch, dtype_name)
    return check_sharded(ctx, lambda: zoo.build(name, dtype), zoo.make_inputs(name), name=name,
                         dtype=dtype, steps=steps, config=config)


def check_zoo_model(ctx, name: str) -> dict:
    """check_sharded for any zoo model as the zoo builds it by default (float32)."""
    return check_sharded(ctx, lambda: zoo.build(name), zoo.make_inputs(name), name=name)


def sharded_pair(ctx, model):
    """(model sharded over ctx.group in eval mode, an unsharded copy of it)."""
    model.eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    return model, ref


def greedy_matches(model, ref, inputs: dict, name: str, new_tokens: int) -> torch.Tensor:
    """Greedy generate() of `model` on `inputs` equals `ref`'s; returns the tokens."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(**inputs, **kwargs)
        exp = ref.generate(**inputs, **kwargs)
    assert torch.equal(got, exp), f"{name}: generate() differs:\n{got}\n{exp}"
    return got


def prompt_ids(seed: int = 3) -> torch.Tensor:
    """The [2, 5] prompt of the generate() checks."""
    return torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(seed))


def generate_matches(ctx, name: str, new_tokens: int = 6):
    """Greedy generate() of the sharded model equals the unsharded model's;
    returns the tokens and the KV heads this rank's cache holds."""
    model, ref = sharded_pair(ctx, zoo.build(name))
    prompt = prompt_ids()
    got = greedy_matches(model, ref, {"input_ids": prompt}, name, new_tokens)
    # The KV cache holds only this rank's heads: check via one cached step.
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    keys = out.past_key_values.layers[0].keys
    return {"tokens": got.tolist(), "local_kv_heads": keys.shape[1]}


def to_device(inputs: dict, device) -> dict:
    """`inputs` with every tensor on `device` (None: unchanged)."""
    if device is None:
        return inputs
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def check_sharded(ctx, build, inputs: dict, name: str, dtype=torch.float32, steps: int = 1, config=None,
                  policy=None, fp64_floor: bool = False, reference=None, plan=None, device=None,
                  default_group: bool = False) -> dict:
    """Forward, loss, every gradient and the outputs after SGD steps of
    build() sharded over ctx.group, against build() unsharded.  Returns the
    max relative errors seen; raises AssertionError on any mismatch.

    fp64_floor (float32 only): also run the unsharded model in float64 and
    allow, on top of the tolerance, twice the unsharded float32 model's own
    distance from it, i.e. sharding may not add more error than float32
    arithmetic already has.  For models measured to be that ill-conditioned
    (see the zoo that asks for it); every other model gets the plain tolerance.

    reference: the unsharded model to compare with (default: a copy of build()'s).
    policy / plan: passed to optimize().  device: where the model (built on
    CPU from the seed, then moved), the reference and the inputs run (None: CPU).
    default_group: the plain ShardConfig (no group given: the world, so
    ctx.group must span it), instead of ctx.group passed explicitly."""
    torch.manual_seed(0)
    model = build()
    if device is not None:
        model.to(device)
        inputs = to_device(inputs, device)
        reference = None if reference is None else reference.to(device)
    model.train()
    ref = copy.deepcopy(model) if reference is None else reference.train()
    ref64 = copy.deepcopy(ref).double() if fp64_floor and dtype == torch.float32 else None
    inputs64 = _double(inputs) if ref64 is not None else None
    full_numel = sum(p.numel() for p in ref.parameters())
    group = {} if default_group else {"tensor_parallel_process_group": ctx.group}
    shard_config = ShardConfig(**group, **(config or {}))
    sharded, _ = ShardFormer(shard_config=shard_config).optimize(model, policy=policy, plan=plan)
    local_numel = sum(p.numel() for p in sharded.parameters())
    report = {"tp": ctx.tp_size, "param_fraction": local_numel / full_numel}
    if ctx.tp_size > 1 and shard_config.enable_tensor_parallelism and not local_numel < full_numel:
        raise AssertionError(f"{name}: rank holds {local_numel} of {full_numel} parameters: nothing was sharded")

    return compare_sharded(sharded, ref, inputs, name, dtype, steps, ref64=ref64, inputs64=inputs64, report=report)


def compare_grads(sharded, ref, name: str, tol: tuple[float, float], ref64=None) -> float:
    """Every gradient of `sharded` against this rank's shard of `ref`'s (and
    of the float64 `ref64`'s, when given); returns the worst relative error."""
    ref64_params = dict(ref64.named_parameters()) if ref64 is not None else {}
    info = _shard_info(sharded)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))   # a tied weight under each of its names
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
        expected64 = ref64_params[pname].grad if pname in ref64_params else None
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(rp.grad, dim, shard)
            expected64 = None if expected64 is None else shard_of(expected64, dim, shard)
        worst = max(worst, assert_close(f"{name} grad of {pname}", p.grad, expected, tol, expected64))
    return worst


def compare_sharded(sharded, ref, inputs: dict, name: str, dtype=torch.float32, steps: int = 1, ref64=None,
                    inputs64=None, report: dict | None = None) -> dict:
    """The checks of check_sharded on a model already sharded: forward, loss,
    every gradient (each rank's shard of the reference's), outputs after SGD
    steps, against the unsharded `ref` (float64 `ref64` for fp64_floor)."""
    tol = TOL[dtype]
    report = {} if report is None else report
    out, exp = sharded(**inputs), ref(**inputs)
    exp64 = ref64(**inputs64) if ref64 is not None else None
    report["forward"] = max(check_outputs(name, out, exp, tol, exp64).values())
    if dtype != torch.float32:
        return report

    probe = {}
    loss, ref_loss = loss_of(out, probe), loss_of(exp, probe)
    loss64 = loss_of(exp64, probe) if ref64 is not None else None
    report["loss"] = assert_close(f"{name} loss", loss, ref_loss, tol, loss64)
    loss.backward()
    ref_loss.backward()
    if loss64 is not None:
        loss64.backward()
    report["grad"] = compare_grads(sharded, ref, name, tol, ref64)

    models = [sharded, ref] + ([ref64] if ref64 is not None else [])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for _ in range(steps):
        for opt in opts:
            opt.step()
    with torch.no_grad():
        out2, exp2 = sharded(**inputs), ref(**inputs)
        exp2_64 = ref64(**inputs64) if ref64 is not None else None
    report["after_step"] = max(check_outputs(f"{name} after step", out2, exp2, tol, exp2_64).values())
    return report
