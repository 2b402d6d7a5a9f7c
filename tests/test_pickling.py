"""torch.save(model) / pickle of sharded models: one class of every family at
TP=2, with enable_all_optimization and with split_gather sequence
parallelism; the modes that cannot pickle are refused with the reason."""
import pytest

from checks import pickling
import zoo

FAMILIES = zoo.family_classes()
ONE_PER_FAMILY = sorted(classes[0] for classes in FAMILIES.values())


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_round_trip_tp2(pool, name):
    pool.run(pickling.round_trip_matches, 2, name)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPTJForCausalLM", "BloomForCausalLM", "ViTForImageClassification"])
def test_round_trip_all_optimization(pool, name):
    pool.run(pickling.round_trip_matches, 2, name, {"enable_all_optimization": True})


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Swinv2ForImageClassification", "SamModel", "AlbertForMaskedLM",
                                  "MixtralForCausalLM"])
def test_round_trip_sequence_parallel(pool, name):
    pool.run(pickling.round_trip_matches, 2, name, {"enable_sequence_parallelism": True})


@pytest.mark.parametrize("name", ["BloomForCausalLM", "BertForMaskedLM", "Swinv2ForImageClassification"])
def test_round_trip_eval_with_dropout(pool, name):
    pool.run(pickling.round_trip_matches, 2, name, {"enable_sequence_parallelism": True}, dropout=0.3)


@pytest.mark.parametrize("tp", [2, 4])
def test_round_trip_plain_pickle(pool, tp):
    pool.run(pickling.round_trip_matches, tp, "GPTNeoForCausalLM", {"enable_all_optimization": True}, via="pickle")


def test_replicated_gradient_hooks_reattached(pool):
    res = pool.run(pickling.replicated_hooks_reattached, 2, "SamModel")
    for r in res:
        assert r["saved"] > 0 and r["after_load"] == 0 and r["after_forward"] == r["saved"], r


@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
def test_refused_modes(pool, mode):
    config = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": mode,
              "enable_tensor_parallelism": False}
    for message in pool.run(pickling.refused_with_reason, 2, "LlamaForCausalLM", config):
        assert "LlamaForCausalLM" in message and mode in message and "state_dict" in message, message


def test_missing_group_refused(pool):
    message = pool.run(pickling.missing_group_refused, 2)[0]
    assert "[0, 7, 9]" in message and "new_group" in message, message


def test_pipeline_refused(pool):
    for message in pool.run(pickling.pipelined_refused, 4):
        assert "LlamaForCausalLM" in message and "pipeline" in message and "state_dict" in message, message


def test_attention_seams_pickle_by_registered_name():
    """A family's attention seam pickles as the module-level name it was
    registered under (AttentionSeam.registered; no search of the imported
    modules); an unregistered seam is refused, naming the seam and the fix."""
    import pickle

    from shardformer.layer.sequence_attention import AttentionSeam
    from shardformer.policies import bloom, gptj

    for seam in (bloom.SEAM, gptj.SEAM):
        assert pickle.loads(pickle.dumps(seam)) is seam
    loose = AttentionSeam("LooseAttention", "forward", split=lambda *a: None)
    with pytest.raises(TypeError, match=r"LooseAttention\.forward .*not registered.*docs/code-layers\.md"):
        pickle.dumps(loose)
