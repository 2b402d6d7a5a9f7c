"""ShardFormer.from_pretrained: a HF checkpoint built lazily, sharded, and
each rank's slices read from the files: equal to transformers'
from_pretrained of the same checkpoint (logits, loss, every gradient) at
TP=1, 2 and 4, with no parameter of the checkpoint ever built whole from its
init recipe; dtype conversion both ways; parameters the checkpoint lacks are
initialized and named."""
import pytest

from checks import lazy

MODELS = ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "MixtralForCausalLM", "BloomForCausalLM",
          "Qwen2ForCausalLM"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(name, dtype_name="float32", drop=None):
        key = (name, dtype_name, drop)
        if key not in cache:
            d = str(tmp_path_factory.mktemp(name.replace("/", "_")))
            lazy.save_reference(name, d, dtype_name, drop)
            cache[key] = d
        return cache[key]
    return get


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_from_pretrained_equals_hf(pool, saved, name, tp):
    pool.run(lazy.from_pretrained_equals_hf, tp, name, saved(name))


@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_checkpoint_into_fp32_model(pool, saved, tp):
    pool.run(lazy.from_pretrained_equals_hf, tp, "LlamaForCausalLM", saved("LlamaForCausalLM", "bfloat16"),
             "float32")


def test_fp32_checkpoint_into_bf16_model(pool, saved):
    pool.run(lazy.from_pretrained_equals_hf, 2, "LlamaForCausalLM", saved("LlamaForCausalLM"), "bfloat16")


def test_missing_parameters_are_initialized_and_named(pool, saved):
    d = saved("LlamaForCausalLM", drop="lm_head.")
    pool.run(lazy.from_pretrained_initializes_missing, 2, "LlamaForCausalLM", d, "lm_head.")


@pytest.mark.parametrize("load_tp", [1, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_saved_at_tp2_loads_at_other_sizes(pool, tmp_path, name, load_tp):
    directory = str(tmp_path / "trained")
    pool.run(lazy.save_trained, 2, name, directory)
    pool.run(lazy.from_pretrained_equals_hf, load_tp, name, directory)


def _one_class_per_family():
    import zoo

    picked = []
    for family, classes in zoo.family_classes().items():
        if family in ("chatglm2",):        # a local model outside transformers: no from_pretrained of its own
            continue
        picked.append(classes[0])
    return picked


@pytest.mark.parametrize("name", _one_class_per_family())
def test_from_pretrained_every_family(pool, saved, name):
    pool.run(lazy.from_pretrained_equals_hf, 2, name, saved(name))


def test_missing_checkpoint_is_named(tmp_path, monkeypatch):
    import transformers

    from shardformer import ShardConfig, ShardFormer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint.*not a local checkpoint directory"):
        ShardFormer(ShardConfig()).from_pretrained(transformers.LlamaForCausalLM, missing)


_FRESH = """
import sys
import transformers
from transformers import conversion_mapping
from shardformer import ShardConfig, ShardFormer

model, _ = ShardFormer(ShardConfig()).from_pretrained(transformers.LlamaForCausalLM, sys.argv[1])
# the vocabulary-parallel loss plan (what every TP > 1 load runs) asks the registry about every submodule
model, _ = ShardFormer(ShardConfig(parallel_output=True)).from_pretrained(transformers.LlamaForCausalLM, sys.argv[1])
policies = sorted(k for k, m in list(sys.modules.items())
                  if k.startswith("shardformer.policies.") and (hasattr(m, "FAMILY") or hasattr(m, "FAMILIES")))
assert policies == ["shardformer.policies.llama"], f"policy files imported: {policies}"
built = conversion_mapping._checkpoint_conversion_mapping_cache is not None
assert not built, "transformers' conversion mapping was built for a checkpoint holding the model's own names"
print("ok")
"""


def test_fresh_process_reads_only_what_it_needs(saved):
    """A fresh process (what a user's first from_pretrained is): the policy
    registry imports the one policy file named after the model's package
    (not every file), and a checkpoint whose keys are the model's own names
    is read without building transformers' conversion mapping (issue 34
    item 2: both were a fixed cost of every load)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRESH, saved("LlamaForCausalLM")], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_registry_names_models_only():
    """autopolicy answers a layer of torch / transformers (not a
    PreTrainedModel) "no policy" without importing the policy files; that
    holds because every class the built-in policy files declare by full name
    is a transformers PreTrainedModel, and no bare name (remote code) is a
    torch.nn or transformers class name."""
    import importlib

    import torch
    import transformers

    from shardformer import autopolicy

    wrong = []
    for key in autopolicy.registry():
        module, _, name = key.rpartition(".")
        if not module:
            if hasattr(torch.nn, key) or hasattr(transformers, key):
                wrong.append(key)
            continue
        cls = getattr(importlib.import_module(module), name)
        if not (module.startswith("transformers.") and issubclass(cls, transformers.PreTrainedModel)):
            wrong.append(key)
    assert wrong == [], f"registry entries a layer's class could match: {wrong}"
