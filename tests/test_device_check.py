"""scripts/device_check.sh is not broken, proven without a GPU: its dry run
(--dry-run) finds every part's command, collects the tests marked gpu
(more than none) and writes its summary to $OUT; the benchmark it runs
refuses a machine without a GPU with a clear message."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.transformers_independent


def test_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE_CHECK_PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_device_check.json").read_text())
    assert summary["dry_run"] is True
    assert [p["part"] for p in summary["parts"]] == ["env", "build", "tests", "bench"]
    assert all(p["status"] == "ok" for p in summary["parts"]), summary["parts"]
    assert summary["gpu_tests_collected"] > 0
    assert "device check summary (dry run)" in proc.stdout


def test_benchmark_refuses_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is for machines without one")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_llama.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr
