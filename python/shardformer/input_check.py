"""The ranks that split one model must be given one batch.

A tensor-parallel layer computes its part of the output from its rank's
input and sums or gathers the parts with its peers' (Y = sum_i X W_i under
row parallelism): if the peers were handed different rows, the sum mixes
two batches and nothing fails.  That is what a data-parallel loader spanning
the tensor-parallel ranks does: torch's DistributedSampler or DDP over the
whole world, and transformers.Trainer or accelerate's prepare() under
torchrun, give every rank of the world its own rows.  The same holds for the
sequence-parallel group of all_to_all / ring_attn (every rank gets the full
sequence and keeps its part inside) and for the stages of a pipeline (the
first stage reads the ids, the last the labels).

So the sharded model compares a fingerprint of its inputs across those
groups on its first forward and every `ShardConfig.check_inputs_every`
forwards after (0: never), and raises ValueError on every rank, naming the
ranks that were given other inputs, the input that differs and the likely
cause with its fix.  The fingerprint of a call is three int64:

    names   crc32 of the tensor arguments' names, shapes and dtypes
    values  the 64-bit fingerprints of their bytes (C, shardformer._C.
            fingerprint; on an accelerator an exact integer checksum on the
            device) folded into one
    count   the number of tensor arguments

all-gathered once as a [ranks, 3] int64 table (one small collective; the
cost against the forward it guards is in benchmarks/input_check.py).  The
tensors are the call's positional and keyword arguments, and tensors inside
lists, tuples and dicts of them; model outputs handed back in
(encoder_outputs) and caches are not inputs the user chose and are skipped.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from . import replica_drift
from .config import group_size_and_rank
from .hashes import signed, value_fingerprint
from .replicas import all_gather_ints


FIX = ("Every rank of a tensor-parallel (or sequence-parallel, or pipeline) group must be given the same batch. "
       "The likely cause: a data-parallel wrapper or sampler spanning those ranks - torch's DistributedSampler or "
       "DistributedDataParallel over the whole world, or transformers.Trainer / accelerate's prepare() under "
       "torchrun, which give every rank of the world its own rows. Fix: build the groups with "
       "m = shardformer.mesh(tp=...), wrap the model with shardformer.data_parallel(model, m) (DDP over m.dp "
       "only) and sample over the data-parallel ranks only: DistributedSampler(dataset, num_replicas="
       "m.sizes['dp'], rank=m.coords['dp']), so the ranks of a group get the same rows")


def _tensors(value, name: str, out: list) -> None:
    """(name, tensor) of every tensor in `value`, descending into plain lists,
    tuples and dicts (not into model outputs or caches)."""
    if isinstance(value, torch.Tensor):
        out.append((name, value))
    elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        for i, v in enumerate(value):
            _tensors(v, f"{name}[{i}]", out)
    elif type(value) is dict:
        for k, v in value.items():
            _tensors(v, f"{name}[{k!r}]", out)


def named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensor arguments of a call, named as the caller passed them."""
    out: list = []
    for i, a in enumerate(args):
        _tensors(a, f"args[{i}]", out)
    for k, v in kwargs.items():
        _tensors(v, k, out)
    return out


def fingerprint(named: list[tuple[str, torch.Tensor]]) -> list[int]:
    """[names-and-shapes crc, folded value fingerprint, count] of a call's tensors."""
    layout = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named)
    folded = 0
    for _, t in named:
        folded = (folded * 1000003 + value_fingerprint(t)) & ((1 << 64) - 1)
    return [zlib.crc32(layout.encode()), signed(folded), len(named)]


def _describe(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, str, int]]:
    return [(n, tuple(t.shape), str(t.dtype), value_fingerprint(t)) for n, t in named]


def _difference(details: list, ranks: list[int]) -> str:
    """The first input that differs between the ranks' descriptions, in words."""
    by_name = [{n: (shape, dtype, h) for n, shape, dtype, h in d} for d in details]
    names = list(dict.fromkeys(n for d in details for n, *_ in d))
    for name in names:
        seen = [b.get(name) for b in by_name]
        if all(s == seen[0] for s in seen):
            continue
        parts = []
        for r, s in zip(ranks, seen):
            parts.append(f"rank {r}: " + ("absent" if s is None else f"shape {s[0]} {s[1]}"))
        same_shapes = all(s is not None and s[:2] == seen[0][:2] for s in seen)
        what = "same shapes, different values" if same_shapes else "; ".join(parts)
        return f"'{name}' differs ({what})"
    return "the inputs differ"


