"""checkpoint.save_state / load_state: the whole training state (model,
AdamW, LambdaLR, step, torch's generator and the TP dropout modules'),
resumed in new processes.

Same layout (TP=2 over an explicit group; DP=2 x TP=2 with DDP), dropout
on: 6 steps straight equal, bit for bit (losses and every rank's weights),
3 steps + save_state + a new world of processes + load_state + 3 steps.
Another layout (TP=2 -> TP=4 with the plain ShardConfig(), dropout off):
the next 3 steps equal the unsharded straight run within float tolerance.
A save with a rank SIGKILLed mid-write leaves the previous checkpoint
loadable; async_save overlaps the write with a training step and saves
the state at the call; bad input is refused on every rank.  docs/resume.md's
recipe runs as written.  Across pipeline-stage, expert-parallel and ZeRO-1
layouts (in the pool): the next steps within tolerance of the unsharded
straight run; TP x PP resumed at TP x PP bit for bit."""
import os
import pickle
import re

import numpy as np
import pytest

from checks import resume as checks
from shardformer.launch import RankError, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def new_world(pool, tmp_path_factory):
    """The first halves in the pool; one new world of 4 processes for the
    resume halves, which then runs a save that kills rank 1 mid-write."""
    tmp = tmp_path_factory.mktemp("resume")
    cases = [("tp2", True, str(tmp / "tp2")), ("dp2tp2", True, str(tmp / "dp2tp2"))]
    straight = {layout: pool.run(checks.first_half, 2 if layout == "tp2" else 4, layout, dropout, d)
                for layout, dropout, d in cases}
    pool.run(checks.first_half, 2, "tp2", False, str(tmp / "tp2-nodrop"))
    killed = str(tmp / "killed")
    with pytest.raises(RankError) as err:     # rank 1 dies; the others wait for its files until stopped
        spawn(checks.second_half, 4, (cases + [("world", False, str(tmp / "tp2-nodrop"))], str(tmp), killed),
              timeout_s=300, grace_s=3)
    resumed = []
    for rank in range(4):
        assert (tmp / f"rank{rank}.pkl").exists(), str(err.value)
        resumed.append(pickle.loads((tmp / f"rank{rank}.pkl").read_bytes()))
    return {"cases": cases, "straight": straight, "resumed": resumed, "killed": killed, "error": err.value}


def test_resume_exactly_in_new_processes(new_world):
    straight, resumed = new_world["straight"], new_world["resumed"]
    for layout, _, _ in new_world["cases"]:
        for rank, (a, b) in enumerate(zip(straight[layout], resumed)):
            got = b[layout]
            assert got["extra"] == straight[layout][0]["losses"][:3], (layout, rank)   # extra: the lowest rank's
            assert got["losses"] == a["losses"][3:], (layout, rank, got["losses"], a["losses"][3:])
            differ = [k for k in a["weights"] if not np.array_equal(got["weights"][k], a["weights"][k])]
            assert not differ, f"{layout} rank {rank}: weights differ from the straight run: {differ}"
    print("TP=2 -> TP=4 relative errors after 3 more steps:", max(resumed[0]["world"]["errors"].values()))


def test_killed_save_leaves_the_previous_checkpoint(new_world, pool):
    failures = new_world["error"].failures
    assert "exit code -9" in failures.get(1, ""), str(new_world["error"])     # SIGKILL
    report = pool.run(checks.load_after_kill, 4, new_world["killed"])
    assert report[0]["leftovers"], "the killed save left no temporary directory: it was not killed mid-write"


def test_async_save_and_refusals(pool, tmp_path):
    reports = pool.run(checks.async_and_refusals, 2, str(tmp_path / "ckpt"))
    print("async save_state: the caller was blocked", reports[0]["blocked_s"], "s")


def test_docs_recipe_runs_as_written(pool2, tmp_path):
    text = open(os.path.join(ROOT, "docs", "resume.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/resume.md has no python block"
    script = tmp_path / "resume_recipe.py"
    script.write_text(blocks[0])
    pool2.run(checks.docs_recipe, 2, str(script), str(tmp_path / "ckpt"))


def test_resume_across_pipeline_expert_and_zero_layouts(pool, tmp_path):
    """save_state / load_state (in the pool) with pipeline stages (1F1B), expert parallelism (Mixtral,
    5 experts) and ZeRO-1, dropout off: DP=2 x TP=2 -> TP=2 x PP=2, TP=2 x PP=2 -> TP=4 (ShardConfig()),
    EP=2 x TP=2 -> EP=4 (saved asynchronously: expert weights split along two dimensions), ZeRO-1
    DP=2 x TP=2 -> TP=2 (explicit group): AdamW, LambdaLR and the step
    restored, two more steps within tolerance of the unsharded straight run.  Dropout 0.1, TP=2 x PP=2 ->
    TP=2 x PP=2: Llama (torch's generator seeded per rank) bit for bit the straight run of the same
    layout, each rank's generator its own; GPT-2 (TP dropout modules on both stages) -> TP=4: every
    dropout module, stage 1's included, gets its saved (seed, step)."""
    from checks.dcp_layouts import DP2TP2, EP2, EP4, PP2TP2, TP2, TP4, ZERO

    d = {k: str(tmp_path / k) for k in ("dp_tp", "pp", "pp_drop", "gpt2", "ep", "zero")}
    saved = pool.run(checks.save_layouts, 4, [("llama", DP2TP2, d["dp_tp"], 0.0, False),
                                              ("llama", PP2TP2, d["pp"], 0.0, False),
                                              ("llama", PP2TP2, d["pp_drop"], 0.1, True),
                                              ("gpt2", PP2TP2, d["gpt2"], 0.1, False),
                                              ("mixtral", EP2, d["ep"], 0.0, False, True),     # async
                                              ("llama", ZERO, d["zero"], 0.0, False)])
    exact = {**saved[0][d["pp_drop"]], "torch_rng": [r[d["pp_drop"]]["torch_rng"] for r in saved]}
    saved = saved[0]
    errors = pool.run(checks.resume_layouts, 4, [("llama", PP2TP2, d["dp_tp"], 0.0, None),
                                                 ("llama", TP4, d["pp"], 0.0, None),
                                                 ("mixtral", EP4, d["ep"], 0.0, None),
                                                 ("llama", PP2TP2, d["pp_drop"], 0.1, exact),
                                                 ("gpt2", TP4, d["gpt2"], 0.1, saved[d["gpt2"]])])
    zero = pool.run(checks.resume_layouts, 2, [("llama", TP2, d["zero"], 0.0, None)])
    print("resume across layouts, max errors:", {**errors[0], **zero[0]})


def test_save_between_accumulated_micro_batches(pool, tmp_path):
    """The accumulated gradients are part of the saved state: a resume between
    two micro-batches steps to the straight run's weights (TP=2); under DDP's
    no_sync() (DP=2 x TP=2) the save is refused by name."""
    pool.run(checks.accumulation_mid_cycle, 2, str(tmp_path / "mid"))
    pool.run(checks.accumulation_no_sync_refused, 4, str(tmp_path / "no_sync"))
