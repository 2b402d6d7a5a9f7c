"""A rank that raises inside a step: an error on every peer within seconds.

A pipeline step (or generate()) runs collectives and point-to-point
transfers over a few groups: the pipeline group, each stage's
tensor-parallel group, the expert-parallel groups.  When one rank raises in
the middle of it (a bad micro-batch only the last stage sees, a user's hook,
a shape error, an out-of-memory), its peers are waiting for a message that
will never come.  `guard(groups, what, where)` runs a step so that instead:

  * the failing rank writes an account of its failure -- global rank,
    exception type and message, where (what the caller's `where()` says:
    schedule, stage, micro-batch, forward / backward) -- into the
    torch.distributed store under a fresh random token, then aborts the
    shm communicator of every group of the step with that token
    (ShmCommunicator.abort: the segment's abort record, which every wait
    of every rank checks at least every 15 ms), and re-raises its own
    exception unchanged, with a note saying what it did;
  * a peer's wait fails at once; seeing the record (a rank of the group
    raised, with a token) it reads the account from the store (it was
    written before the abort) and raises PeerFailed naming the failing
    rank, its exception and where, and where this rank was waiting.

Cost on the hot path: nothing per call (the waits already check the abort
record in their slow path); a try block around the step.

Afterwards.  Every rank of each aborted group drops the group's
communicators (communicator.forget_group): the next collective on the group
sets up a fresh segment, as on first use, so the next step with good input
runs as if nothing had happened -- provided every rank of the group runs
it (each of them got an exception from this step).  The gradients the
failed step accumulated are partial: zero them before the next step.

The store holds at most SLOTS accounts: a failure takes the next slot of a
ring (a counter in the store), the token names the slot, and the account
records its token; a peer reading a slot another failure has since taken
finds another token there and says the account was lost, so a long job
leaves at most SLOTS keys behind however many steps fail.

Outside a step: a call outside any guard (a collective of loss.backward())
that a peer's abort ended raises PeerFailed too (shm.on_peer_failure;
shardformer.backward_watch tells the peers of a backward that raised); a
process leaving with an uncaught exception, or while a peer waits for it,
aborts its groups at exit with its account (_at_exit); one leaving without
Python (os._exit, a signal) is found by the waiting peers' pid check.

What this does not reach: groups whose collectives go through
torch.distributed (SHARDFORMER_COMM=torch, ranks on several hosts, CUDA
tensors), and a rank that fails before a group's first collective (its
communicator's set-up is torch.distributed's): there peers wait until the
transport's own timeout.  See docs/pipeline.md, "When a stage fails".
"""
from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import sys
import threading

import torch.distributed as dist

from . import communicator as _comm
from .agree import default_store
from . import shm as _shm

__all__ = ["PeerFailed", "guard"]

PREFIX = "shardformer/failed/"
SLOTS = 16                 # accounts kept in the store at once (a ring; module doc)
HANDLED = "_shardformer_failure_told"   # set on an exception whose peers were told (an outer guard passes it on)
RAISED = 4                 # the abort record's reason for ShmCommunicator.abort (csrc/comm/shm_internal.h)
EXITED = 5                 # ... when a waiting rank found a peer's process gone (its token: their ranks' mask)
READ_TIMEOUT_S = 5.0       # how long a peer waits for the failing rank's account in the store
_REASONS = {1: "timed out", 2: "was interrupted", 3: "found the group out of step"}
_inside = threading.local()  # .depth: guarded steps this thread is in


class PeerFailed(RuntimeError):
    """Another rank of a group this rank ran a step with raised; this rank
    stopped waiting for it.  `ranks`: the failing global rank(s);
    `account`: what the failing rank recorded (rank, type, message, where),
    or None when it did not raise (a timeout or an interrupt there)."""

    def __init__(self, message: str, ranks: list[int], account: dict | None):
        super().__init__(message)
        self.ranks = ranks
        self.account = account


def _store():
    """The default group's store (agree.py's), or None where there is none."""
    try:
        return default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def shm_comms(groups) -> list:
    """(group, ShmCommunicator) of the groups that have one (of several ranks)."""
    out, seen = [], set()
    for group in groups:
        comm = _shm.existing(group)
        if comm is not None and not comm.closed and id(comm) not in seen:
            seen.add(id(comm))
            out.append((group, comm))
    return out


