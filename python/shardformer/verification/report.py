"""The result of verify(): what was compared, and where the models first part.

Every rank produces `Entry`s, one per comparison, each with its place in
execution order (`order`: forward hooks in the order modules finish, then
backward hooks in the order they fire, then parameter gradients, ...).  The
ranks' entries are merged (the worst numbers of each comparison over the
ranks) into a `Report`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .compare import Diff

#: The checks; `Report.checks` has one per name.
CHECKS = ("forward", "loss", "modules", "grads", "after_steps")

#: Phases of execution order, the first element of an Entry's `order`.
MODULE_OUTPUT, MODEL_OUTPUT, LOSS, MODULE_INPUT_GRAD, PARAM_GRAD, AFTER_STEPS = range(6)


@dataclass
class Entry:
    """One comparison on one rank: `check` (one of CHECKS), `order` (its
    place in execution order: (phase, index, ...), the phases above),
    `module` (its path, "" for the whole model),
    `what` ("output", "output 'logits'", "input grad", "grad of weight",
    "weight after 1 step", "raised"), the numbers (None when it raised or
    was not comparable) and `note` (the exception, or why it was skipped)."""

    check: str
    order: tuple
    module: str
    what: str
    diff: Diff | None = None
    note: str = ""
    ranks: tuple = ()
    missing: bool = False

    @property
    def failed(self) -> bool:
        return self.missing or self.what == "raised" or (self.diff is not None and not self.diff.ok)

    @property
    def where(self) -> str:
        return self.module or "(model)"

    def text(self) -> str:
        ranks = f" on rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}" if self.ranks else ""
        body = self.note if self.diff is None else self.diff.text()
        return f"{self.where}: {self.what}{ranks}: {body}"


@dataclass
class Mismatch:
    """Where the sharded model first departs: `module` (dotted path, "" for
    the model's own outputs), `what`, the numbers (`max_abs`, `max_rel`,
    `shape`, `expected_shape`; None when it raised), `ranks` that saw it and
    `message` (the exception, when it raised)."""

    module: str
    what: str
    max_abs: float | None
    max_rel: float | None
    shape: tuple | None
    expected_shape: tuple | None
    ranks: tuple
    message: str = ""

    @classmethod
    def of(cls, e: Entry) -> "Mismatch":
        d = e.diff
        return cls(e.module, e.what, d and d.max_abs, d and d.max_rel, d and d.shape, d and d.expected_shape,
                   e.ranks, e.note)


@dataclass
class CheckResult:
    """One check over every rank: `ok`, how many comparisons `compared` and
    `skipped` (sharded tensors of a layout no layer recorded), the worst
    relative difference `max_rel`, and its first failing entry."""

    name: str
    ok: bool = True
    compared: int = 0
    skipped: int = 0
    max_rel: float = 0.0
    first_failure: Entry | None = None

    def text(self) -> str:
        state = "ok" if self.ok else "MISMATCH"
        skipped = f", {self.skipped} not comparable" if self.skipped else ""
        return f"{self.name:<12} {state:<9} {self.compared} compared{skipped}, max rel diff {self.max_rel:.3g}"


@dataclass
class Report:
    """verify()'s answer.  `ok`; `first_mismatch` (a Mismatch, or None);
    `checks` {name: CheckResult} for forward, loss, modules, grads and
    after_steps; `entries` every comparison (merged over ranks) in execution
    order; `setup` a line on what was compared.  print() it for a summary."""

    setup: str
    checks: dict = field(default_factory=dict)
    entries: list = field(default_factory=list)
    first_mismatch: Mismatch | None = None

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        lines = [f"shardformer.verify: {self.setup}"]
        lines += ["  " + c.text() for c in self.checks.values()]
        if self.ok:
            lines.append("OK: the sharded model matches the unsharded one")
        else:
            m = self.first_mismatch
            lines.append(f"MISMATCH: first departs at {m.module or '(model)'} ({m.what})")
            first = next(e for e in self.entries if e.failed)
            lines.append("  " + first.text())
            if m.what == "raised":
                lines.append("  (the sharded model raised there; see docs/verify.md)")
        return "\n".join(lines)

    __repr__ = __str__


def merge(setup: str, per_rank: list[list[Entry]]) -> Report:
    """The Report of every rank's entries: each comparison (check, order,
    module, what) once, with the worst numbers over the ranks and the ranks
    where it failed; the first mismatch is the failing entry first in
    execution order."""
    merged: dict[tuple, Entry] = {}
    for rank, entries in enumerate(per_rank):
        for e in entries:
            key = (e.check, e.order, e.module, e.what)
            cur = merged.get(key)
            failed_here = (e.ranks or (rank,)) if e.failed else ()
            if cur is None:
                merged[key] = Entry(e.check, e.order, e.module, e.what, e.diff, e.note, failed_here, e.missing)
                continue
            cur.ranks = cur.ranks + failed_here
            cur.missing = cur.missing or e.missing
            if e.failed and not cur.note:
                cur.note = e.note
            if e.diff is not None and (cur.diff is None or _worse(e.diff, cur.diff)):
                cur.diff = e.diff
    entries = sorted(merged.values(), key=lambda e: e.order)
    checks = {name: CheckResult(name) for name in CHECKS}
    for e in entries:
        c = checks[e.check]
        if e.diff is None and not e.failed:
            c.skipped += 1
            continue
        c.compared += 1
        if e.diff is not None and e.diff.max_rel == e.diff.max_rel:
            c.max_rel = max(c.max_rel, e.diff.max_rel)
        if e.failed and c.ok:
            c.ok, c.first_failure = False, e
    first = next((e for e in entries if e.failed), None)
    return Report(setup, checks, entries, None if first is None else Mismatch.of(first))


def _worse(a: Diff, b: Diff) -> bool:
    if a.ok != b.ok:
        return not a.ok
    return not (a.max_rel <= b.max_rel)
