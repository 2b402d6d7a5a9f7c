"""Faults during optimize() and checkpoint loading (issue 11, classes 4, 7, 8, 9).

    failed apply     a replacement that fails to build, a swap that fails, an
                     interrupt: the model comes back exactly as it was (same
                     module and parameter objects, values, hooks, configs,
                     outputs) and a later optimize() succeeds; a change that
                     cannot be undone marks the model, and every later call
                     says so
    interrupts       KeyboardInterrupt / SystemExit / MemoryError /
                     RecursionError raised while planning or applying come out
                     as raised (the same object)
    process group    given while torch.distributed is not initialized: a
                     ValueError before anything changes
    checkpoints      load_full_state_dict checks every dimension and dtype of
                     every tensor and the keys before it copies anything, and
                     lists every problem in one error (TP=2 and 4)
    replicas         ranks whose models differ in one element, config, dtype or
                     a buffer are refused before anything changes (TP=2 and 4)
    C engine         sharder_apply's journal, the in-place protocol, and the
                     layout arithmetic that used to crash or overflow

Rank-side functions live here too (the pool imports them by module name).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from checks import replicas
from shardformer import ModulePolicyDescription, Policy, ShardConfig, ShardFormer, _C
from shardformer import SubModuleReplacementDescription as Sub
from shardformer.checkpoint import gather_full_state_dict, load_full_state_dict
from shardformer.layer import Linear1D_Col, Linear1D_Row, ParallelModule
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from zoo import custom

LLAMA = "LlamaForCausalLM"
# toy_model() puts a user's hook on every fc1, which the successful optimize() then warns about
pytestmark = pytest.mark.filterwarnings("ignore:.*moved to the parallel layers:UserWarning")


# ---------------------------------------------------------------------------
# What "unchanged" means
# ---------------------------------------------------------------------------

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks")


def snapshot(model: nn.Module, inputs: dict) -> dict:
    """Everything a failed optimize() must leave as it was."""
    with torch.no_grad():
        out = model(**inputs)
    return {
        "modules": [(n, m, type(m)) for n, m in model.named_modules(remove_duplicate=False)],
        "params": [(n, p, p.detach().clone(), p.requires_grad)
                   for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, b, b.clone()) for n, b in model.named_buffers(remove_duplicate=False)],
        "hooks": [(n, d, list(getattr(m, d))) for n, m in model.named_modules() for d in _HOOK_DICTS],
        "own": [(n, sorted(vars(m))) for n, m in model.named_modules()],
        "configs": [(n, dict(vars(m.config))) for n, m in model.named_modules() if hasattr(m, "config")],
        "repr": repr(model),
        "out": (out["logits"] if isinstance(out, dict) else out.logits).clone(),
    }


def assert_unchanged(model: nn.Module, inputs: dict, before: dict) -> None:
    now = snapshot(model, inputs)
    assert [(n, id(m), t) for n, m, t in now["modules"]] == [(n, id(m), t) for n, m, t in before["modules"]]
    assert [(n, id(p), g) for n, p, _, g in now["params"]] == [(n, id(p), g) for n, p, _, g in before["params"]]
    for (n, _, value, _), (_, _, old, _) in zip(now["params"], before["params"]):
        assert torch.equal(value, old), f"{n} changed"
    assert [(n, id(b)) for n, b, _ in now["buffers"]] == [(n, id(b)) for n, b, _ in before["buffers"]]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(now["buffers"], before["buffers"]))
    assert now["hooks"] == before["hooks"]
    assert now["own"] == before["own"], "instance attributes were added or removed"
    assert [(n, c) for n, c in now["configs"]] == [(n, c) for n, c in before["configs"]]
    assert now["repr"] == before["repr"]
    assert torch.equal(now["out"], before["out"]), "the model's output changed"
    assert not any(isinstance(m, ParallelModule) for m in model.modules())


# ---------------------------------------------------------------------------
# A failure in the middle of apply
# ---------------------------------------------------------------------------

class FailingCol(Linear1D_Col):
    """Linear1D_Col whose build fails on call number `fail_at` (1-based), and
    which brings a forward hook of its own (merged into the native's hooks
    by the sharder)."""

    calls = 0
    fail_at = 3
    error: BaseException = RuntimeError("no memory for this shard")

    @classmethod
    def from_native_module(cls, module, process_group=None, **kwargs):
        FailingCol.calls += 1
        if FailingCol.calls == FailingCol.fail_at:
            raise FailingCol.error
        layer = super().from_native_module(module, process_group, **kwargs)
        layer.register_forward_hook(lambda *args: None)
        return layer


class FailingPolicy(Policy):
    """ToyPolicy's layers plus a bias table split in place (ShardParams) on
    every attention module, with fc1 replaced by FailingCol."""

    def module_policy(self):
        heads = Heads(5, 5, 8)
        return {
            custom.ToyModel: ModulePolicyDescription(sub_module_replacement=[Sub("head", Linear1D_Col)]),
            custom.ToyBlock: ModulePolicyDescription(
                attribute_replacement={"attn.heads": heads.local_heads()},
                sub_module_replacement=[
                    Sub("attn", ShardParams, kwargs={"params": {"table": (1, Heads(5, head_dim=1).q)}}),
                    Sub("attn.qkv", Linear1D_Col, kwargs={"split": heads.qkv}),
                    Sub("attn.out", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("fc1", FailingCol),
                    Sub("fc2", Linear1D_Row),
                ]),
        }


def toy_model() -> nn.Module:
    """ToyModel with a per-head table on each attention (for ShardParams) and
    a user's forward hook on every fc1."""
    torch.manual_seed(0)
    model = custom.ToyModel()
    for block in model.blocks:
        block.attn.table = nn.Parameter(torch.randn(3, 5))
        block.fc1.register_forward_hook(lambda *args: None)
    return model


