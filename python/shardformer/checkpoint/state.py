"""The whole training state of a sharded model, saved and resumed.

    checkpoint.save_state(model, dir, optimizer=None, lr_scheduler=None, step=None, extra=None,
                          async_save=False, process_group=None) -> None | SaveHandle
    state = checkpoint.load_state(model, dir, optimizer=None, lr_scheduler=None, process_group=None)
    state["step"], state["extra"]

`model` is the sharded model, or the DistributedDataParallel around it
(shardformer.data_parallel); it is loaded in place.  Collective over
`process_group` (default: the world), which must hold every rank of the
model (all its TP groups and data-parallel replicas).

What `dir` holds: one torch.distributed.checkpoint (DCP) checkpoint of the
state dict

    "model"            dcp.get_state_dict's model dict (PlacedShard values:
    "optim"            every split tensor written once, reshardable on load)
    "train"            {step, extra, the scheduler's state_dict(), the layout}
    "rng.rankNNNNN"    global rank NNNNN's generators: torch's CPU generator,
                       the CUDA generators (when CUDA is initialized), and
                       every tensor-parallel dropout module's (seed, step)
    "grads"            the gradients the parameters hold at the save (placed
                       as "model"; only when some are not None): a save
                       between the micro-batches of a gradient accumulation
                       resumes with the sum so far.  load_state sets them
                       back, and leaves a parameter without a saved gradient
                       with none.  Under DDP the replicas must hold the same
                       gradients (they differ under no_sync(), where one
                       copy would resume every replica with the first's):
                       ValueError naming the ranks, before anything is written.

"train" is the same on every rank and written once (DCP's de-duplication of
replicated values); the step must agree on every rank (ValueError naming the
ranks that differ, before anything is written).  `extra` is any picklable
object, as on the lowest rank of the group.

Random state.  A TP dropout module (shardformer.layer.dropout) draws its
mask from a generator seeded with mix(seed, step[, TP rank]); seed is agreed
over the TP group when the model is sharded, step counts the module's calls.
So (seed, step) of every module is its whole state, and together with
torch's own generators (HF's dropouts, layer-drop, the RankStream draws)
they make the masks after a resume the masks of the run that never stopped.
`layout` is each rank's (TP size, TP rank, pipeline stage, layers of each
stage, EP size, EP rank), gathered at save with the global ranks; the DP
rank is not in it (replicas hold the same modules; which rows a rank reads
is the data loader's).  "train" also keeps every dropout module's (seed,
step) from the lowest rank that holds it, so a module of any stage has its
record:

  * the same layout on load: every rank takes back its own generators
    (exact resume: the same losses and weights, bit for bit, pipeline
    stages included);
  * another layout (a TP, DP, PP or EP size, another stage split, another
    world size): every rank takes rank 0's torch generators and each
    dropout module the merged record (the TP groups keep agreeing, which a
    replicated dropout needs).  The replicated-input dropouts draw the masks they
    would have drawn; a parallel-input mask is per TP rank and per shard
    shape, so those masks are new draws of the same distribution, and the
    resumed run is a valid continuation rather than the same numbers.  With
    dropout off, the next steps equal the straight run's within float
    tolerance (the sum order of the split matmuls changes).

Atomic.  Every rank writes into one temporary sibling `.NAME.partial-XXXX`
(checkpoint.atomic); after DCP's metadata is written, the lowest rank puts it
in place (rename, or an exchange with the previous checkpoint).  A save
killed at any point (SIGKILL of any rank mid-write) leaves the previous
checkpoint under NAME; the next save removes the leftovers.

Asynchronous.  With async_save=True every tensor is copied first (the
training may change the originals right after the call) and the write is
planned with the other ranks (DCP's planner: the only collectives, in the
caller's thread); then a thread writes this rank's files, and the lowest
rank's thread, once every rank has posted its records through the process
group's store, writes DCP's metadata and puts the directory in place.  No
collective runs beside the training's (a second gloo group made for the
writer would need every rank of the world at its creation).  The call
returns a SaveHandle; wait() blocks until the checkpoint is in place and
raises what went wrong on any rank.  A later save_state or load_state waits
for the pending save first.  The training is blocked for the copy and the
plan only (benchmarks/checkpoint_state.py).  The synchronous save runs the
same two parts in the caller's thread.

Layouts.  The model and optimizer go through checkpoint.get_state_dict /
set_state_dict (checkpoint.dcp), so every layout that DCP reshards resumes:
TP, DP (DDP), pipeline stages (global keys), expert parallelism and ZeRO-1
(torch's ZeroRedundancyOptimizer: its partitions follow their parameters),
saved at one and loaded at another (docs/checkpoint_layouts.md).

Not kept: the dropout modules' recomputation keys (gradient checkpointing
files them within one step's backward; a save falls between steps).
"""
from __future__ import annotations

