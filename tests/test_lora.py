"""PEFT LoRA on sharded models (shardformer.lora, shardformer.layer.lora):
against the unsharded PeftModel from the same seed."""
import os
import sys

import pytest

from checks import lora
from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tp, default_group", [(2, False), (4, False), (4, True)])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_lora_training_matches_unsharded(pool, name, tp, default_group):
    for report in pool.run(lora.train_matches, tp, default_group, name=name):
        assert report["lora_fraction"] < 1


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name, overlap", [("LlamaForCausalLM", False), ("LlamaForCausalLM", True),
                                           ("GPT2LMHeadModel", False)])
def test_lora_with_split_gather_sequence_parallelism(pool, name, overlap, tp):
    config = dict(enable_sequence_parallelism=True, enable_sequence_overlap=overlap)
    pool.run(lora.train_matches, tp, False, name=name, config=config)


def test_lora_on_a_gather_input_layer_is_refused(pool):
    """GPT-2's c_attn gathers its input rows itself with sequence overlap (Linear1D_Col(gather_input=True))."""
    config = dict(enable_sequence_parallelism=True, enable_sequence_overlap=True)
    pool.run(lora.gather_input_refused, 2, "GPT2LMHeadModel", config)


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
    assert set(messages) == {"ia3", "lm_head", "embedding", "dora", "modules_to_save", "inner", "all_to_all",
                             "pissa", "after_ia3", "peft_itself"}


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_dropout_in_training_is_one_unsharded_mask(pool, tp):
    pool.run(lora.dropout_matches, tp)


def test_lora_example_runs_as_written(tmp_path):
    """docs/lora.md's recipe: examples/lora_finetune.py under torchrun at TP=2 (it exits 1 unless the adapters
    are sharded and the losses, the adapter saved and loaded unsharded, and merge_and_unload agree with the
    unsharded run)."""
    script = os.path.join(ROOT, "examples", "lora_finetune.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
           "--out", str(tmp_path)]
    out = run_killing_group(cmd, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count("-> OK") == 4 and (tmp_path / "adapter_model.safetensors").exists(), text[-4000:]
