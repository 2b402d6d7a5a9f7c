"""Checkpoints of a sharded model: HF's save_pretrained on a sharded model
writes one full HF checkpoint from rank 0 that plain transformers loads back
equal to the unsharded model; a rank's shards are refused as a state_dict;
gather_full_state_dict gives contiguous tensors, everywhere or on rank 0 only;
a full state dict gathered at one TP size loads into a model sharded at
another.  (The full state-dict round trip of each family is a model test:
test_state_dict_round_trip in tests/test_models_*.py.)"""
import json
import os

import pytest

from checks import checkpoints

SAVED = ["LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "MixtralForCausalLM",
         "T5ForConditionalGeneration", "WhisperForConditionalGeneration", "ViTForImageClassification"]


@pytest.mark.parametrize("name", SAVED)
def test_save_pretrained_reloads_in_plain_transformers_tp2(pool, tmp_path, name):
    directory = str(tmp_path / "ckpt")
    reports = pool.run(checkpoints.save_and_reload, 2, name, directory)
    assert reports[0]["files"] == reports[1]["files"]  # rank 1 saw rank 0's finished files
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [name]


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen2ForCausalLM", "BertForMaskedLM"])
def test_save_pretrained_reloads_tp4(pool, tmp_path, name):
    pool.run(checkpoints.save_and_reload, 4, name, str(tmp_path / "ckpt"))


def test_save_pretrained_refuses_a_shard(pool, tmp_path):
    msgs = pool.run(checkpoints.save_shard_refused, 2, "LlamaForCausalLM", str(tmp_path / "ckpt"))
    assert all("shard" in m and "gather_full_state_dict" in m for m in msgs), msgs


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["Qwen2ForCausalLM", "BertForMaskedLM", "MixtralForCausalLM"])
def test_gather_full_state_dict_modes(pool, name, tp):
    reports = pool.run(checkpoints.gather_modes, tp, name)
    assert reports[0]["n"] > 0 and all(r["n"] == 0 for r in reports[1:])


def test_failed_save_raises_everywhere_and_leaves_nothing(pool, tmp_path):
    msgs = pool.run(checkpoints.failed_save_leaves_nothing, 2, str(tmp_path / "ckpt"))
    assert msgs[0] == "OSError: disk full" and "failed on rank 0" in msgs[1], msgs


@pytest.mark.parametrize("save_tp, load_tp", [(2, 4), (4, 2), (4, 1)])
def test_load_across_tp_sizes(pool, save_tp, load_tp):
    full = pool.run(checkpoints.gathered_state, save_tp, "LlamaForCausalLM")[0]
    pool.run(checkpoints.load_into, load_tp, "LlamaForCausalLM", full)
