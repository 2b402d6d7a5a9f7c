"""The ranks splitting one model are given one batch: a fingerprint of the
inputs compared on the first forward (and every ShardConfig.check_inputs_every
forwards) over the tensor-parallel, sequence-parallel and pipeline groups
(shardformer.input_check); DistributedDataParallel over a group holding two
ranks of one tensor-parallel group or pipeline is refused at construction,
before its broadcast overwrites the shards (shardformer.ddp_guard); the real
transformers.Trainer and accelerate's prepare() under a TP=2 launch raise
that refusal instead of training the wrong model."""
import pytest

from checks import batch_agreement as check
from shardformer.launch import spawn

# The compat run (scripts/test_compat.sh) leaves out the fingerprint checks (shardformer's, over any
# module); the test marked transformers_independent(False) refuses HF's Trainer and stays.
pytestmark = pytest.mark.transformers_independent


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_given_other_rows(pool, tp):
    reports = pool.run(check.tp_rows_differ, tp, 3)
    assert all(r["first"] == reports[0]["first"] for r in reports), "every rank raises the same error"


def test_check_inputs_every_zero_never_checks(pool):
    assert pool.run(check.tp_rows_differ, 2, 0) == [{"checked": False}] * 2


def test_default_group_sampler_over_world(pool):
    """ShardConfig() on the pool's 4-rank world (TP=4) fed by a world-wide DistributedSampler."""
    message = pool.run(check.default_group_sampler, 4)[0]
    assert message.index("Fix:") < message.index("check_inputs_every=0"), message


def test_dp_tp_sampler(pool):
    pool.run(check.dp_tp_sampler, 4)


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
def test_sequence_parallel_full_sequence_on_every_rank(pool, mode):
    pool.run(check.sequence_parallel_rows, 2, mode)


def test_tp_sp_world_sampler(pool):
    pool.run(check.tp_sp_world_sampler, 4)


def test_pipeline_stages_given_other_rows(pool):
    pool.run(check.pipeline_rows, 4)


def test_float_inputs(pool):
    pool.run(check.vision_pixels_differ, 2)


def test_ddp_over_world_refused_dp_tp(pool):
    pool.run(check.ddp_dp_tp, 4)


def test_ddp_over_pipeline_refused(pool):
    pool.run(check.ddp_pipeline, 4)


@pytest.mark.transformers_independent(False)
def test_trainer_and_accelerate_refused(tmp_path):
    """The real transformers.Trainer and accelerate.Accelerator.prepare on two ranks started as torchrun
    would (shardformer.launch.spawn: RANK, WORLD_SIZE, MASTER_*), the model sharded with ShardConfig()."""
    pytest.importorskip("accelerate")
    out = spawn(check.trainers_refused, 2, args=(str(tmp_path),))
    assert out[0].keys() == {"ddp", "trainer", "accelerate"}


@pytest.mark.parametrize("tp,plain", [(2, False), (4, True)])
def test_torch_clip_grad_norm_drift_caught(pool, tp, plain):
    """torch.nn.utils.clip_grad_norm_ on a sharded model makes the ranks' whole
    parameters drift apart: the next forward raises, naming them
    (shardformer.replica_drift); shardformer.clip_grad_norm_ trains on."""
    reports = pool.run(check.torch_clip_drift, tp, plain)
    assert all(r["drift"] == reports[0]["drift"] for r in reports), "every rank raises the same error"
