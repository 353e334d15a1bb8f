"""--rope-scaling on a backend that cannot apply it: only llama.cpp stretches RoPE positions, so
the MLX and ONNX backends refuse it in one line (exit 2) before anything loads, on serve's
command line and in their sessions (LoadOptions from anywhere else)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import error_line, run_cli

from localinfer.backends import LoadOptions
from localinfer.errors import UsageError


@pytest.mark.parametrize("models", [["smollm2"], []], ids=["named", "any-on-disk"])
@pytest.mark.parametrize("backend", ["mlx", "onnx"])
def test_serve_refuses_rope_scaling_on_mlx_and_onnx_before_any_load(backend, models, tmp_path):
    # An empty home: had the command got as far as the model, it would say the model is missing;
    # with no model named, serve used to start and wait for requests it could not answer.
    refused = run_cli("serve", *models, "--offline", "--port", "1", "--backend", backend,
                      "--rope-scaling", "yarn", "--ctx", "16384", home=tmp_path, timeout=60)
    assert refused.returncode == 2, refused.stderr
    line = error_line(refused)
    assert f"the {backend} backend" in line and "--backend llama.cpp" in line, line


def test_the_sessions_refuse_rope_scaling_before_reading_the_file(tmp_path):
    from localinfer.backends.mlx.session import MlxSession
    from localinfer.backends.onnx.session import OnnxSession
    missing = Path(tmp_path / "absent.gguf")        # never opened: the option is refused first
    for session, name in ((MlxSession, "MLX"), (OnnxSession, "ONNX")):
        with pytest.raises(UsageError, match=f"the {name} backend does not apply RoPE scaling"):
            session(missing, LoadOptions(n_ctx=16384, rope_scaling="linear"))