def wrapped(error: BaseException) -> bool:
    """Whether the sharder reports `error` as a RuntimeError with context
    (ordinary errors) or lets it through as raised (interrupts, MemoryError,
    RecursionError)."""
    return isinstance(error, Exception) and not isinstance(error, (MemoryError, RecursionError))


@pytest.fixture
def failing(monkeypatch):
    monkeypatch.setattr(FailingCol, "calls", 0)
    return FailingCol


@pytest.mark.parametrize("error", [RuntimeError("no memory for this shard"), ValueError("bad shard"),
                                   KeyboardInterrupt(), SystemExit(3), MemoryError(), RecursionError()])
def test_failed_build_leaves_model_unchanged(failing, monkeypatch, error):
    """The 2nd fc1 fails to build, after the first block's replacements, the
    in-place table split and the head were built: nothing of it reaches the
    model; interrupts and resource errors come out as the same object; the
    same model then shards once the failure is gone."""
    monkeypatch.setattr(failing, "error", error)
    monkeypatch.setattr(failing, "fail_at", 2)
    model, inputs = toy_model(), custom.toy_inputs()
    before = snapshot(model, inputs)
    with pytest.raises(RuntimeError if wrapped(error) else type(error)) as info:
        ShardFormer(ShardConfig()).optimize(model, policy=FailingPolicy())
    if wrapped(error):
        assert type(info.value) is RuntimeError
        assert "blocks.1.fc1" in str(info.value) and "the model is as it was" in str(info.value)
        assert info.value.__cause__ is error
    else:
        assert info.value is error
    assert_unchanged(model, inputs, before)
    monkeypatch.setattr(failing, "fail_at", -1)
    ShardFormer(ShardConfig()).optimize(model, policy=FailingPolicy())
    assert isinstance(model.blocks[1].fc1, FailingCol) and isinstance(model.blocks[0].attn, ParallelModule)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs)["logits"], before["out"], rtol=1e-5, atol=1e-5)


class Touchy(nn.Module):
    """A module whose `heads` setter fails: a swap that fails in the second
    phase, after other swaps went in."""

    error: BaseException = ValueError("heads is read-only here")

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def heads(self):
        return 5

    @heads.setter
    def heads(self, value):
        raise Touchy.error

    def forward(self, x):
        return self.inner(x)


