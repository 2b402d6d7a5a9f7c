"""benchmarks/collectives_under_load.py runs (--quick): both backends are the
ones named, under one busy loop.  No timing is asserted."""
import json
import os
import sys

from launcher import run_killing_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick(tmp_path):
    out = tmp_path / "r.json"
    run = run_killing_group([sys.executable, os.path.join(ROOT, "benchmarks", "collectives_under_load.py"),
                             "--quick", "--out", str(out)], timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())["results"]
    assert set(result) == {"1"}
    for row in result.values():
        assert row["4096"]["shm"]["backend"] == "shm" and row["4096"]["gloo"]["backend"] == "torch"
        assert row["4096"]["shm"]["median_us"] > 0
