"""Ranks agree on a set-up step before they wait on each other.

A collective set-up step (`shardformer.mesh()`, a PipelineStageManager,
`optimize()`) makes the ranks of a group wait on each other: new_group, the
shm segment, the replica check.  Ranks that arrive with different arguments
(other mesh sizes, another group, another model) would wait forever on
different collectives, or run ones that happen to match.
`agree(step, values, group)` runs first and turns that into an error.

Each rank of `group` publishes `values` (a small dict of plain values, the
step's arguments) in torch.distributed's key-value store -- the rendezvous
store, TCP to the master, not the group's transport, so a rank that never
arrives blocks nothing and a later collective is not disturbed -- under

    shardformer/agree/<step>/<ranks of the group>/<n>/<global rank>

where n counts this process's calls of (step, group).  It then waits
for the other members' entries (polling store.check, then one multi_get):

  * all there and equal: returns (a few store round trips, ~1 ms);
  * all there, some different: raises RuntimeError on every rank (each
    sees the same entries), naming the ranks on each side and the values
    that differ;
  * some missing after `timeout_s` (SHARDFORMER_AGREE_TIMEOUT_S, default
    120): raises naming the missing ranks and, for each, the last step it
    published (a rank calling with another group shows up there).  The
    rank's own entry is withdrawn and its count put back, so the ranks stay
    in step for the next call.

A group of one rank, or torch.distributed not initialized, agrees with
itself at no cost.
"""
from __future__ import annotations

import os
import threading
import time

import torch.distributed as dist

TIMEOUT_ENV = "SHARDFORMER_AGREE_TIMEOUT_S"
_PREFIX = "shardformer/agree"
_COUNTS: dict = {}
_LOCK = threading.Lock()


def timeout_s() -> float:
    """SHARDFORMER_AGREE_TIMEOUT_S (default 120 s): how long a step waits for a rank that does not arrive."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return value


def members(group) -> list[int]:
    """The global ranks of `group` (None: the default group), in group order
    ([0] when torch.distributed is not initialized)."""
    if not dist.is_available() or not dist.is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def default_store():
    """The default group's key-value store (the rendezvous store): records
    that must travel without a collective (agreement checks, a failing
    rank's account in shardformer.distributed.failures) go through it."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _render(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def name_ranks(ranks: list[int]) -> str:
    """"rank 3" or "ranks 0, 2"."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _disagreement(step: str, entries: dict, me: int, where: str) -> str:
    """The ranks on each side of a disagreement, with the values that differ."""
    sides: dict = {}
    for rank, values in sorted(entries.items()):
        sides.setdefault(repr(values), (values, []))[1].append(rank)
    keys = list(dict.fromkeys(k for values, _ in sides.values() for k in values))
    differ = [k for k in keys if len({repr(values.get(k)) for values, _ in sides.values()}) > 1]
    parts = "; ".join(f"{name_ranks(ranks)}: {_render({k: values.get(k) for k in differ})}"
                      for values, ranks in sides.values())
    return (f"{step}: the ranks of {where} disagree ({parts}); every rank must make this call with the same "
            f"arguments (this is rank {me}); nothing was set up")


def agree(step: str, values: dict, group=None, timeout: float | None = None) -> None:
    """Check that every rank of `group` calls `step` with the same `values`
    (see the module doc); RuntimeError naming the ranks otherwise.  Made by
    every rank of the group at the same point, like the step it guards."""
    if not dist.is_available() or not dist.is_initialized():
        return
    ranks = members(group)
    if len(ranks) < 2:
        return
    me = dist.get_rank()
    where = f"the group of global ranks {ranks}"
    scope = f"{_PREFIX}/{step}/{','.join(map(str, ranks))}"
    with _LOCK:
        n = _COUNTS.get(scope, 0) + 1
        _COUNTS[scope] = n
    store = default_store()
    mine = repr(values)
    store.set(f"{scope}/{n}/{me}", mine)
    store.set(f"{_PREFIX}/last/{me}", f"{step} over {where} ({_render(values)})")
    limit = timeout_s() if timeout is None else timeout
    others = [r for r in ranks if r != me]
    keys = [f"{scope}/{n}/{r}" for r in others]
    start = time.monotonic()
    deadline = start + limit
    # polled (store.check does not block; a store.wait that times out logs a c10d warning), so
    # Ctrl-C gets through between checks: every millisecond for the first 0.2 s (ranks a few
    # milliseconds apart go on together, not up to a doubled pause later), then backing off to 50 ms
    pause = 0.001
    while not store.check(keys):
        now = time.monotonic()
        if now > deadline:
            missing = [r for r, key in zip(others, keys) if not store.check([key])]
            if missing:
                _withdraw(store, scope, n, me)
                raise RuntimeError(_missing(step, missing, store, me, where, limit))
        time.sleep(pause)
        if now - start > 0.2:
            pause = min(0.05, pause * 2)
    texts = [t.decode() for t in store.multi_get(keys)]
    if any(text != mine for text in texts):
        entries = {me: values, **{r: _parse(text) for r, text in zip(others, texts)}}
        raise RuntimeError(_disagreement(step, entries, me, where))


def _parse(text: str):
    """An entry back as a dict (entries are reprs of plain values)."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"values": text}


def _withdraw(store, scope: str, n: int, me: int) -> None:
    """A timed-out call leaves no trace: its entry goes and its count comes back."""
    try:
        store.delete_key(f"{scope}/{n}/{me}")
    except (RuntimeError, NotImplementedError):     # a store without deletion (FileStore on some versions)
        pass
    with _LOCK:
        if _COUNTS.get(scope) == n:
            _COUNTS[scope] = n - 1


def _missing(step: str, pending: list[int], store, me: int, where: str, limit: float) -> str:
    seen = []
    for r in pending:
        key = f"{_PREFIX}/last/{r}"
        last = store.get(key).decode() if store.check([key]) else "nothing yet"
        seen.append(f"rank {r}: last called {last}")
    return (f"{step}: {name_ranks(pending)} of {where} did not make this call within {limit:g} s "
            f"({TIMEOUT_ENV}); {'; '.join(seen)} (this is rank {me}); nothing was set up")

