"""Issue 33 items 2 and 3: the communicator owns the backend (asynchronous
calls with wait handles on every backend) and sequence parallelism spoken in
typed input / output layouts (shardformer.distributed.mappings)."""
import pytest

from checks import regions as check


@pytest.mark.parametrize("tp", [2, 4])
def test_async_handles_on_gloo_and_shm(pool, tp):
    """all_gather / reduce_scatter / all_reduce with async_op=True and the ring exchange, on the torch
    (gloo) and shm backends, on 2 and 4 ranks (4: a ring whose neighbours differ in both directions)."""
    for report in pool.run(check.async_handles, tp, ("torch", "shm")):
        assert set(report) == {"torch", "shm"}
