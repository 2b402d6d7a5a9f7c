"""Rank-side checks of a failing stage (tests/test_pipefail.py).

One rank raises in the middle of a pipeline step (a forward hook on one of
its decoder layers raising at micro-batch 2, in the forward or, through a
hook on the layer's output, in the backward; phase "inference": in the
forward of schedule.forward(); or, phase "batch", a batch
that only this rank is given, one row short, refused before the step's
first collective): that rank must re-raise its
own exception (same type) with shardformer's note, and every other rank a
PeerFailed naming the failing rank, its exception and where, within seconds
(the times go back to the driver, which compares them across ranks).  Then
the same schedule runs a good step on the same model: its loss and every
gradient equal the unsharded HF model's from the same seed."""
from __future__ import annotations

import copy
import inspect
import time

import torch

from checks import parity
from checks.pipeline import batch_of, build, groups
from checks.zero_bubble import _pipelined
from shardformer import ShardConfig, ShardFormer
from shardformer.pipeline import (GPipeSchedule, InterleavedSchedule, OneForwardOneBackwardSchedule,
                                  ZeroBubbleSchedule, ZeroBubbleVSchedule)

NAME = "LlamaForCausalLM"
M = 4                  # micro-batches; the hook raises at micro-batch BAD_MB
BAD_MB = 2
# schedule -> (class, chunks, layout)
SCHEDULES = {"gpipe": (GPipeSchedule, 1, "loop"), "1f1b": (OneForwardOneBackwardSchedule, 1, "loop"),
             "zb-h1": (ZeroBubbleSchedule, 1, "loop"), "interleaved": (InterleavedSchedule, 2, "loop"),
             "zb-v": (ZeroBubbleVSchedule, 2, "v")}


class StageBoom(Exception):
    """The user's exception, raised on the failing rank only."""


def _held_layer(model):
    """The first decoder layer this rank holds (its chunk 0's first)."""
    for module in model.modules():
        if type(module).__name__ == "LlamaDecoderLayer" and any(True for _ in module.parameters()):
            return module
    raise AssertionError("no decoder layer on this rank")


def _raising_hook(phase: str, raised: dict):
    """A forward hook raising StageBoom at micro-batch BAD_MB: in its forward,
    or (phase "backward") when the gradient of that call's output arrives."""
    calls = [0]

    def boom(*_):
        raised["t"] = time.time()
        raise StageBoom(f"bad value at micro-batch {BAD_MB} ({phase})")

    def hook(module, args, out):
        calls[0] += 1
        if calls[0] != BAD_MB + 1:
            return None
        if phase != "backward":
            boom()
        (out if isinstance(out, torch.Tensor) else out[0]).register_hook(boom)
        return None
    return hook


def _one_failure(ctx, runner, model, batch, bad: int, phase: str, schedule: str) -> dict:
    """Run the step with rank `bad` raising; what this rank saw, checked."""
    raised: dict = {}
    hook = phase != "batch" and ctx.rank == bad
    handle = _held_layer(model).register_forward_hook(_raising_hook(phase, raised)) if hook else None
    if phase == "batch" and ctx.rank == bad:          # a batch only this rank sees: one row short
        batch = {k: t[1:] if isinstance(t, torch.Tensor) else t for k, t in batch.items()}
    t0 = raised["t"] = time.time()
    step = runner.forward if phase == "inference" else runner.forward_backward_step
    error, caught = _raised_by(lambda: step(model, batch), handle,
                               f"{schedule}: rank {ctx.rank}: the step with rank {bad} raising")
    text = str(error)
    if phase == "batch":
        exc, message, where = "ValueError", f"batch size {2 * M - 1} does not split", "schedule, stage"
    else:
        exc, message = "StageBoom", f"bad value at micro-batch {BAD_MB} ({phase})"
        where = f"{'forward' if phase == 'inference' else phase} of micro-batch {BAD_MB}"
    if ctx.rank == bad:
        assert type(error).__name__ == exc, f"{schedule}: the failing rank raised {type(error).__name__}: {text}"
        notes = " ".join(getattr(error, "__notes__", []))
        assert "shardformer" in notes and f"global rank {bad} raised this" in notes, notes
        assert where in notes and f"{SCHEDULES[schedule][0].name} schedule" in notes, notes
        return {"raised": raised["t"], "caught": caught, "start": t0}
    # by name: the check also runs against a shardformer without it (where the peers hang instead)
    _check_peer(error, ctx.rank, bad, schedule, (exc, message, where, f"{SCHEDULES[schedule][0].name} schedule"))
    return {"caught": caught, "start": t0}


