"""Rank-side checks of checkpoint.save_state / load_state (tests/test_resume.py).

The model is zoo's GPT2LMHeadModel (6 heads, 90 MLP features, vocabulary 99:
uneven at TP=4) with every dropout at 0.1, so TP dropout modules
(replicated and parallel input) and torch's generator both draw masks;
AdamW with a warm-up LambdaLR.  A run is `steps` training steps on batches
drawn from the step number.  Layouts:

    tp2      TP=2 over an explicit group (ShardConfig(tensor_parallel_process_group=...))
    dp2tp2   shardformer.mesh(dp=2, tp=2): TP=2, and DDP over the two replicas
             (shardformer.data_parallel), each taking its row of the batch
    world    TP over the whole world with the plain ShardConfig() (TP=4 in a world
             of 4, TP=2 in the world of 2 of the kill test)

The first half runs in the long-lived rank pool; the resume half in a world
of new processes (shardformer.launch.spawn from the test), so nothing of the
first half's process state (torch's generators, the dropout modules, the
optimizer) can carry over except through the checkpoint.
"""
from __future__ import annotations

import os
import pickle
import signal

import numpy as np
import torch
import torch.distributed as dist

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer, data_parallel, mesh
from shardformer.checkpoint import gather_full_state_dict, load_state, save_state

NAME = "GPT2LMHeadModel"
P = 0.1
LR, WD, WARMUP = 1e-3, 0.1, 4
TOL = parity.TOL[torch.float32]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def batch(step: int) -> dict:
    return zoo.make_inputs(NAME, seed=100 + step)


class Run:
    """The sharded model of `layout` (from `seed`), its optimizer, scheduler
    and the group save_state / load_state run over."""

    def __init__(self, layout: str, group, seed: int, dropout: bool, dtype=torch.float32):
        model = zoo.build_with_dropout(NAME, P, seed=seed) if dropout else zoo.build(NAME, seed=seed)
        model = model.to(dtype).train()
        self.group, self.dp_rank, self.layout = group, 0, layout
        if layout == "tp2":
            ShardFormer(shard_config=ShardConfig(tensor_parallel_process_group=group)).optimize(model)
            self.runner = model
        elif layout == "dp2tp2":
            m = mesh(dp=2, tp=2)
            ShardFormer(shard_config=m.shard_config()).optimize(model)
            self.runner, self.dp_rank = data_parallel(model, m), m.coords["dp"]
        elif layout == "world":
            ShardFormer(shard_config=ShardConfig()).optimize(model)
            self.runner = model
        elif layout == "plain":
            self.runner = model
        else:
            raise ValueError(layout)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup)

    def train(self, steps) -> list[float]:
        losses = []
        for step in steps:
            inputs = batch(step)
            if self.layout == "dp2tp2":
                inputs = {k: v[self.dp_rank:self.dp_rank + 1] for k, v in inputs.items()}
            if next(self.model.parameters()).dtype == torch.float64:
                inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
            loss = parity.loss_of(self.runner(**inputs), {})
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return losses

    def save(self, directory: str, step: int, **kwargs):
        return save_state(self.runner, directory, self.optimizer, self.scheduler, step=step,
                          process_group=self.group, **kwargs)

    def load(self, directory: str) -> dict:
        return load_state(self.runner, directory, self.optimizer, self.scheduler, process_group=self.group)

    def local(self) -> dict:
        """This rank's tensors (its shards), NumPy."""
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}


def _pool_group(ctx, layout: str):
    return None if layout in ("dp2tp2", "world") else ctx.group


def first_half(ctx, layout: str, dropout: bool, directory: str) -> dict:
    """Straight: 6 steps.  Interrupted: the same 3 steps, then save_state.
    Both from seed 0 and the same torch generator state."""
    group = _pool_group(ctx, layout)
    torch.manual_seed(11)
    straight = Run(layout, group, seed=0, dropout=dropout)
    losses = straight.train(range(6))
    torch.manual_seed(11)
    part = Run(layout, group, seed=0, dropout=dropout)
    first = part.train(range(3))
    assert first == losses[:3], (first, losses[:3])
    part.save(directory, 3, extra={"losses": first})
    return {"losses": losses, "weights": straight.local()}


