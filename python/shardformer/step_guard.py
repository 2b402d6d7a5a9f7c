"""A rank that raises inside a sharded model's forward() or generate() stops its peers.

Without a pipeline, the ranks of a tensor-parallel group (and of a separate
sequence-parallel group, and of the expert-parallel group) run one forward
together: its all-reduces, all-gathers and all-to-alls wait for every rank.
When one rank raises in the middle of it -- a shape error only its shard
hits, a user's hook, a NaN guard -- the others would wait in their next
collective until the transport's timeout.  So optimize() puts the sharded
model's forward() and generate() under distributed.failures.guard over
those groups: the failing rank re-raises its own exception with a note,
its peers raise PeerFailed naming it within milliseconds, and the groups'
communicators are set up afresh by the next collective (see failures).

The wrappers are module-level classes held in the model's __dict__ (not
closures), so the model pickles and deep-copies; a forward() called by
generate() is guarded once (the inner guard marks the exception told).
Cost per call: a try block.  A backward that raised (the caller's
loss.backward(), outside the guard) is settled at the next forward():
shardformer.backward_watch.
"""
from __future__ import annotations

import inspect

import torch

from . import backward_watch
from .config import group_size_and_rank
from .distributed import failures
from .input_check import groups_of as input_groups


class _Guarded:
    """Runs the model's `method` (the instance's earlier one, or the class's)
    under failures.guard over `groups`."""

    method = ""

    def __init__(self, model, groups: list, name: str):
        self.model, self.groups, self.name = model, groups, name
        self.what = f"{type(model).__name__}.{self.method}()"     # the step's name in messages
        self.inner = model.__dict__.get(self.method)
        self.calls = 0
        self.open_backward = None   # the call whose backward started and has not finished (backward_watch)

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own method's (generate() reads which inputs forward takes)."""
        return inspect.signature(getattr(type(self.model), self.method).__get__(self.model))

    def _original(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return getattr(type(self.model), self.method)(self.model, *args, **kwargs)

    def settle(self) -> None:
        """Before this call's first collective: a backward of this model that
        started and did not finish on this rank (it raised here, or a peer's
        failure ended it) is settled with the peers first (backward_watch)."""
        if self.open_backward is not None:
            backward_watch.settle(self, self.groups, self.what, self.name)

    def _where(self) -> str:
        return f"{self.method}() call {self.calls} of {self.name}"

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():       # no try block in a traced graph: the call as it was
            return self._original(*args, **kwargs)
        self.settle()
        self.calls += 1
        with failures.guard(self.groups, self.what, self._where):
            out = self._original(*args, **kwargs)
        if self.method == "forward" and torch.is_grad_enabled():
            out = backward_watch.mark_outputs(self, self.calls, out)
        return out


class GuardedForward(_Guarded):
    """model.forward under failures.guard."""

    method = "forward"
    #: shardformer.decode's fast path may wrap it (its other calls go through it; its decode steps
    #: run inside generate(), which is guarded too)
    WRAPPABLE_IN_DECODE = True


class GuardedGenerate(_Guarded):
    """model.generate under failures.guard."""

    method = "generate"


def groups_of(cfg) -> list:
    """The groups whose ranks run one forward of the sharded model together
    (of more than one rank): tensor-parallel, sequence-parallel when it is
    another group, expert-parallel."""
    out = [group for group, _ in input_groups(cfg)]
    experts = cfg.expert_parallel_process_group
    if experts is not None and experts not in out and group_size_and_rank(experts)[0] > 1:
        out.append(experts)
    return out


def _settle_hook(module, args, kwargs):
    """Forward pre-hook run before every other (the input check's and the
    whole parameters' collectives, shardformer.input_check): settles an
    unfinished backward first, so no collective of the new call can meet a
    peer still waiting in that backward."""
    guarded = module.__dict__.get("forward")
    if isinstance(guarded, GuardedForward) and not torch.compiler.is_compiling():
        guarded.settle()


def settle_before_other_hooks(model) -> None:
    """Called by the sharder after the model's other forward pre-hooks are
    installed (input_check.install): _settle_hook runs first."""
    if isinstance(model.__dict__.get("forward"), GuardedForward):
        model.register_forward_pre_hook(_settle_hook, with_kwargs=True, prepend=True)


def install(model, cfg, name: str) -> bool:
    """Put the sharded, unpipelined `model`'s forward() (and generate(), when
    it generates) under failures.guard over groups_of(cfg); nothing when
    every group is of one rank.  Returns whether it did."""
    groups = groups_of(cfg)
    if not groups:
        return False
    model.__dict__["forward"] = GuardedForward(model, groups, name)
    if callable(getattr(type(model), "generate", None)) and hasattr(model, "generation_config"):
        model.__dict__["generate"] = GuardedGenerate(model, groups, name)
    return True
