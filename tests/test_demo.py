"""The main job (examples/llama_tp.py) on a local HuggingFace checkpoint directory."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("extra", [[], ["--all-optimization"]], ids=["plain", "all_optimization"])
def test_demo_on_local_checkpoint(tmp_path, extra):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=211,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "llama_tp.py"), "--model",
                          str(tmp_path / "ckpt"), "--tp", "2", "--seq", "16", "--steps", "2", "--new-tokens", "3", *extra],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "logits vs unsharded" in out.stdout and "-> OK" in out.stdout
    assert out.stdout.count("of the full model") == 2
    assert "generated 3 tokens" in out.stdout
