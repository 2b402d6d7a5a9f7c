"""Zero-bubble pipeline schedules (Qi et al. 2023): ZB-H1 and ZB-V.

Both split a micro-batch's backward in two (weight_grads): B, the input
gradients, sent to the previous stage at once, and W, the linears' weight
gradients, which nothing downstream waits for and which therefore fill time
the stage would otherwise spend waiting.  With F, B and W of one
(chunk, micro-batch) each taking one unit, p stages and m micro-batches:

ZB-H1 (ZeroBubbleSchedule, one chunk per stage).  1F1B's order with W moved:
stage s runs p-s-1 warm-up forwards, then for k = 0 .. m-1 the next forward
(if any), B(k) and W(k-s) (when k >= s), then the W's left.  Stage s defers
its W's by s micro-batches, exactly the time its cool-down would wait for
gradients, so every stage holds at most p micro-batches whose W has not run
(F's minus W's): 1F1B's peak (stage 0's).  Each stage idles p-1 units (at
the start: the warm-up wait, 1F1B's too, but one unit long instead of F+B+W),
so the bubble is

    ZB-H1:  (p-1) / (3m + p-1)        against 1F1B's  (p-1) / (m + p-1)

(for F = B = W; in general (p-1)(F+B-W) of idle time against (p-1)(F+B+W)).

ZB-V (ZeroBubbleVSchedule, two chunks per stage, PipelineStageManager
layout "v").  Chunk 0 of stage s is virtual stage s, chunk 1 is virtual
stage 2p-1-s: the chain runs down the stages and back up, so stage 0 holds
the first and the last virtual stage (embeddings and head) and the turn at
stage p-1 is a local hand-over.  The order of each stage's F, B and W steps
comes from a list schedule of the whole pipeline in unit time: at every
tick each free stage runs, among the steps whose input has arrived, a B
(chunk 1's first), else an F (chunk 1's first) while it holds fewer than
2p chunks whose W has not run (a chunk is half a stage's layers: p
micro-batches' worth, 1F1B's peak), else the oldest pending W.  Its bubble,
in chunk units, is about p-1 units of 6m:

    ZB-V:   about (p-1) / (6m + p-1)

(`ideal_bubble` gives the exact unit-time figure of any schedule's lists).
ZB-V needs m >= p micro-batches (fewer leave the V's turn without work).
"""
from __future__ import annotations

import functools

from .schedule import PipelineSchedule
from .stage_manager import chain_position

__all__ = ["ZeroBubbleSchedule", "ZeroBubbleVSchedule", "ideal_bubble"]


def _zb_h1_steps(s: int, p: int, v: int, m: int):
    warmup = min(p - s - 1, m)
    steps = [("F", 0, i) for i in range(warmup)]
    done_w = 0
    for k in range(m):
        if warmup + k < m:
            steps.append(("F", 0, warmup + k))
        steps.append(("B", 0, k))
        if k >= s:
            steps.append(("W", 0, k - s))
            done_w += 1
    return steps + [("W", 0, j) for j in range(done_w, m)]


def _zb_v_steps(s: int, p: int, v: int, m: int):
    return list(_zb_v_lists(p, m)[s])


