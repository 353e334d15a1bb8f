"""Op coverage for an NPU without one (opt-in, `pytest -m exhaustive`): scripts/openvino_check.py
runs smollm2's static graphs on OpenVINOExecutionProvider (CPU device) with CPU fallback disabled,
in a venv of its own, and its logits agree with the CPU provider's.

The first run makes the venv (~/.cache/localinfer-bench/openvino-venv: onnxruntime-openvino and
numpy, a few hundred MB from the package index); without the index the test is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "openvino_check.py"
NO_VENV = 3                     # the script's exit status when the venv cannot be made


@pytest.mark.exhaustive
def test_static_graphs_run_on_openvino_without_cpu_fallback(models_home):
    env = {**os.environ, "LOCALINFER_HOME": str(models_home)}
    done = subprocess.run([sys.executable, str(SCRIPT), "smollm2"], capture_output=True,
                          text=True, env=env, timeout=1800)
    if done.returncode == NO_VENV:
        pytest.skip(f"no OpenVINO venv (package index unreachable?): {done.stdout.strip()}")
    # The table names a failing session's ORT error and the ops it left to the CPU provider.
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "| smollm2 | 200 |" in done.stdout
