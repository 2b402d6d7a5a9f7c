"""Rank-side checks: torch.save(model) / torch.load of a sharded model (shardformer.pickling)."""
from __future__ import annotations

import copy
import io
import pickle

import torch

from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer import pickling
from shardformer.layer.parallel_module import ParallelModule
from shardformer.layer.replicated import GradAllReduce

import zoo


def _round_trip(model, via: str = "torch"):
    """torch.save of the whole module, then torch.load (weights_only=False);
    via="pickle": pickle.dumps / pickle.loads."""
    if via == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _groups(model) -> set:
    return {id(m.process_group) for m in model.modules() if isinstance(m, ParallelModule)}


def round_trip_matches(ctx, name: str, config: dict | None = None, via: str = "torch", dropout: float = 0.0) -> dict:
    """`name` sharded over ctx.group (with `config`), pickled and loaded in
    this rank: the loaded model's eval outputs equal the saved model's
    exactly, its parallel layers run on ctx.group, and (dropout 0) its
    forward, loss, every gradient and the outputs after an SGD step match
    the unsharded model from the same seed.  dropout > 0: every dropout of
    the config set to it, and the loaded model, still in eval mode, matches
    the unsharded model in eval mode."""
    torch.manual_seed(0)
    model = zoo.build_with_dropout(name, dropout) if dropout else zoo.build(name)
    ref = copy.deepcopy(model)
    if dropout:
        model.eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **(config or {}))).optimize(model)
    inputs = zoo.make_inputs(name)
    model.eval()
    with torch.no_grad():
        before = parity.output_tensors(model(**inputs))
    loaded = _round_trip(model, via)
    assert loaded is not model and type(loaded) is type(model)
    parallel = [m for m in loaded.modules() if isinstance(m, ParallelModule)]
    assert parallel, f"{name}: the loaded model has no parallel layer"
    assert _groups(loaded) == {id(ctx.group)}, f"{name}: the loaded layers are not on the TP group"
    assert not any(m.training for m in loaded.modules()), f"{name}: the loaded model left eval mode"
    with torch.no_grad():
        after = parity.output_tensors(loaded(**inputs))
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{name}: loaded output {k} differs"
    if dropout:
        with torch.no_grad():
            errs = parity.check_outputs(f"{name} loaded, eval", loaded(**inputs), ref.eval()(**inputs),
                                        parity.TOL[torch.float32])
        return {"forward": max(errs.values()), "parallel_layers": len(parallel)}
    loaded.train()
    report = parity.compare_sharded(loaded, ref.train(), inputs, f"{name} loaded")
    report["parallel_layers"] = len(parallel)
    return report


def replicated_hooks_reattached(ctx, name: str) -> dict:
    """torch.save drops tensor hooks: after a load the replicated parameters'
    gradient all-reduce is registered again at the first forward (counted)."""
    torch.manual_seed(0)
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)

    def hooked(m):
        return sum(any(isinstance(h, GradAllReduce) for h in (p._backward_hooks or {}).values())
                   for p in m.parameters())

    saved = hooked(model)
    loaded = _round_trip(model)
    lost = hooked(loaded)
    with torch.no_grad():
        loaded(**zoo.make_inputs(name))
    return {"saved": saved, "after_load": lost, "after_forward": hooked(loaded)}


def refused_with_reason(ctx, name: str, config: dict) -> str:
    """torch.save of a model sharded with `config` raises TypeError naming
    the model and the setting; copy.deepcopy still works."""
    torch.manual_seed(0)
    model = zoo.build(name)
    group = dict(tensor_parallel_process_group=ctx.group)
    ShardFormer(ShardConfig(**group, **config)).optimize(model)
    try:
        torch.save(model, io.BytesIO())
    except TypeError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name} {config}: torch.save(model) was not refused")
    copy.deepcopy(model)
    return message


def missing_group_refused(ctx) -> str:
    """A group reference whose ranks this process has no group of: RuntimeError naming them."""
    try:
        pickling.resolve_group((0, 7, 9))
    except RuntimeError as e:
        return str(e)
    raise AssertionError("resolve_group of unknown ranks did not raise")


def pipelined_refused(ctx) -> str:
    """torch.save of a pipeline stage (PP=2 on the pool's 4 ranks) raises TypeError naming the
    model and pipeline parallelism; copy.deepcopy still works."""
    from checks import pipeline

    _, model, _, _ = pipeline.pipelined(ctx, "LlamaForCausalLM", 2)
    try:
        torch.save(model, io.BytesIO())
    except TypeError as e:
        message = str(e)
    else:
        raise AssertionError("torch.save of a pipeline stage was not refused")
    copy.deepcopy(model)
    return message
