"""Checkpoint integrity and errors (issue 30, classes 4b, 5, 6, 9, 10).

  * save_sharded / load_sharded with the plain ShardConfig() (the default
    group = the world) at TP=2 and TP=4 and across them: every rank's
    shards written, the manifest's tp_size right, loaded equal.
  * Every rank file says what it holds (rank, size, each shard's place,
    CRC-32): swapped, relabelled or damaged files and damaged manifests are
    refused on every rank within seconds, naming the file, the tensor and
    both values, with the model untouched.
  * A save supersedes the checkpoint it replaces, whatever its format (HF
    safetensors in several files, .bin, save_sharded's rank files).
  * Errors: from_pretrained with the default group of a checkpoint lacking
    a parameter, broadcast_weights with the default group, an unknown dtype,
    a checkpoint of another model type, a truncated pytorch_model.bin, a
    save into a symbolic link to a directory.
"""
import json
import os

import pytest
import torch

from checks import checkpoint_integrity as checks
from checks import lazy
from checks import save as save_checks

NAME = "LlamaForCausalLM"      # intermediate_size 90: uneven at TP=4


# ---------------------------------------------------------------- the default group (class 5)

@pytest.mark.parametrize("tp", [2, 4])
def test_save_sharded_default_group_writes_every_rank(world_pool, tmp_path, tp):
    p, d = world_pool(tp), str(tmp_path / "sharded")
    full = p.run(save_checks.sharded_save, tp, NAME, d, default_group=True)[0]
    same = p.run(save_checks.sharded_load, tp, NAME, d, full, default_group=True)
    assert [r["opened"] for r in same] == [[r] for r in range(tp)], same      # own file only


@pytest.mark.parametrize("save_tp, load_tp", [(2, 4), (4, 2)])
def test_save_sharded_default_group_reshards(world_pool, tmp_path, save_tp, load_tp):
    d = str(tmp_path / "sharded")
    full = world_pool(save_tp).run(save_checks.sharded_save, save_tp, NAME, d, default_group=True)[0]
    world_pool(load_tp).run(save_checks.sharded_load, load_tp, NAME, d, full, default_group=True)


# ---------------------------------------------------------------- self-describing files (class 4b, 10)

def _refused(pool, tp, d, default_group=False):
    reports = pool.run(checks.refused_everywhere, tp, d, default_group=default_group)
    assert all(r["seconds"] < 30 for r in reports), reports            # no rank waited for a timeout
    return [r["msg"] for r in reports]


def _rank_file(r, n):
    return f"rank{r:05d}-of-{n:05d}.safetensors"


@pytest.mark.parametrize("tp", [2, 4])
def test_swapped_rank_files_refused_everywhere(pool, tmp_path, tp):
    d = str(tmp_path / "sharded")
    pool.run(save_checks.sharded_save, tp, NAME, d)
    a, b = os.path.join(d, _rank_file(0, tp)), os.path.join(d, _rank_file(1, tp))
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    for msg in _refused(pool, tp, d):
        assert f"{_rank_file(0, tp)}: holds the shards of rank 1 of {tp}, the manifest lists it as rank 0" in msg, msg
        assert f"{_rank_file(1, tp)}: holds the shards of rank 0 of {tp}" in msg, msg


def test_reordered_manifest_files_refused(pool, tmp_path):
    d = str(tmp_path / "sharded")
    pool.run(save_checks.sharded_save, 2, NAME, d)
    path = os.path.join(d, "shardformer_manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"].reverse()
    with open(path, "w") as f:
        json.dump(manifest, f)
    for msg in _refused(pool, 2, d):
        assert f"{_rank_file(1, 2)}: holds the shards of rank 1 of 2, the manifest lists it as rank 0 of 2" in msg


