"""Pipeline schedules: GPipe, 1F1B and interleaved 1F1B.

A schedule splits the batch into m micro-batches along dimension 0 and runs,
on every rank, its list of forward (F) and backward (B) steps of (chunk,
micro-batch) in the schedule's order:

    GPipe         F0 .. F(m-1), then B0 .. B(m-1): m micro-batches of
                  activations in flight on every stage
    1F1B          stage s runs min(p-s-1, m) forwards, then alternates one
                  forward and one backward, then the remaining backwards: at
                  most p-s micro-batches in flight (PipeDream-flush)
    Interleaved   v chunks per rank (virtual stage c*p + s): the 1F1B order
                  over micro-steps that take p micro-batches through one chunk
                  before moving to the next (Narayanan et al. 2021); needs
                  m to be a multiple of p; the bubble shrinks v times

Both bubbles are (p-1)/(m+p-1) of the step for GPipe and 1F1B, and
(p-1)/(v m + p-1) for interleaved.

The zero-bubble schedules (zero_bubble.py) add W steps: their B computes
the input gradients only, and W(chunk, mb) the weight gradients of the
linear products that B left in a sink (weight_grads.py).  W needs and sends
no message.  Virtual stage of chunk c on stage s: c*p + s, or for a stage
manager with layout "v" s (c = 0) and 2p-1-s (c = 1).

Communication.  The activation of F(c, i) goes to the next virtual stage's
F, the gradient of B(c, i) w.r.t. the chunk's input to the previous virtual
stage's B.  Sends and receives are blocking (shardformer.distributed.send /
recv: a large message waits for its receiver), so their order on every rank
is worked out in advance: all ranks simulate the whole schedule in ticks
(cheap: every rank's step list), each rank running its next step in a tick
when its input arrived in an earlier one, and every message made in a tick
is transferred right after it, the tick's transfers in one global order.
Each rank then runs its steps and its sends and receives in that order: the
transfers follow one global order, so none can deadlock (the earliest
pending one has both its ends at it), and a stage's output leaves as soon as
it is made, so the stages overlap as the schedule means them to.  The plan
is cached per (schedule, p, v, m).

Messages are one tensor, or a tuple of tensors for a split with carried
layer outputs or two stacks (stages.StageRuntime): the gradient message
holds one gradient per tensor of the activation message (zeros where the
stage's input got none), and B runs one backward over every output tensor
that requires a gradient.

Loss.  With criterion=None the model's own loss (the batch holds labels);
else criterion(outputs, micro_batch).  Micro-batch losses are averaged
(each backward is of loss / m), which equals the full-batch loss when every
micro-batch weighs the same; a causal LM's token loss instead gets
num_items_in_batch (HF's loss kwarg: the batch's count of predicted tokens),
so padded, unevenly labelled micro-batches add up to the full-batch mean
exactly (not for a class whose LM loss is its own nn.CrossEntropyLoss mean,
which ignores it: StageRuntime.own_mean_loss).  The loss is broadcast
from the last stage to every rank.

Caches.  Every stage runs the model without a KV cache (use_cache=False).
The unsharded model's mask can depend on the cache (packed documents in the
position_ids are masked block-diagonally only without one): that decision is
taken on the user's batch, its use_cache included, and held for each forward
(shardformer.packing).  So the outputs hold no past_key_values, and a tuple
output (return_dict=False) with use_cache=True is refused
(StageRuntime.refuse_outputs), as are the per-layer outputs
(output_hidden_states / output_attentions), whose entries each stage makes
for its own layers only.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
import zlib

import torch

from .. import distributed as D
from .. import packing
from ..distributed import failures
from ..distributed.agree import members, name_ranks
from ..input_check import CHECK_ATTR
from .p2p import StageLink
from . import weight_grads
from .stage_manager import PipelineStageManager, chain_position, stage_running
from .stages import runtime_of

# Replicated parameters whose gradients this process summed over their stages (for tests: proof it ran).
COUNTS = {"held": 0}   # parameters summed over their holding stages (_sum_over_holders)

__all__ = ["PipelineSchedule", "GPipeSchedule", "OneForwardOneBackwardSchedule", "InterleavedSchedule"]


# ---- the plan ---------------------------------------------------------------------------

def _plan(steps_of, p: int, v: int, m: int, with_backward: bool, layout: str = "loop"):
    """[rank] -> list of ("F" | "B" | "W", chunk, mb) and ("send" | "recv" | "local", peer, message) in
    the order that rank runs them (see the module docstring).  message: ("act" | "grad", vs, mb).
    `layout`: how chunks map to virtual stages (PipelineStageManager.layout); a W step needs and
    sends nothing (its B ran earlier on the same rank)."""
    V = p * v
    lists = [steps_of(s, p, v, m) if with_backward else [st for st in steps_of(s, p, v, m) if st[0] == "F"]
             for s in range(p)]
    out = [[] for _ in range(p)]
    arrived: set = set()
    pos = [0] * p
    while any(pos[s] < len(lists[s]) for s in range(p)):
        produced = []                                 # this tick's messages, in rank order
        ran = False
        for s in range(p):
            if pos[s] == len(lists[s]):
                continue
            kind, c, i = lists[s][pos[s]]
            vs = chain_position(s, c, p, layout)
            need = (("act", vs - 1, i) if vs > 0 else None) if kind == "F" else \
                   (("grad", vs + 1, i) if vs < V - 1 and kind == "B" else None)
            if need is not None and need not in arrived:
                continue                              # waits for a later tick
            out[s].append((kind, c, i))
            pos[s] += 1
            ran = True
            if kind == "F" and vs < V - 1:
                produced.append((s, stage_running(vs + 1, p, layout), ("act", vs, i)))
            if kind == "B" and vs > 0:
                produced.append((s, stage_running(vs - 1, p, layout), ("grad", vs, i)))
        if not ran:
            raise RuntimeError(f"pipeline schedule {steps_of.__name__}: the step lists deadlock (p={p}, v={v}, m={m})")
        for src, dst, msg in produced:                # the tick's transfers, one global order
            if src == dst:
                out[src].append(("local", src, msg))
            else:
                out[src].append(("send", dst, msg))
                out[dst].append(("recv", src, msg))
            arrived.add(msg)
    return out


def _gpipe_steps(s: int, p: int, v: int, m: int):
    return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


def _one_f_one_b_steps(s: int, p: int, v: int, m: int):
    warmup = min(p - s - 1, m)
    steps = [("F", 0, i) for i in range(warmup)]
    for k in range(m - warmup):
        steps += [("F", 0, warmup + k), ("B", 0, k)]
    return steps + [("B", 0, i) for i in range(m - warmup, m)]


def _interleaved_steps(s: int, p: int, v: int, m: int):
    total = m * v

    def mb(k):
        return (k // (p * v)) * p + k % p

    def fwd(k):
        return ("F", (k // p) % v, mb(k))

    def bwd(k):
        return ("B", v - 1 - (k // p) % v, mb(k))

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    steps = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [fwd(warmup + k), bwd(k)]
    return steps + [bwd(k) for k in range(total - warmup, total)]


@functools.lru_cache(maxsize=64)
def _cached_plan(steps_of, p, v, m, with_backward, layout="loop"):
    return _plan(steps_of, p, v, m, with_backward, layout)


# ---- the schedules ----------------------------------------------------------------------

class PipelineSchedule:
    """Runs a model pipelined by optimize() (ShardConfig.pipeline_stage_manager)
    over micro-batches.  Subclasses choose the order of the steps."""

    name = "pipeline"
    _steps = staticmethod(_gpipe_steps)
    splits_backward = False      # True: B computes input gradients only, W the linears' weight gradients
    timeline = None              # a list: every F / B / W step appends (kind, chunk, mb, start, end), perf_counter

    def __init__(self, stage_manager: PipelineStageManager, num_microbatches: int) -> None:
        if not isinstance(stage_manager, PipelineStageManager):
            raise TypeError(f"{type(self).__name__}: stage_manager must be a PipelineStageManager, "
                            f"got {type(stage_manager).__name__}")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: num_microbatches must be an int >= 1, got {num_microbatches!r}")
        self.stage_manager = stage_manager
        self.num_microbatches = num_microbatches
        self.link = StageLink(stage_manager)
        self._check_chunks()

    def _check_chunks(self) -> None:
        if self.stage_manager.num_model_chunks != 1:
            raise ValueError(f"{type(self).__name__}: the stage manager has num_model_chunks="
                             f"{self.stage_manager.num_model_chunks}; use InterleavedSchedule for more than one")

    # -- public -------------------------------------------------------------------------

    def forward_backward_step(self, model, batch: dict, criterion=None, return_loss: bool = True,
                              return_outputs: bool = False) -> dict:
        """Forward and backward of `batch` (a dict of model inputs, split along
        dimension 0 into micro-batches) through the pipeline; parameter
        gradients accumulate in .grad as loss.backward() would.  Returns
        {"loss": the full-batch loss on every rank (None unless return_loss),
        "outputs": the last stage's outputs, micro-batches concatenated (on the
        last stage; None elsewhere, or unless return_outputs)}.  Collective
        over the pipeline group."""
        return self._run(model, batch, criterion, True, return_loss, return_outputs)

    @torch.no_grad()
    def forward(self, model, batch: dict):
        """The model's outputs on `batch` (no gradients), from the last stage,
        on every rank of the pipeline: the same output class as the model's
        forward, micro-batches concatenated along dimension 0 (or the batch
        dimension the policy's StageSplit.batch_dims names for an output)."""
        return self._run(model, batch, None, False, False, True)["outputs"]

    # -- the step -------------------------------------------------------------------------

    def _run(self, model, batch, criterion, backward: bool, return_loss: bool, return_outputs: bool) -> dict:
        """_step under failures.guard: a rank raising inside it stops its peers
        (pipeline, tensor-parallel, expert-parallel groups) within
        milliseconds with a PeerFailed naming it and where (docs/pipeline.md,
        "When a stage fails"); every rank then starts its messages afresh."""
        rt = runtime_of(model)
        if rt is None or self.stage_manager.num_stages == 1:
            return self._step(model, batch, criterion, backward, return_loss, return_outputs)
        self._at = "start"
        groups = [self.stage_manager.group] + ([rt.tp_group] if rt.tp_group is not None else []) + \
            [g for g, _ in rt.lockstep_groups]
        try:
            with failures.guard(groups, f"{type(self).__name__}: {type(model).__name__}", self._where):
                return self._step(model, batch, criterion, backward, return_loss, return_outputs)
        except BaseException:
            if self._at != "agreed":               # a failure: headers sent may never have been received
                self.link = StageLink(self.stage_manager)
            raise

    def _where(self) -> str | None:
        """Where this rank is in the step (for failures.guard); None inside the
        agreed refusals, which every rank raises alike."""
        at, sm = self._at, self.stage_manager
        if at == "agreed":
            return None
        head = f"{self.name} schedule, stage {sm.stage} of {sm.num_stages}"
        if isinstance(at, str):
            return f"{head}, {at}"
        kind = at[0]
        if kind in ("send", "recv"):
            what, vs, mb = at[2]
            return (f"{head}, {'sending' if kind == 'send' else 'receiving'} the "
                    f"{'activation' if what == 'act' else 'gradient'} of micro-batch {mb} "
                    f"{'to' if kind == 'send' else 'from'} stage {at[1]}")
        step = {"F": "forward", "B": "backward", "W": "weight gradients"}[kind] if kind in "FBW" else kind
        return f"{head}, {step} of micro-batch {at[2]} (chunk {at[1]})"

    def _step(self, model, batch, criterion, backward: bool, return_loss: bool, return_outputs: bool) -> dict:
        sm, name = self.stage_manager, type(model).__name__
        rt = runtime_of(model)
        if rt is None:
            raise ValueError(f"{type(self).__name__}: {name} is not pipelined; shard it with "
                             f"ShardConfig(pipeline_stage_manager=...) first")
        if rt.manager is not sm and (rt.manager.group is not sm.group or rt.manager.layout != sm.layout or
                                     rt.manager.num_model_chunks != sm.num_model_chunks):
            raise ValueError(f"{type(self).__name__}: {name} was pipelined with another stage manager ({rt.manager})")
        if not isinstance(batch, dict):
            raise TypeError(f"{type(self).__name__}: batch must be a dict of model inputs, got {type(batch).__name__}")
        micro = self._split(batch, name)
        device = _device_of(model)
        sig = tuple(sorted((k, tuple(t.shape), str(t.dtype)) for k, t in micro[0].items()
                           if isinstance(t, torch.Tensor)))
        # the per-layer outputs asked (refused below): in the agreed signature, so that every stage
        # raises alike or the stages' disagreement is named
        asked = rt.outputs_asked(model, batch)
        if asked:
            sig = sig + (("asked", asked),)
        rows = next(t.shape[0] for t in batch.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        # every all-gather runs on every rank before any raises: a rank leaving after the first
        # would leave its EP peers (or its stages) waiting in the next
        problems = [self._agree(sig, rows, backward, name, device),
                    *self._agree_with_peers(rt.lockstep_groups, backward, name, device)]
        self._at = "agreed"                      # from here to the input check every rank raises alike
        problem = next((p for p in problems if p is not None), None)
        if rt.lockstep_groups:
            problem = self._spread(problem, [(sm.group, "pipeline")] + rt.lockstep_groups, name) or problem
        if problem is not None:
            raise ValueError(problem)
        rt.refuse_outputs(model, batch, asked)           # agreed over the stages: every rank raises alike
        check = model.__dict__.get(CHECK_ATTR)      # the stages and TP ranks given one batch (shardformer.input_check)
        if check is not None:
            check.step((), batch, extra=((sm.group, "pipeline"),) if sm.num_stages > 1 else (), model=model)
        if backward and criterion is None and "labels" not in batch:
            raise ValueError(f"{type(self).__name__}: {name}: criterion=None uses the model's own loss, but the "
                             f"batch has no 'labels'; add them or pass criterion(outputs, micro_batch)")
        self._at = "before the first micro-batch"
        extra = self._forward_kwargs(model, batch, criterion)
        packed = packing.unsharded_packs(model, batch)   # the unsharded model's masking, decided on the user's batch
        p, v, m = sm.num_stages, sm.num_model_chunks, len(micro)
        V = p * v
        plan = _cached_plan(self._steps, p, v, m, backward, sm.layout)[sm.stage]
        inbox, outbox, saved, losses, outputs = {}, {}, {}, [], []
        shapes = {}                                      # message -> the first stage's layer input shape
        grad_on = torch.is_grad_enabled() and backward
        # B: input gradients; W: the linears' weight gradients.  Not under gradient checkpointing: a layer
        # recomputed in B must save what its forward saved, and torch.utils.checkpoint's recomputation does
        # not see the deferring mode, so there every weight gradient stays in B (the W steps find nothing).
        split = grad_on and self.splits_backward and not getattr(model, "is_gradient_checkpointing", False)
        sinks = {}                                       # (chunk, mb) -> the deferred products (weight_grads)
        timeline = self.timeline
        for step in plan:
            self._at = step
            kind = step[0]
            if timeline is not None and kind in ("F", "B", "W"):
                t0 = time.perf_counter()
            if kind == "recv":
                _, peer, msg = step
                key = (msg[0], msg[1], sig)
                inbox[msg] = self.link.recv_message(peer, key, device, rt.messages_are_tuples)
                if msg[0] == "act":
                    shapes[msg] = self.link.input_shape(key)
            elif kind == "send":
                _, peer, msg = step
                self.link.send_message(outbox.pop(msg), peer, (msg[0], msg[1], sig), shapes.pop(msg, None))
            elif kind == "local":                        # the next virtual stage is this rank's own chunk
                inbox[step[2]] = outbox.pop(step[2])     # (its input shape stays in `shapes`)
            elif kind == "F":
                _, c, i = step
                vs = sm.virtual_stage(c)
                entry = inbox.pop(("act", vs - 1, i)) if vs > 0 else None
                if entry is not None and grad_on:
                    for t in _tensors(entry):
                        if t.is_floating_point():
                            t.requires_grad_(True)
                with torch.set_grad_enabled(grad_on), packing.held(packed), \
                        _deferring(sinks.setdefault((c, i), []) if split else None):
                    out = rt.run(model, c, entry, dict(micro[i], **extra), shapes.pop(("act", vs - 1, i), None))
                if vs == V - 1:
                    if return_outputs:
                        outputs.append(out)
                    if backward or return_loss:
                        loss = self._loss(out, micro[i], criterion, name, m, "num_items_in_batch" in extra)
                        losses.append(loss.detach())
                        saved[(c, i)] = (loss, entry)
                else:
                    outbox[("act", vs, i)] = _detached(out)
                    shapes[("act", vs, i)] = rt.input_shape
                    saved[(c, i)] = (out, entry)
            elif kind == "W":                            # the weight gradients B left in the sink
                weight_grads.apply(sinks.pop(step[1:], []))
            else:                                        # "B"
                _, c, i = step
                vs = sm.virtual_stage(c)
                out, entry = saved.pop((c, i))
                with _deferring(sinks[(c, i)] if split else None):
                    if vs == V - 1:
                        if out.requires_grad:
                            torch.autograd.backward(out)
                    else:
                        grad = inbox.pop(("grad", vs + 1, i))
                        pairs = [(o, g) for o, g in zip(_tensors(out), _tensors(grad)) if o.requires_grad]
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
                if vs > 0:
                    grads = tuple(e.grad if e.grad is not None else torch.zeros_like(e) for e in _tensors(entry))
                    outbox[("grad", vs, i)] = grads if isinstance(entry, tuple) else grads[0]
            if timeline is not None and kind in ("F", "B", "W"):
                timeline.append((kind, step[1], step[2], t0, time.perf_counter()))
        if inbox or outbox or any(sinks.values()):
            raise RuntimeError(f"{name}: pipeline messages or weight gradients left over after the schedule "
                               f"({list(inbox) + list(outbox) + [k for k, v in sinks.items() if v]})")
        self._at = "after the last micro-batch (shared gradients, loss, outputs)"
        if backward:
            self._sum_over_holders(rt)
        result = {"loss": None, "outputs": None}
        if return_loss:
            result["loss"] = self._broadcast_loss(losses, device)
        if return_outputs:
            result["outputs"] = self._gather_outputs(outputs, name, not backward, device, rt.plan.batch_dims)
        return result

    # -- pieces -----------------------------------------------------------------------------

    def _split(self, batch: dict, name: str) -> list[dict]:
        m = self.num_microbatches
        sizes = {k: t.shape[0] for k, t in batch.items() if isinstance(t, torch.Tensor) and t.dim() > 0}
        if not sizes:
            raise ValueError(f"{type(self).__name__}: {name}: the batch holds no tensor to split into micro-batches")
        B = next(iter(sizes.values()))
        odd = {k: n for k, n in sizes.items() if n != B}
        if odd:
            raise ValueError(f"{type(self).__name__}: {name}: batch tensors disagree on the batch size "
                             f"(dimension 0): {sizes}")
        if B % m:
            raise ValueError(f"{type(self).__name__}: {name}: batch size {B} does not split into "
                             f"num_microbatches={m} equal micro-batches")
        size = B // m
        return [{k: (t[i * size:(i + 1) * size] if k in sizes else t) for k, t in batch.items()} for i in range(m)]

    def _agree(self, sig, batch_size: int, backward: bool, name: str, device) -> str | None:
        """Every rank of the pipeline runs the same schedule on the same shapes
        (one small all-gather); the error message when they do not, else None."""
        sm = self.stage_manager
        if sm.num_stages == 1:
            return None
        if device.type != "cpu":                 # the group's communicator for this device type (collective)
            D.backend_for(torch.zeros(1, device=device), sm.group)
        mine = torch.tensor([zlib.crc32(type(self).__name__.encode()), self.num_microbatches,
                             sm.num_model_chunks, batch_size, int(backward),
                             zlib.crc32(repr(sig).encode())], dtype=torch.int64)
        table = torch.empty((sm.num_stages, mine.numel()), dtype=torch.int64)
        D.all_gather_into_tensor(table, mine[None], sm.group)
        if not bool((table == table[0]).all()):
            fields = ("schedule", "num_microbatches", "num_model_chunks", "batch size", "backward",
                      "input shapes and flags")
            rows = [", ".join(f"{f}={int(x)}" for f, x in zip(fields, row)) for row in table.tolist()]
            return (f"{type(self).__name__}: {name}: the pipeline's ranks disagree on the step "
                    f"(crc32 for names and shapes):\n" + "\n".join(f"  stage {s}: {r}" for s, r in enumerate(rows)))
        return None

    def _agree_with_peers(self, groups, backward: bool, name: str, device) -> list:
        """The ranks of each group in `groups` ((group, what) pairs: the
        stage's expert-parallel group, whose exchanges run inside each
        forward and backward) run the same steps in the same order: the same
        schedule, micro-batch count, chunks and forward-only / backward.
        Their batches may differ (other data); the steps may not, or one
        rank's exchange would wait on a peer running another step.  One
        small all-gather per group; returns per group the error message
        naming the ranks when they disagree, else None."""
        problems = []
        for group, what in groups:
            mine = torch.tensor([zlib.crc32(type(self).__name__.encode()), self.num_microbatches,
                                 self.stage_manager.num_model_chunks, int(backward)], dtype=torch.int64)
            if device.type != "cpu":
                D.backend_for(torch.zeros(1, device=device), group)
            ranks = members(group)
            table = torch.empty((len(ranks), mine.numel()), dtype=torch.int64)
            D.all_gather_into_tensor(table, mine[None], group)
            problems.append(None)
            if not bool((table == table[0]).all()):
                names = {zlib.crc32(c.__name__.encode()): c.__name__ for c in _subclasses(PipelineSchedule)}
                fields = ("num_microbatches", "num_model_chunks", "backward")
                rows = [f"{names.get(row[0], f'schedule crc32 {row[0]}')}, "
                        + ", ".join(f"{f}={int(x)}" for f, x in zip(fields, row[1:])) for row in table.tolist()]
                problems[-1] = (f"{type(self).__name__}: {name}: the ranks of the {what} group run other "
                                f"pipeline steps, and its exchanges would wait on each other (every pipeline "
                                f"must run the same schedule; docs/parallel-modes.md#combining-modes):\n"
                                + "\n".join(f"  global rank {r}: {row}" for r, row in zip(ranks, rows)))
        return problems

    def _spread(self, problem: str | None, groups, name: str) -> str | None:
        """A refusal found on some ranks, made known to every rank that would
        wait on them: one int64 all-gathered over the pipeline group, then
        over each EP group (pipeline, EP: every stage of every pipeline
        joined to a refusing rank by a stage or an exchange learns of it).
        Returns None where nothing was refused, the rank's own problem where
        it has one, else a message naming the ranks that refused."""
        bad = problem is not None
        named: list[int] = []
        me = torch.distributed.get_rank()
        for group, what in groups:
            ranks = members(group)
            flags = torch.empty(len(ranks), dtype=torch.int64)
            D.all_gather_into_tensor(flags, torch.tensor([int(bad)], dtype=torch.int64), group)
            found = [r for r, f in zip(ranks, flags.tolist()) if f and r != me]
            named += [r for r in found if r not in named]
            bad = bad or bool(found)
        if not bad or problem is not None:
            return problem
        return (f"{type(self).__name__}: {name}: global {name_ranks(sorted(named))} refused this step (their "
                f"pipeline's stages or expert-parallel peers run other steps; the error there says which), and "
                f"this rank would wait on them; every pipeline must run the same schedule "
                f"(docs/parallel-modes.md#combining-modes)")

    def _forward_kwargs(self, model, batch: dict, criterion) -> dict:
        params = _forward_params(type(model))
        extra = {}
        if "use_cache" in params:
            extra["use_cache"] = False
        if criterion is None and "labels" in batch and "**" in params \
                and getattr(model, "loss_type", None) == "ForCausalLM" and not runtime_of(model).own_mean_loss:
            labels = batch["labels"]
            extra["num_items_in_batch"] = labels[..., 1:].ne(-100).sum()
        return extra

    def _loss(self, out, micro_batch: dict, criterion, name: str, m: int, summed: bool) -> torch.Tensor:
        if criterion is not None:
            loss = criterion(out, micro_batch)
        else:
            loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
            if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
                    and out[0].dim() == 0:
                loss = out[0]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"{type(self).__name__}: {name}: the {'criterion' if criterion else 'model'} gave no "
                             f"scalar loss ({type(loss).__name__})")
        return loss if summed else loss / m

    def _broadcast_loss(self, losses, device):
        sm = self.stage_manager
        total = torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float32, device=device)
        total = total.to(torch.float32).reshape(1).clone()
        if sm.num_stages > 1:
            D.broadcast(total, sm.stage_of(sm.num_virtual_stages - 1), sm.group)
        return total[0]

    def _sum_over_holders(self, rt) -> None:
        """Parameters held by several stages of the pipeline (StageRuntime.
        held_by_several): a tied set (an input embedding and the LM head; an
        encoder-decoder's shared embedding), one copy on each stage holding
        one of its modules, and a module replicated on several stages
        (StageSplit.calls: ALBERT's shared layers, each replica's gradient
        holding its own stage's calls; StageSplit.everywhere: BEiT's shared
        relative position bias).  Either way the unsharded model has one
        parameter whose gradient is the sum of the copies' gradients, so on
        the holders s0 < s1 < ... < sk every copy's gradient becomes

            g = g_s0 + g_s1 + ... + g_sk

        (a copy without a gradient counts as zeros).  Up the chain, s_j
        receives the partial sum of s0..s(j-1), adds its own and passes it
        on; sk then holds the total and it goes back down the chain, so
        every copy gets the same tensor (one order of additions) and steps
        alike.  Every rank walks the parameters in one order (the tied sets
        in plan order, then the replicated modules, module then name) and
        takes part in those it holds only; as each chain's sends and
        receives follow its stage order, and the parameters one order
        everywhere, nothing waits on a transfer that cannot come."""
        me = self.stage_manager.stage
        for stages, key, param in rt.held_by_several:
            j = stages.index(me)
            below = stages[j - 1] if j > 0 else None
            above = stages[j + 1] if j + 1 < len(stages) else None
            total = param.grad if param.grad is not None else torch.zeros_like(param)
            if below is not None:
                total = self.link.recv(below, ("held", key, below, me), total.device) + total
            if above is not None:
                self.link.send(total, above, ("held", key, me, above))
                total = self.link.recv(above, ("held", key, above, me), total.device)
            if below is not None:
                self.link.send(total, below, ("held", key, me, below))
            param.grad = total
            COUNTS["held"] += 1

    def _gather_outputs(self, outputs: list, name: str, broadcast: bool, device, batch_dims: dict):
        """The last stage's micro-batch outputs, concatenated along their batch
        dimension (0, or the policy's StageSplit.batch_dims); with `broadcast`,
        on every rank."""
        sm = self.stage_manager
        last = sm.stage_of(sm.num_virtual_stages - 1)
        merged = _concat(outputs, batch_dims) if outputs else None
        if not broadcast or sm.num_stages == 1:
            return merged
        import torch.distributed as dist

        mine = dict(_items(merged)) if sm.stage == last else {}
        # the last stage's word first, through the group's communicator: a failure there (which
        # failures.guard turns into an abort) reaches the other stages here, where the wait checks
        # for it, and not in the object broadcast below, whose wait does not
        D.broadcast(torch.zeros(1, dtype=torch.int64, device=device), last, sm.group)
        meta = [(type(merged), [(k, tuple(t.shape), t.dtype) for k, t in mine.items()])]
        dist.broadcast_object_list(meta, src=dist.get_global_rank(sm.group, last) if sm.group is not None
                                   else last, group=sm.group)
        cls, fields = meta[0]
        tensors = {k: D.broadcast(mine[k].contiguous() if k in mine else torch.empty(shape, dtype=dtype, device=device),
                                  last, sm.group) for k, shape, dtype in fields}
        return merged if sm.stage == last else _rebuild(cls, tensors)


