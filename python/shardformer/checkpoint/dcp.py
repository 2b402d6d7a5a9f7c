"""State dicts that torch.distributed.checkpoint (DCP) saves and reshards.

get_state_dict(model, optimizer=None) -> (model_state_dict, optim_state_dict)
set_state_dict(model, optimizer=None, *, model_state_dict, optim_state_dict)

The signatures and meaning of torch.distributed.checkpoint.state_dict's:
the dicts are handed to dcp.save / dcp.load (which load in place), and
set_state_dict puts loaded values into the model and optimizer.  The
optimizer dict has torch's layout: {"state": {fqn: {name: value}},
"param_groups": [{hyperparameters..., "params": [fqn, ...]}]}.

Placement.  A tensor split along dimension d over N ranks is a PlacedShard:
a tensor of the full (HuggingFace) shape F whose only data on this rank are
its pieces.  Rank r holds the ranges (o_1, n_1), (o_2, n_2), ... of d's
full length (DimShard.ranges: several for fused projections, [q | k | v],
uneven when heads or features do not divide, followed by zero rows of
vocabulary padding), laid back to back in its local tensor L.  Piece j is
the block of the full tensor at offset o_j along d (0 elsewhere) of size
n_j along d (F elsewhere), and its data are L.narrow(d, p_j, n_j) with
p_j = n_1 + ... + n_(j-1).  These are exactly DCP's chunks
(ChunkStorageMetadata offsets/sizes), so the tensor answers DCP's hooks
itself: __create_write_items__ (the pieces to write), __create_chunk_list__
(the pieces to read) and __get_tensor_shard__ (a piece's data).  DTensor's
Shard(d) cannot say this: it cuts d into ceil(F_d / N) blocks, one per rank,
which is neither our uneven head splits, nor several ranges per rank, nor
the padding.

Written once.  An index held by several ranks (a KV head replicated on the
ranks that split its query heads) is written by the lowest of them only:
rank r writes its ranges minus the union of ranks 0..r-1's, so the written
pieces tile the full tensor exactly once (padding is never written).
Replicated tensors (norms, unsplit biases, `step`) are plain tensors, and
DCP's own de-duplication writes one copy; so do the copies of every
data-parallel replica.

Loading.  dcp.load reads into each piece the overlap of the saved chunks
with it, whatever layout wrote them: another TP size, or an unsharded model
(a plain model.state_dict() saved with dcp.save, a single chunk).  The
pieces are views of the model's parameters and of the optimizer's states,
so dcp.load fills them in place; set_state_dict then checks and puts what
is not already there (hyperparameters, values from another dict).  A
checkpoint of this kind loads into a plain unsharded model with DCP alone
(dcp.load of model.state_dict(), or dcp_to_torch_save).

Optimizer states follow their parameter: a state of the parameter's shape
(AdamW's exp_avg, exp_avg_sq; SGD's momentum) has its placement; scalars
(`step`) are replicated.  As in torch, an optimizer without state gets it
created (one step at learning rate 0 with zero gradients; the weights do
not change) so that dcp.load has tensors to load into.

Not covered (refused by name, before anything changes): pipeline stages,
expert parallelism and ZeroRedundancyOptimizer (ZeRO-1).  Sequence parallelism does not change parameters.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..layer.expert_parallel import refuse_expert_parallel
from ..layer.parallel_module import shard_of
from .full import _check_tensor, _named_tensors, _shard_info, load_full_state_dict

__all__ = ["PlacedShard", "get_state_dict", "set_state_dict"]


def _pieces(shard) -> list[tuple[int, int, int]]:
    """This rank's ranges of the split dimension: [(offset in full, length, position in local)]."""
    out, pos = [], 0
    for off, n in shard.ranges:
        if n > 0:
            out.append((off, n, pos))
        pos += n
    return out


def _first_held(shard) -> list[tuple[int, int, int]]:
    """The parts of this rank's pieces that no lower rank holds (what it writes)."""
    lower = sorted((off, off + n) for ranges in shard.all_ranges[:shard.rank] for off, n in ranges if n > 0)
    out = []
    for off, n, pos in _pieces(shard):
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