import io
import os
import threading
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..layer.dropout import SeededDropout
from ..layer.parallel_module import ParallelModule
from ..pipeline.stages import runtime_of
from .atomic import make_temp, put_in_place, save_target
from ..hashes import signed, tensor_hash
from ..replicas import all_gather_ints
from .dcp import PlacedShard, get_state_dict, gradient_state_dict, set_gradients, set_state_dict

__all__ = ["SaveHandle", "load_state", "save_state"]

_TRAIN = "train"
_GRADS = "grads"
_RNG = "rng.rank{:05d}"
_pending: list[SaveHandle] = []
_WRITE_TIMEOUT_S = 1800.0    # how long the lowest rank waits for the others' files


def _unwrap(model: nn.Module) -> nn.Module:
    """The sharded model inside DistributedDataParallel / DataParallel."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def _check_replica_gradients(model: nn.Module, who: str) -> None:
    """ValueError unless the data-parallel replicas of DDP `model` hold the
    same gradients (one int64 fingerprint all-gathered over DDP's group).
    They differ in the middle of a gradient accumulation under no_sync():
    the checkpoint keeps one copy of each gradient, so such a save would
    resume every replica with the first one's."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or dist.get_world_size(model.process_group) < 2:
        return
    folded = 0
    for p in _unwrap(model).parameters():
        h = 0 if p.grad is None else tensor_hash(p.grad)
        folded = (folded * 1000003 + h + 1) & ((1 << 64) - 1)
    seen = all_gather_ints([signed(folded)], model.process_group)[:, 0].tolist()
    if len(set(seen)) > 1:
        ranks = dist.get_process_group_ranks(model.process_group)
        groups: dict = {}
        for r, h in zip(ranks, seen):
            groups.setdefault(h, []).append(r)
        raise ValueError(f"{who}: the data-parallel replicas hold different gradients (ranks "
                         f"{' vs '.join(str(g) for g in groups.values())}): a save in the middle of a gradient "
                         f"accumulation under DDP's no_sync(), whose gradients are not averaged yet. Save after "
                         f"the micro-batch that synchronizes them (or after the optimizer step); nothing was "
                         f"written; see docs/resume.md")


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data):
    if isinstance(data, io.BytesIO):
        data.seek(0)
        return torch.load(data, weights_only=False)
    return torch.load(io.BytesIO(data), weights_only=False)


def _dropouts(model: nn.Module) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, SeededDropout)}


def _layout(model: nn.Module) -> tuple:
    """(TP size, TP rank, pipeline stage, the layers of each stage [and
    chunk], EP size, EP rank) of this rank's model: what decides which
    modules a rank holds and which masks its dropout modules draw.  The DP rank is not part of it: replicas
    hold the same modules, and the global rank is compared beside it."""
    tp = next(((m.tp_size, m.tp_rank) for m in model.modules() if isinstance(m, ParallelModule)), (1, 0))
    ep = next(((m.ep_size, m.ep_rank) for m in model.modules() if hasattr(m, "ep_rank")), (1, 0))
    runtime = runtime_of(model)
    manager = runtime.manager if runtime is not None else None
    stage, split = (manager.stage, manager.num_layers_per_stage) if hasattr(manager, "num_stages") else (0, ())
    return (int(tp[0]), int(tp[1]), int(stage), tuple(int(n) for n in split or ()), int(ep[0]), int(ep[1]))


