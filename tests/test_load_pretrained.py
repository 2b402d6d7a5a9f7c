"""shardformer.checkpoint.load_pretrained: HF checkpoints (one safetensors
file, a sharded safetensors index, a pytorch_model.bin) written by plain
transformers save_pretrained, loaded into models built from another seed and
sharded at TP=1/2/4, give the saved model's outputs and gradients.  Covers
GQA with KV heads replicated (Llama, 2 KV heads at TP=4), tied and untied
embeddings, fused c_attn (GPT-2) and query_key_value (BLOOM, Falcon
multi-query), MoE experts in the per-expert layout HF 5 writes (Mixtral),
padded vocabularies (101 rows: not a multiple of tp * 64), dtype conversion,
refused checkpoints, that only slices are read, the progress bar, and the
real all-MiniLM-L6-v2 checkpoint."""
import os
import sys

import pytest

from checks import load_pretrained as checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from checkpoints import CheckpointNotInstalled, minilm_dir  # noqa: E402

TIED = {"tie_word_embeddings": True}

# (model, tp, layout, config overrides).  Layouts: "single" model.safetensors and "index" (several
# files and model.safetensors.index.json) by HF save_pretrained; "bin" / "bin-index" torch pickles.
CASES = [
    ("LlamaForCausalLM", 1, "single", {}),
    ("LlamaForCausalLM", 2, "index", {}),
    ("LlamaForCausalLM", 4, "single", {}),
    ("LlamaForCausalLM", 4, "bin", TIED),
    ("LlamaForCausalLM", 2, "single", TIED),
    ("GPT2LMHeadModel", 2, "single", {}),
    ("GPT2LMHeadModel", 4, "index", {}),
    ("BertForMaskedLM", 1, "bin", {}),
    ("BertForMaskedLM", 4, "single", {}),
    ("MixtralForCausalLM", 1, "single", {}),
    ("MixtralForCausalLM", 2, "index", {}),
    ("MixtralForCausalLM", 4, "bin-index", {}),
    ("BloomForCausalLM", 2, "single", {}),
    ("FalconForCausalLM", 4, "index", {}),
]
FILES = {"single": "model.safetensors", "index": "model.safetensors.index.json", "bin": "pytorch_model.bin",
         "bin-index": "pytorch_model.bin.index.json"}


def _id(case):
    name, tp, layout, over = case
    return f"{name}-tp{tp}-{layout}" + ("-tied" if over else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_load_equals_saved_model(pool, tmp_path, case):
    name, tp, layout, overrides = case
    reports = pool.run(checks.load_equals_saved, tp, name, str(tmp_path / "ckpt"), layout, overrides)
    files = reports[0]["files"]
    weights = [f for f in files if f.endswith((".safetensors", ".bin"))]
    assert FILES[layout] in files and (len(weights) > 1) == ("index" in layout), files
    if overrides.get("tie_word_embeddings"):
        assert all(r["tied"] for r in reports)


@pytest.mark.parametrize("saved, loaded", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_dtype_conversion_equals_hf_from_pretrained(pool, tmp_path, saved, loaded):
    pool.run(checks.dtype_conversion, 2, "LlamaForCausalLM", str(tmp_path / "ckpt"), saved, loaded)


def test_bad_checkpoint_lists_every_key_and_leaves_model(pool, tmp_path):
    directory = str(tmp_path / "ckpt")
    msgs = pool.run(checks.bad_checkpoint_refused, 2, "LlamaForCausalLM", directory)
    for msg in msgs:
        assert msg.startswith("load_pretrained(LlamaForCausalLM)") and directory in msg, msg
        assert "missing keys (1): model.layers.0.mlp.up_proj.weight" in msg, msg
        assert "unexpected keys (1): model.layers.0.mlp.extra.weight" in msg, msg
        assert "model.layers.1.self_attn.k_proj.weight: checkpoint shape [24, 96]" in msg, msg
        assert "expects [32, 96]" in msg, msg


def test_tied_weights_stored_under_the_head_name(pool, tmp_path):
    pool.run(checks.tied_under_either_name, 2, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("name, tp, layout", [("LlamaForCausalLM", 2, "single"), ("MixtralForCausalLM", 4, "index"),
                                              ("GPT2LMHeadModel", 4, "bin")])
def test_each_rank_reads_only_its_slices(pool, tmp_path, name, tp, layout):
    reports = pool.run(checks.reads_only_slices, tp, name, str(tmp_path / "ckpt"), layout)
    total = reports[0]["total"]
    # what a rank reads is its shards, plus the small replicated tensors
    assert sum(r["read"] for r in reports) < 1.3 * total, reports
    assert all(r["read"] < 0.7 * total for r in reports), reports


def test_progress_bar_on_first_rank_only(pool, tmp_path):
    shown = pool.run(checks.progress_bar, 2, str(tmp_path / "a"), True)
    assert "load_pretrained a" in shown[0], shown
    assert shown[1] == ""
    quiet = pool.run(checks.progress_bar, 2, str(tmp_path / "b"), None)   # small checkpoint: no bar
    assert quiet == ["", ""], quiet


def _minilm():
    try:
        return minilm_dir()
    except CheckpointNotInstalled as e:
        pytest.skip(f"all-MiniLM-L6-v2: {e}")


@pytest.mark.parametrize("tp", [2])
def test_real_minilm_checkpoint(pool, tp):
    reports = pool.run(checks.minilm, tp, _minilm())
    assert all(r["forward"] < 1e-5 for r in reports), reports


# ------------------------------------------------------------ mapped shards (issue 34 item 2)
@pytest.mark.parametrize("tp, default_group", [(2, True), (4, False)])
def test_mapped_shards_equal_the_unsharded_slices(pool, world_pool, tmp_path, tp, default_group):
    """from_pretrained maps the shards that are one byte range of the file
    (vocabulary 101: padded, so a padded rank copies its vocabulary shard)."""
    ranks = world_pool(tp) if default_group else pool
    reports = ranks.run(checks.mapped_shards_equal_slices, tp, str(tmp_path / "ckpt"), default_group)
    assert all(r["forward"] < 1e-5 for r in reports), reports
    # the last rank holds the vocabulary padding: its embedding is copied, the first rank's mapped
    assert "model.embed_tokens.weight" in reports[0]["aliased"], reports[0]["aliased"]
    assert "model.embed_tokens.weight" not in reports[-1]["aliased"], reports[-1]["aliased"]


def test_writes_never_reach_the_mapped_file(pool2, tmp_path):
    """An optimizer step, then save_pretrained and save_sharded into the
    directory the model is mapped from: the checkpoint's bytes never change
    under the model, the model's values never change under the save (TP=2,
    the plain ShardConfig(); the TP=4 explicit group is the test above)."""
    reports = pool2.run(checks.writes_never_reach_the_file, 2, str(tmp_path / "ckpt"), True)
    assert all(r["changed"] > 0 for r in reports), reports


def test_mapped_rows_only(pool2, tmp_path):
    """mmap="rows" maps only byte ranges (column shards copied, compact);
    a bad mmap value is refused by name (TP=2, plain ShardConfig())."""
    reports = pool2.run(checks.mapped_rows_only, 2, str(tmp_path / "ckpt"))
    assert all(r["aliased"] > 0 for r in reports), reports


def test_lazy_model_loads_mapped(pool, tmp_path):
    reports = pool.run(checks.lazy_model_loads_mapped, 2, str(tmp_path / "ckpt"))
    assert all("meta device" in r["meta"] for r in reports), reports