def _raised_by(call, handle, what: str) -> tuple[BaseException, float]:
    """(what call() raised, the time it came); the hook's handle removed."""
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the check looks at whatever came
        return e, time.time()
    else:
        raise AssertionError(f"{what} returned")
    finally:
        if handle is not None:
            handle.remove()


def _check_peer(error: BaseException, rank: int, bad: int, what: str, parts) -> None:
    """A peer's error: PeerFailed naming rank `bad`, holding each of `parts`."""
    text = str(error)
    # by name: the check also runs against a shardformer without it (where the peers hang instead)
    assert type(error).__name__ == "PeerFailed" and isinstance(error, RuntimeError), \
        f"{what}: rank {rank}: {type(error).__name__}: {text}"
    assert error.ranks == [bad], (error.ranks, text)
    for part in (f"global rank {bad} raised", f"global rank {rank} stopped waiting", *parts):
        assert part in text, f"{what}: rank {rank}: {part!r} not in: {text}"


def _good_step(runner, model, ref, batch, tag: str) -> float:
    """A step with good input after the failure: loss and gradients equal the unsharded model's."""
    for mdl in (model, ref):
        mdl.zero_grad(set_to_none=True)
    out = runner.forward_backward_step(model, batch)
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(type(ref).forward).parameters else {}
    exp = ref(**batch, **no_cache)
    exp.loss.backward()
    tol = parity.TOL[torch.float32]
    err = parity.assert_close(f"{tag} loss after a failed step", out["loss"], exp.loss.detach(), tol)
    return max(err, parity.compare_grads(model, ref, f"{tag} after a failed step", tol))


def _failing_generate(ctx, model, ref, bad: int) -> dict:
    """generate() with rank `bad` raising at decoding step BAD_MB + 1 (its layer's
    third call: the prefill, then two new tokens), then a greedy generate() equal
    to the unsharded model's."""
    from checks.pipeline_generate import prompts

    model.eval()
    ref.eval()
    batch, kwargs = prompts(), dict(max_new_tokens=5, pad_token_id=0, do_sample=False)
    raised: dict = {}
    handle = _held_layer(model).register_forward_hook(_raising_hook("forward", raised)) if ctx.rank == bad else None
    with torch.no_grad():
        error, caught = _raised_by(lambda: model.generate(**batch, **kwargs), handle,
                                   f"generate: rank {ctx.rank}: rank {bad} raising, generate()")
    step = f"decoding step {BAD_MB + 1}"
    if ctx.rank == bad:
        notes = " ".join(getattr(error, "__notes__", []))
        assert type(error) is StageBoom and f"generate, stage {bad}" in notes and step in notes, (error, notes)
    else:
        _check_peer(error, ctx.rank, bad, "generate", ("StageBoom", step))
    with torch.no_grad():
        got, exp = model.generate(**batch, **kwargs), ref.generate(**batch, **kwargs)
    assert torch.equal(got, exp), f"generate after a failure: rank {ctx.rank} decoded\n{got}\nunsharded\n{exp}"
    model.train()
    ref.train()
    return {"raised": raised.get("t"), "caught": caught, "good": 0.0}


def _tensor_parallel(ctx, how: str):
    """(reference, model sharded over the world at TP=world): how "default" the plain
    ShardConfig(), "sp" an explicit group with split_gather sequence parallelism."""
    torch.manual_seed(0)
    model = build(NAME, 2)
    model.train()
    ref = copy.deepcopy(model)
    cfg = ShardConfig() if how == "default" else ShardConfig(
        tensor_parallel_process_group=groups(ctx, 1, ctx.world_size)[0], enable_sequence_parallelism=True,
        sequence_parallelism_mode="split_gather")
    model, _ = ShardFormer(shard_config=cfg).optimize(model)
    return ref, model


def _good_tp_step(model, ref, batch, tag: str) -> float:
    """A forward / backward with good input: loss and gradients equal the unsharded model's."""
    for mdl in (model, ref):
        mdl.zero_grad(set_to_none=True)
    out, exp = model(**batch), ref(**batch)
    out.loss.backward()
    exp.loss.backward()
    tol = parity.TOL[torch.float32]
    err = parity.assert_close(f"{tag} loss", out.loss.detach(), exp.loss.detach(), tol)
    return max(err, parity.compare_grads(model, ref, tag, tol))


