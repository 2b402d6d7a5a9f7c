"""shardformer.integrations.ShardedTrainer (transformers.Trainer for a sharded
model, issue 31 item 3): losses, grad norms and weights equal to the plain
Trainer on the unsharded model over the same global batches, at TP=2
(ShardConfig()), DP=2 x TP=2 (shardformer.mesh) and DP=2 x SP=2 (all_to_all, the mesh found by the trainer), sharded checkpoints that
resume, save_model() that plain from_pretrained() loads; plain Trainer and
accelerate's prepare() on a sharded model refused by the DDP guard; the
recipes of docs/trainer.md run as written at DP=2 x TP=2."""
import os

import numpy as np
import pytest
import torch

from checks import parity
from checks import trainer as check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "trainer.md")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain Trainer's run on the unsharded model, in float64 (see check.reference: in float32 AdamW
    turns rounding noise of small gradients into weight differences near the learning rate's size)."""
    return check.reference(str(tmp_path_factory.mktemp("reference")), torch.float64)


def _close(what, got, want, rtol=1e-5, atol=1e-6):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want).max() if got.size else 0.0
    assert err <= rtol * np.abs(want).max() + atol, f"{what}: max abs error {err:.3g} (max |ref| {np.abs(want).max():.3g})"


def _same_weights(what, got, reference):
    want = reference["weights"]
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        parity.assert_close(f"{what} {k}", torch.from_numpy(got[k]), torch.from_numpy(want[k]),
                            parity.TOL[torch.float32])


@pytest.mark.parametrize("layout, ranks", [("default", 2), ("mesh", 4), ("sp", 4)])
def test_sharded_trainer_equals_trainer(world_pool, reference, tmp_path, layout, ranks):
    """float64 on both sides, compared within float32's tolerance (the float64 runs agree to ~1e-14)."""
    results = world_pool(ranks).run(check.sharded_run, ranks, layout, str(tmp_path), "float64")
    for rank, r in enumerate(results):
        assert len(r["loss"]) == check.STEPS
        _close(f"rank {rank} losses", r["loss"], reference["loss"])
        _close(f"rank {rank} grad norms", r["grad_norm"], reference["grad_norm"])
        _same_weights(f"rank {rank} weights after {check.STEPS} steps", r["weights"], reference)
        # the resumed run's history: steps 1-2 from checkpoint-2's trainer state, step 3 its own
        _close(f"rank {rank} resumed losses", r["resumed_loss"], reference["loss"])
        _same_weights(f"rank {rank} weights resumed from checkpoint-2", r["resumed_weights"], reference)
    assert "shardformer_state" in results[0]["checkpoint"] and "model.safetensors" in results[0]["checkpoint"]
    assert results[0]["reload_error"] < 1e-5, results[0]["reload_error"]


def test_plain_trainer_and_accelerate_refused(pool, tmp_path):
    """Plain Trainer / accelerate's prepare() on a DP=2 x TP=2 model do not train silently: the DDP guard
    (item 2) refuses the DDP they wrap over the whole world, naming the TP ranks and the fix; ShardedTrainer
    refuses an unsharded model, a mesh that did not shard the model and a pipelined model, by name."""
    for message in pool.run(check.plain_trainer_refused, 4, str(tmp_path)) + pool.run(check.accelerate_prepare_refused, 4):
        assert "DistributedDataParallel over ranks [0, 1, 2, 3]" in message and "tensor-parallel" in message, message
        assert "shardformer.data_parallel" in message, message
    for r in pool.run(check.refusals, 4, str(tmp_path)):
        assert "was not sharded by shardformer" in r["unsharded"], r
        assert "split over the ranks" in r["mesh"] and "(tp)" in r["mesh"], r
        assert "2 pipeline stages" in r["pipeline"] and "OneForwardOneBackwardSchedule" in r["pipeline"], r
        assert all("docs/trainer.md" in m for m in r.values()), r


def test_docs_recipes_run_as_written(pool, tmp_path):
    """docs/trainer.md's two python blocks, exec'd as written on 4 ranks (DP=2 x TP=2): ShardedTrainer
    trains 4 steps, logs the same global loss on every rank and writes a checkpoint plain transformers
    loads; the accelerate recipe trains 4 steps with the same loss on every rank."""
    from transformers import AutoModelForCausalLM

    with open(DOCS) as f:
        blocks = check.python_blocks(f.read())
    assert len(blocks) == 2, len(blocks)
    for i, block in enumerate(blocks):
        results = pool.run(check.run_doc_block, 4, block, str(tmp_path / f"block{i}"))
        losses = np.array([r["losses"] for r in results])
        assert losses.shape == (4, 4) and np.isfinite(losses).all(), losses
        assert (losses == losses[0]).all(), losses
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "block0" / "trainer-out" / "final"))
    assert (tmp_path / "block0" / "trainer-out" / "checkpoint-4" / "shardformer_state").is_dir()