class TouchyPolicy(Policy):
    def __init__(self, param_fn=None):
        super().__init__()
        self.param_fn = param_fn

    def module_policy(self):
        return {
            custom.ToyModel: ModulePolicyDescription(
                param_replacement=[self.param_fn] if self.param_fn else [],
                sub_module_replacement=[Sub("head", Linear1D_Col)]),
            custom.ToyBlock: ModulePolicyDescription(
                sub_module_replacement=[Sub("fc1", Linear1D_Col), Sub("fc2", Linear1D_Row)]),
            Touchy: ModulePolicyDescription(attribute_replacement={"heads": 1}),
        }


def touchy_model() -> nn.Module:
    model = toy_model()
    model.blocks[1].touchy = Touchy(nn.Identity())   # planned after blocks.0 and blocks.1's swaps
    return model


@pytest.mark.parametrize("error", [ValueError("heads is read-only here"), KeyboardInterrupt()])
def test_failed_swap_is_undone(monkeypatch, error):
    """A setattr that fails in the swap phase, after five swaps went in: they
    are undone (the same objects back in their places)."""
    monkeypatch.setattr(Touchy, "error", error)
    model, inputs = touchy_model(), custom.toy_inputs()
    before = snapshot(model, inputs)
    with pytest.raises(RuntimeError if wrapped(error) else type(error)) as info:
        ShardFormer(ShardConfig()).optimize(model, policy=TouchyPolicy())
    if not wrapped(error):
        assert info.value is error
    else:
        assert "blocks.1.touchy.heads" in str(info.value) and "as it was" in str(info.value)
    assert_unchanged(model, inputs, before)


def test_change_that_cannot_be_undone_marks_the_model():
    """A param_replacement callable ran before the failing swap: the model is
    marked, and optimize() and forward on it say so, naming the error."""
    model, inputs = touchy_model(), custom.toy_inputs()
    ran = []
    with pytest.raises(RuntimeError, match=r"partially sharded \(changes that cannot be undone: <root>\)"):
        ShardFormer(ShardConfig()).optimize(model, policy=TouchyPolicy(param_fn=ran.append))
    assert ran == [model]
    expected = r"partially sharded by a failed optimize\(\) \(RuntimeError: applying the shard plan .*rebuild it"
    with pytest.raises(RuntimeError, match=expected):
        ShardFormer(ShardConfig()).optimize(model, policy=custom.ToyPolicy())
    with pytest.raises(RuntimeError, match=expected):
        model(**inputs)


def test_failed_postprocess_marks_the_model():
    class BadPost(custom.ToyPolicy):
        def postprocess(self):
            raise OSError("postprocess failed")

    model = custom.ToyModel()
    with pytest.raises(OSError, match="postprocess failed"):
        ShardFormer(ShardConfig()).optimize(model, policy=BadPost())
    with pytest.raises(RuntimeError, match=r"partially sharded .*OSError: postprocess failed.*rebuild"):
        model(**custom.toy_inputs())


def _fail_third_row_layer(monkeypatch):
    """The third Linear1D_Row the sharder builds raises RuntimeError("injected");
    returns the real from_native_module, to put back."""
    calls = []
    real = Linear1D_Row.from_native_module.__func__

    def failing(cls, module, process_group=None, **kwargs):
        calls.append(cls)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(cls, module, process_group, **kwargs)

    monkeypatch.setattr(Linear1D_Row, "from_native_module", classmethod(failing))
    return real


