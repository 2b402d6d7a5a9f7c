"""A stage that raises in the middle of a pipeline step (shardformer.distributed.failures):
the failing rank re-raises its own exception with a note, every peer raises PeerFailed naming
it, its exception and where, within seconds (never a hang), and a following good step equals
the unsharded model.  Cases: a batch only one rank is given, a failure in the forward, one in
the backward, one in schedule.forward(), one in generate().  2 ranks: the plain ShardConfig() (PipelineStageManager over
the world), every schedule.  4 ranks: an explicit pipeline group (1F1B, ZB-V); and TP=2 x PP=2
(the tensor-parallel peer learns of it in its all-reduce and passes it on to its own
pipeline).  Without a pipeline (shardformer.step_guard): TP=2 over the plain ShardConfig() and
TP=4 over an explicit group with split_gather sequence parallelism, a hook raising in forward()
on one rank.  One pool call per world size, limited to 60 s: on a regression the peers hang,
and the call fails then rather than after the pool's 240 s."""
import pytest

from checks import pipefail as check

LIMIT_S = 60
BOUND_S = 5.0        # a peer's error after the failing rank raised
TP_BACKWARD = [("tp", phase) for phase in check.BACKWARD_PHASES]   # loss.backward() raising on one rank


def _assert_prompt(report, bad: int):
    for k, case in enumerate(report[bad]):
        late = {r: round(rep[k]["caught"] - case["raised"], 2) for r, rep in enumerate(report) if r != bad}
        assert max(late.values()) <= BOUND_S, f"{case['schedule']} ({case['phase']}): peers' errors after {late} s"


def test_failing_stage_2_ranks_default_group(pool2):
    cases = [("1f1b", "batch")] + [(s, "forward") for s in check.SCHEDULES] + [
        ("1f1b", "backward"), ("gpipe", "inference"), ("generate", "forward")]
    report = pool2.run_within(LIMIT_S, check.failing_stage, 2, 1, [(2, 1, "default", cases),
                                                                   (1, 2, "default", [("shm", "pairing"), ("tp", "forward")] + TP_BACKWARD)])
    _assert_prompt(report, 1)


@pytest.mark.compat_covered_by("test_failing_stage_2_ranks_default_group")   # the same HF layers
def test_failing_stage_4_ranks_explicit_groups(pool):
    # a one-chunk and the V two-chunk model at PP=4 (every schedule shares the one guard, and the
    # 2-rank call runs each): the 10 s this file may add to CI leave no room for five models here
    cases = [("1f1b", "batch"), ("1f1b", "forward"), ("zb-v", "forward"), ("zb-v", "backward")]
    report = pool.run_within(LIMIT_S, check.failing_stage, 4, 1, [(4, 1, "groups", cases),
                                                                  (2, 2, "groups", [("1f1b", "forward")]),
                                                                  (1, 4, "sp", [("tp", "forward")] + TP_BACKWARD)])
    _assert_prompt(report, 1)
