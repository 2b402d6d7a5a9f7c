import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_pool import RankPool  # noqa: E402


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


@pytest.fixture(scope="module")
def pool2():
    """Two ranks, for the plain ShardConfig() (its default group is the world) at TP=2."""
    yield from _running_pool(2)