def test_hf_model_failure_with_every_optimization(monkeypatch):
    """Llama with the built-in policy, fused norms, fused MLPs and flash
    attention switched on: the third row-parallel layer fails to build; the
    model (attention config included) is as it was, then shards."""
    real = _fail_third_row_layer(monkeypatch)
    model, inputs = zoo.build(LLAMA).eval(), zoo.make_inputs(LLAMA)
    before = snapshot(model, inputs)
    cfg = ShardConfig(enable_all_optimization=True)
    with pytest.raises(RuntimeError, match="injected; every change was undone"):
        ShardFormer(cfg).optimize(model)
    assert model.config._attn_implementation == "eager"
    assert_unchanged(model, inputs, before)
    monkeypatch.setattr(Linear1D_Row, "from_native_module", classmethod(real))
    ShardFormer(cfg).optimize(model)
    assert model.config._attn_implementation == "shardformer"
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before["out"], rtol=1e-4, atol=1e-4)


def replicated_norms_failure(ctx) -> dict:
    """Qwen3 (q_norm / k_norm replicated, their gradients all-reduced by hooks)
    whose last row-parallel layer fails to build: nothing of the model changed,
    no gradient hook is left on the norms, and it then shards."""
    name = "Qwen3ForCausalLM"
    model, inputs = zoo.build(name).eval(), zoo.make_inputs(name)
    before = snapshot(model, inputs)
    real = Linear1D_Row.from_native_module.__func__
    n_rows = 2 * model.config.num_hidden_layers          # o_proj and down_proj per layer
    calls = []

    def failing(cls, module, process_group=None, **kwargs):
        calls.append(cls)
        if len(calls) == n_rows:
            raise RuntimeError("injected")
        return real(cls, module, process_group, **kwargs)

    Linear1D_Row.from_native_module = classmethod(failing)
    try:
        cfg = ShardConfig(tensor_parallel_process_group=ctx.group)
        try:
            ShardFormer(cfg).optimize(model)
        except RuntimeError as e:
            error = str(e)
        hooked = [n for n, p in model.named_parameters() if p._backward_hooks]
        assert_unchanged(model, inputs, before)
    finally:
        Linear1D_Row.from_native_module = classmethod(real)
    ShardFormer(cfg).optimize(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before["out"], rtol=1e-4, atol=1e-4)
    return {"error": error, "hooked": hooked, "hooked_after": [n for n, p in model.named_parameters()
                                                               if p._backward_hooks]}


def test_replicated_norms_failure_is_undone(pool):
    for r in pool.run(replicated_norms_failure, 2):
        assert "injected; every change was undone" in r["error"], r["error"]
        assert r["hooked"] == [], r["hooked"]
        assert any("q_norm" in n for n in r["hooked_after"]), r["hooked_after"]


# ---------------------------------------------------------------------------
# Interrupts while planning
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("error", [KeyboardInterrupt("^C"), SystemExit(2), GeneratorExit(), MemoryError(),
                                   RecursionError("deep")])
def test_interrupt_while_planning_passes_through(monkeypatch, error):
    calls = []
    real = Linear1D_Col.plan_shard.__func__

    def plan_shard(cls, module, tp_size, rank, **kwargs):
        calls.append(module)
        if len(calls) == 2:
            raise error
        return real(cls, module, tp_size, rank, **kwargs)

    monkeypatch.setattr(Linear1D_Col, "plan_shard", classmethod(plan_shard))
    model, inputs = toy_model(), custom.toy_inputs()
    before = snapshot(model, inputs)
    with pytest.raises(BaseException) as info:
        ShardFormer(ShardConfig()).optimize(model, policy=custom.ToyPolicy())
    assert info.value is error
    assert_unchanged(model, inputs, before)


def test_interrupt_in_a_per_rank_value_passes_through():
    from shardformer.layout import PerRank

    error = KeyboardInterrupt()

    def interrupted(tp_size, rank):
        raise error

    class P(Policy):
        def module_policy(self):
            return {custom.ToyBlock: ModulePolicyDescription(attribute_replacement={"attn.heads": PerRank(interrupted)})}

    with pytest.raises(KeyboardInterrupt) as info:
        ShardFormer(ShardConfig()).optimize(custom.ToyModel(), policy=P())
    assert info.value is error


# ---------------------------------------------------------------------------
# A process group without torch.distributed
# ---------------------------------------------------------------------------