def check_same_inputs(named: list[tuple[str, torch.Tensor]], group, what: str, model_name: str,
                      call: int) -> None:
    """Raise ValueError on every rank of `group` unless all were given the
    same tensors (collective; no-op for one rank)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    table = all_gather_ints(fingerprint(named), group)
    if bool((table == table[0]).all()):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    details = [None] * len(ranks)
    dist.all_gather_object(details, _describe(named), group=group)
    classes: dict[tuple, list[int]] = {}
    for r, row in zip(ranks, table.tolist()):
        classes.setdefault(tuple(row), []).append(r)
    split = " vs ".join(f"ranks {members}" for members in classes.values())
    raise ValueError(f"{model_name}: the ranks of the {what} group were given different inputs on forward call "
                     f"{call} ({split}): {_difference(details, ranks)}. {FIX}. (ShardConfig(check_inputs_every=0) "
                     f"turns this check off.)")


class InputCheck:
    """The check of one sharded model: which groups must agree and how often.
    Called as a forward pre-hook (with kwargs) of the model; a pipelined
    model's schedule calls step() instead (shardformer.pipeline.schedule)."""

    def __init__(self, model_name: str, groups: list[tuple[object, str]], every: int, whole=None):
        self.model_name = model_name
        self.whole = whole                   # model -> its whole (not split) (name, parameter) pairs
        self.groups = groups
        self.every = every
        self.calls = 0

    def due(self) -> bool:
        """Counts a call; True on the first and every `every`-th after."""
        self.calls += 1
        return self.every > 0 and (self.calls - 1) % self.every == 0

    def step(self, args: tuple, kwargs: dict, extra: tuple = (), model=None) -> None:
        """Check this call's inputs over the model's groups and `extra`
        ((group, what) pairs) when due, and before that, when
        replica_drift.due, that the ranks of the model's groups still hold
        the same whole parameters (shardformer.replica_drift)."""
        if model is not None and self.whole is not None and replica_drift.due(self.calls + 1, self.every):
            replica_drift.check_whole_parameters(self.whole(model), self.groups, self.model_name, self.calls + 1)
        if not self.due():
            return
        named = named_inputs(args, kwargs)
        for group, what in list(self.groups) + list(extra):
            check_same_inputs(named, group, what, self.model_name, self.calls)

    def __call__(self, module, args, kwargs):
        self.step(args, kwargs, model=module)


try:                                 # run eagerly under torch.compile (the counter is Python state)
    InputCheck.__call__ = torch.compiler.disable(InputCheck.__call__)
except AttributeError:               # pragma: no cover - torch without torch.compiler
    pass

CHECK_ATTR = "_shardformer_input_check"


def groups_of(cfg) -> list[tuple[object, str]]:
    """(group, what) of the groups whose ranks must be given the same inputs
    (the pipeline's is added by the schedule): the tensor-parallel group when
    it splits the model or the sequence, and a sequence-parallel group of its
    own (all_to_all / ring_attn with tensor parallelism)."""
    out = []
    tp = cfg.tensor_parallel_process_group
    if (cfg.enable_tensor_parallelism or cfg.sequence_group is tp) and group_size_and_rank(tp)[0] > 1:
        out.append((tp, "tensor-parallel" if cfg.enable_tensor_parallelism else "sequence-parallel"))
    sp = cfg.sequence_group
    if cfg.enable_sequence_parallelism and sp is not tp and group_size_and_rank(sp)[0] > 1:
        out.append((sp, "sequence-parallel"))
    return out


def skip_whole_parameters(model) -> None:
    """Turn off the sharded `model`'s whole-parameter comparison
    (shardformer.replica_drift), keeping its input check: for
    shardformer.verify, which compares every parameter with the unsharded
    model's after its steps itself and reports where they part."""
    check = model.__dict__.get(CHECK_ATTR)
    if check is not None:
        check.whole = None


def install(model, cfg, name: str, pipelined: bool, whole=None) -> None:
    """Give the sharded `model` its input check (ShardConfig.check_inputs_every;
    nothing when 0 or when no group must agree): a forward pre-hook, or for a
    pipelined model the object its schedule calls.  `whole(model)`: the
    (name, parameter) pairs every rank of the groups holds whole, compared
    by shardformer.replica_drift."""
    groups = groups_of(cfg)
    if cfg.check_inputs_every == 0 or not (groups or pipelined):
        return
    check = InputCheck(name, groups, cfg.check_inputs_every, whole)
    model.__dict__[CHECK_ATTR] = check
    if not pipelined:
        model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
