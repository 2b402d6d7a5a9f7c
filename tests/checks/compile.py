"""Rank-side checks of torch.compile on sharded models (docs/compile.md): the
compiled sharded model against the unsharded HF model from the same seed.

The backend is "aot_eager" (dynamo + AOTAutograd, no code generation): it
traces through the custom ops' fake implementations and registered autograd
as inductor does, in a fraction of the time on CPU.  Graphs are counted by
a counting backend: graph breaks = graphs - 1."""
from __future__ import annotations

import copy

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from shardformer import ShardConfig, ShardFormer

import zoo
from checks.parity import TOL, assert_close, check_outputs, compare_grads

NAME = "LlamaForCausalLM"


def _pair(ctx, default_group: bool, config: dict | None, name: str = NAME):
    """(the model sharded over ctx.group -- or the world with the plain
    ShardConfig() --, an unsharded copy), both in training mode."""
    torch.manual_seed(0)
    model = zoo.build(name)
    model.train()
    ref = copy.deepcopy(model)
    config = dict(config or {})
    shard_config = ShardConfig(**config) if default_group else \
        ShardConfig(tensor_parallel_process_group=ctx.group, **config)
    sharded, _ = ShardFormer(shard_config=shard_config).optimize(model)
    return sharded, ref


def _sgd(*models):
    for m in models:
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    p.grad = None


def whole_model(ctx, default_group: bool = False, config: dict | None = None, steps: int = 2) -> dict:
    """torch.compile(sharded) trains like the unsharded model: logits, loss and
    every gradient at each of `steps` SGD steps; returns the graphs dynamo made
    (and raises if the second step compiled anything new)."""
    torch._dynamo.reset()
    sharded, ref = _pair(ctx, default_group, config)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(sharded, backend=counter)
    inputs = zoo.make_inputs(NAME)
    tol = TOL[torch.float32]
    graphs = []
    for step in range(steps):
        out, exp = compiled(**inputs), ref(**inputs)
        check_outputs(f"compiled step {step}", out, exp, tol)
        out.loss.backward()
        exp.loss.backward()
        compare_grads(sharded, ref, f"compiled step {step}", tol)
        _sgd(sharded, ref)
        graphs.append(counter.frame_count)
    if graphs[-1] != graphs[0]:
        raise AssertionError(f"the compiled model recompiled after its first step: {graphs} graphs")
    return {"graphs": graphs[0], "ops": counter.op_count}


def decoder_layer_fullgraph(ctx, config: dict | None = None) -> dict:
    """One decoder layer of the sharded model compiles with fullgraph=True
    (no graph break at all) and gives the unsharded layer's output and
    gradients (its input's and every parameter's shard)."""
    torch._dynamo.reset()
    sharded, ref = _pair(ctx, False, config)
    layer, ref_layer = sharded.model.layers[0], ref.model.layers[0]
    seen = {}
    for tag, model, module in (("sharded", sharded, layer), ("ref", ref, ref_layer)):
        hook = module.register_forward_pre_hook(lambda m, a, k, tag=tag: seen.update({tag: (a, k)}),
                                                with_kwargs=True)
        with torch.no_grad():   # each model's own layer arguments (its attention's mask form)
            model(**zoo.make_inputs(NAME), use_cache=False)
        hook.remove()
    (hidden,), kwargs = seen["sharded"]
    ref_kwargs = seen["ref"][1]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x, x_ref = hidden.detach().clone().requires_grad_(), hidden.detach().clone().requires_grad_()
    out, exp = compiled(x, **kwargs), ref_layer(x_ref, **ref_kwargs)
    out, exp = (o[0] if isinstance(o, tuple) else o for o in (out, exp))
    tol = TOL[torch.float32]
    assert_close("compiled decoder layer output", out, exp, tol)
    probe = torch.randn(exp.shape, generator=torch.Generator().manual_seed(5))
    (out * probe).sum().backward()
    (exp * probe).sum().backward()
    assert_close("compiled decoder layer input grad", x.grad, x_ref.grad, tol)
    compare_grads(layer, ref_layer, "compiled decoder layer", tol)
    return {"graphs": counter.frame_count}


