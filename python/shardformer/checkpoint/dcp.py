"""State dicts that torch.distributed.checkpoint (DCP) saves and reshards.

get_state_dict(model, optimizer=None) -> (model_state_dict, optim_state_dict)
set_state_dict(model, optimizer=None, *, model_state_dict, optim_state_dict)

The signatures and meaning of torch.distributed.checkpoint.state_dict's:
the dicts are handed to dcp.save / dcp.load (which load in place), and
set_state_dict puts loaded values into the model and optimizer.  The
optimizer dict has torch's layout: {"state": {fqn: {name: value}},
"param_groups": [{hyperparameters..., "params": [fqn, ...]}]}.  Every
layout gives the keys of the unsharded model: tensor parallelism (TP), its
data-parallel replicas, pipeline stages (PP), expert parallelism (EP),
sequence parallelism (which changes no parameter) and ZeRO-1, so a
checkpoint saved at one layout loads at any other.

Placement.  A tensor split along dimension d over N ranks is a PlacedShard:
a tensor of the full (HuggingFace) shape F whose only data on this rank are
its pieces.  Rank r holds the ranges (o_1, n_1), (o_2, n_2), ... of d's
full length (DimShard.ranges: several for fused projections, [q | k | v],
uneven when heads or features do not divide, followed by zero rows of
vocabulary padding), laid back to back in its local tensor L.  Piece j is
the block of the full tensor at offset o_j along d (0 elsewhere) of size
n_j along d (F elsewhere), and its data are L.narrow(d, p_j, n_j) with
p_j = n_1 + ... + n_(j-1).  A tensor split along several dimensions (an
expert-parallel layer's [E, 2I, H] experts: E over the EP group, 2I over
TP) has as pieces the products of each dimension's pieces: the box at the
offsets (o_j along d, o'_k along d') of sizes (n_j, n'_k), data
L.narrow(d, p_j, n_j).narrow(d', p'_k, n'_k).  These are exactly DCP's
chunks (ChunkStorageMetadata offsets/sizes), so the tensor answers DCP's
hooks itself: __create_write_items__ (the pieces to write),
__create_chunk_list__ (the pieces to read) and __get_tensor_shard__ (a
piece's data).  DTensor's Shard(d) cannot say this: it cuts d into
ceil(F_d / N) blocks, one per rank, which is neither our uneven head
splits, nor several ranges per rank, nor the padding.

Written once.  An index held by several ranks (a KV head replicated on the
ranks that split its query heads) is written by the lowest of them only:
along each split dimension rank r writes its ranges minus the union of
ranks 0..r-1's, so the written pieces tile the full tensor exactly once
(padding is never written; the groups of different dimensions are
independent mesh axes, so the products tile it too).  Replicated tensors
(norms, unsplit biases, `step`) are plain tensors, and DCP's own
de-duplication writes one copy; so do the copies of every data-parallel
replica, of expert-data-parallel replicas and of a module several pipeline
stages hold.

Pipeline stages.  A stage holds its layers under their global indices
(pipeline/stages.py), so its keys are already the unsharded model's; each
stage writes its own.  A Parameter tied across stages (input embeddings
and LM head) is one Parameter per holding stage: each stage's model dict
gives it under its own name (both names are in the unsharded state
dict), and its optimizer state is keyed by the unsharded model's name of
it (the first, as torch's get_state_dict does).  The optimizer's
param_groups list, for each group, the parameters of every stage (one
all-gather of names over the pipeline group), so the dict DCP writes once
names them all.

ZeRO-1 (torch's ZeroRedundancyOptimizer over the data-parallel group).
Each rank's partition of the optimizer (`.optim`) holds the states of its
own parameters only: the optimizer dict has those, keyed by their fqns
and placed as their parameters, and param_groups name every parameter
(ZeRO's own groups).  DCP writes each state from the rank that owns it;
a load gives every rank the states of its partition, whatever layout or
partition wrote them.

Loading.  dcp.load reads into each piece the overlap of the saved chunks
with it, whatever layout wrote them: another TP size, other stages, other
expert blocks, or an unsharded model (a plain model.state_dict() saved with
dcp.save, a single chunk).  The pieces are views of the model's parameters
and of the optimizer's states, so dcp.load fills them in place;
set_state_dict then checks and puts what is not already there
(hyperparameters, values from another dict).  A checkpoint of this kind
loads into a plain unsharded model with DCP alone (dcp.load of
model.state_dict(), or dcp_to_torch_save).

Optimizer states follow their parameter: a state of the parameter's shape
(AdamW's exp_avg, exp_avg_sq; SGD's momentum) has its placement; scalars
(`step`) are replicated.  As in torch, an optimizer without state gets it
created (one step at learning rate 0 with zero gradients; the weights do
not change) so that dcp.load has tensors to load into.

Collectives: none for TP, EP and plain optimizers; the pipeline group's
all-gather of parameter names (a pipelined model with an optimizer); for
ZeRO-1, one all-reduce over its group deciding whether to create states
(and then its step's broadcasts).  Every rank of those groups calls
get_state_dict together.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import nn

from ..layer.expert_parallel import expert_shards
from ..layer.parallel_module import shard_of
from ..pipeline.stages import runtime_of
from .full import check_tensor, expert_blocks, named_tensors, shard_info, load_full_state_dict

__all__ = ["PlacedShard", "get_state_dict", "set_state_dict"]


def held_pieces(shard) -> list[tuple[int, int, int]]:
    """This rank's ranges of the split dimension: [(offset in full, length, position in local)]."""
    out, pos = [], 0
    for off, n in shard.ranges:
        if n > 0:
            out.append((off, n, pos))
        pos += n
    return out