def _failing_forward(ctx, ref, model, how: str, bad: int, batch) -> dict:
    """No pipeline (shardformer.step_guard): a forward hook on rank `bad`'s first decoder layer
    raises in forward(); rank `bad` re-raises it with the note, every peer raises PeerFailed
    naming it (not a wait until the shm timeout); then a good forward / backward equals unsharded."""
    raised: dict = {}

    def boom(*_):
        raised["t"] = time.time()
        raise StageBoom("bad value in a tensor-parallel forward")

    handle = _held_layer(model).register_forward_hook(boom) if ctx.rank == bad else None
    t0 = raised["t"] = time.time()
    error, caught = _raised_by(lambda: model(**batch).loss.backward(), handle,
                               f"TP={ctx.world_size} ({how}): rank {ctx.rank}: rank {bad} raising in forward()")
    where = "forward() call 1 of"
    if ctx.rank == bad:
        notes = " ".join(getattr(error, "__notes__", []))
        assert type(error) is StageBoom, f"the failing rank raised {type(error).__name__}: {error}"
        assert f"global rank {bad} raised this" in notes and where in notes, notes
        seen = {"raised": raised["t"], "caught": caught, "start": t0}
    else:
        _check_peer(error, ctx.rank, bad, f"TP={ctx.world_size} ({how})",
                    ("StageBoom: bad value in a tensor-parallel forward", where))
        seen = {"caught": caught, "start": t0}
    seen["good"] = _good_tp_step(model, ref, batch, f"{NAME} (TP={ctx.world_size}, {how}) after a failed forward")
    return dict(seen, schedule=f"tp-{how}", phase="forward")


# phases of _failing_backward: where rank `bad`'s loss.backward() raises (backward_watch):
# "backward" at its first decoder layer's output gradient (its peers wait in that layer's
# all-reduce); "late" at the embeddings' output gradient, after its last collective (its peers
# finish the backward); "loss" in the caller's own loss computed from the logits, before the
# backward reaches the model's outputs (its next forward's first call meets the peers' first
# backward call)
BACKWARD_PHASES = ("backward", "late", "loss")


def _failing_backward(ctx, ref, model, how: str, bad: int, batch, phase: str) -> dict:
    """No pipeline: rank `bad`'s loss.backward() raises (a gradient hook; where: BACKWARD_AT),
    the caller catches it and goes on with its next forward() (the "skip the bad batch" loop).
    Never a silent pairing of that forward with the peers' backward, never a wait for the shm
    timeout: every rank gets an error from that step, the peers within seconds, naming rank
    `bad`; then a good forward / backward equals unsharded."""
    raised: dict = {}
    tag = f"TP={ctx.world_size} ({how}), backward raising ({phase}): rank {ctx.rank}"

    def boom(*_):
        raised["t"] = time.time()
        raise StageBoom(f"bad gradient ({phase})")

    def on_output_grad(module, args, output):
        (output if isinstance(output, torch.Tensor) else output[0]).register_hook(boom)

    handles = []
    if ctx.rank == bad and phase != "loss":
        at = _held_layer(model) if phase == "backward" else model.get_input_embeddings()
        handles.append(at.register_forward_hook(on_output_grad))
    for mdl in (model, ref):
        mdl.zero_grad(set_to_none=True)
    t0 = raised["t"] = time.time()
    out = model(**batch)
    loss = out.logits.float().square().mean() if phase == "loss" else out.loss   # "loss": the caller's own
    if ctx.rank == bad and phase == "loss":
        loss.register_hook(boom)
    try:
        loss.backward()
    except BaseException as e:  # noqa: BLE001 - looked at below
        error, caught = e, time.time()
    else:
        error, caught = None, time.time()
    finally:
        for h in handles:
            h.remove()
    seen = {"start": t0, "caught": caught}
    nxt = None
    if ctx.rank == bad:
        assert type(error) is StageBoom, f"{tag}: {type(error).__name__}: {error}"
        seen["raised"] = raised["t"]
        if phase != "backward":                       # its next forward() fails too (all skip it)
            nxt, _ = _raised_by(lambda: model(**batch), None, f"{tag}: the next forward()")
    elif phase == "late":                             # the peers finished; their next forward() fails
        assert error is None, f"{tag}: {type(error).__name__}: {error}"
        nxt, seen["caught"] = _raised_by(lambda: model(**batch), None, f"{tag}: the next forward()")
        _check_peer(nxt, ctx.rank, bad, tag, ("an exception in backward",
                                              "backward of forward() call", f"raised on global rank {bad}"))
    elif phase == "backward":
        _check_peer(error, ctx.rank, bad, tag, ("an exception in backward",
                                                "backward of forward() call", f"raised on global rank {bad}",
                                                "in backward"))
    else:
        assert error is not None, f"{tag}: the peers' backward returned (paired with rank {bad}'s forward?)"
    if phase == "loss":                               # a mismatch naming both ranks and both calls
        text = str(error if ctx.rank != bad else nxt)
        for part in ("collective mismatch", "in forward", "in backward", f"rank {bad} called"):
            assert part in text, f"{tag}: {part!r} not in: {text}"
    if phase == "late" and ctx.rank == bad:
        text = str(nxt)
        assert f"raised on global rank {bad} after its last collective" in text and "finished that backward" in text, text
    seen["good"] = _good_tp_step(model, ref, batch, f"{NAME} ({tag}) the step after")
    return dict(seen, schedule=f"tp-{how}", phase=phase)