class GPipeSchedule(PipelineSchedule):
    """All forwards, then all backwards (Huang et al. 2019)."""

    name = "gpipe"
    _steps = staticmethod(_gpipe_steps)


class OneForwardOneBackwardSchedule(PipelineSchedule):
    """1F1B: warm-up forwards, then one forward and one backward in turn."""

    name = "1f1b"
    _steps = staticmethod(_one_f_one_b_steps)


class InterleavedSchedule(PipelineSchedule):
    """Interleaved 1F1B over num_model_chunks > 1 chunks per rank."""

    name = "interleaved"
    _steps = staticmethod(_interleaved_steps)

    def _check_chunks(self) -> None:
        sm = self.stage_manager
        if sm.layout != "loop":
            raise ValueError(f"InterleavedSchedule: the stage manager folds its chunks in a V (layout={sm.layout!r}); "
                             f"use ZeroBubbleVSchedule, or PipelineStageManager(..., layout='loop')")
        if self.num_microbatches % sm.num_stages:
            raise ValueError(f"InterleavedSchedule: num_microbatches={self.num_microbatches} must be a multiple of "
                             f"the {sm.num_stages} pipeline stages")


# ---- helpers ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _forward_params(cls) -> frozenset:
    sig = inspect.signature(cls.forward)
    names = {n for n, prm in sig.parameters.items() if prm.kind != prm.VAR_KEYWORD}
    if any(prm.kind == prm.VAR_KEYWORD for prm in sig.parameters.values()):
        names.add("**")
    return frozenset(names)


