import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_pool import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    p = RankPool(world_size=4)
    p.start()
    yield p
    p.stop()


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