def reset_comms(comms) -> None:
    """Drop the aborted groups' communicators (and only theirs: a group
    without an shm communicator keeps its choice, which its peers keep too)."""
    for group, comm in comms:
        if comm.abort_record() is not None:
            _comm.forget_group(group)


def _slot_key(token: int) -> str:
    """The store key of the ring slot `token` names (bits 1..4)."""
    return PREFIX + str((token >> 1) % SLOTS)


def _account_of(store, token: int) -> dict | None:
    """The account written with `token`, or None (no store, not written in
    READ_TIMEOUT_S, or its slot since taken by another failure)."""
    if store is None:
        return None
    key = _slot_key(token)
    try:
        store.wait([key], datetime.timedelta(seconds=READ_TIMEOUT_S))
        account = json.loads(store.get(key).decode())
    except (RuntimeError, ValueError, UnicodeDecodeError):
        return None
    return account if isinstance(account, dict) and account.get("token") == token else None


def _describe(account: dict) -> str:
    return (f"global rank {account['rank']} raised {account['type']}: {account['message']} "
            f"({account['where']})")


def publish(account: dict, comms) -> None:
    """Write `account` under a fresh token in the next ring slot, then abort
    every communicator of `comms` not aborted yet with it (the peers' waits
    end within ~15 ms).  Nothing is written when every one is aborted already."""
    pending = [comm for _, comm in comms if comm.abort_record() is None]
    if not pending:
        return
    store = _store()
    slot = secrets.randbelow(SLOTS)
    if store is not None:
        with contextlib.suppress(RuntimeError, ValueError):
            slot = (store.add(PREFIX + "next", 1) - 1) % SLOTS
    token = (secrets.randbits(58) << 5) | (slot << 1) | 1
    if store is not None:
        with contextlib.suppress(RuntimeError, ValueError):
            store.set(_slot_key(token), json.dumps(dict(account, token=token)))
    for comm in pending:
        if comm.abort_record() is None:
            with contextlib.suppress(RuntimeError, ValueError):
                comm.abort(token)


def _own_failure(error: BaseException, comms, what: str, where: str) -> None:
    """Record this rank's failure, abort the groups' communicators, add a note."""
    me = dist.get_rank()
    message = str(error)
    if len(message) > 2000:
        message = message[:2000] + " ..."
    publish({"rank": me, "type": f"{type(error).__module__}.{type(error).__qualname__}",
              "message": message, "where": where}, comms)
    told = "; ".join(comm.label for _, comm in comms) or "no shm group"
    error.add_note(f"shardformer: {what}: global rank {me} raised this ({where}); its peers were told "
                   f"({told}) and raise PeerFailed naming it; the groups' communicators are set up "
                   f"again by the next collective (docs/pipeline.md#when-a-stage-fails)")


def _peer_failure(comms, what: str, where: str, tell_others: bool = True) -> PeerFailed | None:
    """The PeerFailed for a wait that another rank's abort ended (that
    rank's account passed on to this rank's other groups), or None when no
    group of the step was aborted by another rank."""
    store = _store()
    for _, comm in comms:
        record = comm.abort_record()
        if record is None or (record[0] == comm.rank and record[1] != EXITED):
            continue
        who, why, token = record
        account = _account_of(store, token) if why == RAISED else None
        if why == EXITED:
            gone = [comm.ranks[q] for q in range(comm.size) if token >> q & 1]
            story = (f"global rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} exited "
                     f"(its process is gone: killed, or os._exit)")
            return PeerFailed(f"{what}: {story}; global rank {dist.get_rank()} stopped waiting for it "
                              f"({where}; {comm.label}).  The job cannot go on without it: restart it "
                              f"(docs/pipeline.md#when-a-stage-fails)", gone, None)
        if account is not None:
            story = _describe(account)
        elif why == RAISED:
            story = (f"global rank {comm.ranks[who]} raised (its account did not reach the store in "
                     f"{READ_TIMEOUT_S:g} s)")
        else:
            story = f"global rank {comm.ranks[who]} {_REASONS.get(why, f'failed (reason {why})')}"
        ranks = [account["rank"] if account is not None else comm.ranks[who]]
        if tell_others:
            publish(account or {"rank": ranks[0], "type": "no exception", "message": story,
                                 "where": comm.label}, comms)
        return PeerFailed(f"{what}: {story}; global rank {dist.get_rank()} stopped waiting for it ({where}; "
                          f"{comm.label}).  Every rank of the group got an error from this step; zero the "
                          f"gradients and run the next step on every rank (docs/pipeline.md#when-a-stage-fails)",
                          ranks, account)
    return None