def _dropout_record(model: nn.Module) -> dict:
    """{module name: (seed, step)} of this rank's TP dropout modules."""
    return {name: (int(m.seed), int(m.step)) for name, m in _dropouts(model).items()}


def _merged_dropouts(records: list[dict]) -> dict:
    """Every module's (seed, step) from the lowest rank that holds it: a
    pipeline stage holds its own layers' modules only."""
    merged: dict = {}
    for record in records:
        for name, value in record.items():
            merged.setdefault(name, value)
    return merged


def _rng_state(model: nn.Module) -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda,
            "dropout": _dropout_record(model)}


def _set_rng_state(model: nn.Module, state: dict) -> None:
    """Put generators back: torch's, CUDA's (when the device count matches)
    and every dropout module's (seed, step) by module name."""
    modules = _dropouts(model)
    missing = sorted(set(modules) - set(state["dropout"]))
    if missing:
        raise ValueError(f"load_state: the checkpoint holds no dropout state for {missing[:4]} "
                         f"({len(missing)} modules of {type(model).__name__}); it was saved from another model")
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, m in modules.items():
        m.seed, m.step = state["dropout"][name]
        m._filed.clear()


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _gather(group, value) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _agree(what: str, values: list, ranks: list[int], who: str) -> None:
    """ValueError naming the ranks whose `what` differs from the lowest rank's."""
    differ = [(r, v) for r, v in zip(ranks, values) if v != values[0]]
    if differ:
        shown = ", ".join(f"rank {r}: {v!r}" for r, v in differ[:4])
        raise ValueError(f"{who}: the ranks disagree on {what}: rank {ranks[0]}: {values[0]!r}, {shown}; "
                         f"nothing was written")


