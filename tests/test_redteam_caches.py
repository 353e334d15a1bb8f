"""What the caches cost and hold, and whether the user hears of them (issue 41, items 23, 24, 28).

23: the one-time batching check made `quantize` take 91 s where the docs said 0.6-2.6 s, and ran
silently in a pipeline. 24: the README promised that run and chat keep every prompt's KV state;
prompts under 64 tokens are never kept. 28: `frontier` left 484 MB that `cache clear` did not
remove, and measured against an upcast reference without saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli

CHECK = "checking once how this model batches"


# -- 23: the batching check --------------------------------------------------------------------
def test_quantize_leaves_the_check_to_the_first_run_which_says_so_in_a_pipeline(smollm_path,
                                                                                 tmp_path):
    home, out = tmp_path / "home", tmp_path / "smol-Q8_0.gguf"
    verdicts = home / "cache/exact_batch.json"
    made = run_cli("quantize", str(smollm_path), "--type", "Q8_0", "--allow-requantize", "-o",
                   str(out), home=home)
    assert made.returncode == 0, made.stderr
    assert CHECK not in made.stderr and not verdicts.exists()      # no check, no verdict
    first = run_cli("run", str(out), "Hi", "-n", "2", "--temp", "0", home=home)   # piped
    assert first.returncode == 0, first.stderr
    assert sum(line.startswith(CHECK) for line in first.stderr.splitlines()) == 1
    assert verdicts.exists()
    again = run_cli("run", str(out), "Hi", "-n", "2", "--temp", "0", home=home)
    assert again.returncode == 0 and CHECK not in again.stderr      # once per model


def test_quantize_makes_the_check_when_asked(smollm_path, tmp_path):
    home, out = tmp_path / "home", tmp_path / "smol-Q8_0.gguf"
    made = run_cli("quantize", str(smollm_path), "--type", "Q8_0", "--allow-requantize", "-o",
                   str(out), "--check-batching", home=home)
    assert made.returncode == 0, made.stderr
    assert sum(CHECK in line for line in made.stderr.splitlines()) == 1
    verdicts = json.loads((home / "cache/exact_batch.json").read_text())["verdicts"]
    assert len(verdicts) == 1


def test_the_checks_estimate_counts_threads_and_knows_what_it_cannot_know(monkeypatch):
    from localinfer.speculate import exactness
    monkeypatch.setattr(exactness, "_load_factor", lambda: 1.0)
    assert exactness._announcement(4.0, None, 2, 0) == f"{CHECK}, ~4 s"
    assert "~8 s" in exactness._announcement(4.0, None, 1, 0)       # one thread: twice as long
    assert "~6 s" in exactness._announcement(4.0, 1.5, 1, 0)        # a measured slowdown wins
    placed = exactness._announcement(4.0, None, 2, 24)              # a GPU or workers: unknown
    assert placed.startswith(CHECK) and "~" not in placed
