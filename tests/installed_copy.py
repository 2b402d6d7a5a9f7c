"""Run by tests/test_packaging.py with the python of a fresh venv into which the
built wheel was installed (not editable), from a folder outside the checkout:

    <venv>/bin/python /path/to/tests/installed_copy.py

1. `shardformer` and every module under it (policies included, found by
   pkgutil.walk_packages, not listed) import from that venv's site-packages,
   and no folder of the source tree (python/, policies/) is on sys.path;
2. one model of every built-in family is sharded at TP=2 by the installed copy
   on two CPU ranks (the test pool, gloo) and equals the unsharded model:
   forward, loss, every gradient, the weights after a step.

This file's folder (tests/) goes on sys.path for the zoo and the parity
checks; that is test code only.  Prints one JSON line with what it did.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)


def import_every_module() -> list[str]:
    """Import shardformer and all its submodules; each must come from this venv."""
    import shardformer

    source = [os.path.join(ROOT, "python"), os.path.join(ROOT, "policies")]
    on_path = [p for p in sys.path if p and any(_inside(p, s) for s in source)]
    if on_path:
        raise AssertionError(f"the source tree is on sys.path: {on_path}")
    names = ["shardformer"] + [m.name for m in pkgutil.walk_packages(shardformer.__path__, "shardformer.")]
    for name in names:
        module = importlib.import_module(name)
        where = getattr(module, "__file__", None) or ""
        if not _inside(where, sys.prefix) or _inside(where, ROOT):
            raise AssertionError(f"{name} imported from {where!r}, not from the installed copy in {sys.prefix}")
    return names


def main() -> None:
    modules = import_every_module()
    if "shardformer.pipeline" not in modules or not any(m.startswith("shardformer.policies.") for m in modules):
        raise AssertionError(f"the wheel lacks packages: {modules}")

    sys.path.insert(0, TESTS_DIR)
    import zoo
    from checks import parity
    from dist_pool import RankPool

    first_of_family = {family: classes[0] for family, classes in sorted(zoo.family_classes().items())}
    pool = RankPool(world_size=2)
    pool.start()
    try:
        sharded = {}
        for family, name in first_of_family.items():
            reports = pool.run(parity.check_zoo_model, 2, name)
            fraction = max(r["param_fraction"] for r in reports)
            if not fraction < 1:
                raise AssertionError(f"{name}: nothing was sharded (each rank holds {fraction:.2f} of it)")
            sharded[family] = name
    finally:
        pool.stop()
    print(json.dumps({"modules": modules, "families": sharded}))


if __name__ == "__main__":
    main()