def first_held(shard) -> list[tuple[int, int, int]]:
    """The parts of this rank's pieces that no lower rank holds (what it writes)."""
    lower = sorted((off, off + n) for ranges in shard.all_ranges[:shard.rank] for off, n in ranges if n > 0)
    out = []
    for off, n, pos in held_pieces(shard):
        start, end = off, off + n
        for lo, hi in lower:
            if hi <= start or lo >= end:
                continue
            if lo > start:
                out.append((start, lo - start, pos + start - off))
            start = max(start, hi)
            if start >= end:
                break
        if start < end:
            out.append((start, end - start, pos + start - off))
    return out


def placements_of(model: nn.Module) -> dict[int, list[tuple[int, object]]]:
    """id(tensor) -> [(dim, DimShard), ...]: the dimensions every split
    tensor of the model is split along, over more than one rank or padded
    (an expert-parallel parameter's experts, dim 0 over its EP group, then
    its TP dimension; a vocabulary padded at TP=1).  Whole tensors are absent."""
    out: dict[int, list] = {}
    for key, (shard, _) in expert_shards(model).items():
        if _placed_dim(shard):
            out[key] = [(0, shard)]
    for key, (dim, shard, _) in shard_info(model).items():
        if _placed_dim(shard):
            out.setdefault(key, []).append((dim, shard))
    return out


def _placed_dim(shard) -> bool:
    """Whether a dimension needs placing: split over several ranks, or padded."""
    return shard.tp_size > 1 or shard.length != shard.full


def unsharded_shape(t: torch.Tensor, splits) -> list[int]:
    """The unsharded shape of the local tensor `t` split along `splits`."""
    shape = list(t.shape)
    for dim, shard in splits or ():
        shape[dim] = shard.full
    return shape


class PlacedShard(torch.Tensor):
    """A tensor of the full shape of which this rank holds the pieces of
    `local` (see the module doc): what get_state_dict returns for a split
    tensor, split along `dim` (DimShard `shard`) and, for tensors split
    along several dimensions, the further (dim, DimShard) pairs of `also`.
    Only DCP uses it as a tensor: it has the full size, dtype and device;
    to_local() is this rank's shard; any other operation raises."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, dim: int, shard, key: str, also=()):
        splits = [(dim, shard), *also]
        shape = unsharded_shape(local, splits)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                requires_grad=False)
        t._local, t._splits, t._key = local, splits, key
        t._dim, t._shard = dim, shard
        return t

    def __init__(self, local, dim, shard, key, also=()):
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"PlacedShard (a state-dict value for torch.distributed.checkpoint) does not "
                        f"support {func}: use .to_local() for this rank's shard")

    def to_local(self) -> torch.Tensor:
        return self._local

    @property
    def placement(self) -> tuple[int, object]:
        """(split dimension, DimShard) of the first split dimension."""
        return self._dim, self._shard

    @property
    def placements(self) -> list[tuple[int, object]]:
        """[(split dimension, DimShard), ...]: every split dimension."""
        return list(self._splits)

    def __repr__(self):
        where = ", ".join(f"dim {d} ranges {list(s.ranges)} of rank {s.rank}/{s.tp_size}" for d, s in self._splits)
        return f"PlacedShard({self._key}: shape {tuple(self.shape)}, {where})"

    def _chunks(self, which):
        """[(ChunkStorageMetadata, local data)] of the products of each split
        dimension's pieces (`which`: held_pieces, or first_held to write)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        out = []
        for combo in itertools.product(*(which(shard) for _, shard in self._splits)):
            offsets = [0] * self._local.dim()
            sizes = list(self._local.shape)
            data = self._local
            for (dim, _), (off, n, pos) in zip(self._splits, combo):
                offsets[dim], sizes[dim] = off, n
                data = data.narrow(dim, pos, n)
            out.append((ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)), data))
        return out

    # DCP's hooks (torch.distributed.checkpoint.planner_helpers / utils)
    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk, _ in self._chunks(first_held)]

    def __create_chunk_list__(self):
        return [chunk for chunk, _ in self._chunks(held_pieces)]

    def __get_tensor_shard__(self, index):
        for chunk, data in self._chunks(held_pieces):
            if chunk.offsets == index.offset:
                return data
        raise ValueError(f"{self._key}: this rank ({self!r}) holds no piece at offset {list(index.offset)} "
                         f"(its pieces: {[list(c.offsets) for c, _ in self._chunks(held_pieces)]})")