class PlacedShard(torch.Tensor):
    """A tensor of the full shape of which this rank holds the pieces of
    `local` (see the module doc): what get_state_dict returns for a split
    tensor.  Only DCP uses it as a tensor: it has the full size, dtype and
    device; to_local() is this rank's shard; any other operation raises."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, dim: int, shard, key: str):
        shape = list(local.shape)
        shape[dim] = shard.full
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                requires_grad=False)
        t._local, t._dim, t._shard, t._key = local, dim, shard, key
        return t

    def __init__(self, local, dim, shard, key):
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
        """(split dimension, DimShard)."""
        return self._dim, self._shard

    def __repr__(self):
        return (f"PlacedShard({self._key}: shape {tuple(self.shape)}, dim {self._dim}, "
                f"ranges {list(self._shard.ranges)} of rank {self._shard.rank}/{self._shard.tp_size})")

    def _chunks(self, pieces):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        out = []
        for off, n, pos in pieces:
            offsets = [0] * self._local.dim()
            offsets[self._dim] = off
            sizes = list(self._local.shape)
            sizes[self._dim] = n
            out.append((ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                        self._local.narrow(self._dim, pos, n)))
        return out

    # DCP's hooks (torch.distributed.checkpoint.planner_helpers / utils)
    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk, _ in self._chunks(_first_held(self._shard))]

    def __create_chunk_list__(self):
        return [chunk for chunk, _ in self._chunks(_pieces(self._shard))]

    def __get_tensor_shard__(self, index):
        for chunk, data in self._chunks(_pieces(self._shard)):
            if chunk.offsets == index.offset:
                return data
        raise ValueError(f"{self._key}: rank {self._shard.rank} holds no piece at offset {list(index.offset)} "
                         f"(its pieces: {[list(c.offsets) for c, _ in self._chunks(_pieces(self._shard))]})")


def _whole(split) -> bool:
    """Whether a tensor with this (dim, DimShard) split (None: not split) is
    the full tensor on this rank: not split, or "split" over one rank without
    padding (a vocabulary padded for one rank, e.g. sequence parallelism
    without TP, is not whole: its padding rows are not the model's)."""
    return split is None or (split[1].tp_size <= 1 and split[1].length == split[1].full)


def _placed(t: torch.Tensor, split, key: str):
    """`t` (detached) as a state-dict value: placed unless it is whole (_whole)."""
    t = t.detach()
    if _whole(split):
        return t
    return PlacedShard(t, split[0], split[1], key)


def _refuse_layouts(model: nn.Module, what: str) -> None:
    """NotImplementedError for the layouts these state dicts do not describe yet."""
    from ..pipeline.stages import runtime_of

    stages = runtime_of(model)
    if stages is not None and stages.manager.num_stages > 1:
        raise NotImplementedError(
            f"{type(model).__name__}: {what} does not cover pipeline parallelism yet (the model is split into "
            f"{stages.manager.num_stages} pipeline stages); use checkpoint.save_sharded / load_sharded")
    refuse_expert_parallel(model, what)


def _split_of(info: dict, t: torch.Tensor):
    """(dim, DimShard) of the model's tensor `t`, or None when it is whole."""
    return info[id(t)][:2] if id(t) in info else None


def _refuse_optimizer(optimizer, what: str) -> None:
    """NotImplementedError for optimizers whose state is not per parameter on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise NotImplementedError(
            f"{what}: ZeroRedundancyOptimizer keeps each parameter's state on one data-parallel rank only; "
            "its partitions are not covered yet (consolidate_state_dict() and a plain optimizer state dict)")


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in the model (torch's fqn of a tied parameter)."""
    return {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


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


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """(model_state_dict, optim_state_dict) of a sharded model for dcp.save /
    dcp.load: split tensors are PlacedShards (views of this rank's data),
    the others plain detached tensors; keys as in the unsharded model's
    state_dict() and torch's optimizer state dict (module doc).  No
    collectives.  optim_state_dict is {} without an optimizer."""
    _refuse_layouts(model, "get_state_dict")
    info = _shard_info(model)
    tensors = dict(_named_tensors(model))
    model_sd = {}
    for key, value in model.state_dict().items():
        t = tensors.get(key)
        model_sd[key] = value if t is None else _placed(t, _split_of(info, t), key)
    if optimizer is None:
        return model_sd, {}
    _refuse_optimizer(optimizer, "get_state_dict")
    names = _param_names(model)
    if not optimizer.state:
        _create_optimizer_state(optimizer)
    state, groups = {}, []
    for i, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            fqn = names.get(id(p))
            if fqn is None:
                raise ValueError(f"get_state_dict: parameter group {i} of {type(optimizer).__name__} holds a "
                                 f"parameter of shape {tuple(p.shape)} that is not in {type(model).__name__}")
            fqns.append(fqn)
            split = _split_of(info, p)
            if p in optimizer.state:
                state[fqn] = {k: _state_value(v, p, split, f"{fqn}.{k}", optimizer) for k, v in
                              optimizer.state[p].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return model_sd, {"state": state, "param_groups": groups}


def _state_value(v, p: torch.Tensor, split, key: str, optimizer):
    """An optimizer state as a state-dict value: placed as its parameter when
    it has the parameter's shape, plain when the parameter is whole or the
    state is a scalar; anything else has no known placement."""
    if not isinstance(v, torch.Tensor) or _whole(split) or v.dim() == 0:
        return v.detach() if isinstance(v, torch.Tensor) else v
    if v.shape != p.shape:
        raise NotImplementedError(
            f"get_state_dict: {type(optimizer).__name__} state '{key}' has shape {tuple(v.shape)}, not its "
            f"parameter's {tuple(p.shape)} (split along dimension {split[0]}): its placement is unknown")
    return _placed(v, split, key)


def _local_value(key: str, value, t: torch.Tensor, split, problems: list):
    """What goes into the tensor `t` (split: (dim, DimShard) or None) from
    `value`: a PlacedShard's local data when its placement is t's, a plain
    tensor's shard when it has the full shape, or the plain tensor itself;
    None (with the reason in `problems`) when it does not fit."""
    if isinstance(value, PlacedShard):
        mine = None if split is None else (split[0], split[1].ranges, split[1].length)
        theirs = (value._dim, value._shard.ranges, value._shard.length)
        if mine != theirs or value._local.shape != t.shape:
            problems.append(f"{key}: placed as dim {theirs[0]} ranges {list(theirs[1])}, this rank holds "
                            + ("all of it" if split is None else f"dim {mine[0]} ranges {list(mine[1])}"))
            return None
        return value._local
    if not isinstance(value, torch.Tensor):
        problems.append(f"{key}: not a tensor ({type(value).__name__})")
        return None
    if split is not None and value.dim() == t.dim() and value.shape[split[0]] == split[1].full \
            and value.shape != t.shape:
        return shard_of(value, split[0], split[1])
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
    _refuse_layouts(model, "set_state_dict")
    if optimizer is not None:
        _refuse_optimizer(optimizer, "set_state_dict")
    info = _shard_info(model)
    tensors = dict(_named_tensors(model))
    expected = set(model.state_dict().keys())
    problems: list[str] = []
    placed, full = [], {}
    for key, value in model_state_dict.items():
        if key not in expected:
            problems.append(f"{key}: not in {type(model).__name__}'s state dict")
        elif isinstance(value, PlacedShard):
            local = _local_value(key, value, tensors[key], _split_of(info, tensors[key]), problems)
            placed.append((tensors[key], local))
        else:
            t = tensors.get(key)
            problem = None if t is None else _check_tensor(key, value, t, _split_of(info, t))
            if problem is None:
                full[key] = value
            else:
                problems.append(problem)
    problems += [f"{key}: missing" for key in sorted(expected - set(model_state_dict))]
    optim = None
    if optimizer is not None and optim_state_dict is not None:
        optim = _native_optim_state(model, optimizer, optim_state_dict, info, problems)
    if problems:
        raise ValueError(f"set_state_dict({type(model).__name__}): the state dicts do not fit; nothing was "
                         f"loaded:\n  " + "\n  ".join(problems))
    if full:
        load_full_state_dict(model, full, strict=False)   # checks these first too
    for t, local in placed:
        if local.data_ptr() != t.data_ptr():
            t.copy_(local)
    if optim is not None:
        optimizer.load_state_dict(optim)


def _native_optim_state(model, optimizer, osd: Mapping, info: dict, problems: list) -> dict | None:
    """torch's optimizer.state_dict() form (parameters by index) of `osd`
    (parameters by name), each state the local value for this rank."""
    names = _param_names(model)
    saved_groups = osd.get("param_groups", [])
    saved_state = osd.get("state", {})
    if len(saved_groups) != len(optimizer.param_groups):
        problems.append(f"optimizer: {len(saved_groups)} parameter groups, {type(optimizer).__name__} has "
                        f"{len(optimizer.param_groups)}")
        return None
    state, groups, index = {}, [], 0
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        fqns = [names.get(id(p)) for p in group["params"]]
        if list(saved.get("params", [])) != fqns:
            problems.append(f"optimizer: parameter group {i} holds {list(saved.get('params', []))[:4]}..., "
                            f"{type(optimizer).__name__}'s holds {fqns[:4]}...")
            continue
        ids = []
        for p, fqn in zip(group["params"], fqns):
            if fqn in saved_state:
                split = _split_of(info, p)
                state[index] = {k: (_local_value(f"{fqn}.{k}", v, p, split, problems)
                                    if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                for k, v in saved_state[fqn].items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}
