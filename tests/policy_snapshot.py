"""The descriptions the built-in policies produce, as plain data.

`snapshot()` builds every zoo model that a built-in family covers, runs its
policy's module_policy() under a few shard configurations (tensor parallel;
with parallel_output; with split-gather sequence parallelism, with and
without overlap) and writes each replacement as (configuration, model
class, policy key, suffix, layer class, kwargs) and each attribute as
(configuration, model class, policy key, attribute, value): policy keys
sorted by class name (by_key), replacements in the order the policy gives
them (the sharder applies them in that order).
tests/data/policy_snapshot.json.gz holds the snapshot taken before the
built-in shapes were written as plans (shardformer.plan); test_plan.py
compares it with today's.  It predates the typed sequence layouts: a
SequenceParallelRegion's `role` there (a role string or a tuple of them) and
a `layouts=` value today are both compared as the SequenceLayouts they are
(`layouts_of`; shardformer.layer.sequence_layout.as_layouts), so a policy
that spells its regions either way gives the same rows.  Regenerate only
for an intended change:

    cd tests && ../.venv/bin/python policy_snapshot.py
"""
from __future__ import annotations

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "policy_snapshot.json.gz")

#: (name, ShardConfig kwargs) of the configurations snapshotted.
CONFIGS = (
    ("tp", {}),
    ("tp_parallel_output", {"parallel_output": True}),
    ("split_gather", {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}),
    ("split_gather_overlap", {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather",
                              "enable_sequence_overlap": True}),
)


def variants() -> dict[str, tuple[str, dict]]:
    """{snapshot name: (zoo name, config overrides)} of configurations the
    zoo builds only with overrides (Falcon's two other QKV layouts)."""
    from zoo import decoders

    return {"FalconForCausalLM/new_arch": ("FalconForCausalLM", decoders.FALCON_NEW_ARCH),
            "FalconForCausalLM/per_head": ("FalconForCausalLM", decoders.FALCON_PER_HEAD)}


def plain(value):
    """A JSON-able stand-in for a description value: split specs by their
    data, classes by name, per-run objects (sequence state) by type."""
    from shardformer.layer.sequence_layout import SequenceLayouts
    from shardformer.layout import PerRank

    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, SequenceLayouts):
        return repr(value)
    if isinstance(value, PerRank):
        return f"PerRank({value.description})"
    if hasattr(value, "data") and type(value).__module__.startswith("shardformer.layout"):
        return [type(value).__name__, plain(value.data)]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return type(value).__name__


#: "<model> <key>.<suffix>" of every region a built-in policy spelled with a
#: role string in the last snapshot() (they spell layouts=; test_plan.py)
ROLE_SPELLED: list[str] = []


def family_classes() -> dict[str, str]:
    """{model class name: family name} of every built-in family."""
    from shardformer.autopolicy import families

    return {cls: fam.name for fam in families() for cls in fam.heads}


def rows_of(name: str, config_kwargs: dict, overrides: dict | None = None) -> list:
    import zoo
    from shardformer import ShardConfig
    from shardformer.autopolicy import get_autopolicy

    model = zoo.build(name, **(overrides or {}))
    policy = get_autopolicy(model)
    policy.set_model(model)
    policy.set_shard_config(ShardConfig(**config_kwargs))
    try:
        description = policy.module_policy()
    except Exception as e:       # a configuration the family refuses: the refusal is the snapshot
        return [["refused", type(e).__name__]]
    rows = []
    for key, desc in description.items():
        key = key if isinstance(key, str) else key.__name__
        for sub in desc.sub_module_replacement:
            if "role" in (sub.kwargs or {}):
                ROLE_SPELLED.append(f"{name} {key}.{sub.suffix}")
            rows.append(["sub", key, sub.suffix, plain(sub.target_module), layouts_of(plain(sub.kwargs or {})),
                         bool(sub.ignore_if_not_exist)])
        for attr, value in desc.attribute_replacement.items():
            rows.append(["attr", key, attr, plain(value)])
        rows.append(["methods", key, sorted(desc.method_replacement), len(desc.param_replacement)])
    return by_key(rows)


def by_key(rows: list) -> list:
    """`rows` ordered by their policy key's class name, each key's rows in
    their order (a stable sort): a key spelled as a class or as its name
    (a spec's ModuleSpec) takes the same place.  The stored snapshot sorted
    keys by str(key), which puts class keys ("<class ...>") first; load()
    reorders it the same way, changing no row."""
    return sorted(rows, key=lambda row: row[1] if row[0] in ("sub", "attr", "methods") else "")


def layouts_of(kwargs: dict) -> dict:
    """`kwargs` (plain) with a region's role strings written as the
    SequenceLayouts they name: {"role": "block"} -> {"layouts":
    "SequenceLayouts(input=Move(ROWS, FULL_PARTIAL_GRAD), ...)"}."""
    from shardformer.layer.sequence_layout import as_layouts

    if "role" not in kwargs:
        return kwargs
    role = kwargs["role"]
    out = {k: v for k, v in kwargs.items() if k != "role"}
    out["layouts"] = repr(as_layouts(tuple(role) if isinstance(role, list) else role))
    return dict(sorted(out.items()))


def load() -> dict:
    """The stored snapshot, its role strings read as layouts (layouts_of)."""
    with gzip.open(SNAPSHOT, "rt") as f:
        data = json.load(f)
    return {name: by_key([row[:4] + [layouts_of(row[4])] + row[5:] if row[0] == "sub" else row for row in rows])
            for name, rows in data.items()}


def snapshot(classes=None) -> dict:
    """{"<config>/<zoo name>": sorted rows} for every zoo model of a built-in family."""
    import zoo

    covered = family_classes()
    builds = {name: (name, {}) for name in zoo.names()}
    builds.update(variants())
    out = {}
    for name, (zoo_name, overrides) in sorted(builds.items()):
        cls = name.split("/")[0]
        if cls not in covered or (classes is not None and cls not in classes):
            continue
        for config_name, kwargs in CONFIGS:
            out[f"{config_name}/{name}"] = rows_of(zoo_name, kwargs, overrides)
    return out


if __name__ == "__main__":
    data = snapshot()
    with gzip.open(SNAPSHOT, "wt") as f:
        json.dump(data, f, indent=0, sort_keys=True)
    print(f"{len(data)} entries -> {SNAPSHOT}")
