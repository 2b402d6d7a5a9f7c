"""clip_grad_norm_: the gradient norm of the whole (unsharded) model, from the shards.

For a p-norm the unsharded model's norm is

    ||g||_p^p = sum over parameters P, over the full rows i of P's split
                dimension, of |g_P[i]|^p

Each rank holds some of those rows.  A row may be on one rank (a split
dimension), on several (KV heads replicated for GQA, padding excluded), or
on every rank of the tensor-parallel group (a parameter that is not split:
norms, biases of row-parallel layers).  Each rank adds its rows weighted by
1 / (number of ranks holding that row), sums over the TP group (one
all-reduce per process group), then over the pipeline group (stages hold
different layers; a parameter tied between the first and last stage counts
on the first only).  Data-parallel replicas hold the same gradients once
DDP (or the user) has averaged them, so nothing is summed over DP, except
for expert-parallel parameters (shardformer.layer.expert_parallel): each
EP rank holds other experts, so their sum (already summed over TP) is
summed over the EP group too, once.  p = inf takes maxima instead of sums.

The ranks of a tensor-parallel group must hold gradients for the same
parameters (checked first, one small all-gather per group: a gradient
missing on some ranks only is refused, naming the parameters and ranks);
every reduction above runs whatever the gradients, so no rank waits on a
reduction another skipped.

Every rank gets the same norm and scales its gradients by
min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ does.
Call it after the backward (and after DDP's gradient all-reduce), before the
optimizer step.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import ddp_guard
from .checkpoint.full import shard_info
from .distributed import collectives as C
from .distributed.agree import members
from .layer.expert_parallel import EXPERT_GROUP_ATTR, is_expert_param
from .parallel_mesh import Mesh
from .pipeline.stages import runtime_of

_WEIGHTS: dict = {}


def _row_weights(shard, device) -> torch.Tensor:
    """1 / multiplicity of each local row of a DimShard (0 for padding rows)."""
    key = (shard, device)
    w = _WEIGHTS.get(key)
    if w is None:
        counts = torch.zeros(shard.full, dtype=torch.float64)
        for ranges in shard.all_ranges:
            for start, n in ranges:
                counts[start:start + n] += 1
        parts = [1.0 / counts[start:start + n] for start, n in shard.ranges]
        parts.append(torch.zeros(shard.length - shard.real, dtype=torch.float64))
        w = torch.cat(parts).to(device)
        _WEIGHTS[key] = w
    return w


def _group_key(group):
    return id(group)


def _check_same_gradients(named: list, groups, device) -> None:
    """The ranks of each tensor-parallel group hold the same parameters, so
    they must hold gradients for the same ones: a gradient on one rank only
    would count a replicated parameter on some ranks and not others (each
    rank clipping by another norm) or leave a shard out of the sum.  torch
    treats a None gradient as absent; here it is a bug in the training loop,
    so it is refused on every rank, naming the parameters and the ranks.
    One all-gather of (parameters, gradients, checksum of which) per group:
    3 int64."""
    have = torch.tensor([t.grad is not None for _, t in named], dtype=torch.int64, device=device)
    weights = torch.arange(have.numel(), dtype=torch.int64, device=device) * 2 + 1
    mine = torch.stack([torch.tensor(have.numel(), device=device), have.sum(), (have * weights).sum()])
    for group in groups:
        size = C.world_size(group)
        if size < 2:
            continue
        every = torch.empty(3 * size, dtype=torch.int64, device=device)
        C.all_gather_into_tensor(every, mine, group)
        rows = every.view(size, 3).tolist()
        if all(row == rows[0] for row in rows):
            continue
        ranks = members(group)
        counts = ", ".join(f"rank {ranks[q]}: {row[1]} of {row[0]}" for q, row in enumerate(rows))
        detail = ""
        if all(row[0] == rows[0][0] for row in rows):    # the same parameters: every rank can show which
            table = torch.empty(have.numel() * size, dtype=torch.int64, device=device)
            C.all_gather_into_tensor(table, have, group)
            table = table.view(size, -1)
            odd = [i for i in range(have.numel()) if 0 < int(table[:, i].sum()) < size][:8]
            detail = "; " + "; ".join(
                f"{named[i][0]} has one on ranks {[ranks[q] for q in range(size) if table[q, i]]}, none on "
                f"{[ranks[q] for q in range(size) if not table[q, i]]}" for i in odd)
        raise RuntimeError(
            f"clip_grad_norm_: the ranks of the group of global ranks {ranks} hold gradients for different "
            f"parameters (parameters with a gradient: {counts}){detail}; every rank of a tensor-parallel group must "
            f"run the same backward (a gradient left None, or set to None, on some ranks only)")


def whole_parameters(model: nn.Module) -> list:
    """(name, parameter) of the parameters this rank holds whole: not split
    over a tensor-parallel group and not an expert's (the ones the norm
    counts once; shardformer.replica_drift checks that the ranks' copies stay
    equal)."""
    split = shard_info(model)
    return [(n, t) for n, t in model.named_parameters() if id(t) not in split and not is_expert_param(t)]


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The unsharded model's gradient norm (see the module doc), on every rank;
    a float64 scalar on the gradients' device."""
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}")
    inf = math.isinf(p)
    info = shard_info(model)
    runtime = runtime_of(model)
    skip = set()
    if runtime is not None:           # tied or replicated across stages: counted on the lowest holder only
        skip = runtime.counted_elsewhere()
    named = [(n, t) for n, t in model.named_parameters() if id(t) not in skip]
    params = [t for _, t in named if t.grad is not None]
    device = params[0].grad.device if params else next(model.parameters()).device
    _check_same_gradients(named, {id(g): g for _, _, g in info.values()}.values(), device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    replicated = zero.clone()
    per_group: dict = {}              # ids of the groups -> [groups to reduce over in turn, accumulated]
    for _, t in named:                # an entry per group whatever the gradients: the reductions every rank runs
        if id(t) in info:
            groups = (info[id(t)][2],) + ((getattr(t, EXPERT_GROUP_ATTR),) if is_expert_param(t) else ())
            per_group.setdefault(tuple(map(_group_key, groups)), [groups, zero.clone()])
    for t in params:
        g = t.grad.detach()
        a = g.abs().double()
        if id(t) in info:
            dim, shard, group = info[id(t)]
            rows = a.movedim(dim, 0).reshape(a.shape[dim], -1)
            rows = rows.max(dim=1).values if inf else rows.pow(p).sum(dim=1)
            w = _row_weights(shard, device)
            if rows.shape[0] != w.shape[0]:
                raise ValueError(f"clip_grad_norm_: a gradient of shape {tuple(g.shape)} does not match its shard "
                                 f"({shard.length} rows along dimension {dim})")
            part = (rows * (w > 0)).max() if inf else (rows * w).sum()
            groups = (group,) + ((getattr(t, EXPERT_GROUP_ATTR),) if is_expert_param(t) else ())
            entry = per_group[tuple(map(_group_key, groups))]
            entry[1] = torch.maximum(entry[1], part) if inf else entry[1] + part
        else:
            part = a.max() if inf else a.pow(p).sum()
            replicated = torch.maximum(replicated, part) if inf else replicated + part
    total = replicated
    for groups, value in per_group.values():
        for group in groups:
            C.all_reduce(value, group, op="max" if inf else "sum")
        total = torch.maximum(total, value) if inf else total + value
    if runtime is not None and runtime.manager.num_stages > 1:
        C.all_reduce(total, runtime.manager.group, op="max" if inf else "sum")
    return total if inf else total.pow(1.0 / p)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of a sharded (or plain) model so that the unsharded
    model's gradient norm is at most `max_norm`; returns that norm (before
    clipping), the same on every rank.  torch.nn.utils.clip_grad_norm_'s
    contract, over the whole model rather than this rank's shards."""
    norm = grad_norm(model, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({float(norm)}); pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for t in model.parameters():
        if t.grad is not None:
            t.grad.detach().mul_(coef.to(t.grad.dtype))
    return norm.float()


def _data_parallel_groups(model: nn.Module, group) -> tuple:
    """(DP group, expert_dp group or None) from a Mesh or a process group.
    A plain group is enough when the model has no expert-parallel parameters
    or its EP group spans the whole DP group; else the Mesh is needed."""
    if isinstance(group, Mesh):
        if group.expert_dp is not None:
            return group.dp, group.expert_dp
        group = group.dp              # a mesh without ep: the experts' EP group must span its DP group
    ep = {id(g): g for g in (getattr(t, EXPERT_GROUP_ATTR) for t in model.parameters() if is_expert_param(t))}
    for g in ep.values():
        if C.world_size(g) != C.world_size(group):
            raise ValueError(f"{type(model).__name__}: its experts are split over an expert-parallel group of "
                             f"{C.world_size(g)} ranks, not the whole {C.world_size(group)}-rank data-parallel "
                             "group given: pass the shardformer.mesh(..., ep=) that made it (its .expert_dp sums "
                             "the experts' gradients)")
    return group, None


def _average_expert_grad(grad: torch.Tensor, expert_dp, dp_size: int) -> torch.Tensor:
    """An expert parameter's gradient (already summed over its EP group by the
    dispatch exchange's backward) summed over `expert_dp` and divided by the
    DP size: the unsharded model's gradient of the DP-averaged loss."""
    grad = grad.clone()
    if expert_dp is not None and C.world_size(expert_dp) > 1:
        C.all_reduce(grad, expert_dp)
    return grad.div_(dp_size)


def data_parallel(model: nn.Module, mesh, **ddp_kwargs):
    """torch's DistributedDataParallel over `mesh.dp` for a sharded model,
    with expert-parallel parameters left out of DDP's all-reduce (they differ
    between the EP ranks): a gradient hook on each of them sums it over
    `mesh.expert_dp` and divides by the DP size (see
    shardformer.layer.expert_parallel), so every gradient equals the
    unsharded model's on the concatenated batch.  The hooks run on every
    backward, under DDP's no_sync() too (accumulating is still right).
    ddp_kwargs go to DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel

    dp_group, expert_dp = _data_parallel_groups(model, mesh)
    size = C.world_size(dp_group)
    experts = [(name, t) for name, t in model.named_parameters() if is_expert_param(t)]
    if experts:
        ddp_guard.set_ignored(model, [n for n, _ in experts])
        for _, t in experts:
            if not getattr(t, "_shardformer_dp_hooked", False):
                t.register_hook(lambda g: _average_expert_grad(g, expert_dp, size))
                t._shardformer_dp_hooked = True
    return DistributedDataParallel(model, process_group=dp_group, **ddp_kwargs)


def average_gradients(model: nn.Module, group) -> None:
    """Average every parameter's .grad over `group` (data parallelism for a
    model DistributedDataParallel cannot wrap, e.g. a pipelined model driven
    by a schedule: call it after forward_backward_step, before clipping and
    stepping).  The gradients are flattened per dtype and device into one
    buffer each, so it costs one all-reduce per buffer; every rank of the
    group must hold the same parameters (the same stage and TP shard).
    `group` may be a shardformer.mesh(): its .dp; expert-parallel parameters
    are then summed over .expert_dp and divided by the DP size instead (as
    data_parallel does); a plain group does for them when the EP group is
    the whole DP group."""
    group, expert_dp = _data_parallel_groups(model, group)
    size = C.world_size(group)
    if size == 1:
        return
    buckets: dict = {}
    for t in model.parameters():
        if t.grad is not None and is_expert_param(t):
            t.grad = _average_expert_grad(t.grad, expert_dp, size)
        elif t.grad is not None:
            buckets.setdefault((t.grad.dtype, t.grad.device), []).append(t.grad)
    for (_dtype, _device), grads in sorted(buckets.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([g.reshape(-1) for g in grads])
        C.all_reduce(flat, group)
        flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