@functools.lru_cache(maxsize=32)
def _zb_v_lists(p: int, m: int) -> tuple:
    """Every stage's ZB-V step list (the module docstring's list schedule)."""
    last, limit = 2 * p - 1, 2 * p
    clock = [0] * p
    lists = [[] for _ in range(p)]
    ready = {}                                   # ("act" | "grad" | "out", vs, mb) -> tick it is there
    next_f = [[0, 0] for _ in range(p)]
    next_b = [[0, 0] for _ in range(p)]
    pending_w = [[] for _ in range(p)]
    live = [0] * p                               # chunks run forward whose W has not run
    while any(len(lists[s]) < 6 * m for s in range(p)):
        best = None
        for s in range(p):
            options = []                         # (start tick, priority, step)
            for c in (1, 0):
                vs = chain_position(s, c, p, "v")
                i = next_b[s][c]
                key = ("grad", vs + 1, i) if vs < last else ("out", vs, i)
                if i < m and key in ready:
                    options.append((max(clock[s], ready[key]), 0, ("B", c, i)))
            for c in (1, 0):
                vs = chain_position(s, c, p, "v")
                i = next_f[s][c]
                if i < m and live[s] < limit and (vs == 0 or ("act", vs - 1, i) in ready):
                    options.append((max(clock[s], ready.get(("act", vs - 1, i), 0)), 1, ("F", c, i)))
            if pending_w[s]:
                options.append((clock[s], 2, ("W",) + pending_w[s][0]))
            if not options:
                continue
            now = [o for o in options if o[0] <= clock[s]]
            start, _, step = min(now, key=lambda o: o[1]) if now else min(options, key=lambda o: (o[0], o[1]))
            if best is None or start < best[0]:
                best = (start, s, step)
        if best is None:
            raise RuntimeError(f"ZB-V: the list schedule stalls (p={p}, m={m})")
        start, s, (kind, c, i) = best
        clock[s] = start + 1
        lists[s].append((kind, c, i))
        vs = chain_position(s, c, p, "v")
        if kind == "F":
            next_f[s][c] += 1
            live[s] += 1
            ready[("act", vs, i) if vs < last else ("out", vs, i)] = clock[s]
        elif kind == "B":
            next_b[s][c] += 1
            if vs > 0:
                ready[("grad", vs, i)] = clock[s]
            pending_w[s].append((c, i))
        else:
            pending_w[s].pop(0)
            live[s] -= 1
    return tuple(tuple(steps) for steps in lists)


def ideal_bubble(steps_of, p: int, v: int, m: int, layout: str = "loop", split: bool = True) -> list[float]:
    """Each stage's bubble (idle / makespan) when its steps run in list order, every F, B and W of a
    chunk takes one unit (without `split`, B is the whole backward: two units) and a message arrives
    when the step that made it ends."""
    lists = [steps_of(s, p, v, m) for s in range(p)]
    cost = {"F": 1, "B": 1 if split else 2, "W": 1}
    last = p * v - 1
    clock, busy, pos, ready = [0] * p, [0] * p, [0] * p, {}
    while any(pos[s] < len(lists[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                kind, c, i = lists[s][pos[s]]
                vs = chain_position(s, c, p, layout)
                need = ("act", vs - 1, i) if kind == "F" and vs > 0 else \
                       ("grad", vs + 1, i) if kind == "B" and vs < last else None
                if need is not None and need not in ready:
                    break
                clock[s] = max(clock[s], ready.get(need, 0)) + cost[kind]
                busy[s] += cost[kind]
                if kind == "F" and vs < last:
                    ready[("act", vs, i)] = clock[s]
                if kind == "B" and vs > 0:
                    ready[("grad", vs, i)] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{steps_of.__name__}: the step lists deadlock (p={p}, v={v}, m={m})")
    span = max(clock)
    return [1 - b / span for b in busy]


class ZeroBubbleSchedule(PipelineSchedule):
    """ZB-H1: 1F1B's order and memory, each backward split into B (input
    gradients, sent upstream at once) and W (the linears' weight gradients),
    the W's deferred into the cool-down's wait (module docstring)."""

    name = "zb-h1"
    _steps = staticmethod(_zb_h1_steps)
    splits_backward = True


class ZeroBubbleVSchedule(PipelineSchedule):
    """ZB-V: two chunks per stage folded in a V (PipelineStageManager(...,
    num_model_chunks=2, layout="v")), B / W split as in ZB-H1, the steps
    ordered by a unit-time list schedule (module docstring)."""

    name = "zb-v"
    _steps = staticmethod(_zb_v_steps)
    splits_backward = True

    def _check_chunks(self) -> None:
        sm = self.stage_manager
        how = "PipelineStageManager(pp_group, num_model_chunks=2, layout='v') (docs/pipeline.md#zero-bubble-schedules)"
        if sm.num_model_chunks != 2:
            raise ValueError(f"ZeroBubbleVSchedule: the stage manager has num_model_chunks={sm.num_model_chunks}; "
                             f"ZB-V runs exactly 2 chunks per stage: {how}")
        if sm.layout != "v":
            raise ValueError(f"ZeroBubbleVSchedule: the stage manager's chunks are laid out {sm.layout!r} "
                             f"(chunk 1 of stage s is virtual stage p+s); ZB-V needs the V: {how}")
        if self.num_microbatches < sm.num_stages:
            raise ValueError(f"ZeroBubbleVSchedule: num_microbatches={self.num_microbatches} is fewer than the "
                             f"{sm.num_stages} pipeline stages; ZB-V needs at least one micro-batch per stage")

