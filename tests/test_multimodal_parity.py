"""`localinfer run --image/--audio` against llama.cpp's own llama-mtmd-cli (issue 46): the same
greedy answer for the same model, projector, media and prompt, for three image sizes (one tile
and an overview; 3 x 1 and 2 x 2 grids), two images in one prompt and an audio clip. SmolLM2 with
tiny random projectors (tests/mmproj_writer.py): the mechanics, not quality.

llama-mtmd-cli is built from the vendored source by scripts/llama_tools.py (minutes on 2 cores,
once) and run on the wheel's own libraries, both sides with a q8_0 KV cache: the default f16
cache is steered onto ggml's reference kernels for small graphs here (backends/llama/steer.py),
which round differently from stock llama.cpp and may part at a near-tie (seen once, audio, at
the 21st token). Opt-in: `pytest -m exhaustive tests/test_multimodal_parity.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import run_cli
from mmproj_writer import IMAGE_TOKENS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.exhaustive


@pytest.fixture(scope="module")
def bench(models_home, tmp_path_factory):
    """scripts/bench_multimodal.py (its material and its llama-mtmd-cli runner) and the tool."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_multimodal
    import llama_tools
    try:
        cli = llama_tools.ensure_tool("llama-mtmd-cli")
    except llama_tools.BenchError as e:
        pytest.skip(f"llama-mtmd-cli cannot be built here: {e}")
    import os
    os.environ["LOCALINFER_HOME"] = str(models_home)
    cases = bench_multimodal.material(tmp_path_factory.mktemp("parity"))
    return bench_multimodal, cli, {name: case for name, *case in cases}


@pytest.mark.parametrize("case", ["image 32x32", "image 100x30", "image 200x200", "two images",
                                  "audio 1 s"])
def test_run_answers_as_llama_mtmd_cli(bench, case, tmp_path):
    module, cli, cases = bench
    model, mmproj, media = cases[case]
    theirs, _, _ = module.theirs(cli, model, mmproj, media, 24, 2)
    for token in IMAGE_TOKENS:          # control tokens: llama-mtmd-cli spells them, run does not
        theirs = theirs.replace(token, "")
    ours = run_cli("run", str(model), module.PROMPT, *media, "--mmproj", str(mmproj), "--temp",
                   "0", "-n", "24", "--kv-type", "q8_0", "--threads", "2", "--no-cache",
                   home=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.strip() == theirs.strip()
