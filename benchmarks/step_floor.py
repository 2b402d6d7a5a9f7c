"""The compute floor of a training step, and a ledger of everything above it.

A rank's step does a fixed set of matrix products (forward and backward): for a
linear layer y = x W^T, the forward ``mm(x, W^T)`` and the backward
``mm(dy, W)`` (dx) and ``mm(dy^T, x)`` (dW).  Nothing a tensor-parallel library
does can make those cheaper; what it adds (collectives, copies, Python, its
loss) is what can be cut.  This module

* records, from one profiled step (``torch.profiler`` with ``record_shapes``),
  every innermost ``aten::mm / addmm / bmm / baddbmm`` call with its operands'
  shapes, strides and dtypes (innermost: a DTensor ``aten::mm`` contains the
  local one, only the local one is counted);
* replays exactly those products alone (:class:`FloorReplay`), on operands of
  the same shapes, strides (so the same transposes) and dtypes: the floor;
* splits the profiled step's wall time into a ledger (:func:`ledger_of`):
  matmul, attention, loss, embedding, copies, collectives, other aten ops
  (norms, activations, elementwise), fused kernels (shardformer's C norms /
  activations / dropout-add; its C attention, loss and embedding go to those
  rows), autograd's node frames, and the Python between ops, in ms and as a
  share of the step.

The floor ratio of a step is ``step time / floor time``, both measured in the
same processes, interleaved, so that other load on the machine hits both.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")

# Ledger categories, in print order.  Every microsecond of the profiled step is in exactly one.
CATEGORIES = ("matmul", "attention", "loss", "embedding", "copies", "collectives", "other aten ops",
              "fused kernels", "autograd frames", "python")

# shardformer's autograd.Functions over its C kernels (shardformer.ops, layer/loss.py): the
# profiler records each as an event of the Function's name (its backward: name + "Backward")
# whose self time is the kernel's own compute, not autograd's frame.  Each goes to the category
# the same work has in torch ops (attention, loss, embedding), the norms / activations /
# dropout-add to "fused kernels".
_KERNEL_FUNCTIONS = {"_Attention": "attention", "_VocabParallelCrossEntropy": "loss",
                     "_VocabEmbedding": "embedding", "_Norm": "fused kernels", "_BiasGelu": "fused kernels",
                     "_SwiGLU": "fused kernels", "_BiasDropoutAdd": "fused kernels"}
_KERNEL_FUNCTIONS.update({k + "Backward": v for k, v in list(_KERNEL_FUNCTIONS.items())})

_COLLECTIVE_WORDS = ("c10d", "allreduce", "all_reduce", "all_gather", "allgather", "reduce_scatter",
                     "wait_tensor", "gloo", "broadcast", "all_to_all", "alltoall")
_ATTENTION_WORDS = ("scaled_dot_product", "scaleddotproduct", "flash_attention", "efficient_attention", "ring_attn",
                    "fused_attention")
_LOSS_WORDS = ("cross_entropy", "nll_loss", "log_softmax", "logsoftmax", "nllloss")
_EMBEDDING_WORDS = ("embedding",)
_COPY_OPS = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::cat", "aten::_to_copy",
             "aten::stack", "aten::index_put_", "aten::narrow_copy", "aten::split_with_sizes_copy")


# --------------------------------------------------------------------------- reading a trace

def _trace_events(prof) -> list[dict]:
    """The profiler's CPU op events as dicts (name, ts, dur in us, tid, args),
    read from its Chrome trace: only that export carries the operands' strides."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="step_floor_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]


def _nest(events: list[dict]) -> list[dict]:
    """Give each event 'parent' (index or None), 'children' and 'self_us'; per
    thread, an event is inside another when its interval is.  Returns the events
    sorted by (tid, start)."""
    evs = sorted(events, key=lambda e: (str(e.get("tid")), float(e["ts"]), -float(e["dur"])))
    stack: list[int] = []
    tid = object()
    for i, e in enumerate(evs):
        e["children"], e["parent"] = [], None
        if e.get("tid") != tid:
            tid, stack = e.get("tid"), []
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while stack and float(evs[stack[-1]]["ts"]) + float(evs[stack[-1]]["dur"]) < end - 1e-3:
            stack.pop()
        if stack and float(evs[stack[-1]]["ts"]) <= start:
            e["parent"] = stack[-1]
            evs[stack[-1]]["children"].append(i)
        stack.append(i)
    for e in evs:
        e["self_us"] = max(0.0, float(e["dur"]) - sum(float(evs[c]["dur"]) for c in e["children"]))
    return evs


def _has_matmul_below(evs: list[dict], i: int) -> bool:
    todo = list(evs[i]["children"])
    while todo:
        j = todo.pop()
        if evs[j]["name"] in MATMUL_OPS:
            return True
        todo.extend(evs[j]["children"])
    return False


def matmul_records(evs: list[dict]) -> list[dict]:
    """The innermost matmul calls: {"op", "inputs": [(shape, strides, dtype) or None], "scalars"}."""
    out = []
    for i, e in enumerate(evs):
        if e["name"] not in MATMUL_OPS or _has_matmul_below(evs, i):
            continue
        a = e.get("args", {})
        dims, strides, types = a.get("Input Dims", []), a.get("Input Strides", []), a.get("Input type", [])
        inputs = []
        for d, s, t in zip(dims, strides, types):
            inputs.append((tuple(d), tuple(s), t) if t not in ("Scalar", "") and d else None)
        scalars = [c for c, t in zip(a.get("Concrete Inputs", []), types) if t == "Scalar"]
        out.append({"op": e["name"], "inputs": inputs, "scalars": scalars, "us": float(e["dur"])})
    return out


