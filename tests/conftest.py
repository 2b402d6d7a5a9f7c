import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_pool import RankPool  # noqa: E402

# scripts/test_compat.sh sets it: the suite at the lower end of the transformers range runs only
# the cases whose outcome can depend on the transformers version (the main suite runs all of them).
#  * Each case parametrized over tp / sp in {2, 4} runs at 2 only.  What the version changes is
#    HF's side (module structure, signatures, masks), which size 2 reaches as well as 4; the
#    size-4 arithmetic (uneven heads, vocab padding) is ours and runs in the main suite.
#  * _COMPAT_ONE_OF: for these parameters one value stands for the others, because the values
#    differ only in shardformer's or torch's code, never in which HF code runs.  A case with a
#    listed value is left out only while another case of the same test function remains, so no
#    test function leaves the compat run.
#  * @pytest.mark.transformers_independent: a test whose outcome cannot depend on the transformers
#    version: it builds no HF module (a C kernel against a torch reference, a schedule's step list)
#    or uses one only to carry shardformer's own bookkeeping.  A module-level pytestmark can be
#    overridden per test by transformers_independent(False).
#  * @pytest.mark.compat_covered_by("test_x"): the HF code this test reaches, test_x of the same module
#    reaches too (the difference is shardformer's); left out while test_x is selected.
COMPAT_SUBSET = os.environ.get("SHARDFORMER_COMPAT_SUBSET") == "1"
_SIZES = ("tp", "sp")
_COMPAT_ONE_OF = {
    # GPipe and 1F1B run the same stage forwards and backwards (the family's HF code); they differ
    # only in the order of the micro-batches (shardformer.pipeline.schedules).  Interleaved stays:
    # its chunks split the layers differently.
    "schedule": "gpipe",
    # torch.utils.checkpoint's two implementations; HF's layers call it the same way for both.
    "use_reentrant": True,
    "reentrant": True,
}


def pytest_configure(config):
    config.addinivalue_line("markers", "transformers_independent(flag=True): the outcome cannot depend on the "
                                       "transformers version; left out of the compat run (scripts/test_compat.sh)")
    config.addinivalue_line("markers", "compat_covered_by(name): test `name` of the same module reaches the same "
                                       "HF code; left out of the compat run while `name` runs")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False); scripts/device_check.sh runs "
                        "these on one (docs/gpu.md)")


def compat_dropped(items) -> list:
    """The items the compat run leaves out (see COMPAT_SUBSET above)."""
    dropped = set()
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        mark = item.get_closest_marker("transformers_independent")
        if any(params.get(k) == 4 for k in _SIZES) or (mark is not None and (mark.args or (True,))[0]):
            dropped.add(item)
    by_function: dict = {}
    for item in items:
        if item not in dropped:
            by_function.setdefault((item.module.__name__, item.originalname), []).append(item)
    for cases in by_function.values():
        for key, value in _COMPAT_ONE_OF.items():
            other = [c for c in cases if c.callspec.params.get(key, value) != value] if len(cases) > 1 else []
            if other:
                gone = {c for c in cases if key in c.callspec.params and c.callspec.params[key] == value}
                dropped |= gone
                cases[:] = [c for c in cases if c not in gone]
    kept = {(item.module.__name__, item.originalname) for item in items if item not in dropped}
    for item in items:
        mark = item.get_closest_marker("compat_covered_by")
        if mark is not None and (item.module.__name__, mark.args[0]) in kept:
            dropped.add(item)
    return [item for item in items if item in dropped]


def pytest_collection_modifyitems(config, items):
    if not COMPAT_SUBSET:
        return
    dropped = compat_dropped(items)
    if dropped:
        gone = set(dropped)
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in gone]


def _running_pool(world_size: int):
    p = RankPool(world_size=world_size)
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="session")
def pool():
    yield from _running_pool(4)


@pytest.fixture(scope="session")
def world_pool(pool):
    """world_pool(n): a pool whose whole world is n ranks, for ShardConfig()
    (the default group = the world) at TP=n; n=4 is `pool` itself.  Each
    size is started once, on first use."""
    pools = {pool.world_size: pool}

    def get(n: int) -> RankPool:
        if n not in pools:
            pools[n] = RankPool(world_size=n)
            pools[n].start()
        return pools[n]

    yield get
    for n, p in pools.items():
        if p is not pool:
            p.stop()


@pytest.fixture(scope="session")
def pool2(world_pool):
    """Two ranks, for the plain ShardConfig() (its default group is the world) at TP=2."""
    return world_pool(2)