def _phase_pairing(ctx, bad: int) -> dict:
    """The pairing itself, through the tensor-parallel region operators over the default
    group: every rank but `bad` all-reduces a gradient in backward (copy_to_tp_region's)
    while rank `bad` (its backward skipped) all-reduces a forward tensor of the same size
    and dtype (reduce_from_tp_region's).  Before the phase tag the two summed
    silently (the backward's gradient came back holding rank `bad`'s activations); now
    every rank raises a collective mismatch naming both ranks and both calls.  The
    group's communicator is dropped afterwards (every rank), as after any failed step."""
    from shardformer.distributed import communicator
    from shardformer.distributed.mappings.tensor import copy_to_tp_region, reduce_from_tp_region

    t0 = time.time()
    if ctx.rank == bad:
        error, caught = _raised_by(lambda: reduce_from_tp_region(torch.full((96,), 5.0)), None,
                                   f"pairing: rank {bad}'s forward all_reduce")
    else:
        x = torch.ones(96, requires_grad=True)
        error, caught = _raised_by(lambda: copy_to_tp_region(x).sum().backward(), None,
                                   f"pairing: rank {ctx.rank}'s backward all_reduce")
    text = str(error)
    for part in ("collective mismatch", "in forward", "in backward", "all_reduce(sum, 384 bytes, float32"):
        assert part in text, f"pairing: rank {ctx.rank}: {part!r} not in: {text}"
    assert f"rank {bad} called" in text or f"rank 0 called all_reduce(sum, 384 bytes, float32, one-shot) in " \
        f"{'forward' if bad == 0 else 'backward'}" in text, text
    communicator.forget_group(None)
    return {"start": t0, "caught": caught, "good": 0.0, **({"raised": t0} if ctx.rank == bad else {}),
            "schedule": "shm", "phase": "pairing"}


def failing_stage(ctx, bad: int, runs) -> list[dict]:
    """For each (pp, tp, how, cases) of `runs` (how: checks.zero_bubble._pipelined's)
    and each (schedule, phase) of its cases: rank `bad` raises at micro-batch
    BAD_MB (see the module doc), then a good step equals unsharded.  One model
    per (chunks, layout) and run, reused by the schedules that share it; a case
    ("generate", _) runs _failing_generate on the one-chunk model.  Returns,
    per case, this rank's times (time.time(): `raised` on the failing rank,
    `caught` everywhere) and the good step's worst relative error."""
    batch = batch_of(NAME, 2 * M)
    out = []
    for pp, tp, how, cases in runs:
        built: dict = {}
        for schedule, phase in cases:
            if schedule == "shm":                      # the pairing itself, on the world's communicator
                out.append(_phase_pairing(ctx, bad))
                continue
            if schedule == "tp":                       # no pipeline: TP over the world (pp, tp unused)
                if "tp" not in built:
                    built["tp"] = _tensor_parallel(ctx, how)
                ref, model = built["tp"]
                out.append(_failing_forward(ctx, ref, model, how, bad, batch) if phase == "forward" else
                           _failing_backward(ctx, ref, model, how, bad, batch, phase))
                continue
            if schedule == "generate":                  # on the one-chunk model of an earlier case
                ref, model, _ = built[(1, "loop")]
                out.append(dict(_failing_generate(ctx, model, ref, bad), schedule=schedule, phase=phase))
                continue
            cls, chunks, layout = SCHEDULES[schedule]
            if (chunks, layout) not in built:
                built[(chunks, layout)] = _pipelined(ctx, NAME, pp, tp, schedule, max(4, pp * chunks), how,
                                                     shape=(chunks, layout))
            ref, model, sm = built[(chunks, layout)]
            runner = cls(sm, num_microbatches=M)
            seen = _one_failure(ctx, runner, model, batch, bad, phase, schedule)
            seen["good"] = _good_step(runner, model, ref, batch, f"{NAME} ({schedule}, pp={pp}, tp={tp}, {how})")
            out.append(dict(seen, schedule=schedule, phase=phase))
    return out
