"""PEFT LoRA on sharded models (shardformer.lora, shardformer.layer.lora):
against the unsharded PeftModel from the same seed."""
import pytest

from checks import lora


@pytest.mark.parametrize("tp, default_group", [(2, False), (4, False), (4, True)])
def test_lora_training_matches_unsharded(pool, tp, default_group):
    for report in pool.run(lora.train_matches, tp, default_group):
        assert report["lora_fraction"] < 1


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_adapters_dropout_eval_disable(pool, tp):
    pool.run(lora.adapters_match, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_save_pretrained_and_merge(pool, tp, tmp_path):
    reports = pool.run(lora.save_and_merge, tp, str(tmp_path))
    assert "adapter_model.safetensors" in reports[0]["files"]


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_after_optimize(pool, tp, tmp_path):
    pool.run(lora.after_optimize_matches, tp, str(tmp_path))


def test_lora_refusals(pool):
    messages = pool.run(lora.refusals, 2)[0]
    assert set(messages) == {"ia3", "lm_head", "embedding", "dora", "modules_to_save", "inner", "sequence"}


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_dropout_in_training_is_one_unsharded_mask(pool, tp):
    pool.run(lora.dropout_matches, tp)