@pytest.mark.parametrize("tp", [2, 4])
def test_damaged_rank_file_refused_everywhere(world_pool, tmp_path, tp):
    """The last rank's file has bytes flipped inside a tensor: the rank that
    verifies it names the file, the tensor and both CRC-32s; the others
    name that rank.  Loaded with the default group."""
    p, d = world_pool(tp), str(tmp_path / "sharded")
    p.run(save_checks.sharded_save, tp, NAME, d)                   # saved over an explicit group of all ranks
    path = os.path.join(d, _rank_file(tp - 1, tp))
    with open(path, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        data = bytearray(f.read(8))
        f.seek(-64, os.SEEK_END)
        f.write(bytes(x ^ 0x5A for x in data))
    msgs = _refused(p, tp, d, default_group=True)
    assert f"{_rank_file(tp - 1, tp)}: " in msgs[tp - 1] and "CRC-32" in msgs[tp - 1] and "damaged" in msgs[tp - 1]
    for msg in msgs[:tp - 1]:
        assert f"failed on rank {tp - 1}" in msg and "nothing was loaded" in msg, msg


@pytest.mark.parametrize("damage, expect", [
    (lambda text: text[: len(text) // 2], "is damaged: not valid JSON"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "tensors"}), "no 'tensors' key"),
    (lambda text: json.dumps(dict(json.loads(text), files="rank00000-of-00002.safetensors")),
     "'files' is a str, not a list"),
    (lambda text: json.dumps(dict(json.loads(text), tp_size=3)), "'files' names 2 files for tp_size 3"),
], ids=["truncated", "no-tensors", "files-not-a-list", "wrong-tp-size"])
def test_damaged_manifest_named(pool, tmp_path, damage, expect):
    d = str(tmp_path / "sharded")
    pool.run(save_checks.sharded_save, 2, NAME, d)
    path = os.path.join(d, "shardformer_manifest.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(damage(text))
    for msg in _refused(pool, 2, d):
        assert path in msg and expect in msg, msg


# ---------------------------------------------------------------- superseded checkpoints (class 6)

def test_save_supersedes_other_formats(pool, tmp_path):
    r = pool.run(checks.formats_supersede, 2, str(tmp_path / "ckpt"))[0]
    assert r["files"] == ["config.json", "generation_config.json", "model.safetensors", "notes.txt",
                          "tokenizer.json"], r


# ---------------------------------------------------------------- errors (class 9, 10)

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    lazy.save_reference(NAME, d, drop="lm_head.")
    return d


def test_from_pretrained_default_group_initializes_missing(world_pool, llama_dir):
    world_pool(2).run(lazy.from_pretrained_initializes_missing, 2, NAME, llama_dir, "lm_head.", default_group=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_broadcast_weights_default_group(world_pool, tp):
    world_pool(tp).run(checks.broadcast_weights_default_group, tp)


def _from_pretrained(path, **kwargs):
    import transformers

    from shardformer import ShardConfig, ShardFormer

    return ShardFormer(ShardConfig()).from_pretrained(transformers.LlamaForCausalLM, path, **kwargs)


def test_unknown_dtype_named(llama_dir):
    with pytest.raises(ValueError, match=r"dtype='float17' is not a torch dtype; one of .*bfloat16.*float32"):
        _from_pretrained(llama_dir, dtype="float17")


def test_checkpoint_of_another_model_type_named(tmp_path):
    import zoo

    zoo.build("GPT2LMHeadModel").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"holds a 'gpt2' checkpoint \(GPT2Config\); LlamaForCausalLM is a 'llama'"):
        _from_pretrained(str(tmp_path))


def test_truncated_bin_named(tmp_path):
    import zoo

    model = zoo.build(NAME)
    model.config.save_pretrained(str(tmp_path))
    path = os.path.join(str(tmp_path), "pytorch_model.bin")
    torch.save(model.state_dict(), path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: not a readable PyTorch checkpoint"):
        _from_pretrained(str(tmp_path))


def test_save_into_symlink_to_directory(pool, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "notes.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    files = pool.run(checks.save_through_symlink, 2, str(link))[0]["files"]
    assert "notes.txt" in files and "model.safetensors" not in files and "shardformer_manifest.json" in files, files
    assert sorted(os.listdir(tmp_path)) == ["link", "real"], os.listdir(tmp_path)