def matmul_flops(rec: dict) -> int:
    """2 * m * n * k (times the batch for bmm) of one recorded call."""
    mats = [x for x in rec["inputs"] if x is not None and len(x[0]) >= 2]
    a, b = mats[-2][0], mats[-1][0]
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


# --------------------------------------------------------------------------- the ledger

def _category(evs: list[dict], i: int) -> str:
    """The ledger category of event i's own (self) time."""
    name = evs[i]["name"]
    if name in MATMUL_OPS:
        return "matmul"
    chain, j = [], i
    while j is not None:
        if evs[j]["name"] in _KERNEL_FUNCTIONS:      # a C kernel's Function (or an op inside it)
            return _KERNEL_FUNCTIONS[evs[j]["name"]]
        chain.append(evs[j]["name"].lower())
        j = evs[j]["parent"]
    for words, cat in ((_COLLECTIVE_WORDS, "collectives"), (_ATTENTION_WORDS, "attention"),
                       (_LOSS_WORDS, "loss"), (_EMBEDDING_WORDS, "embedding")):
        if any(w in n for n in chain for w in words):
            return cat
    if name in _COPY_OPS:
        return "copies"
    if name.startswith("autograd::") or "Backward" in name or not name.startswith(("aten::", "c10d::")):
        return "autograd frames"
    return "other aten ops"


def ledger_of(evs: list[dict], wall_s: float, collective_s: float = 0.0) -> dict:
    """Split a profiled step of `wall_s` seconds into CATEGORIES, {cat: seconds}.

    Each event's self time (its duration minus its children's) on the step's
    thread (the one whose ops cover most of it; CPU backward runs there too)
    goes to one category; "python" is the wall time no op covers on that
    thread.  Ops on other threads (e.g. gloo's worker running DTensor's
    collectives) overlap the step and are left out: the step waits for them
    in its own ops (wait_tensor).
    `collective_s` (e.g. from shardformer.comm_stats()) is the time the step's
    collectives took when they run outside torch's ops (shardformer's shm
    backend): what the profile counted as collectives is topped up to it,
    taken from autograd frames, python and then the loss (whose Function
    runs one all-gather), where such calls run."""
    led = {c: 0.0 for c in CATEGORIES}
    main_tid = max({e.get("tid") for e in evs}, key=lambda t: sum(float(e["dur"]) for e in evs
                                                                    if e.get("tid") == t and e["parent"] is None),
                   default=None)
    for i, e in enumerate(evs):
        if e.get("tid") == main_tid:       # other threads' ops (a backend's worker) overlap the step
            led[_category(evs, i)] += e["self_us"] * 1e-6
    covered = sum(float(e["dur"]) for e in evs if e["parent"] is None and e.get("tid") == main_tid) * 1e-6
    led["python"] = max(0.0, wall_s - covered)
    extra = max(0.0, collective_s - led["collectives"])
    for c in ("autograd frames", "python", "loss"):   # the vocabulary-parallel loss gathers its statistics
        take = min(extra, led[c])
        led[c] -= take
        led["collectives"] += take
        extra -= take
    return led


def profile_step(step_fn, collective_stats=None) -> dict:
    """Run step_fn() once under torch.profiler; the matmul records and the ledger.

    collective_stats: optional context-manager factory whose object has
    ``total("seconds")`` (shardformer.comm_stats), for collectives the profiler
    cannot see."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    stats_cm = collective_stats() if collective_stats is not None else contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with stats_cm as stats:
            t0 = time.perf_counter()
            step_fn()
            wall = time.perf_counter() - t0
    coll = stats.total("seconds") if stats is not None else 0.0
    evs = _nest(_trace_events(prof))
    recs = matmul_records(evs)
    return {"wall_s": wall, "matmuls": recs, "ledger_s": ledger_of(evs, wall, coll),
            "matmul_flops": sum(matmul_flops(r) for r in recs)}


# --------------------------------------------------------------------------- replay

WIRE_DTYPES = {"float": "float32", "double": "float64", "c10::BFloat16": "bfloat16", "c10::Half": "float16",
           "BFloat16": "bfloat16", "Half": "float16"}


class FloorReplay:
    """The recorded matmuls, alone: ``run()`` does each call once, in order, on
    operands with the recorded shapes, strides and dtypes, and returns seconds.

    Operands are made once and shared between calls with the same (shape,
    strides, dtype); every call allocates its output as the step does."""

    def __init__(self, records: list[dict], seed: int = 0):
        import torch

        self._torch = torch
        g = torch.Generator().manual_seed(seed)
        made: dict = {}

        def operand(spec):
            if spec is None:
                return None
            shape, strides, tname = spec
            key = (shape, strides, tname)
            if key not in made:
                dtype = getattr(torch, WIRE_DTYPES.get(tname, tname))
                span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
                base = torch.randn(span, generator=g).to(dtype)
                made[key] = base.as_strided(shape, strides)
            return made[key]

        self.calls = []
        for r in records:
            ops = [operand(x) for x in r["inputs"]]
            fn = getattr(torch, r["op"].split("::")[1])
            tensors = [t for t in ops if t is not None]
            self.calls.append((fn, tensors))
        self.flops = sum(matmul_flops(r) for r in records)

    def run(self) -> float:
        t0 = time.perf_counter()
        for fn, args in self.calls:
            fn(*args)
        return time.perf_counter() - t0


def format_ledger(ledger_s: dict, wall_s: float) -> str:
    """One line: each category's ms and share of the profiled step."""
    return "  ".join(f"{c} {ledger_s[c] * 1e3:.1f} ms ({100 * ledger_s[c] / wall_s:.1f}%)"
                     for c in CATEGORIES if ledger_s.get(c))