def _unsharded_straight(dtype) -> tuple:
    """The unsharded model (seed 0, no dropout) after 6 steps and its losses."""
    run = Run("plain", None, seed=0, dropout=False, dtype=dtype)
    losses = run.train(range(6))
    return run.model.state_dict(), losses


def _against_unsharded(full: dict, losses: list) -> dict:
    """The full weights and the losses of steps 4..6 of the TP=2 -> TP=4
    resume against the unsharded straight run: within the float32 tolerance
    plus twice that run's own error against float64."""
    exp, ref_losses = _unsharded_straight(torch.float32)
    exp64, ref64_losses = _unsharded_straight(torch.float64)
    for i, (a, b, b64) in enumerate(zip(losses, ref_losses[3:], ref64_losses[3:])):
        parity.assert_close(f"{NAME} TP=2 -> TP=4: loss of step {4 + i}", torch.tensor(a), torch.tensor(b), TOL,
                            torch.tensor(b64, dtype=torch.float64))
    return {k: parity.assert_close(f"{NAME} TP=2 -> TP=4, after step 6: {k}", full[k], exp[k], TOL, exp64[k])
            for k in exp}


def second_half(rank: int, cases: list, out_dir: str, kill_dir: str) -> None:
    """In a new world of 4 processes: each case (layout, dropout, directory)
    builds its model from another seed, scrambles torch's generator, loads
    the checkpoint and trains steps 3..5.  tp2 runs on ranks 0 and 1.  The
    case "world" (TP=4, dropout off) is compared here with the unsharded
    straight run (_against_unsharded, on rank 0).  Each rank's results go to
    out_dir/rankR.pkl; then the same world runs save_then_killed (its last
    act: rank 1 dies)."""
    pair = dist.new_group([0, 1])
    out = {}
    for layout, dropout, directory in cases:
        group = pair if layout == "tp2" else None
        if layout == "tp2" and rank > 1:
            continue
        run = Run(layout, group, seed=7, dropout=dropout)
        torch.manual_seed(1000 + rank)
        state = run.load(directory)
        assert state["step"] == 3 and len(state["extra"]["losses"]) == 3, state
        assert run.scheduler.last_epoch == 3, run.scheduler.last_epoch
        losses = run.train(range(3, 6))
        result = {"extra": state["extra"]["losses"], "losses": losses, "weights": run.local()}
        if layout == "world":
            result["weights"] = None
            full = gather_full_state_dict(run.model)
            if rank == 0:
                result["errors"] = _against_unsharded(full, losses)
        out[layout] = result
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    save_then_killed(rank, kill_dir)


# ------------------------------------------------------------------ atomic