def _collectives(x, group):
    """Every collective of shardformer.distributed on x ([p * 3, 5] on p ranks)."""
    from shardformer import distributed as D

    p, r = D.world_size(group), D.rank(group)
    summed = D.all_reduce(x.clone(), group)
    top = D.all_reduce(x * (r + 1), group, op="max")
    gathered = x.new_empty((p * x.shape[0],) + tuple(x.shape[1:]))
    D.all_gather_into_tensor(gathered, x, group)
    scattered = x.new_empty((x.shape[0] // p,) + tuple(x.shape[1:]))
    D.reduce_scatter_tensor(scattered, x, group)
    swapped = torch.empty_like(x)
    D.all_to_all_single(swapped, x, group)
    return summed, top, gathered, scattered, swapped


def collectives_fullgraph(ctx, default_group: bool = False) -> dict:
    """shardformer.distributed's collectives called in a function compiled with
    fullgraph=True (dynamo traces them as custom ops over the same
    communicator) give exactly the eager results."""
    torch._dynamo.reset()
    group = None if default_group else ctx.group
    x = torch.arange(ctx.tp_size * 3 * 5, dtype=torch.float32).reshape(-1, 5) * (ctx.rank + 1) / 7
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(_collectives, backend=counter, fullgraph=True)(x, group)
    for what, a, b in zip(("all_reduce", "all_reduce max", "all_gather", "reduce_scatter", "all_to_all"),
                          got, _collectives(x, group)):
        if not torch.equal(a, b):
            raise AssertionError(f"compiled {what} differs from eager: {a} vs {b}")
    return {"graphs": counter.frame_count}


BUCKET_BYTES = 16 * 1024  # DDP buckets of the DP x TP check: several per rank on the tiny Llama


def dp_tp_ddp(ctx, optimize_ddp: bool) -> dict:
    """DP=2 x TP=2 on the 4 ranks (shardformer.mesh): the TP-sharded model in
    DDP over mesh.dp (shardformer.data_parallel), then torch.compile.  Each
    DP replica runs its own 2 rows of a 4-row global batch (both TP ranks of
    a replica the same rows); the DP-averaged loss and every gradient after
    DDP's all-reduce (the mean over the replicas) equal the unsharded
    model's on the global batch, at each of 2 SGD steps.  optimize_ddp:
    torch._dynamo.config.optimize_ddp (True: dynamo's DDPOptimizer splits
    the graph at DDP's bucket boundaries, so each bucket's all-reduce can
    start in backward while the earlier graphs' backward runs; False: one
    graph, the all-reduces after the whole backward).  Returns the graphs
    made, and the graph breaks dynamo reported (real breaks; DDPOptimizer's
    splits are inside one frame's graph and are not breaks)."""
    import torch.distributed as dist

    from shardformer import data_parallel, mesh

    from checks.hybrid import _split_rows
    from checks.pipeline import batch_of

    torch._dynamo.reset()
    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = zoo.build(NAME)
    model.train()
    ref = copy.deepcopy(model)
    sharded, _ = ShardFormer(shard_config=m.shard_config()).optimize(model)
    # small buckets: several all-reduces per backward (the tiny model would fit one 25 MB bucket)
    ddp = data_parallel(sharded, m, bucket_cap_mb=BUCKET_BYTES / 2 ** 20)
    counter = CompileCounterWithBackend("aot_eager")
    breaks_before = _graph_breaks()
    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        compiled = torch.compile(ddp, backend=counter)
        batch = batch_of(NAME, 4)
        mine = _split_rows(batch, 2, m.coords["dp"])
        tol = TOL[torch.float32]
        graphs = []
        for step in range(2):
            loss = compiled(**mine).loss
            loss.backward()
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=m.dp)
            assert_close(f"DP x TP compiled step {step} loss", total / 2, ref_loss.detach(), tol)
            compare_grads(sharded, ref, f"DP x TP compiled step {step}", tol)
            _sgd(sharded, ref)
            graphs.append(counter.frame_count)
    finally:
        torch._dynamo.config.optimize_ddp = saved
    if graphs[-1] != graphs[0]:
        raise AssertionError(f"the compiled DDP model recompiled after its first step: {graphs} graphs")
    return {"graphs": graphs[0], "breaks": _graph_breaks() - breaks_before}


def _graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def sequence_parallel_refused(ctx, mode: str, default_group: bool = False) -> dict:
    """Sequence parallelism (`mode`) under torch.compile: the compiled model's
    forward raises naming the model, the mode and the fix (docs/compile.md),
    on every rank, under the default torch.compile settings; the same model
    eagerly still equals the unsharded model."""
    torch._dynamo.reset()
    config = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": mode,
              "enable_tensor_parallelism": mode == "split_gather"}
    sharded, ref = _pair(ctx, default_group, config)
    inputs = zoo.make_inputs(NAME)
    compiled = torch.compile(sharded, backend="aot_eager")
    try:
        compiled(**inputs)
    except Exception as e:  # dynamo wraps it (TorchRuntimeError); the message is ours
        message = str(e)
    else:
        raise AssertionError(f"sequence parallelism ({mode}) ran under torch.compile without an error")
    missing = [w for w in (NAME, f"sequence parallelism ({mode!r})", "torch.compile", "eagerly",
                           "enable_sequence_parallelism=False", "docs/compile.md") if w not in message]
    assert not missing, f"the refusal does not name {missing}: {message}"
    torch._dynamo.reset()
    tol = TOL[torch.float32]
    out, exp = sharded(**inputs), ref(**inputs)
    check_outputs(f"eager {mode} after the refusal", out, exp, tol)
    out.loss.backward()
    exp.loss.backward()
    compare_grads(sharded, ref, f"eager {mode}", tol)
    return {"message": message.splitlines()[0] if message else message}


def dp_tp_ddp_optimizer_refused(ctx) -> dict:
    """DP=2 x TP=2 in DDP over mesh.dp, torch.compile'd with torch's default
    torch._dynamo.config.optimize_ddp=True (the DDPOptimizer, which gave a
    wrong embedding gradient: dp_tp_ddp): the compile stops with an error
    naming the model, the setting and the fix, on every rank; nothing runs."""
    from shardformer import data_parallel, mesh

    torch._dynamo.reset()
    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    sharded, _ = ShardFormer(shard_config=m.shard_config()).optimize(zoo.build(NAME))
    ddp = data_parallel(sharded, m)      # torch's default buckets (tiny ones: DDPOptimizer's own assertion first)
    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = True
    try:
        torch.compile(ddp, backend="aot_eager")(**zoo.make_inputs(NAME))
    except Exception as e:  # dynamo wraps it (TorchRuntimeError); the message is ours
        message = str(e)
    else:
        raise AssertionError("DDP with the DDPOptimizer ran under torch.compile without an error")
    finally:
        torch._dynamo.config.optimize_ddp = saved
    missing = [w for w in (NAME, "optimize_ddp", "= False", "DistributedDataParallel", "docs/compile.md")
               if w not in message]
    if missing:
        raise AssertionError(f"the refusal does not name {missing}: {message[:1500]}")
    return {"message": message[:200]}
