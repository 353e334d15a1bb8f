"""scripts/multimodal_check.py and gpu_check.py --multimodal where no vision model can be fetched
(the build machine): the check degrades to one `skip:` line before anything is built, and
gpu_check counts that skip as no failure. The check itself needs the Hub and, for its point, a GPU
or a Mac (docs/gpu.md); its --help is tests/test_scripts.py's."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "multimodal_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
mm = gpu_check.mm
CUDA = {"name": "CUDA0", "description": "Fake GPU", "backend": "CUDA"}


def test_a_model_that_cannot_be_fetched_is_one_skip_line(tmp_path):
    """The Hub at a closed port: the pull fails at once; exit 2, nothing built or kept."""
    env = {**os.environ, "LOCALINFER_HOME": str(tmp_path / "home"),
           "LOCALINFER_BENCH_CACHE": str(tmp_path / "bench"), "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=120, stdin=subprocess.DEVNULL)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "skip: multimodal check: cannot fetch smolvlm2-256m-video-instruct"), done.stderr
    assert not (tmp_path / "bench").exists()


def test_gpu_check_reports_the_skip_and_fails_on_different_tokens(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "run_probe", lambda model, ctx: {"gpus": [CUDA]})

    def unreachable(model: str):
        raise mm.Skip(f"cannot fetch {model}: no Hub here")
    monkeypatch.setattr(mm, "fetch", unreachable)
    assert gpu_check.run(gpu_check.parse_args(["--multimodal"])) == 0
    assert capsys.readouterr().err.strip() == (
        "skip: multimodal check: cannot fetch smolvlm2-256m-video-instruct: no Hub here")
    asked = {}
    monkeypatch.setattr(mm, "check", lambda model, **kw: asked.update(model=model, **kw) or 1)
    assert gpu_check.run(gpu_check.parse_args(["--multimodal", "gemma-3-4b-it"])) == 1
    assert asked["model"] == "gemma-3-4b-it" and asked["gpu_layers"] == gpu_check.ALL_LAYERS


def test_the_picture_passes_the_media_checks(tmp_path):
    from localinfer.media import read_path
    medium = read_path(mm.picture(tmp_path / "picture.png"))
    assert medium.kind == "image" and medium.data[:8] == b"\x89PNG\r\n\x1a\n"