def _outside_a_step(comm, error: RuntimeError) -> PeerFailed | None:
    """shm.on_peer_failure: a call outside any guarded step (a collective of
    loss.backward()) failed because another rank aborted its group: the
    PeerFailed naming that rank (its account passed on to no other group:
    the next guarded forward() sets the groups up again, step_guard)."""
    if getattr(_inside, "depth", 0) or comm.label not in str(error) or not dist.is_initialized():
        return None
    record = comm.abort_record()
    if record is None or not (record[1] == EXITED or (record[1] == RAISED and record[0] != comm.rank)):
        return None
    where = "in backward" if _shm.in_backward() else "outside a guarded step"
    return _peer_failure([(None, comm)], "a collective", where, tell_others=False)


_shm.on_peer_failure = _outside_a_step

_uncaught: list = []       # the exception this process is exiting with (_excepthook)


def _excepthook(kind, value, tb, _previous=sys.excepthook):
    """sys.excepthook: remember the exception the process exits with (for
    _at_exit's account), then the hook that was there."""
    _uncaught.append(value)
    _previous(kind, value, tb)


def _at_exit(comms) -> None:
    """shm.at_exit: this process is leaving.  With an uncaught exception:
    every open group is aborted with its account (peers raise PeerFailed
    naming this rank and the exception).  Otherwise (sys.exit, the end of
    the program): only the groups in which a peer already waits for this
    rank (it entered a call this rank never will).  A process that leaves
    without running Python (os._exit, a signal) is found by its peers'
    waits instead (the pid check of csrc/comm/shm_wait.c)."""
    if not dist.is_initialized():
        return
    live = [(None, comm) for comm in comms if not comm.closed]
    if not _uncaught:
        live = [(g, comm) for g, comm in live if _waited_for(comm)]
    if not live:
        return
    error = _uncaught[-1] if _uncaught else None
    if error is not None:
        kind, message = f"{type(error).__module__}.{type(error).__qualname__}", str(error)[:2000]
    else:
        kind, message = "exit", "the process exited (sys.exit or the end of its program)"
    publish({"rank": dist.get_rank(), "type": kind, "message": message,
              "where": "an uncaught exception: the process exited" if error is not None else
              "while its peers waited for it in a collective"}, live)


def _waited_for(comm) -> bool:
    """Whether a peer of `comm` waits in a call this rank has not entered."""
    states = comm.rank_states()
    mine = states[comm.rank][0]
    return any(seq > mine for seq, _ in states)


sys.excepthook = _excepthook
_shm.at_exit.append(_at_exit)


@contextlib.contextmanager
def guard(groups, what: str, where):
    """Run the body as one step over `groups` (see the module doc; None: the
    default group).
    `what`: names the step in messages ("OneForwardOneBackwardSchedule:
    LlamaForCausalLM"); `where()`: this rank's position in it, asked only
    when something raised; None there means every rank raises this error
    alike (an agreed refusal): it passes untouched."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    except PeerFailed:
        raise
    except BaseException as error:
        if getattr(error, HANDLED, False):      # an inner guard (forward() inside generate()) told the peers
            raise
        at = where() if dist.is_initialized() else None
        if at is None:
            raise
        comms = shm_comms(groups)
        ours = isinstance(error, (RuntimeError, OSError)) and any(c.label in str(error) for _, c in comms)
        peer = _peer_failure(comms, what, at) if ours else None
        if peer is None:
            _own_failure(error, comms, what, at)
        reset_comms(comms)
        if peer is not None:
            setattr(peer, HANDLED, True)
            raise peer from error
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, HANDLED, True)
        raise
    finally:
        _inside.depth -= 1
