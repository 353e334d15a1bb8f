"""Op coverage for an NPU without one (opt-in, `pytest -m exhaustive`): scripts/openvino_check.py
runs smollm2's static graphs on OpenVINOExecutionProvider (CPU device) with CPU fallback disabled,
in a venv of its own, and its logits agree with the CPU provider's; with --tiny, the tiny GGUFs of
test_onnx_graphs.py (every block format in every place) at accuracy level 0 agree exactly.

The first run makes the venv (~/.cache/localinfer-bench/openvino-venv: onnxruntime-openvino and
numpy, a few hundred MB from the package index); without the index the test is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_onnx_graphs import MODELS

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "openvino_check.py"
NO_VENV = 3                     # the script's exit status when the venv cannot be made


@pytest.mark.exhaustive
def test_static_graphs_run_on_openvino_without_cpu_fallback(models_home):
    done = _check("smollm2", home=models_home, timeout=1800)
    assert "| smollm2 | 200 |" in done.stdout


@pytest.mark.exhaustive
def test_tiny_graphs_match_the_cpu_provider_on_openvino(tmp_path):
    # Before 122559e four of the five failed here (a uint8 BitShift, an unread graph input).
    done = _check("--tiny", home=tmp_path / "home", timeout=600)
    for name in MODELS:            # exit 0 means top-1 100% and max |diff| <= 1e-3 for each
        assert f"| {name} | 24 | 100.0% |" in done.stdout, done.stdout


def _check(*args: str, home: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALINFER_HOME": str(home)}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode == NO_VENV:
        pytest.skip(f"no OpenVINO venv (package index unreachable?): {done.stdout.strip()}")
    # The table names a failing session's ORT error and the ops it left to the CPU provider.
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    return done
