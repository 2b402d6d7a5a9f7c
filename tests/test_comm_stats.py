"""shardformer.comm_stats(): the communication ledger (shardformer.distributed.ledger).

Calls and bytes per kind are exact for one training step of the tiny Llama
(each check compares the step with the unsharded model from the same seed):
TP=2 and TP=4 (6 heads / 2 KV heads: uneven at 4) on an explicit group and
on the plain ShardConfig() (the world), split_gather sequence parallelism,
and the pipeline's sends and receives (1F1B).  Nested ledgers, and no hooks
at all while no ledger is active."""
import pytest

from checks import comm_stats as check


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_llama_counts(pool, tp):
    pool.run(check.tp_llama, tp)


def test_tp_llama_default_config(pool2):
    pool2.run(check.tp_llama, 2, True)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_gather_counts(pool, tp):
    pool.run(check.split_gather, tp)


def test_pipeline_send_recv(pool):
    report = pool.run(check.pipeline_p2p, 4)
    assert all(r["bytes"][0] > r["bytes"][1] for r in report)    # the first step sent the headers


@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_convention(pool, tp):
    pool.run(check.collectives, tp)


def test_comm_volume_accounting(pool2):
    """benchmarks/comm_volume.py's accounting holds in every mode: the ledger's bytes are the minimum plus the
    explained excess, to the byte (run on the pool's 2 ranks, not through the script's own processes)."""
    modes = ["tp", "split_gather", "all_to_all", "ring_attn", "pp_1f1b", "dp", "ep"]
    report = pool2.run(check.benchmark_accounting, 2, modes)
    assert report[0]["dp"] == 1.0 and report[0]["all_to_all"] < 1.001