def _placed(t: torch.Tensor, splits, key: str):
    """`t` (detached) as a state-dict value: placed when split over several ranks."""
    t = t.detach()
    if not splits:
        return t
    (dim, shard), *also = splits
    return PlacedShard(t, dim, shard, key, also)


def _pipeline(model: nn.Module):
    """The model's StageRuntime when it is split into several pipeline stages, else None."""
    stages = runtime_of(model)
    return stages if stages is not None and stages.manager.num_stages > 1 else None


def _zero_group(optimizer):
    """(the local optimizer holding this rank's states, ZeRO's process group), or (optimizer, None)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim, optimizer.process_group
    return optimizer, None


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the unsharded model (torch's fqn: a tied
    parameter's first name; a pipeline stage's copy of a Parameter tied
    across stages gets the name the unsharded model gives it)."""
    names = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    stages = _pipeline(model)
    if stages is not None:
        order = {k: i for i, k in enumerate(stages.plan.names)}
        for tied in stages.plan.shared:
            first = min(tied, key=lambda k: order.get(k, len(order)))
            for name in tied:
                try:
                    p = model.get_parameter(name)
                except AttributeError:       # held by another stage
                    continue
                names[id(p)] = first
    return names


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state: one step with zero gradients at
    learning rate 0 (parameters unchanged: AdamW multiplies them by
    1 - 0 * weight_decay and adds 0 * update), gradients and rates restored."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    rates = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g, lr in zip(optimizer.param_groups, rates):
            if isinstance(lr, torch.Tensor):
                g["lr"] = torch.zeros_like(lr)
            elif lr is not None:
                g["lr"] = 0.0
        optimizer.step()
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, rates):
            if lr is not None:
                g["lr"] = lr


