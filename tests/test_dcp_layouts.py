"""Checkpoints across parallel layouts: shardformer.checkpoint.get_state_dict /
set_state_dict with torch.distributed.checkpoint (model and AdamW state)
for pipeline stages, expert parallelism and ZeRO-1, saved at one layout and
loaded at another; save_sharded / load_sharded for the same layouts, with
the saving mesh in the manifest.  After the load the weights are bit for
bit the saved ones and the next step equals the straight unsharded run
(tests/checks/dcp_layouts.py)."""
from checks import dcp_layouts as checks
from checks.dcp_layouts import DP2TP2, EP2, EP4, PP2TP2, TP2, TP4, ZERO



def _round_trip(pool, tmp_path, arch, save, loads, sharded=False):
    directory = str(tmp_path / "ckpt")
    saved = pool.run(checks.train_and_save, checks.ranks(save), arch, save, directory, sharded)[0]
    assert saved["placed"] > 0 and saved["states"] > 0, saved
    out = []
    for load in loads:
        reports = pool.run(checks.load_and_step, checks.ranks(load), arch, load, directory, saved["full"])
        print(f"dcp {save} -> {load}: errors after the next step {reports[0]}")
        out.append(reports)
    return directory, saved, out


def test_pipeline_stages_to_tp2_and_tp4(pool, tmp_path):
    """TP=2 x PP=2 (each stage its layers, global keys) -> TP=2 (explicit group) and TP=4 (ShardConfig());
    save_sharded of the stages records the mesh and loads at TP=4."""
    directory, saved, _ = _round_trip(pool, tmp_path, "llama", PP2TP2, [TP2, TP4], sharded=True)
    rec = pool.run(checks.sharded_load, 4, "llama", TP4, directory, saved["full"], PP2TP2)[0]
    assert rec["pp"] == 2 and rec["tp"] == 2 and sorted(rec["ranks"]) == [0, 1, 2, 3], rec


def test_pipeline_stages_with_different_optimizer_groups_refused(pool):
    msgs = pool.run(checks.stages_disagree, 4)
    assert all("lr" in m for m in msgs), msgs


def test_dp_tp_to_pipeline_stages(pool, tmp_path):
    """DP=2 x TP=2 replicas -> TP=2 x PP=2; load_sharded of the replicas' save (the TP format: one TP group's
    files, ranks 0 and 1) into the stages, with the mesh in the manifest and without it (an older manifest)."""
    directory, saved, _ = _round_trip(pool, tmp_path, "llama", DP2TP2, [PP2TP2], sharded=True)
    rec = pool.run(checks.sharded_load, 4, "llama", PP2TP2, directory, saved["full"], DP2TP2, True)[0]
    assert rec["ranks"] == [0, 1] and rec["sp"] == 1, rec


def test_expert_parallel_ep2_to_ep4(pool, tmp_path):
    """Mixtral, 5 experts: EP=2 (x TP=2, blocks of 3 and 2 experts, each split over TP) -> EP=4 (2, 1, 1, 1);
    save_sharded at EP=2 loads at EP=4."""
    directory, saved, _ = _round_trip(pool, tmp_path, "mixtral", EP2, [EP4], sharded=True)
    assert saved["multi"] > 0, saved           # experts placed along two dimensions
    pool.run(checks.sharded_load, 4, "mixtral", EP4, directory, saved["full"], EP2)


def test_zero1_to_tp2_and_back(pool, tmp_path):
    """ZeRO-1 (AdamW partitioned over DP=2) x TP=2 -> TP=2, and TP=2 -> a fresh ZeRO-1."""
    _round_trip(pool, tmp_path / "a", "llama", ZERO, [TP2])
    _round_trip(pool, tmp_path / "b", "llama", TP2, [ZERO])