def _subclasses(cls) -> list:
    """cls and every subclass of it defined so far (the schedules a peer may run)."""
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def _device_of(model) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _deferring(sink):
    """weight_grads.deferring(sink), or nothing with sink None."""
    return contextlib.nullcontext() if sink is None else weight_grads.deferring(sink)


def _tensors(message) -> tuple:
    """A message's tensors: itself, or the tuple's."""
    return tuple(message) if isinstance(message, tuple) else (message,)


def _detached(message):
    return tuple(t.detach() for t in message) if isinstance(message, tuple) else message.detach()


def _items(out):
    if isinstance(out, torch.Tensor):
        return [("", out)]
    if isinstance(out, dict):
        return [(k, t) for k, t in out.items() if isinstance(t, torch.Tensor)]
    if isinstance(out, (tuple, list)):
        return [(str(k), t) for k, t in enumerate(out) if isinstance(t, torch.Tensor)]
    raise TypeError(f"pipeline outputs: cannot gather a {type(out).__name__}")


def _concat(outputs: list, batch_dims: dict):
    parts = [dict(_items(o)) for o in outputs]
    cat = {k: torch.cat([p[k].detach() for p in parts], batch_dims.get(k, 0)) if t.dim() > 0 else
           torch.stack([p[k].detach() for p in parts]).mean() for k, t in parts[0].items()}
    return _rebuild(type(outputs[0]), cat)


def _rebuild(cls, tensors: dict):
    if cls is torch.Tensor or issubclass(cls, torch.Tensor):
        return tensors[""]
    if issubclass(cls, dict):
        return cls(**tensors)
    return tuple(tensors[str(k)] for k in range(len(tensors)))