def _copy(value):
    """A copy of a state-dict value that the training cannot change (async save)."""
    if isinstance(value, PlacedShard):         # every split kept: experts are split over EP and TP
        (dim, shard), *also = value.placements
        return PlacedShard(value.to_local().detach().clone(), dim, shard, value._key, also)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class SaveHandle:
    """An asynchronous save_state in flight: wait() blocks until the
    checkpoint is in place (and raises what the writer raised); done() says
    whether it finished."""

    def __init__(self, directory: str):
        self.directory = directory
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, work) -> None:
        def run():
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"save_state {self.directory}")
        self._thread.start()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self in _pending:
            _pending.remove(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _wait_pending() -> None:
    for handle in list(_pending):
        handle.wait()


def _store():
    """The default group's key-value store (the rendezvous TCPStore): the
    writers' records and the outcome travel through it, so the write needs
    no collective and can run beside the training's collectives."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


class _Write:
    """One save_state into `directory`, in two parts.

    plan() (the caller's thread, collective over the group): the lowest rank
    makes the temporary directory; DCP's planner plans every rank's writes
    (gathered to the lowest rank and scattered back, as dcp.save does).
    finish() (any thread, no collective): this rank writes its files
    (DCP's FileSystemWriter, fsynced) and posts their records to the store;
    the lowest rank waits for every rank's, writes DCP's metadata, puts the
    directory in place and posts the outcome, which every rank waits for."""

    def __init__(self, state: dict, directory: str, group, who: str):
        self.state, self.directory, self.group, self.who = state, directory, group, who
        self.ranks = _group_ranks(group)
        self.root = dist.get_rank(group) == 0

    def plan(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        box, error = [None], None
        if self.root:
            try:
                box[0] = make_temp(self.directory)
            except BaseException as e:  # noqa: BLE001 - the others must not wait for a name
                error = e
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        if error is not None:
            raise error
        if box[0] is None:
            raise RuntimeError(f"{self.who}: the lowest rank could not create the temporary directory beside "
                               f"{self.directory} (see its error)")
        self.tmp = box[0]
        self.key = f"shardformer/save_state/{os.path.basename(self.tmp)}"
        self.writer, self.planner = FileSystemWriter(self.tmp), DefaultSavePlanner()
        self.planner.set_up_planner(state_dict=self.state, storage_meta=self.writer.storage_meta(),
                                    is_coordinator=self.root)
        self.writer.set_up_storage_writer(self.root, rank=dist.get_rank(self.group), use_collectives=True)
        local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        plans = [None] * len(self.ranks) if self.root else None
        dist.gather_object(local, plans, dst=self.ranks[0], group=self.group)
        central = None
        if self.root:
            plans, self.metadata = self.planner.create_global_plan(plans)
            central = self.writer.prepare_global_plan(plans)
        mine = [None]
        dist.scatter_object_list(mine, central, src=self.ranks[0], group=self.group)
        self.plan_of_rank = self.planner.finish_plan(mine[0])

    def finish(self) -> None:
        import pickle
        from datetime import timedelta

        store, rank = _store(), dist.get_rank(self.group)
        timeout = timedelta(seconds=_WRITE_TIMEOUT_S)
        try:
            writes = self.writer.write_data(self.plan_of_rank, self.planner)
            writes.wait()
            posted = ("ok", writes.value())
        except BaseException as e:  # noqa: BLE001 - the lowest rank must hear of it
            posted = ("error", f"rank {self.ranks[rank]}: {type(e).__name__}: {e}")
        store.set(f"{self.key}/{rank}", pickle.dumps(posted))
        if self.root:
            outcome = self._complete(store, timeout)
            store.set(f"{self.key}/done", outcome.encode())
        else:
            store.wait([f"{self.key}/done"], timeout)
            outcome = store.get(f"{self.key}/done").decode()
        if outcome != "ok":
            raise RuntimeError(f"{self.who}: the save failed ({outcome}); {self.directory} holds what it held "
                               "before")

    def _complete(self, store, timeout) -> str:
        """The lowest rank: every rank's records -> metadata -> in place; the outcome."""
        import pickle
        import shutil

        keys = [f"{self.key}/{r}" for r in range(len(self.ranks))]
        try:
            store.wait(keys, timeout)
            posted = [pickle.loads(store.get(k)) for k in keys]
            for k in keys:
                store.delete_key(k)
            errors = [text for status, text in posted if status != "ok"]
            if errors:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return "; ".join(errors)
            self.writer.finish(metadata=self.metadata, results=[value for _, value in posted])
            put_in_place(self.tmp, self.directory)
            return "ok"
        except BaseException as e:  # noqa: BLE001 - every rank hears the outcome
            shutil.rmtree(self.tmp, ignore_errors=True)
            return f"rank {self.ranks[0]}: {type(e).__name__}: {e}"


def save_state(model: nn.Module, dir, optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None,
               step: int | None = None, extra=None, async_save: bool = False, process_group=None):
    """Save the model, the optimizer, the scheduler, `step`, `extra` and the
    random state into `dir` (see the module doc), atomically.  Collective
    over `process_group` (default: the world).  Returns None, or with
    async_save a SaveHandle whose wait() finishes the save."""
    inner = _unwrap(model)
    who = f"{type(inner).__name__}: save_state"
    _wait_pending()
    directory = save_target(dir, who)
    ranks = _group_ranks(process_group)
    mine = (step, optimizer is not None, lr_scheduler is not None, _layout(inner), _dropout_record(inner))
    seen = _gather(process_group, mine)
    _agree("the step", [s[0] for s in seen], ranks, who)
    _agree("whether an optimizer / scheduler is saved", [s[1:3] for s in seen], ranks, who)
    _check_replica_gradients(model, who)
    msd, osd = get_state_dict(inner, optimizer)
    train = {"step": step, "extra": extra, "layout": {"ranks": ranks, "of_rank": [s[3] for s in seen]},
             "dropout": _merged_dropouts([s[4] for s in seen]),
             "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
             "optimizer": optimizer is not None}
    state = {"model": msd, _RNG.format(dist.get_rank()): _blob(_rng_state(inner))}
    if dist.get_rank(process_group) == 0:      # one copy: the lowest rank's (its `extra`)
        state[_TRAIN] = _blob(train)
    if optimizer is not None:
        state["optim"] = osd
    grads = gradient_state_dict(inner)
    if grads:                                  # accumulated gradients (a save between micro-batches)
        state[_GRADS] = grads
    write = _Write(_copy(state) if async_save else state, directory, process_group, who)
    write.plan()
    if not async_save:
        write.finish()
        return None
    handle = SaveHandle(directory)
    _pending.append(handle)
    handle._start(write.finish)
    return handle


def _read_local(directory: str, keys: list[str]) -> dict:
    """The values of `keys` (save_state's pickled records) read by this rank
    alone from the checkpoint's files (no collectives)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    box = {k: b"" for k in keys}
    with warnings.catch_warnings():     # DCP warns that no_dist reads in one process: what is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(box, storage_reader=FileSystemReader(directory), no_dist=True)
    return {k: _unblob(v) for k, v in box.items()}


def _read_train(directory: str, who: str) -> tuple[dict, set]:
    """The "train" record and the keys of the checkpoint in `directory`."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{who}: no checkpoint directory {directory}")
    if not os.path.exists(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{who}: {directory} holds no checkpoint of save_state (no .metadata); "
                                "see docs/resume.md")
    keys = set(FileSystemReader(directory).read_metadata().state_dict_metadata)
    if _TRAIN not in keys:
        raise ValueError(f"{who}: {directory} is a torch.distributed.checkpoint without the training state "
                         f"(no '{_TRAIN}' entry): not written by save_state; see docs/resume.md")
    return _read_local(directory, [_TRAIN])[_TRAIN], keys


def load_state(model: nn.Module, dir, optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None,
               process_group=None) -> dict:
    """Load what save_state wrote in `dir` into the model (in place), the
    optimizer and the scheduler, and put the random state back (the same
    layout: each rank's own; another: rank 0's, see the module doc).
    Returns {"step": ..., "extra": ...}.  Collective over `process_group`."""
    import torch.distributed.checkpoint as dcp

    inner = _unwrap(model)
    who = f"{type(inner).__name__}: load_state"
    _wait_pending()
    directory = os.path.realpath(os.path.abspath(os.fspath(dir)))
    ranks = _group_ranks(process_group)
    try:
        train, keys = _read_train(directory, who)
        if optimizer is not None and not train["optimizer"]:
            raise ValueError(f"{who}: {directory} was saved without an optimizer; load it with optimizer=None")
        if lr_scheduler is not None and train["scheduler"] is None:
            raise ValueError(f"{who}: {directory} was saved without a learning-rate scheduler; "
                             "load it with lr_scheduler=None")
        error = None
    except (OSError, ValueError) as e:
        error = e
    seen = _gather(process_group, (_layout(inner), None if error is None else str(error)))
    if error is not None:
        raise error
    failed = [(r, msg) for r, (_, msg) in zip(ranks, seen) if msg is not None]
    if failed:
        raise RuntimeError(f"{who}: rank {failed[0][0]} cannot read the checkpoint: {failed[0][1]}")
    layouts = [layout for layout, _ in seen]
    same = layouts == train["layout"]["of_rank"] and ranks == train["layout"]["ranks"]
    rng_key = _RNG.format(dist.get_rank() if same else train["layout"]["ranks"][0])
    if rng_key not in keys:
        raise ValueError(f"{who}: {directory} holds no random state '{rng_key}' (its keys: "
                         f"{sorted(k for k in keys if k.startswith('rng.'))[:4]}...)")
    rng = _read_local(directory, [rng_key])[rng_key]
    if not same and "dropout" in train:     # every module's record, also those of the other stages
        rng["dropout"] = train["dropout"]
    msd, osd = get_state_dict(inner, optimizer)
    state = {"model": msd}
    if optimizer is not None:
        state["optim"] = osd
    prefix = _GRADS + "."
    grads = gradient_state_dict(inner, {k[len(prefix):] for k in keys if k.startswith(prefix)})
    if grads:
        state[_GRADS] = grads
    dcp.load(state, checkpoint_id=directory, process_group=process_group)
    set_state_dict(inner, optimizer, model_state_dict=msd, optim_state_dict=osd if optimizer is not None else None)
    set_gradients(inner, grads)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(train["scheduler"])
    _set_rng_state(inner, rng)
    return {"step": train["step"], "extra": train["extra"]}
