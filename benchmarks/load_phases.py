"""Where a load's time goes, in counts that a loaded machine does not blur
(benchmarks/load.py --profile).

Phases(spec) wraps named functions (module path, attribute) for the length
of a `with` block and records, per phase: calls, wall seconds, CPU seconds
of the process (user + system, all threads: under load the wall time
stretches, the CPU time much less), minor and major page faults (each
minor fault is one mapping of a page, or with fault-around up to 16, of a
file the kernel already holds), and for the loader its byte counts: bytes
aliased (mapped, no copy), bytes copied, mmap calls, and how many lazy
parameters were built from their init recipe (0: none initialized and
then overwritten) or only allocated.  Phases nest (a phase
inside another counts in both); `report()` lists them in the order they
first ran, indented by depth.
"""
from __future__ import annotations

import functools
import importlib
import resource
import time


def _now():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), time.process_time(), r.ru_minflt, r.ru_majflt


# (label, module, attribute path) of what ShardFormer.from_pretrained runs, and transformers'
LAZY_PHASES = (
    ("from_pretrained", "shardformer.shardformer", "ShardFormer._from_pretrained"),
    ("config", "transformers", "AutoConfig.from_pretrained"),
    ("build (lazy)", "transformers.modeling_utils", "PreTrainedModel._from_config"),
    ("plan_load", "shardformer.checkpoint.pretrained", "plan_load"),
    ("hf conversion mapping", "shardformer.checkpoint.pretrained", "_build_hf_mapping"),
    ("mark_uninitialized", "shardformer.lazy", "mark_uninitialized"),
    ("optimize", "shardformer.shardformer", "ShardFormer.optimize"),
    ("load_pretrained", "shardformer.shardformer", "load_pretrained"),
    ("alias", "shardformer.checkpoint.pretrained", "alias"),
    ("copy", "shardformer.checkpoint.pretrained", "_copy_all"),
    ("generation config", "shardformer.shardformer", "_load_generation_config"),
)
HF_PHASES = (
    ("from_pretrained", "transformers.modeling_utils", "PreTrainedModel.from_pretrained"),
    ("hf conversion mapping", "transformers.modeling_utils", "get_model_conversion_mapping"),
)


class Phases:
    def __init__(self, spec):
        self.spec = spec
        self.rows: dict[str, list] = {}      # label -> [calls, wall, cpu, minflt, majflt, depth]
        self.counts = {"aliased_bytes": 0, "copied_bytes": 0, "mmap_calls": 0}
        self._depth = 0
        self._undo = []

    def _wrap(self, label, fn, is_classmethod=False):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            row = self.rows.setdefault(label, [0, 0.0, 0.0, 0, 0, self._depth])
            start = _now()
            self._depth += 1
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                end = _now()
                row[0] += 1
                for i in range(4):
                    row[1 + i] += end[i] - start[i]
        return wrapper

    def _patch(self, owner, attr, new):
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append((owner, attr, old))

    def __enter__(self):
        for label, module, path in self.spec:
            owner = importlib.import_module(module)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
            if isinstance(raw, classmethod):
                self._patch(owner, attr, classmethod(self._wrap(label, raw.__func__)))
            elif isinstance(raw, staticmethod):
                self._patch(owner, attr, staticmethod(self._wrap(label, raw.__func__)))
            else:
                self._patch(owner, attr, self._wrap(label, raw))
        self._count_bytes()
        self._lazy0 = self._lazy_stats()
        return self

    @staticmethod
    def _lazy_stats() -> dict:
        try:
            from shardformer import lazy
        except ImportError:
            return {}
        return dict(lazy.stats)

    def _count_bytes(self):
        """Bytes aliased / copied by load_pretrained and mmap calls of the reader."""
        try:
            from shardformer.checkpoint import mapped, pretrained
        except ImportError:
            return
        alias, fill, map_range = pretrained.alias, pretrained.fill, mapped.map_range

        def counted_alias(item, reader, *a, **k):
            ok = alias(item, reader, *a, **k)
            if ok:
                self.counts["aliased_bytes"] += item.tensor.nbytes
            return ok

        def counted_fill(item, reader):
            fill(item, reader)
            self.counts["copied_bytes"] += item.tensor.nbytes

        def counted_map(*a, **k):
            self.counts["mmap_calls"] += 1
            return map_range(*a, **k)
        self._patch(pretrained, "alias", counted_alias)
        self._patch(pretrained, "fill", counted_fill)
        self._patch(mapped, "map_range", counted_map)

    def __exit__(self, *exc):
        for owner, attr, old in reversed(self._undo):
            setattr(owner, attr, old)
        self._undo.clear()

    def phase(self, label):
        """A context measuring one more phase (e.g. the first forward)."""
        return _Block(self, label)

    def result(self) -> dict:
        keys = ("calls", "seconds", "cpu_seconds", "minor_faults", "major_faults", "depth")
        lazy = {k: v - self._lazy0.get(k, 0) for k, v in self._lazy_stats().items()}
        return {"phases": {k: dict(zip(keys, v)) for k, v in self.rows.items()}, **self.counts, "lazy": lazy}


class _Block:
    def __init__(self, phases, label):
        self.p, self.label = phases, label

    def __enter__(self):
        self.start = _now()
        self.p._depth += 1

    def __exit__(self, *exc):
        self.p._depth -= 1
        end = _now()
        row = self.p.rows.setdefault(self.label, [0, 0.0, 0.0, 0, 0, self.p._depth])
        row[0] += 1
        for i in range(4):
            row[1 + i] += end[i] - self.start[i]


def report(name: str, results: list[dict]) -> str:
    """A table of one configuration's phases: medians over its runs (each
    run's slowest rank by CPU seconds)."""
    import statistics

    lines = [f"  {name}: phase (calls)            wall s   cpu s  minflt  majflt"]
    first = results[0]["phases"]
    for label, row in first.items():
        def med(key):
            return statistics.median(r["phases"].get(label, {}).get(key, 0) for r in results)
        lines.append(f"  {'  ' * row['depth']}{label + ' (' + str(row['calls']) + ')':<{30 - 2 * row['depth']}} "
                     f"{med('seconds'):>7.3f} {med('cpu_seconds'):>7.3f} {med('minor_faults'):>7.0f} "
                     f"{med('major_faults'):>7.0f}")
    c = results[0]
    if c.get("aliased_bytes") or c.get("copied_bytes"):
        lines.append(f"  bytes aliased {c['aliased_bytes'] / 1e6:.1f} MB, copied {c['copied_bytes'] / 1e6:.1f} MB, "
                     f"mmap calls {c['mmap_calls']}")
    lazy = c.get("lazy") or {}
    if lazy:
        built, allocated = lazy.get("built_bytes", 0) / 1e6, lazy.get("allocated_bytes", 0) / 1e6
        lines.append(f"  lazy parameters: {lazy.get('built', 0)} built from their init ({built:.1f} MB: "
                     f"initialized, then overwritten if the checkpoint holds them), {lazy.get('allocated', 0)} "
                     f"only allocated ({allocated:.1f} MB, never touched when mapped)")
    return "\n".join(lines)
