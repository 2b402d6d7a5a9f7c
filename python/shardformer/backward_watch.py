"""A rank whose loss.backward() raised: its peers learn of it, and no call pairs wrongly.

The backward of a sharded model's forward() runs collectives too (the
all-reduce of a column-parallel layer's input gradient, ...), inside
torch's autograd, outside any guarded step.  When one rank's backward
raises (a user's gradient hook, a NaN check, an out-of-memory) and the
caller goes on ("skip the bad batch": zero the gradients, next batch), its
peers still wait in that backward -- and that rank's next forward would
pair its first all-reduce with theirs when the sizes agree (silently: the
peers' gradients would hold that rank's activations).  Two mechanisms:

  * Every shm call carries its phase (forward, or inside autograd's
    backward; shm.in_backward) in the descriptor its first barrier checks:
    a forward call never pairs with a backward call; both ranks raise a
    collective mismatch naming both ranks and both calls.
  * `BackwardStarted`, a gradient hook on the outputs of every guarded
    forward() that need a gradient: it runs first in the model's backward
    ("started", call N) and queues an autograd callback that runs when the
    whole backward has finished ("finished"); autograd skips that callback
    when the backward raises.  So at the next
    forward(), a rank whose backward of call N started and did not finish
    knows it raised, and `settle()` runs before anything else:
      - a group already aborted by another rank (this rank's backward
        failed because a peer's did): set up again (forget_group), go on;
      - else this rank's own backward raised.  Its peers are blocked on it
        (a collective it did not join): it waits until each has entered
        one and reads its phase.  It writes its account ("the backward of
        forward() call N raised on global rank R") to the store and aborts
        the groups (failures.publish): a peer waiting in the backward
        raises PeerFailed there (shm.on_peer_failure), a peer waiting in
        its next forward() raises PeerFailed from its guard.  Every rank
        then drops the communicators.  When every peer was waiting in the
        backward, this rank and they skipped the same step, and this
        forward runs (its collectives set the groups up again); when a peer
        had finished that backward (this rank raised after its last
        collective), that peer's next forward() fails, so this rank's
        forward() raises too and every rank skips the same two steps.

Cost: a hook per output needing a gradient, one callback per backward.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .distributed import failures

__all__ = ["BackwardStarted", "mark_outputs", "settle"]

POLL_S = 0.001            # how often settle() reads the peers' state


class BackwardStarted:
    """A gradient hook on a forward()'s outputs: when the backward of call `n`
    reaches one of them (the first thing that backward does), it records on
    `watch` that the backward started, and queues the autograd callback that
    records it finished (autograd runs it only when the whole backward did).
    A hook, not an autograd node: the outputs stay what they were (in-place
    ops on them, as transformers.Trainer's `loss *= scale`, keep working)."""

    __slots__ = ("watch", "n")

    def __init__(self, watch, n: int):
        self.watch, self.n = watch, n

    def __call__(self, grad):
        watch, n = self.watch, self.n
        if watch.open_backward != n:
            watch.open_backward = n
            torch.autograd.Variable._execution_engine.queue_callback(self.finished)
        return None

    def finished(self) -> None:
        if self.watch.open_backward == self.n:
            self.watch.open_backward = None


def mark_outputs(watch, n: int, out):
    """`out` (a tensor, a tuple / list, or a ModelOutput) with a BackwardStarted
    hook on each of its tensors that need a gradient; returned as it was."""
    values = [out] if isinstance(out, torch.Tensor) else list(out.values()) if isinstance(out, dict) else \
        list(out) if isinstance(out, (tuple, list)) else []
    hook = None
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            hook = hook or BackwardStarted(watch, n)
            value.register_hook(hook)
    return out


def _peers_blocked(comms) -> dict[int, bool] | None:
    """Wait until every peer of every group has entered a call this rank did
    not (it is blocked on this rank); per global rank, whether that call runs
    in backward.  None when a group was aborted meanwhile (another rank's
    failure is the story) or a peer did not arrive within the group's timeout."""
    state: dict[int, bool] = {}
    for _, comm in comms:
        deadline = time.monotonic() + comm.timeout
        while True:
            if comm.abort_record() is not None:
                return None
            states = comm.rank_states()
            mine = states[comm.rank][0]
            if all(seq > mine for r, (seq, _) in enumerate(states) if r != comm.rank):
                state.update({comm.ranks[r]: bw for r, (_, bw) in enumerate(states) if r != comm.rank})
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)
    return state


def settle(watch, groups, what: str, name: str) -> None:
    """At the entry of forward(): the backward of call watch.open_backward
    started and did not finish on this rank (see the module doc).  Returns
    when this forward may run; raises RuntimeError when a peer finished that
    backward (so that every rank skips the same steps)."""
    n, watch.open_backward = watch.open_backward, None
    comms = failures.shm_comms(groups)
    if any(comm.abort_record() is not None for _, comm in comms):   # a peer's failure, or told already
        failures.reset_comms(comms)
        return
    where = f"backward of {what.split('.')[-1]} call {n} of {name}"
    peers = _peers_blocked(comms)
    me = dist.get_rank()
    failures.publish({"rank": me, "type": "an exception in backward",
                       "message": f"the backward of {what} call {n} raised on global rank {me} "
                                  f"(caught by the caller, which went on)", "where": where}, comms)
    failures.reset_comms(comms)
    done = sorted(r for r, in_backward in (peers or {}).items() if not in_backward)
    if done:
        raise RuntimeError(
            f"{what}: the backward of call {n} of {name} raised on global rank {me} after its last "
            f"collective: global ranks {done} finished that backward and were waiting in their next "
            f"forward(); every rank was told and this call {n + 1} runs on none of them (their "
            f"optimizer may have stepped without this rank: its shards are a step behind; "
            f"docs/pipeline.md#when-a-stage-fails)")