def test_process_group_without_distributed_is_refused_first():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="process group was given .* torch.distributed is not initialized"):
        ShardConfig(tensor_parallel_process_group=object())
    cfg = ShardConfig()
    cfg.tensor_parallel_process_group = object()       # set after the config's own check
    model, inputs = toy_model(), custom.toy_inputs()
    before = snapshot(model, inputs)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        ShardFormer(cfg).optimize(model, policy=custom.ToyPolicy())
    assert_unchanged(model, inputs, before)


# ---------------------------------------------------------------------------
# load_full_state_dict (rank side, then the tests)
# ---------------------------------------------------------------------------

UP, DOWN = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"


def _expect_refused(model, state, strict=True) -> str:
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    try:
        load_full_state_dict(model, state, strict=strict)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("load_full_state_dict accepted a state dict that does not fit")
    for n, (p, value) in before.items():
        assert dict(model.named_parameters())[n] is p and torch.equal(p, value), f"{n} changed by a failed load"
    return message


def bad_checkpoints(ctx) -> dict:
    """Each bad state dict is refused with the keys named, and the model's
    parameters are untouched (every other tensor of the dict differs from
    the model's, so a partial copy would show)."""
    model = zoo.build(LLAMA)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    full = gather_full_state_dict(model)
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
    messages = {}
    messages["column"] = _expect_refused(model, {**shifted, UP: full[UP][:, :1].clone()})
    messages["row"] = _expect_refused(model, {**shifted, DOWN: full[DOWN][:1, :].clone()})
    messages["unexpected"] = _expect_refused(model, {**shifted, "model.layers.9.mlp.up_proj.weight": full[UP]})
    missing = dict(shifted)
    del missing[UP]
    messages["missing"] = _expect_refused(model, missing)
    messages["dtype"] = _expect_refused(model, {**shifted, UP: full[UP].to(torch.complex64)})
    messages["all"] = _expect_refused(model, {**missing, DOWN: full[DOWN][:, :5].clone(), "extra": full[UP]},
                                      strict=True)
    # strict=False ignores missing and unexpected keys, never a wrong shape
    messages["lenient_shape"] = _expect_refused(model, {**missing, DOWN: full[DOWN][:1, :].clone()}, strict=False)
    load_full_state_dict(model, {**missing, "extra": full[UP]}, strict=False)
    for k, v in gather_full_state_dict(model).items():
        assert torch.equal(v, full[k] if k == UP else shifted[k]), k
    return messages


@pytest.mark.parametrize("tp", [2, 4])
def test_load_full_state_dict_checks_everything_first(pool, tp):
    messages = pool.run(bad_checkpoints, tp)
    assert all(m == messages[0] for m in messages)
    m = messages[0]
    # [90, 1] into the column-split [90, 96] (split dim 0): the broadcast that used to pass
    assert f"{UP}: shape [90, 1], expected [90, 96] (dimension 0 is split over {tp} ranks)" in m["column"]
    # the non-split dimension of a row-split weight
    assert f"{DOWN}: shape [1, 90], expected [96, 90] (dimension 1 is split over {tp} ranks)" in m["row"]
    assert "unexpected keys (1): model.layers.9.mlp.up_proj.weight" in m["unexpected"]
    assert f"missing keys (1): {UP}" in m["missing"]
    assert f"{UP}: dtype torch.complex64 does not convert to the model's torch.float32" in m["dtype"]
    for part in (f"missing keys (1): {UP}", "unexpected keys (1): extra", f"{DOWN}: shape [96, 5], expected [96, 90]"):
        assert part in m["all"], m["all"]
    assert "nothing was loaded" in m["all"] and "missing" not in m["lenient_shape"]


# ---------------------------------------------------------------------------
# Ranks that disagree (what tests/test_replicas.py does not already cover)
# ---------------------------------------------------------------------------

def different_dtype_refused(ctx) -> str:
    dtype = torch.bfloat16 if ctx.rank == ctx.tp_size - 1 else torch.float32
    return replicas._refused(ctx, zoo.build(LLAMA, dtype=dtype))


