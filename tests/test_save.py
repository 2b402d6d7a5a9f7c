"""Streamed, atomic save_pretrained and per-rank save_sharded / load_sharded
(python/shardformer/checkpoint/save.py, sharded.py).

save_pretrained at TP=2 and TP=4 writes what HF's own save_pretrained of the
unsharded model writes (names, shapes, file naming, index), plain
transformers loads it back equal to the unsharded model, without the writing
rank ever holding more full tensors than one output file plus one tensor;
overwriting keeps the user's files and drops the old weights; a failed
write raises everywhere and keeps the old checkpoint; a save SIGKILLed at
any point leaves the old checkpoint loadable, and the next save cleans up.
save_sharded at one TP size loads at another (and unsharded), and refuses a
checkpoint of another configuration without touching the model."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from checks import save as checks

HERE = os.path.dirname(os.path.abspath(__file__))

# name, config overrides, ShardConfig extra_kwargs
MODELS = {
    "llama-gqa": ("LlamaForCausalLM", None, None),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}, None),
    "llama-padded-vocab": ("LlamaForCausalLM", None, {"make_vocab_size_divisible_by": 64}),
    "gpt2": ("GPT2LMHeadModel", None, None),
    "bert": ("BertForMaskedLM", None, None),
    "mixtral": ("MixtralForCausalLM", None, None),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(MODELS))
def test_save_pretrained_matches_hf_and_reloads(pool, tmp_path, case, tp):
    name, overrides, extra = MODELS[case]
    d, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf" / "ckpt")
    reports = pool.run(checks.round_trip, tp, name, d, hf, "2GB", overrides, extra)
    assert all(r["files"] == reports[0]["files"] for r in reports)      # every rank saw the finished directory
    assert "model.safetensors" in reports[0]["files"]
    assert all(r["peak"] == 0 for r in reports[1:])                     # only rank 0 receives full tensors


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", ["llama-gqa", "mixtral"])
def test_small_max_shard_size_streams_files(pool, tmp_path, case, tp):
    name, overrides, extra = MODELS[case]
    r = pool.run(checks.round_trip, tp, name, str(tmp_path / "ckpt"), str(tmp_path / "hf" / "ckpt"), "60KB",
                 overrides, extra)[0]
    assert "model.safetensors.index.json" in r["files"] and len([f for f in r["files"] if f.startswith("model-")]) > 3
    # the writing rank never held the model: one file's limit and one tensor at most
    assert r["peak"] <= r["limit"] + r["largest"] < r["model_bytes"] / 2, r


def test_overwrite_keeps_user_files_drops_old_weights(pool, tmp_path):
    pool.run(checks.overwrite, 2, str(tmp_path / "ckpt"))


def test_failed_write_raises_everywhere_keeps_old(pool, tmp_path):
    msgs = pool.run(checks.failing_write, 2, str(tmp_path / "ckpt"))
    assert msgs[0] == "OSError: disk full" and "failed on rank 0" in msgs[1], msgs


def _child(directory, seed, mode, marker, wait=True):
    cmd = [sys.executable, os.path.join(HERE, "checks", "save.py"), directory, str(seed), mode, marker]
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if wait:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode()
        return None
    deadline = time.time() + 120
    while not os.path.exists(marker):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0].decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc


def _assert_holds(directory, seed):
    """Plain transformers loads `directory` with exactly the weights of the model of `seed`."""
    import transformers

    model, info = transformers.LlamaForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                                attn_implementation="eager")
    assert not any(info.values()), info
    exp = checks.expected_state(seed)
    got = model.state_dict()
    assert got.keys() == exp.keys()
    assert all(torch.equal(got[k], exp[k]) for k in exp), [k for k in exp if not torch.equal(got[k], exp[k])]


def _save_here(directory, seed):
    """A TP=1 save in this process (no process group): the model of `seed`."""
    from shardformer.checkpoint import save_pretrained

    save_pretrained(checks.zoo.build("LlamaForCausalLM", seed=seed), directory, max_shard_size="60KB")


@pytest.mark.parametrize("mode", ["write", "swap", "exchanged", "fallback"])
def test_killed_save_leaves_old_checkpoint(tmp_path, mode):
    d = str(tmp_path / "ckpt")
    _save_here(d, 0)
    _child(d, 1, mode, str(tmp_path.parent / f"{tmp_path.name}.marker"), wait=False)   # SIGKILLed inside the save
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(".ckpt.")]
    assert leftovers, "the killed save left nothing to clean: it was not killed inside the save"
    if mode == "fallback":
        # the one window of the fallback: the name is missing, the old checkpoint lies aside;
        # recover_directory puts it back (on a copy), and so does the next save before replacing it
        assert not os.path.exists(d) and any(".old-" in f for f in leftovers), leftovers
        import shutil

        from shardformer.checkpoint.save import recover_directory

        copy = tmp_path.parent / f"{tmp_path.name}-copy"
        shutil.copytree(tmp_path, copy, symlinks=True)
        recover_directory(str(copy / "ckpt"))
        _assert_holds(str(copy / "ckpt"), 0)
        assert os.listdir(copy) == ["ckpt"], os.listdir(copy)
    elif mode == "exchanged":
        _assert_holds(d, 1)                                     # the swap had happened: the new one, complete
    else:
        _assert_holds(d, 0)
    _save_here(d, 2)                                            # the next save works and cleans up
    _assert_holds(d, 2)
    assert os.listdir(tmp_path) == ["ckpt"], os.listdir(tmp_path)


SHARDED = ["llama-gqa", "llama-tied", "llama-padded-vocab", "mixtral"]


@pytest.mark.parametrize("case", SHARDED)
def test_save_sharded_tp2_loads_at_tp2_tp4_tp1(pool, tmp_path, case):
    name, overrides, extra = MODELS[case]
    d = str(tmp_path / "sharded")
    full = pool.run(checks.sharded_save, 2, name, d, overrides, extra)[0]
    same = pool.run(checks.sharded_load, 2, name, d, full, overrides, extra)
    assert [r["opened"] for r in same] == [[0], [1]], same            # same TP and layouts: own file only
    pool.run(checks.sharded_load, 4, name, d, full, overrides, None)   # another TP size (and no vocab padding)
    pool.run(checks.sharded_load, 1, name, d, full, overrides, None)   # unsharded


@pytest.mark.parametrize("case", ["llama-gqa", "gpt2"])
def test_save_sharded_tp4_loads_at_tp2(pool, tmp_path, case):
    name, overrides, extra = MODELS[case]
    d = str(tmp_path / "sharded")
    full = pool.run(checks.sharded_save, 4, name, d, overrides, extra)[0]
    opened = pool.run(checks.sharded_load, 2, name, d, full, overrides, extra)
    assert all(len(r["opened"]) < 4 for r in opened), opened             # each rank reads only what overlaps
    pool.run(checks.sharded_save, 4, name, d, overrides, extra)          # saving over it again works


def test_load_sharded_refuses_other_shapes_untouched(pool, tmp_path):
    d = str(tmp_path / "sharded")
    pool.run(checks.sharded_save, 2, "LlamaForCausalLM", d)
    msgs = pool.run(checks.sharded_refused, 2, d)
    m = msgs[0]
    assert "LlamaForCausalLM" in m and "nothing was loaded" in m, m
    assert "model.embed_tokens.weight: saved shape [101, 96], the model's full shape is [103, 96]" in m, m
    assert "model.layers.0.mlp.up_proj.weight" in m and "[90, 96]" in m and "[88, 96]" in m, m
