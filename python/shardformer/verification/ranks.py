"""What every rank of verify() runs: build the pair, shard one copy, compare.

`run_checks` returns this rank's Entries and, when the sharded model raised,
(module path, order, message) of the innermost module that was running.
It calls `build()` twice under the same seed (reference first) and refuses a
build whose two calls differ, since the comparison would then mean nothing.
Both copies run in eval mode (dropout off, so the two draw no different
random numbers).  The optimizer is plain SGD (lr 0.1) on both copies.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from ..checkpoint.full import shard_info
from ..config import ShardConfig
from ..input_check import skip_whole_parameters
from ..shardformer import ShardFormer
from .compare import compare_maybe_sharded, cut, diff, float_tensors, loss_of
from .report import AFTER_STEPS, LOSS, MODEL_OUTPUT, PARAM_GRAD, Entry
from .trace import Comparer, Recorder

SEED = 0
LR = 0.1


def build_pair(build, seed: int = SEED) -> tuple[nn.Module, nn.Module]:
    """(reference, copy to shard): build() twice from `seed`, checked equal."""
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        m = build()
        if not isinstance(m, nn.Module):
            raise TypeError(f"verify: build() must return a torch.nn.Module, got {type(m).__name__}")
        models.append(m)
    ref, model = models
    if ref is model:
        raise ValueError("verify: build() returned the same model object twice; it must build a fresh model "
                         "on every call")
    a, b = ref.state_dict(), model.state_dict()
    for name, t in a.items():
        if name not in b or b[name].shape != t.shape or not torch.equal(b[name], t):
            raise ValueError(f"verify: build() is not deterministic: two calls under torch.manual_seed({seed}) "
                             f"give different values of {name!r} ({type(ref).__name__}); seed every random "
                             "source it uses from torch (see docs/verify.md)")
    return ref, model


def make_inputs(inputs, seed: int = SEED) -> dict:
    """The input dict (calling `inputs` under a fixed seed when it is a function), checked."""
    if callable(inputs):
        torch.manual_seed(seed + 1)
        inputs = inputs()
    if not isinstance(inputs, dict) or not all(isinstance(k, str) for k in inputs):
        raise TypeError(f"verify: inputs must be a dict of keyword arguments (str -> tensor), got "
                        f"{type(inputs).__name__}")
    if not any(isinstance(v, torch.Tensor) for v in inputs.values()):
        raise ValueError(f"verify: inputs has no tensor (keys {sorted(inputs)})")
    return inputs


def _param_entries(model, ref, check: str, order0: tuple, label, first_fired: dict, grad: bool,
                   rtol: float) -> list[Entry]:
    """Every parameter (grad=False) or its gradient (grad=True) of the
    sharded `model` against `ref`'s, cut to this rank's shard."""
    info = shard_info(model)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    entries = []
    for idx, (pname, p) in enumerate(model.named_parameters()):
        owner, _, leaf = pname.rpartition(".")
        order = order0 + (first_fired.get(owner, 1 << 30), idx)
        what = label(leaf)
        rp = ref_params.get(pname)
        if rp is None:
            entries.append(Entry(check, order, owner, what, note="not in the unsharded model"))
            continue
        got, exp = (p.grad, rp.grad) if grad else (p.detach(), rp.detach())
        if got is None and exp is None:
            continue
        if got is None or exp is None:
            side = "the sharded model" if got is None else "the unsharded model"
            entries.append(Entry(check, order, owner, what, note=f"{side} has none", missing=True))
            continue
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            d = diff(got.narrow(dim, 0, shard.real), cut(exp, dim, shard), rtol, tuple(exp.shape))
        else:
            d = diff(got, exp, rtol)
        entries.append(Entry(check, order, owner, what, d))
    return entries


def _output_entries(out, exp, check: str, phase: int, suffix: str, rtol: float, layouts) -> list[Entry]:
    got, ref = float_tensors(out), float_tensors(exp)
    entries = []
    for i, (key, r) in enumerate(ref.items()):
        what = f"output '{key}'{suffix}"
        t = got.get(key)
        if t is None:
            entries.append(Entry(check, (phase, i), "", what, note="missing from the sharded model's output",
                                 missing=True))
            continue
        d = compare_maybe_sharded(t, r, rtol, layouts)
        entries.append(Entry(check, (phase, i), "", what, d,
                             "" if d is not None else f"a shard {list(t.shape)} of {list(r.shape)} of no known layout"))
    return entries


@contextlib.contextmanager
def _quiet_hooks():
    """torch's notes on full backward hooks that cannot fire (a module
    returning a ModelOutput; inputs needing no gradient) are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        yield


