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