def _needs_state(optimizer) -> bool:
    """Whether the optimizer has no state yet; for ZeRO-1 the ranks of its
    group decide together (a rank owning no parameter has none ever), since
    its step is collective."""
    local, group = _zero_group(optimizer)
    if group is None and local is optimizer:
        return not optimizer.state
    import torch.distributed as dist

    flag = torch.tensor([1 if any(p in local.state for g in local.param_groups for p in g["params"]) else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag) == 0


def _group_hyper(group: Mapping) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _all_group_names(model: nn.Module, optimizer, names: dict[int, str], what: str) -> list[list[str]]:
    """For each parameter group of the optimizer (ZeRO-1: its own groups, which
    hold every parameter), the fqns of its parameters; for a pipelined model
    those of every stage, in stage order (the stages agree on the groups'
    count and hyperparameters, or every rank raises naming the stages)."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            fqn = names.get(id(p))
            if fqn is None:
                raise ValueError(f"{what}: parameter group {i} of {type(optimizer).__name__} holds a "
                                 f"parameter of shape {tuple(p.shape)} that is not in {type(model).__name__}")
            fqns.append(fqn)
        out.append(fqns)
    stages = _pipeline(model)
    if stages is None:
        return out
    import torch.distributed as dist

    mine = {"names": out, "hyper": [repr(sorted(_group_hyper(g).items())) for g in optimizer.param_groups]}
    every = [None] * stages.manager.num_stages
    dist.all_gather_object(every, mine, group=stages.manager.group)
    if any(e["hyper"] != every[0]["hyper"] for e in every):
        raise ValueError(f"{what}({type(model).__name__}): the pipeline stages' {type(optimizer).__name__}s "
                         f"differ in their parameter groups (count or hyperparameters): " + "; ".join(
                             f"stage {s}: {e['hyper']}" for s, e in enumerate(every)))
    merged = []
    for i in range(len(out)):
        seen: dict[str, None] = {}
        for e in every:
            seen.update(dict.fromkeys(e["names"][i]))
        merged.append(list(seen))
    return merged


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """(model_state_dict, optim_state_dict) of a sharded model for dcp.save /
    dcp.load: split tensors are PlacedShards (views of this rank's data),
    the others plain detached tensors; keys as in the unsharded model's
    state_dict() and torch's optimizer state dict (module doc).
    optim_state_dict is {} without an optimizer.  Collectives: see the
    module doc (none for a TP model with a plain optimizer)."""
    placements = placements_of(model)
    tensors = dict(named_tensors(model))
    model_sd = {}
    for key, value in model.state_dict().items():
        t = tensors.get(key)
        model_sd[key] = value if t is None else _placed(t, placements.get(id(t)), key)
    if optimizer is None:
        return model_sd, {}
    names = _param_names(model)
    if _needs_state(optimizer):
        _create_optimizer_state(optimizer)
    group_names = _all_group_names(model, optimizer, names, "get_state_dict")
    local, _ = _zero_group(optimizer)
    state = {}
    for group in local.param_groups:
        for p in group["params"]:
            if p in local.state:
                fqn = names[id(p)]
                state[fqn] = {k: _state_value(v, p, placements.get(id(p)), f"{fqn}.{k}", optimizer)
                              for k, v in local.state[p].items()}
    groups = [{**_group_hyper(g), "params": fqns} for g, fqns in zip(optimizer.param_groups, group_names)]
    return model_sd, {"state": state, "param_groups": groups}


def gradient_state_dict(model: nn.Module, saved: set | None = None) -> dict:
    """The gradients of a sharded model as a state dict for dcp.save /
    dcp.load, keyed and placed as get_state_dict keys and places their
    parameters (a split gradient is a PlacedShard of this rank's rows).
    saved=None: the parameters holding a gradient, views of it (to save);
    else the keys in `saved`, as fresh zero tensors for dcp.load to fill
    (set_gradients then hands them to the parameters)."""
    placements = placements_of(model)
    tensors = dict(named_tensors(model))
    out = {}
    for key in model.state_dict().keys():
        t = tensors.get(key)
        if not isinstance(t, nn.Parameter):
            continue
        if saved is None and t.grad is not None:
            out[key] = _placed(t.grad, placements.get(id(t)), key)
        elif saved is not None and key in saved:
            out[key] = _placed(torch.zeros_like(t), placements.get(id(t)), key)
    return out


def set_gradients(model: nn.Module, gradients: Mapping) -> None:
    """Each parameter's .grad from gradient_state_dict(model, saved) after
    dcp.load (copied into an existing gradient, so DDP's bucket views stay);
    a parameter without an entry is left without a gradient (None)."""
    tensors = dict(named_tensors(model))
    given = {id(tensors[key]): value for key, value in gradients.items()}
    for p in model.parameters():
        value = given.get(id(p))
        if value is None:
            p.grad = None
            continue
        local = value.to_local() if isinstance(value, PlacedShard) else value
        if p.grad is not None and p.grad.shape == local.shape:
            p.grad.copy_(local)
        else:
            p.grad = local.detach().clone()


def _state_value(v, p: torch.Tensor, splits, key: str, optimizer):
    """An optimizer state as a state-dict value: placed as its parameter when
    it has the parameter's shape, plain when the parameter is whole or the
    state is a scalar; anything else has no known placement."""
    if not isinstance(v, torch.Tensor) or not splits or v.dim() == 0:
        return v.detach() if isinstance(v, torch.Tensor) else v
    if v.shape != p.shape:
        raise NotImplementedError(
            f"get_state_dict: {type(optimizer).__name__} state '{key}' has shape {tuple(v.shape)}, not its "
            f"parameter's {tuple(p.shape)} (split along dimensions {[d for d, _ in splits]}): its placement "
            "is unknown")
    return _placed(v, splits, key)


def _layout(splits) -> list:
    return [(d, list(s.ranges), s.length) for d, s in splits or ()]


def _local_value(key: str, value, t: torch.Tensor, splits, problems: list):
    """What goes into the tensor `t` (splits: [(dim, DimShard), ...] or None)
    from `value`: a PlacedShard's local data when its placement is t's, a
    plain tensor's shard when it has the full shape, or the plain tensor
    itself; None (with the reason in `problems`) when it does not fit."""
    if isinstance(value, PlacedShard):
        if _layout(splits) != _layout(value._splits) or value._local.shape != t.shape:
            problems.append(f"{key}: placed as {_layout(value._splits)} (dim, ranges, length), this rank holds "
                            + (f"{_layout(splits)}" if splits else "all of it"))
            return None
        return value._local
    if not isinstance(value, torch.Tensor):
        problems.append(f"{key}: not a tensor ({type(value).__name__})")
        return None
    if splits and list(value.shape) == unsharded_shape(t, splits) and value.shape != t.shape:
        for dim, shard in splits:
            value = shard_of(value, dim, shard)
        return value
    if value.shape != t.shape:
        problems.append(f"{key}: shape {list(value.shape)}, this rank's tensor is {list(t.shape)}")
        return None
    return value


@torch.no_grad()
def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: Mapping, optim_state_dict: Mapping | None = None) -> None:
    """Put the values of (model_state_dict, optim_state_dict) into the model
    and the optimizer: the dicts of get_state_dict after dcp.load, or full
    (unsharded) tensors under the same keys, each rank taking its shard.
    Every key and value is checked first (one ValueError lists all the
    problems, nothing changed); missing and unexpected model keys are
    problems, as in load_state_dict(strict=True)."""
    info = shard_info(model)
    placements = placements_of(model)
    named = list(named_tensors(model))
    tensors = dict(named)
    expected = set(model.state_dict().keys())
    problems: list[str] = []
    placed, full = [], {}
    plain = expert_blocks({k: v for k, v in model_state_dict.items() if not isinstance(v, PlacedShard)},
                           named, expert_shards(model))
    for key, value in model_state_dict.items():
        if key not in expected:
            problems.append(f"{key}: not in {type(model).__name__}'s state dict")
        elif isinstance(value, PlacedShard):
            local = _local_value(key, value, tensors[key], placements.get(id(tensors[key])), problems)
            placed.append((tensors[key], local))
        else:
            t, value = tensors.get(key), plain[key]
            problem = None if t is None else check_tensor(key, value, t, info[id(t)][:2] if id(t) in info else None)
            if problem is None:
                full[key] = value
            else:
                problems.append(problem)
    problems += [f"{key}: missing" for key in sorted(expected - set(model_state_dict))]
    optim = None
    if optimizer is not None and optim_state_dict is not None:
        optim = _native_optim_state(model, optimizer, optim_state_dict, placements, problems)
    if problems:
        raise ValueError(f"set_state_dict({type(model).__name__}): the state dicts do not fit; nothing was "
                         f"loaded:\n  " + "\n  ".join(problems))
    if full:
        load_full_state_dict(model, full, strict=False)   # checks these first too
    for t, local in placed:
        if local.data_ptr() != t.data_ptr():
            t.copy_(local)
    if optim is not None:
        local, _ = _zero_group(optimizer)
        local.load_state_dict(optim)
        if local is not optimizer:         # ZeRO-1: its own groups' hyperparameters (its step copies them down)
            for group, saved in zip(optimizer.param_groups, local.param_groups):
                group.update(_group_hyper(saved))


def _native_optim_state(model, optimizer, osd: Mapping, placements: dict, problems: list) -> dict | None:
    """torch's optimizer.state_dict() form (parameters by index) of `osd`
    (parameters by name) for the optimizer holding this rank's states (ZeRO-1:
    its partition), each state the local value for this rank.  A saved group
    may name more parameters than this rank holds (other pipeline stages,
    other ZeRO partitions), never fewer."""
    names = _param_names(model)
    local, _ = _zero_group(optimizer)
    saved_groups = osd.get("param_groups", [])
    saved_state = osd.get("state", {})
    if len(saved_groups) != len(local.param_groups):
        problems.append(f"optimizer: {len(saved_groups)} parameter groups, {type(optimizer).__name__} has "
                        f"{len(local.param_groups)}")
        return None
    state, groups, index = {}, [], 0
    for i, (group, saved) in enumerate(zip(local.param_groups, saved_groups)):
        fqns = [names.get(id(p)) for p in group["params"]]
        have = set(saved.get("params", []))
        lacking = [f for f in fqns if f not in have]
        if lacking:
            problems.append(f"optimizer: parameter group {i} of the state dict lacks {lacking[:4]} (it holds "
                            f"{list(saved.get('params', []))[:4]}...), which {type(optimizer).__name__}'s holds")
            continue
        ids = []
        for p, fqn in zip(group["params"], fqns):
            if fqn in saved_state:
                splits = placements.get(id(p))
                state[index] = {k: (_local_value(f"{fqn}.{k}", v, p, splits, problems)
                                    if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                for k, v in saved_state[fqn].items()}
            ids.append(index)
            index += 1
        groups.append({**_group_hyper(saved), "params": ids})
    return {"state": state, "param_groups": groups}
