"""The shm backend's waits: spin, yield, then sleep on a futex that the
peer's store wakes (csrc/comm/shm_wait.c, "Waiting").  The counts prove the sleep
and the wake happened; no timing is asserted (see
benchmarks/collectives_under_load.py for the latencies)."""
import sys

import pytest

from checks import shm_wait as check


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futex waits are Linux-only")
def test_late_peer_wakes_the_sleeper(pool):
    early, late = pool.run(check.late_peer, 2)
    assert early["sleeps"] >= 1, early
    assert late["wakes"] >= 1, late


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futex waits and SIGSTOP are Linux-only")
def test_abort_after_arrival_fails_the_next_call_not_this_one(pool):
    rank0 = pool.run(check.abort_after_arrival, 2)[0]
    assert rank0["barrier"] == "returned", rank0
    # the next call is refused naming rank 1 (a PeerFailed: rank 1 aborted with a token no account was written
    # under, so the message says its account did not reach the store)
    assert "rank 1" in rank0["next"] and "raised" in rank0["next"], rank0
