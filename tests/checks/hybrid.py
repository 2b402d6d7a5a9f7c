"""Rank-side checks of hybrid parallelism: shardformer.mesh, data parallelism
(torch's DDP, ZeroRedundancyOptimizer) around sharded models, and
shardformer.clip_grad_norm_ against torch's on the unsharded model.  Every
function runs on all 4 ranks of the pool (new_group is collective)."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import zoo
from checks import parity
from checks import pipeline as pipeline_check
from shardformer import ShardFormer, clip_grad_norm_, mesh
from shardformer.checkpoint import gather_full_state_dict
from shardformer.distributed import backend_for
from shardformer.pipeline import OneForwardOneBackwardSchedule

TOL = (1e-5, 1e-6)
LR = 1e-2


def layout(ctx, dp, pp, tp, sp) -> dict:
    """The groups of mesh() hold the ranks of the documented order, the same
    object comes back for the same sizes, the DeviceMesh agrees."""
    m = mesh(dp=dp, pp=pp, tp=tp, sp=sp)
    assert mesh(dp=dp, pp=pp, tp=tp, sp=sp) is m
    r = ctx.rank
    sizes = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
    coords = {"tp": r % tp, "sp": r // tp % sp, "dp": r // (tp * sp) % dp, "pp": r // (tp * sp * dp)}
    assert m.coords == coords, (m.coords, coords)

    def rank_of(c):
        return ((c["pp"] * dp + c["dp"]) * sp + c["sp"]) * tp + c["tp"]

    for dim in ("tp", "sp", "dp", "pp"):
        group = getattr(m, dim)
        expected = [rank_of(dict(coords, **{dim: i})) for i in range(sizes[dim])]
        assert dist.get_process_group_ranks(group) == expected, (dim, dist.get_process_group_ranks(group), expected)
        assert m.ranks(dim) == expected
    replicas = sorted(rank_of(dict(coords, dp=d, sp=s)) for d in range(dp) for s in range(sp))
    assert dist.get_process_group_ranks(m.replicas) == replicas
    dm = m.device_mesh
    assert dm.mesh_dim_names == ("pp", "dp", "sp", "tp")
    assert dist.get_process_group_ranks(dm.get_group("tp")) == dist.get_process_group_ranks(m.tp)
    return {"coords": m.coords}


def refusals(ctx) -> list:
    out = []
    for kwargs in ({"dp": 3, "tp": 2}, {"tp": 3}, {"tp": 0}, {"dp": 1, "tp": 2}):
        try:
            mesh(**kwargs)
        except ValueError as e:
            out.append(str(e))
        else:
            raise AssertionError(f"mesh({kwargs}) was not refused")
    return out


def _split_rows(batch: dict, parts: int, index: int) -> dict:
    rows = next(iter(batch.values())).shape[0]
    assert rows % parts == 0
    n = rows // parts
    return {k: v[index * n:(index + 1) * n] for k, v in batch.items()}


def dp_tp_training(ctx, name: str = "LlamaForCausalLM", zero: bool = False, clip: float | None = None,
                   steps: int = 3, hosts: bool = False, optimizer: str = "adamw", sp: int = 1) -> dict:
    """DP=2 x TP=2: DDP over mesh.dp around the TP-sharded model, AdamW (or
    ZeRO-1: ZeroRedundancyOptimizer over dp) for `steps` steps on halves of a
    4-row global batch; the losses and the gathered full state dict equal the
    unsharded model trained on the whole batch.  clip: clip_grad_norm_ each
    step, its norm equal to torch's on the unsharded model.  hosts: ranks
    {0,1} and {2,3} pretend to be two hosts (SHARDFORMER_HOST): TP keeps the
    shm backend, DP goes through torch.distributed."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    saved = os.environ.get("SHARDFORMER_HOST")
    if hosts:
        os.environ["SHARDFORMER_HOST"] = f"simulated-host-{ctx.rank // 2}"
    try:
        # hosts: other groups than the earlier meshes' (their backends were chosen on one host)
        m = mesh(dp=2, tp=2 // sp, sp=sp, backend="gloo" if hosts else None)
        torch.manual_seed(0)
        model = zoo.build(name)
        model.train()
        ref = copy.deepcopy(model)
        model, _ = ShardFormer(m.shard_config()).optimize(model)
        backends = {"tp": backend_for(torch.zeros(1), m.tp if sp == 1 else m.sp),
                    "dp": backend_for(torch.zeros(1), m.dp)}
        if hosts:
            assert backends == {"tp": "shm", "dp": "torch"}, backends
        ddp = DistributedDataParallel(model, process_group=m.dp)
        params = list(ddp.parameters())
        kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
        opt = (ZeroRedundancyOptimizer(params, optimizer_class=kind, process_group=m.dp, lr=LR)
               if zero else kind(params, lr=LR))
        ref_opt = kind(ref.parameters(), lr=LR)
        batch = pipeline_check.batch_of(name, 4)
        mine = _split_rows(batch, 2, m.coords["dp"])
        report = {"loss": 0.0, "norm": 0.0, "backends": backends}
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            loss = ddp(**mine).loss
            loss.backward()
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=m.dp)
            report["loss"] = max(report["loss"], parity.assert_close(f"{name} step {step} loss", total / 2,
                                                                     ref_loss.detach(), TOL))
            if clip is not None:
                norm = clip_grad_norm_(model, clip)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                assert float(ref_norm) > clip, "the test's max_norm does not clip"
                report["norm"] = max(report["norm"], parity.assert_close(f"{name} step {step} grad norm",
                                                                         norm, ref_norm, TOL))
            opt.step()
            ref_opt.step()
        if zero:
            state = opt.optim.state
            held = sum(1 for p in params if p in state)
            assert 0 < held < len(params), f"ZeRO-1: this rank holds optimizer state for {held} of {len(params)}"
            report["zero_state_params"] = held
        # SGD: the weights equal the reference's to float32 rounding.  Adam divides by sqrt(v), so
        # gradients that differ by rounding (another summation order: two half-batch means
        # averaged by DDP) move a weight whose gradients nearly cancel over the steps by up to
        # ~1% of lr (measured 1.2e-4 at lr 1e-2, with SGD 1e-7); a wrong gradient moves
        # weights by ~lr.
        tol = (1e-5, 1e-6) if optimizer == "sgd" else (0.0, 0.05 * LR)
        full = gather_full_state_dict(model)
        worst = 0.0
        for key, t in ref.state_dict().items():
            worst = max(worst, parity.assert_close(f"{name} {key} after {steps} steps", full[key], t, tol))
        report["state"] = worst
        return report
    finally:
        if saved is None:
            os.environ.pop("SHARDFORMER_HOST", None)
        else:
            os.environ["SHARDFORMER_HOST"] = saved