def save_then_killed(rank: int, directory: str) -> None:
    """TP = the world (plain ShardConfig()): one step and save_state (step 1);
    one more step and save_state again, where rank 1 is SIGKILLed as soon
    as it has written (and fsynced) its first file."""
    run = Run("world", None, seed=0, dropout=True)
    torch.manual_seed(11)
    run.train(range(1))
    run.save(directory, 1)
    run.train(range(1, 2))
    if rank == 1:
        real = os.fsync

        def fsync_then_die(fd):
            real(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        os.fsync = fsync_then_die
    run.save(directory, 2)
    raise AssertionError(f"rank {rank}: the second save_state returned although rank 1 was killed")


def load_after_kill(ctx, directory: str) -> dict:
    """After the killed save: `directory` holds the step-1 checkpoint, which
    loads (weights bit for bit those of one step from seed 0); the next
    save_state removes the killed save's temporary directory."""
    ref = Run("world", None, seed=0, dropout=True)
    torch.manual_seed(11)
    ref.train(range(1))
    run = Run("world", None, seed=7, dropout=True)
    state = run.load(directory)
    assert state["step"] == 1, state
    differ = [k for k, v in run.local().items() if not np.array_equal(v, ref.local()[k])]
    assert not differ, f"the checkpoint after the killed save is not step 1's: {differ}"
    parent, base = os.path.split(directory)
    leftovers = [n for n in os.listdir(parent) if n.startswith(f".{base}.partial-")]
    run.save(directory, 5)
    after = [n for n in os.listdir(parent) if n.startswith(f".{base}.")]
    assert not after, after
    assert run.load(directory)["step"] == 5
    return {"leftovers": leftovers}


# ------------------------------------------------------------------ async, bad input

def async_and_refusals(ctx, directory: str) -> dict:
    """TP=2 (explicit group): save_state(async_save=True) returns at once
    with a handle; a training step taken while it writes does not reach the
    checkpoint (it holds the state at the call, bit for bit: weights, AdamW
    moments, scheduler); a second async save waits for the first; the
    user's files in the directory stay, stale DCP files go.  Then bad
    input is refused on every rank before anything is written."""
    import time

    run = Run("tp2", ctx.group, seed=0, dropout=True)
    run.train(range(2))
    weights = run.local()
    moments = {id(p): s["exp_avg"].clone() for p, s in run.optimizer.state.items()}
    t0 = time.perf_counter()
    handle = run.save(directory, 2, async_save=True)
    blocked = time.perf_counter() - t0
    run.train(range(2, 3))                    # changes everything the save copied
    handle.wait()
    assert handle.done()
    again = Run("tp2", ctx.group, seed=7, dropout=True)
    assert again.load(directory)["step"] == 2 and again.scheduler.last_epoch == 2
    differ = [k for k, v in again.local().items() if not np.array_equal(v, weights[k])]
    assert not differ, f"the asynchronous checkpoint differs from the state at the call: {differ}"
    for p_new, p_old in zip(again.model.parameters(), run.model.parameters()):
        assert torch.equal(again.optimizer.state[p_new]["exp_avg"], moments[id(p_old)])
    if ctx.rank == 0:       # a file of the user's, and a DCP file of a save from a larger world
        for name in ("notes.txt", "__7_0.distcp"):
            open(os.path.join(directory, name), "w").close()
    h1 = run.save(directory, 3, async_save=True)
    h2 = run.save(directory, 4, async_save=True)     # waits for h1 first
    assert h1.done()
    h2.wait()
    assert Run("tp2", ctx.group, seed=7, dropout=True).load(directory)["step"] == 4
    kept = sorted(os.listdir(directory))
    assert "notes.txt" in kept and "__7_0.distcp" not in kept, kept    # carried over / superseded

    messages = {}
    fresh = directory + "-never"
    try:
        run.save(fresh, step=ctx.rank)
    except ValueError as e:
        messages["steps"] = str(e)
    assert not os.path.exists(fresh), "a refused save wrote something"
    assert "rank 1: 1" in messages.get("steps", ""), messages
    plain = directory + "-plain"
    save_state(run.model, plain, step=0, process_group=ctx.group)
    try:
        load_state(run.model, plain, run.optimizer, process_group=ctx.group)
    except ValueError as e:
        messages["no_optimizer"] = str(e)
    assert "saved without an optimizer" in messages.get("no_optimizer", ""), messages
    try:
        load_state(run.model, directory + "-missing", process_group=ctx.group)
    except FileNotFoundError as e:
        messages["missing"] = str(e)
    assert "no checkpoint directory" in messages.get("missing", ""), messages
    return {"blocked_s": blocked, **messages}


# ------------------------------------------------------------------ docs/resume.md

def docs_recipe(ctx, path: str, directory: str) -> dict:
    """docs/resume.md's script (its main(), as written, at TP = the world):
    6 steps straight; 3 steps into `directory`, then a fresh main() that
    resumes from it to step 6: the same 6 losses and weights, bit for bit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("resume_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    straight = recipe.main(directory + "-straight", steps=6)
    first = recipe.main(directory, steps=3)
    resumed = recipe.main(directory, steps=6)
    assert first == straight[:3] and resumed == straight, (first, resumed, straight)
    return {"losses": straight}


# ------------------------------------------------------------------ across layouts: PP, EP, ZeRO-1

def _layout_run(ctx, arch: str, layout: dict, seed: int, dropout: float = 0.0):
    """checks.dcp_layouts' model, trainer (1F1B for pipeline stages, DDP for
    DP) and optimizer (AdamW, or ZeRO-1 with layout["zero"]) of `layout`,
    with the warm-up LambdaLR.  Returns (model, wrapped, optimizer,
    scheduler, train(n))."""
    from checks import dcp_layouts as dl

    model, m = dl._build(ctx, arch, layout, seed, dropout)
    wrapped, step = dl._trainer(model, m, layout)
    optimizer = dl._optimizer(model, layout, wrapped)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)

    def train(n: int) -> None:
        for _ in range(n):
            step(optimizer)
            scheduler.step()
    return model, wrapped, optimizer, scheduler, train


def _full_numpy(model) -> dict:
    return {k: v.numpy() for k, v in gather_full_state_dict(model).items()}


def _dropout_states(model) -> dict:
    from shardformer.layer.dropout import _SeededDropout

    return {n: (m.seed, m.step) for n, m in model.named_modules() if isinstance(m, _SeededDropout)}


def save_layouts(ctx, cases: list) -> dict:
    """Each case (arch, layout, directory, dropout, straight[, async_save]):
    one step from seed 0 in `layout` (torch's generator seeded per rank,
    so a rank that takes another's after the load draws other masks),
    then save_state (step 1; with async_save, asynchronous, waited for).
    With dropout, returns {"dropout": every TP dropout module's (seed,
    step) at the save, over all ranks (a stage holds its own layers'
    modules)}, and with `straight` also "weights": the full weights of
    the straight run of 3 steps in the same layout (a same-layout resume
    must give them bit for bit) and "torch_rng": this rank's torch
    generator at the save (a same-layout resume must give each rank its
    own)."""
    from checks import dcp_layouts as dl

    out = {}
    for arch, layout, directory, dropout, straight, *asynchronous in cases:
        group = dl._group(ctx, layout)
        out[directory] = {}
        if straight:
            model, _, _, _, train = _layout_run(ctx, arch, layout, 0, dropout)
            torch.manual_seed(11 + ctx.rank)         # after zoo.build, which seeds it
            train(3)
            out[directory]["weights"] = _full_numpy(model)
        model, wrapped, optimizer, scheduler, train = _layout_run(ctx, arch, layout, 0, dropout)
        torch.manual_seed(11 + ctx.rank)
        train(1)
        if straight:
            out[directory]["torch_rng"] = torch.get_rng_state().numpy()
        handle = save_state(wrapped, directory, optimizer, scheduler, step=1, extra={"layout": layout},
                            process_group=group, async_save=bool(asynchronous and asynchronous[0]))
        if handle is not None:
            handle.wait()
        if dropout:
            records = [None] * ctx.world_size
            dist.all_gather_object(records, _dropout_states(model), group=group)
            out[directory]["dropout"] = {k: v for r in records for k, v in r.items()}
    return out


def resume_layouts(ctx, cases: list) -> dict:
    """Each case (arch, layout, directory, dropout, expect): a model from
    seed 5 in `layout` with a fresh optimizer and scheduler, torch's
    generator scrambled per rank, load_state of `directory`, two more
    steps.  Then the optimizer's step and the scheduler are the saved ones
    plus two and, by `expect` (save_layouts' record for the directory):
    None (another layout, dropout off): the full weights equal the
    unsharded straight run of 3 steps (AdamW, LambdaLR) within the float32
    tolerance plus twice its own error against float64 (Mixtral: 5% of the
    learning rate, as checks.dcp_layouts); "weights" (the same layout):
    bit for bit the straight run's, and each rank's torch generator its
    own at the save ("torch_rng": one per rank); "dropout" only (another layout, dropout
    on): after the load every TP dropout module has the (seed, step) it had
    at the save, whichever rank or stage held it."""
    from checks import dcp_layouts as dl

    errors = {}
    for arch, layout, directory, dropout, expect in cases:
        model, wrapped, optimizer, scheduler, train = _layout_run(ctx, arch, layout, 5, dropout)
        torch.manual_seed(1000 + ctx.rank)
        state = load_state(wrapped, directory, optimizer, scheduler, process_group=dl._group(ctx, layout))
        assert state["step"] == 1 and "layout" in state["extra"], state
        if expect is not None and "weights" not in expect:
            got = _dropout_states(model)
            assert got and got == {k: expect["dropout"][k] for k in got}, (got, expect["dropout"])
        if expect is not None and "torch_rng" in expect:
            assert np.array_equal(torch.get_rng_state().numpy(), expect["torch_rng"][ctx.rank]), \
                f"rank {ctx.rank}: torch's generator after load_state at the same layout is not its own"
        train(2)
        local = optimizer.optim if layout.get("zero") else optimizer
        steps = {float(s["step"]) for s in local.state.values()}
        assert steps == {3.0} and scheduler.last_epoch == 3, (steps, scheduler.last_epoch)
        full = gather_full_state_dict(model)
        what = f"{dl.MODELS[arch][0]} {state['extra']['layout']} -> {layout}"
        if expect is not None:
            straight = expect.get("weights", {})
            differ = [k for k in straight if not np.array_equal(full[k].numpy(), straight[k])]
            assert not straight or full.keys() == straight.keys(), sorted(set(full) ^ set(straight))
            assert not differ, f"{what}: differs from the straight run: {differ}"
            errors[what] = 0.0
            continue
        exp, exp64 = (dl._straight(arch, 3, dtype, warmup).state_dict() for dtype in (torch.float32, torch.float64))
        assert full.keys() == exp.keys(), sorted(set(full) ^ set(exp))
        tol = (0.0, 0.05 * LR) if arch == "mixtral" else TOL
        errors[what] = max(parity.assert_close(f"{what}, 2 steps after load_state: {k}", full[k], exp[k], tol,
                                               exp64[k]) for k in exp)
    return errors


def _micro(run: Run, step: int, half: int):
    """The backward of half `half` (0 or 1) of batch(step)'s rows, the loss
    halved: two of them accumulate the gradient of the whole batch (DP=2:
    each replica its own row)."""
    rows = slice(run.dp_rank, run.dp_rank + 1) if run.layout == "dp2tp2" else slice(half, None, 2)
    inputs = {k: v[rows] for k, v in batch(step).items()}
    (parity.loss_of(run.runner(**inputs), {}) / 2).backward()


def _accumulated_step(run: Run, step: int, directory: str | None = None) -> Run:
    """One optimizer step over two accumulated micro-batches; with
    `directory`, saved after the first and resumed in a new Run (another
    seed) that takes the second: the Run that steps is returned."""
    _micro(run, step, 0)
    if directory is not None:
        run.save(directory, step)
        run = Run(run.layout, run.group, seed=7, dropout=False)
        assert run.load(directory)["step"] == step
    _micro(run, step, 1)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return run


def accumulation_mid_cycle(ctx, directory: str) -> dict:
    """save_state between two micro-batches of a gradient accumulation (TP=2,
    explicit group, AdamW after one full step): the accumulated gradients are
    saved and load_state hands them back, so the resumed step's weights are
    those of the run that never stopped, bit for bit, and the unsharded
    model's within the float32 tolerance plus twice its own error against
    float64 (as _against_unsharded).  DP=2 x TP=2 under DDP's no_sync(), where
    the replicas' gradients differ, is refused by name before anything is
    written."""
    straight, resumed = (Run("tp2", ctx.group, seed=0, dropout=False) for _ in range(2))
    ref, ref64 = Run("plain", None, seed=0, dropout=False), Run("plain", None, seed=0, dropout=False,
                                                                 dtype=torch.float64)
    for run in (straight, resumed, ref, ref64):
        _accumulated_step(run, 0)
    for run in (straight, ref, ref64):
        _accumulated_step(run, 1)
    resumed = _accumulated_step(resumed, 1, directory)
    want = straight.local()
    differ = [k for k, v in resumed.local().items() if not np.array_equal(v, want[k])]
    assert not differ, f"the step resumed between micro-batches differs from the straight run: {differ[:4]}"
    full = gather_full_state_dict(resumed.model)
    if ctx.rank == 0:
        exp64 = ref64.model.state_dict()
        for k, v in ref.model.state_dict().items():
            parity.assert_close(f"resumed {k}", full[k], v, TOL, exp64[k])
    return {}


def accumulation_no_sync_refused(ctx, directory: str) -> str:
    """DP=2 x TP=2: save_state under DDP's no_sync(), the replicas holding
    different gradients, raises ValueError on every rank naming the ranks;
    nothing is written."""
    run = Run("dp2tp2", None, seed=0, dropout=False)
    with run.runner.no_sync():
        _micro(run, 0, 0)
    try:
        run.save(directory, 0)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("a save under no_sync() was not refused")
    assert "replicas hold different gradients" in message, message
    assert ("[0] vs [2]" in message) or ("[1] vs [3]" in message), message
    assert "no_sync()" in message, message
    assert not os.path.exists(directory), "a refused save wrote something"
    return message
