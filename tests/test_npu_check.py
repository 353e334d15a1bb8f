"""scripts/npu_check.py, on a machine without an NPU: it must say so in one line and exit 2, and
with the CPU provider standing in for the NPU (`--device cpu`) every step after the check must
run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MODELS_HOME, SMOLLM

pytest.importorskip("onnxruntime")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "npu_check.py"


def _check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALINFER_HOME": str(MODELS_HOME)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=600, stdin=subprocess.DEVNULL)


def test_no_npu_is_one_line_that_says_why_before_any_model_is_touched(tmp_path):
    from localinfer.backends.onnx import npu
    if npu.npu_installed():
        pytest.skip("an NPU build of onnxruntime is installed here")
    done = subprocess.run([sys.executable, str(SCRIPT), SMOLLM, "--no-bench"], capture_output=True,
                          text=True, env={**os.environ, "LOCALINFER_HOME": str(tmp_path)},
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "no NPU build of onnxruntime is installed" in line and "--device cpu" in line
    assert done.stdout == "" and not any(tmp_path.iterdir())


def test_with_the_cpu_standing_in_every_step_runs(models_home):
    done = _check(SMOLLM, "--device", "cpu", "--no-bench", "--tokens", "48", "--gen", "6", "--json")
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert row["whole_graph"] and row["npu"] == "CPUExecutionProvider on the CPU"
    # The static graph against the dynamic one, both in the fast mode: close, not bit-equal.
    assert row["top1_vs_cpu"] >= 0.9 and row["kl_vs_cpu"] < 0.05
    assert row["greedy"] and not row["greedy"].startswith("failed")