def different_buffer_refused(ctx) -> str:
    model = zoo.build(LLAMA)
    if ctx.rank == ctx.tp_size - 1:
        model.model.rotary_emb.inv_freq[1] += 1e-6
    return replicas._refused(ctx, model)


@pytest.mark.parametrize("tp", [2, 4])
def test_different_dtypes_refused(pool, tp):
    msgs = pool.run(different_dtype_refused, tp)
    assert all(m == msgs[0] for m in msgs)
    assert "built different models" in msgs[0] and f"rank {tp - 1}" in msgs[0] and "torch.bfloat16" in msgs[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_different_buffers_refused(pool, tp):
    msgs = pool.run(different_buffer_refused, tp)
    assert all(m == msgs[0] for m in msgs)
    assert f"model.rotary_emb.inv_freq (ranks [{tp - 1}])" in msgs[0] and "different weights" in msgs[0], msgs[0]


# ---------------------------------------------------------------------------
# The C engine
# ---------------------------------------------------------------------------

class _Owner:
    value = "class"        # a class attribute: undone by deleting the instance's


class _Refuses:
    def __setattr__(self, name, value):
        raise AttributeError(f"{name} is read-only")


def _op(kind, path, owner, name=None, value=None):
    """A hand-made attr / param / method plan record."""
    return _C.PlanOp((kind, path, owner, name, value, None, None, None, None, None))


def _sub(path, parent, name, target, native):
    """A hand-made sub-module plan record (no kwargs, no ShardPlan)."""
    return _C.PlanOp(("sub", path, parent, name, None, target, native, {}, None, None))


def test_apply_journal_undoes_swaps_in_reverse():
    """A setattr failing in the swap phase: the swaps before it are undone
    (a sub-module put back, an instance attribute over a class attribute and
    a bound method deleted); after a success the journal is emptied."""
    root = custom.ToyModel()
    blocks = list(root.blocks)
    owner = _Owner()

    def ops():
        return [_sub("blocks.0", root.blocks, "0", _Identity, blocks[0]),
                _op("attr", "owner.value", owner, "value", "instance"),
                _op("method", "owner.forward", owner, "forward", lambda self: 1),
                _op("attr", "refuses.x", _Refuses(), "x", 1)]

    journal = []
    with pytest.raises(RuntimeError, match=r"refuses.x \(op 4 of 4\): x is read-only; every change was undone"):
        _C.sharder_apply(ops(), None, None, journal)
    assert journal == [] and root.blocks[0] is blocks[0]
    assert "value" not in vars(owner) and "forward" not in vars(owner) and owner.value == "class"
    journal = [("earlier",)]
    assert _C.sharder_apply(ops()[:3], None, None, journal) == 3
    assert journal == [] and isinstance(root.blocks[0], nn.Identity) and owner.value == "instance"
    with pytest.raises(TypeError, match="journal must be a list"):
        _C.sharder_apply([], None, None, ())


class _Identity:
    @staticmethod
    def from_native_module(module, process_group, **kwargs):
        return nn.Identity()


class _InPlace:
    """Changes the native module itself, without prepare_native_module."""

    @staticmethod
    def from_native_module(module, process_group, **kwargs):
        module.touched = True
        return module


class _Prepared:
    """prepare_native_module: commit fails halfway; rollback must still run."""

    log: list = []

    @staticmethod
    def prepare_native_module(module, process_group, **kwargs):
        class Change:
            def commit(self):
                module.halfway = True
                raise KeyboardInterrupt

            def rollback(self):
                _Prepared.log.append("rollback")
                del module.halfway
        return Change()


def test_apply_in_place_changes():
    root = custom.ToyModel()
    fc1 = root.blocks[0].fc1
    journal = []
    ops = [_sub("blocks.0.fc1", root.blocks[0], "fc1", _InPlace, fc1),
           _sub("blocks.0.fc2", root.blocks[0], "fc2", object, root.blocks[0].fc2)]
    with pytest.raises(RuntimeError, match=r"changes that cannot be undone: blocks.0.fc1\) and must be rebuilt"):
        _C.sharder_apply(ops, None, None, journal)
    assert journal == [("inplace", "blocks.0.fc1")]
    ops = [_sub("blocks.0.fc2", root.blocks[0], "fc2", _Prepared, root.blocks[0].fc2)]
    with pytest.raises(KeyboardInterrupt):
        _C.sharder_apply(ops, None)
    assert _Prepared.log == ["rollback"] and not hasattr(root.blocks[0].fc2, "halfway")
    ops = [_sub("x", root, "x", type("NoCommit", (), {"prepare_native_module": staticmethod(
        lambda m, g, **k: object())}), root.blocks[0])]
    with pytest.raises(RuntimeError, match="must return an object with commit"):
        _C.sharder_apply(ops, None)


def test_shard_params_prepare_and_rollback():
    attn = toy_model().blocks[0].attn
    table, cls = attn.table, type(attn)
    change = ShardParams.prepare_native_module(attn, None, params={"table": (1, Heads(5, head_dim=1).q)})
    assert attn.table is table and type(attn) is cls and "shard_plan" not in vars(attn)
    assert change.commit() is attn and isinstance(attn, ParallelModule) and attn.table is not table
    change.rollback()
    assert attn.table is table and type(attn) is cls and "shard_plan" not in vars(attn)


@pytest.mark.parametrize("spec, match", [
    (("grouped", "Grouped(-2, 1)", -2, 1, 0), "not a positive multiple"),         # was SIGFPE: full % 0
    (("grouped", "Grouped(huge)", 2 ** 62, 2 ** 61, 0), "overflows int64"),      # n + 2 * kv wrapped
])
def test_grouped_split_arguments_checked(spec, match):
    with pytest.raises((ValueError, OverflowError), match=match):
        _C.resolve_split(spec, 8, 2, 0)


def test_negative_length_refused():
    with pytest.raises(ValueError, match="cannot be negative"):
        _C.resolve_split(("heads", "Heads(2)", 2, 2, 0, 0), -8, 2, 0)


def test_per_rank_head_count_overflow_checked():
    class Huge:
        __shardformer_per_rank__ = True
        __shardformer_heads__ = (8, 8, 0, 2 ** 62)      # 8 local heads * factor 2**62

    entries = {custom.ToyBlock: ((("attn.heads", Huge()),), (), (), ())}
    with pytest.raises(ValueError, match=r"ToyModel: blocks.0.attn.heads: .*overflows int64"):
        _C.sharder_plan(custom.ToyModel(), "ToyModel", entries, 1, 0)


def test_seam_kernel_failure_undone(monkeypatch):
    """GPT-Neo (attention outside the registry: the kernel goes in at its
    seam, GPTNeoSelfAttention._attn) with every optimization on: the third
    row-parallel layer fails to build; no attention module keeps a replaced
    method, and the model is as it was, then shards and runs the kernel."""
    from shardformer import attention as sf_attention

    name = "GPTNeoForCausalLM"
    real = _fail_third_row_layer(monkeypatch)
    model, inputs = zoo.build(name).eval(), zoo.make_inputs(name)
    before = snapshot(model, inputs)
    cfg = ShardConfig(enable_all_optimization=True)
    with pytest.raises(RuntimeError, match="injected; every change was undone"):
        ShardFormer(cfg).optimize(model)
    changed = [n for n, m in model.named_modules() if {"_attn", "forward", sf_attention.SEAM_MARK} & set(vars(m))]
    assert not changed, changed
    assert_unchanged(model, inputs, before)
    monkeypatch.setattr(Linear1D_Row, "from_native_module", classmethod(real))
    ShardFormer(cfg).optimize(model)
    kernel = sf_attention.CALLS["kernel"]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before["out"], rtol=1e-4, atol=1e-4)
    assert sf_attention.CALLS["kernel"] - kernel == model.config.num_layers