def norm_equals_torch(ctx, name: str, norm_type: float) -> dict:
    """clip_grad_norm_ of the model sharded over ctx.group equals torch's on
    the unsharded model, before and after clipping."""
    from shardformer import ShardConfig

    group = ctx.group

    torch.manual_seed(0)
    model = zoo.build(name)
    model.train()
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model)
    inputs = zoo.make_inputs(name)
    parity.loss_of(model(**inputs), {}).backward()
    parity.loss_of(ref(**inputs), {}).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"), norm_type=norm_type)
    max_norm = float(expected) / 3
    got = clip_grad_norm_(model, max_norm, norm_type=norm_type)
    parity.assert_close(f"{name} norm {norm_type}", got, expected, TOL)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
    after = clip_grad_norm_(model, float("inf"), norm_type=norm_type)
    ref_after = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"), norm_type=norm_type)
    parity.assert_close(f"{name} norm {norm_type} after clipping", after, ref_after, TOL)
    return {"norm": float(got), "after": float(after)}


def norm_tp_pp(ctx, name: str, pp: int = 2, tp: int = 2) -> dict:
    """TP=2 x PP=2 (tied embeddings across the first and last stage counted
    once; pp=4: T5's shared embedding held by three stages, counted once):
    clip_grad_norm_ after a 1F1B step equals torch's on the unsharded
    model's full-batch gradients."""
    ref, model, sm, _ = pipeline_check.pipelined(ctx, name, pp, tp)
    batch = pipeline_check.batch_of(name, 4)
    OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward_backward_step(model, batch)
    ref(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    got = clip_grad_norm_(model, float(expected) / 2)
    parity.assert_close(f"{name} TP{tp}xPP{pp} grad norm", got, expected, TOL)
    return {"norm": float(got)}



def autocast_bf16(ctx, name: str) -> dict:
    """Mixed precision with fp32 master weights: the model sharded over
    ctx.group runs under torch.autocast(bfloat16) and its loss and fp32
    gradients match the unsharded model under the same autocast (bf16
    tolerance); the parameters stay float32."""
    from shardformer import ShardConfig
    from shardformer.checkpoint import _shard_info
    from shardformer.layer.parallel_module import shard_of

    torch.manual_seed(0)
    model = zoo.build(name)
    model.train()
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    inputs = zoo.make_inputs(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
        ref_loss = ref(**inputs).loss
    loss.backward()
    ref_loss.backward()
    tol = (3e-2, 1e-2)
    report = {"loss": parity.assert_close(f"{name} autocast loss", loss.float(), ref_loss.float(), tol)}
    info = _shard_info(model)
    refs = dict(ref.named_parameters())
    worst = 0.0
    for pname, p in model.named_parameters():
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32), pname
        if refs[pname].grad is None:
            continue
        expected = refs[pname].grad
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(expected, dim, shard)
        # bf16 matmuls: compare each gradient against its own scale, loosely
        worst = max(worst, parity.assert_close(f"{name} autocast grad of {pname}", p.grad, expected, (1e-1, 1e-3)))
    report["grad"] = worst
    return report


def scaler_skips_together(ctx) -> dict:
    """fp16 loss scaling over shards: an inf in one rank's gradient shard
    makes every rank skip the step (found_inf all-reduced over the world by
    torch's ShardedGradScaler), and the scale drops on every rank."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from shardformer import ShardConfig

    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0, process_group=ctx.group)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(**zoo.make_inputs("LlamaForCausalLM")).loss
    scaler.scale(loss).backward()
    if ctx.rank == 1:                               # an overflow in one shard only
        model.model.layers[0].mlp.down_proj.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not moved, f"rank {ctx.rank} stepped {moved[:3]} although a shard overflowed"
    return {"scale": scaler.get_scale()}


def dp_pp_training(ctx, name: str = "LlamaForCausalLM", steps: int = 3) -> dict:
    """DP=2 x PP=2: each pipeline runs 1F1B on half of a 4-row global batch,
    average_gradients over mesh.dp, clip_grad_norm_, SGD; the losses, norms
    and the gathered full state dict equal the unsharded model's."""
    from shardformer import average_gradients

    m = mesh(dp=2, pp=2, tp=1)
    torch.manual_seed(0)
    model = pipeline_check.build(name, 4)
    model.train()
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(m.shard_config(enable_tensor_parallelism=False)).optimize(model)
    schedule = OneForwardOneBackwardSchedule(_manager(model), num_microbatches=2)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    batch = pipeline_check.batch_of(name, 4)
    mine = _split_rows(batch, 2, m.coords["dp"])
    report = {"loss": 0.0, "norm": 0.0}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = schedule.forward_backward_step(model, mine)["loss"].detach()
        average_gradients(model, m.dp)
        dist.all_reduce(loss, group=m.dp)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        report["loss"] = max(report["loss"], parity.assert_close(f"{name} step {step} loss", loss / 2,
                                                                 ref_loss.detach(), TOL))
        norm = clip_grad_norm_(model, 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        report["norm"] = max(report["norm"], parity.assert_close(f"{name} step {step} norm", norm, ref_norm, TOL))
        opt.step()
        ref_opt.step()
    full = gather_full_state_dict(model)
    for key, t in ref.state_dict().items():
        parity.assert_close(f"{name} {key} after {steps} steps", full[key], t, TOL)
    return report


def _manager(model):
    from shardformer.pipeline.stages import runtime_of

    return runtime_of(model).manager


def fsdp2_dp_tp(ctx, steps: int = 3) -> list:
    """FSDP2 (torch's fully_shard over mesh.device_mesh["dp"]) around the
    TP=2 model: each step's global loss equals the unsharded model's, so the
    gradients it steps with are right too (SGD)."""
    from torch.distributed.fsdp import fully_shard

    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    model.train()
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(m.shard_config()).optimize(model)
    fully_shard(model, mesh=m.device_mesh["dp"])
    batch = pipeline_check.batch_of("LlamaForCausalLM", 4)
    mine = _split_rows(batch, 2, m.coords["dp"])
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    errors = []
    for step in range(steps):
        loss = model(**mine).loss
        loss.backward()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=m.dp)
        errors.append(parity.assert_close(f"FSDP2 step {step} loss", total / 2, ref_loss.detach(), TOL))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return errors


def tp_pp_training(ctx, name: str = "LlamaForCausalLM", steps: int = 3, optimizer: str = "adamw") -> dict:
    """TP=2 x PP=2 (mesh(pp=2, tp=2), 1F1B, 2 micro-batches): `steps` optimizer
    steps with clip_grad_norm_ on a 4-row batch; losses, norms and the
    gathered state dict equal the unsharded model's."""
    m = mesh(pp=2, tp=2)
    torch.manual_seed(0)
    model = pipeline_check.build(name, 4)
    model.train()
    ref = copy.deepcopy(model)
    model, _ = ShardFormer(m.shard_config()).optimize(model)
    schedule = OneForwardOneBackwardSchedule(_manager(model), num_microbatches=2)
    kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt, ref_opt = kind(model.parameters(), lr=LR), kind(ref.parameters(), lr=LR)
    batch = pipeline_check.batch_of(name, 4)
    report = {"loss": 0.0, "norm": 0.0}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = schedule.forward_backward_step(model, batch)["loss"]
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        report["loss"] = max(report["loss"], parity.assert_close(f"{name} step {step} loss", loss,
                                                                 ref_loss.detach(), TOL))
        norm = clip_grad_norm_(model, 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        report["norm"] = max(report["norm"], parity.assert_close(f"{name} step {step} norm", norm, ref_norm, TOL))
        opt.step()
        ref_opt.step()
    tol = (1e-5, 1e-6) if optimizer == "sgd" else (0.0, 0.05 * LR)      # see dp_tp_training
    full = gather_full_state_dict(model)
    worst = 0.0
    for key, t in ref.state_dict().items():
        worst = max(worst, parity.assert_close(f"{name} {key} after {steps} steps", full[key], t, tol))
    report["state"] = worst
    return report
