"""Benchmarks run: benchmarks/generate.py --quick (a tiny random Llama, a few tokens) end to end.

Nothing here looks at timings (the machine is shared and noisy): only that the
script runs every configuration, writes its JSON and Markdown, and that the
sharded model generated the same greedy tokens as the unsharded one.
"""
import json
import os
import sys

from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = os.path.join(ROOT, "benchmarks", "generate.py")


def test_generate_benchmark_quick(tmp_path):
    out = tmp_path / "generate"
    p = run_killing_group([sys.executable, GENERATE, "--quick", "--out", str(out)], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((tmp_path / "generate.json").read_text())
    md = (tmp_path / "generate.md").read_text()
    # batches 1 and 2: 5 configurations, and 5 places of collectives for each of the 3 TP ones
    assert md.count("| tiny |") == 2 * 5 + 2 * 3 * 5
    rows = res["models"]["tiny"]["rows"]
    seen = {(r["kind"], r["batch"], r["config"]) for r in rows}
    assert seen == {(k, b, c) for k in ("real", "skeleton") for b in (1, 2)
                    for c in ("unsharded-1t", "unsharded-2t", "tp2-hf", "tp2", "tp2-skinny")}
    for r in rows:
        assert r["timed_steps"] >= 1 and r["tokens_per_s"] > 0
        assert len(r["tokens"]) == r["batch"] and all(len(t) == 5 for t in r["tokens"])
        if r["config"] in ("tp2-hf", "tp2", "tp2-skinny"):
            # 2 layers: 2 all-reduces each, the embedding's all-reduce, the LM head's all-gather,
            # and generate()'s lock-step check of the step's tokens (shardformer.lockstep)
            assert r["collective_calls_per_step"] == 7
            assert len(r["collective_share_per_rank"]) == 2
            for per_rank in r["collectives_by_position"]:
                assert {k: v["calls_per_step"] for k, v in per_rank.items()} == {
                    "embedding": 1, "attention o_proj": 2, "mlp down_proj": 2, "lm_head": 1, "token check": 1}
    for key, a in res["models"]["tiny"]["analysis"].items():
        assert a["tokens_match_unsharded"], key
    bw = res["bandwidth"]
    assert bw["1t"] > 0 and bw["2t"] > 0 and bw["tp_total"] > 0
