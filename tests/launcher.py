"""Running a launcher (a demo, torchrun) from a test without leaking its ranks."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_killing_group(cmd, timeout, env=None):
    """subprocess.run, but a timeout kills the whole process group (the ranks too), not only the launcher."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
