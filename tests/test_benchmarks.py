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
    """--quick with --dtypes float32 bfloat16 (the rounds alternate the dtypes; one batch, so the run is
    about as long as the two batches of one dtype were); --busy's process in test_generate_busy_process."""
    out = tmp_path / "generate"
    p = run_killing_group([sys.executable, GENERATE, "--quick", "--out", str(out), "--batches", "1",
                           "--dtypes", "float32", "bfloat16"], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((tmp_path / "generate.json").read_text())
    md = (tmp_path / "generate.md").read_text()
    assert "dtypes float32 bfloat16 (rounds alternating)" in md and "busy" not in md
    assert res["busy"] == {"processes": 0}, res["busy"]
    assert set(res["models"]) == {"tiny/float32", "tiny/bfloat16"}
    for key, m in res["models"].items():
        # 5 configurations, and the places of collectives of the 3 TP ones (tp2: every collective of the
        # step but generate()'s token check is made inside the C step, not seen by the benchmark's timer)
        assert md.count(f"| {key} |") == 5 + (5 + 5 + 1), key
        assert {i["dtype"] for i in m["info"]} == {key.split("/")[1]}
        rows = m["rows"]
        seen = {(r["kind"], r["batch"], r["config"]) for r in rows}
        assert seen == {(k, 1, c) for k in ("real", "skeleton")
                        for c in ("unsharded-1t", "unsharded-2t", "tp2-hf", "tp2-py", "tp2")}
        for r in rows:
            assert r["timed_steps"] >= 1 and r["tokens_per_s"] > 0
            assert len(r["tokens"]) == r["batch"] and all(len(t) == 5 for t in r["tokens"])
            if r["config"] in ("tp2-hf", "tp2-py"):
                # 2 layers: 2 all-reduces each, the embedding's all-reduce, the LM head's all-gather,
                # and generate()'s lock-step check of the step's tokens
                layers = {"attention o_proj": 2, "mlp down_proj": 2}
                assert r["collective_calls_per_step"] == 3 + sum(layers.values())
                assert len(r["collective_share_per_rank"]) == 2
                for per_rank in r["collectives_by_position"]:
                    assert {k: v["calls_per_step"] for k, v in per_rank.items()} == {
                        "embedding": 1, "lm_head": 1, "token check": 1, **layers}
            elif r["config"] == "tp2":
                assert r["collective_calls_per_step"] == 1
                for per_rank in r["collectives_by_position"]:
                    assert {k: v["calls_per_step"] for k, v in per_rank.items()} == {"token check": 1}
        for key2, a in m["analysis"].items():
            assert a["tokens_match_unsharded"], (key, key2)
    bw = res["bandwidth"]
    assert bw["1t"] > 0 and bw["2t"] > 0 and bw["tp_total"] > 0


def test_generate_busy_process():
    """generate.py --busy's process spins one core until stopped (its CPU seconds are what the results
    record); a whole --quick run with it beside would double the test's time on 2 cores."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("generate_bench", GENERATE)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_args(["--quick", "--busy"]).out.endswith("generate_quick_busy")
    assert bench.parse_args(["--quick", "--dtypes", "float16", "float32"]).out.endswith(
        "generate_quick_float16_float32")
    proc = bench.start_busy()
    try:
        t0 = time.monotonic()
        while (bench.busy_cpu_s(proc) or 0.0) <= 0.0 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert bench.busy_cpu_s(proc) > 0 and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_tp_step_floor_quick(tmp_path):
    """benchmarks/tp_step.py at a tiny size, the baseline and one TP configuration: each row has its
    matmul floor (3 products per linear layer + the rotary bmm, replayed after every timed step) and a
    ledger that accounts for the whole profiled step; the TP loss equals the unsharded one."""
    out = tmp_path / "tp_step.json"
    script = os.path.join(ROOT, "benchmarks", "tp_step.py")
    p = run_killing_group([sys.executable, script, "--quick", "--hidden", "64", "--heads", "4", "--layers", "1",
                           "--vocab", "256", "--seq", "16", "--iters", "2", "--only", "shardformer-fused-po",
                           "--out", str(out)], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"baseline", "shardformer-fused-po"}
    assert rows["shardformer-fused-po"]["loss_ok"] and rows["shardformer-fused-po"]["grad_check"]["ok"]
    for name, r in rows.items():
        assert r["floor_calls"] == 3 * 8 + 1, (name, r["floor_calls"])    # q k v o gate up down lm_head
        assert len(r["floor_ms"]) == 2 and r["floor_median_ms"] > 0 and r["floor_ratio"] > 0
        assert res["summary"][f"floor_ratio_{name}"] == r["floor_ratio"]
        for led in r["ledger_per_rank"]:
            assert abs(sum(led["ms"].values()) - led["profiled_step_ms"]) < 1e-6 * led["profiled_step_ms"], led
    # TP=2 halves every linear layer: half the baseline's matmul FLOPs, to rounding of the rotary bmm
    assert abs(rows["shardformer-fused-po"]["floor_gflop_per_rank"] * 2 - rows["baseline"]["floor_gflop_per_rank"]) \
        < 1e-3 * rows["baseline"]["floor_gflop_per_rank"]
    assert "step / its matmul floor" in p.stdout and "ledger of one profiled step" in p.stdout