def describe(ref: nn.Module, model: nn.Module, tp: int, rtol: float, steps: int) -> str:
    full = sum(p.numel() for p in ref.parameters())
    local = sum(p.numel() for p in model.parameters())
    return (f"{type(ref).__name__} at TP={tp}, rank 0 holds {local} of {full} parameters; "
            f"rtol={rtol:g}, {steps} SGD step{'s' if steps != 1 else ''} (lr {LR})")


def _staged(sync, stage: str, fn):
    """fn() on this rank, then `sync(stage, error)` on every rank (error:
    None, or this rank's exception as text) before the next collective, so
    one rank failing alone is an error naming the ranks, not a hang."""
    try:
        value = fn()
    except Exception as e:
        sync(stage, f"{type(e).__name__}: {e}")
        raise
    sync(stage, None)
    return value


def run_checks(build, inputs, shard_config: ShardConfig, plan, policy, steps: int, rtol: float, sync=None):
    """This rank's (entries, raised, setup line); see the module doc.

    `sync(stage, value)`, when given, is called by every rank at the points
    where ranks could otherwise part: after the local set-up, after the
    reference's run, after the sharded forward (value: the module it raised
    in), and after the local comparisons.  Comparisons that fail on a rank
    are held back until the collectives (backward, the SGD steps) are done."""
    sync = sync or (lambda stage, value: None)
    ref, model, inputs, policy = _staged(sync, "set-up", lambda: (*build_pair(build), make_inputs(inputs),
                                                                 policy() if isinstance(policy, type) else policy))
    ref.eval()
    model.eval()
    ShardFormer(shard_config=shard_config).optimize(model, policy=policy, plan=plan)
    skip_whole_parameters(model)     # whole parameters that part are found below, after the steps, with their module
    from ..config import group_size_and_rank

    tp, _ = group_size_and_rank(shard_config.tensor_parallel_process_group)
    setup = describe(ref, model, tp, rtol, steps)

    recorder = Recorder(ref)
    probe: dict = {}

    def reference():
        with _quiet_hooks():
            exp = ref(**inputs)
            ref_loss = loss_of(exp, probe)
            ref_loss.backward()
        recorder.remove()
        return exp, ref_loss

    exp, ref_loss = _staged(sync, "the unsharded model's run", reference)

    comparer = Comparer(model, recorder, rtol)
    raised = None
    try:
        with _quiet_hooks():
            out = model(**inputs)
    except Exception as e:  # noqa: BLE001 - reported with the module it happened in
        path, order = comparer.raised_in()
        raised = (path, order, f"{type(e).__name__}: {e}")
    sync("the sharded model's forward", None if raised is None else f"raised in {raised[0] or '(model)'}")
    if raised is not None:
        comparer.remove()
        return comparer.entries, raised, setup

    held: list[Exception] = []

    def local(fn) -> list:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - raised after the collectives, see the doc
            held.append(e)
            return []

    entries = comparer.entries
    layouts = [s for _, s, _ in shard_info(model).values()]
    entries += local(lambda: _output_entries(out, exp, "forward", MODEL_OUTPUT, "", rtol, layouts))
    loss = loss_of(out, probe)
    entries += local(lambda: [Entry("loss", (LOSS, 0), "", "loss", diff(loss, ref_loss, rtol))])
    try:
        with _quiet_hooks():
            loss.backward()
    finally:
        comparer.remove()
    entries += local(lambda: _param_entries(model, ref, "grads", (PARAM_GRAD,), lambda leaf: f"grad of {leaf}",
                                            comparer.first_fired, grad=True, rtol=rtol))

    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, ref)]
    for step in range(steps):
        if step:
            for m, opt in zip((model, ref), opts):
                opt.zero_grad()
                loss_of(m(**inputs), probe).backward()
        for opt in opts:
            opt.step()
    if steps:
        label = f" after {steps} step{'s' if steps != 1 else ''}"
        entries += local(lambda: _param_entries(model, ref, "after_steps", (AFTER_STEPS, 0),
                                                lambda leaf: leaf + label, comparer.first_fired, grad=False,
                                                rtol=rtol))
        with torch.no_grad():
            out2, exp2 = model(**inputs), ref(**inputs)
        entries += local(lambda: [
            Entry(e.check, (AFTER_STEPS, 1) + e.order[1:], e.module, e.what, e.diff, e.note, missing=e.missing)
            for e in _output_entries(out2, exp2, "after_steps", AFTER_STEPS, label, rtol, layouts)])
    sync("the comparisons", f"{type(held[0]).__name__}: {held[0]}" if held else None)
    if held:
        raise held[0]
    return entries, None, setup
