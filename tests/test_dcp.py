"""torch.distributed.checkpoint (DCP) on sharded models.

DCP on model.state_dict() of a sharded model is refused (it used to store
one rank's shards as the whole tensors and load rank 1's q_proj into rank 0,
silently).  shardformer.checkpoint.get_state_dict / set_state_dict give
state dicts DCP saves with every piece placed exactly (uneven head splits,
replicated KV heads, vocabulary padding): saved at one TP size (or from the
plain HF model with torch's own get_state_dict), loaded at another (or into
the plain model), model and AdamW state: the loaded weights are bit for bit
the saved ones, the next step equals the straight unsharded run, and at the
saving TP size bit for bit the run that never stopped.  TP=4 uses the default ShardConfig() (group = the world)."""
import pytest

from checks import dcp as checks

NAME = "LlamaForCausalLM"   # 6 heads, 2 KV heads, 90 MLP features, vocabulary 101: uneven at TP=2 and 4


@pytest.mark.parametrize("tp", [2, 4])
def test_dcp_on_plain_state_dict_is_refused(pool, tmp_path, tp):
    reports = pool.run(checks.plain_state_dict_refused, tp, NAME, str(tmp_path))
    for msgs in reports:
        for what, msg in msgs.items():
            if what == "load_placed":    # DCP's own size check comes first: the full shape vs the shard's
                assert "Size mismatch" in msg or "get_state_dict" in msg, msg
            else:
                assert "get_state_dict" in msg and ".weight' is this rank's shard only" in msg, (what, msg)


@pytest.mark.parametrize("tp", [2, 4])
def test_placed_pieces_tile_each_tensor_once(pool, tp):
    reports = pool.run(checks.placed_pieces, tp, NAME)
    assert reports[0]["placed"] > 0


@pytest.mark.parametrize("save_tp, load_tp", [(2, 2), (4, 4), (2, 4), (4, 2), (2, 1), (1, 4), (4, 1)])
def test_dcp_round_trip_across_tp_sizes(pool, tmp_path, save_tp, load_tp):
    directory = str(tmp_path / "ckpt")
    saved = pool.run(checks.train_and_save, save_tp, NAME, directory)
    if save_tp > 1:
        assert saved[0]["placed"] > 0 and saved[0]["moments"] == 2 * saved[0]["placed"], saved[0]
    reports = pool.run(checks.load_and_step, load_tp, NAME, directory, saved[0]["full"], save_tp == load_tp)
    assert all(r["step"] == 2.0 for r in reports), reports
    print(f"dcp TP={save_tp} -> TP={load_tp}: errors after the next step {reports[0]}")


def test_bad_dicts_are_refused(pool):
    pool.run(checks.bad_dicts_refused, 4)
