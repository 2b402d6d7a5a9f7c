"""benchmarks/step_floor.py: the compute floor of a training step (the rank's
matmuls, recorded from a profiled step and replayed alone) and the ledger of
the rest, on the tiny Llama at TP=4 on an explicit group (6 heads / 2 KV heads:
uneven) and TP=2 with the plain ShardConfig(); each against the unsharded
model from the same seed (tests/checks/step_floor.py)."""
from checks import step_floor as check


def test_floor_records_tp4_uneven(pool):
    pool.run(check.floor_records, 4)


def test_floor_records_default_config(pool2):
    pool2.run(check.floor_records, 2, True)
