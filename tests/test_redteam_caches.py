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
    assert made.stdout == ""
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


# -- 28: every cache, in stats and clear -------------------------------------------------------
def _home_with_every_cache(tmp_path: Path) -> tuple[Path, dict[str, int], list[Path]]:
    """A home holding a file in every cache (bytes each), the files no clear may touch, and a
    link from a cache to a file outside it."""
    from localinfer.cache.prompt_cache import PromptCache
    home = tmp_path / "home"
    cache, models = home / "cache", home / "data/models"
    PromptCache(cache / "prompts", {"model": "m"}, label="m", cap_bytes=1 << 30).save(
        list(range(80)), b"\1" * 5000)
    planted = {cache / "exact_batch.json": 300, cache / "frontier/smollm2/smollm2-F16.gguf": 7000,
               models / ".mlx/m-abc.safetensors": 900, models / ".onnx/m-abc/weights.bin": 1100,
               cache / "projectors.json": 60, cache / "digests.json": 40}
    for path, size in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    kept = [models / "smollm2/smollm2-Q4_1.gguf", home / "config/config.toml",
            tmp_path / "outside.txt"]
    for path in kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# keep\n")
    (cache / "frontier/smollm2/link.gguf").symlink_to(tmp_path / "outside.txt")
    sizes = {"answers": 0, "batching": 300, "frontier": 7000 + len(str(tmp_path / "outside.txt")),
             "projectors": 60, "mlx": 900, "onnx": 1100, "other": 40}
    return home, sizes, kept


def test_cache_stats_and_clear_cover_every_cache_the_tool_writes(tmp_path):
    home, sizes, kept = _home_with_every_cache(tmp_path)
    stats = json.loads(run_cli("cache", "stats", "--json", home=home).stdout)
    assert stats["entries"] == 1 and stats["bytes"] > 5000              # the prompt cache, as before
    assert {c["name"]: c["bytes"] for c in stats["caches"]} == sizes
    assert stats["total_bytes"] == stats["bytes"] + sum(sizes.values())
    shown = run_cli("cache", "stats", home=home).stdout
    assert all(f"{name}: " in shown for name in sizes)
    cleared = run_cli("cache", "clear", home=home)
    assert cleared.returncode == 0, cleared.stderr
    assert "frontier: removed 2 files" in cleared.stderr and "prompts: removed 1 entry" in \
        cleared.stderr
    after = json.loads(run_cli("cache", "stats", "--json", home=home).stdout)
    assert after["total_bytes"] == 0
    assert all(path.read_text() == "# keep\n" for path in kept)             # models, config, a link's target


def test_cache_clear_takes_the_caches_by_name(tmp_path):
    home, sizes, _ = _home_with_every_cache(tmp_path)
    assert run_cli("cache", "clear", "frontier", "other", home=home).returncode == 0
    left = json.loads(run_cli("cache", "stats", "--json", home=home).stdout)
    assert {c["name"]: c["bytes"] for c in left["caches"]} == {**sizes, "frontier": 0, "other": 0}
    assert left["entries"] == 1
    wrong = run_cli("cache", "clear", "prompt", home=home)
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == ("localinfer: error: no cache named 'prompt'; the caches are "
                                    "prompts, answers, batching, frontier, projectors, mlx, onnx, other")


def test_frontier_says_its_reference_is_an_upcast(smollm_path, tmp_path):
    from localinfer.measure import frontier
    assert frontier.source_precision(smollm_path) == "Q4_1"
    note = frontier.upcast_note(smollm_path)
    assert "Q4_1 weights upcast" in note and "against Q4_1" in note
    f16 = tmp_path / "smol-F16.gguf"
    from localinfer.quant import quantize
    quantize.quantize_file(smollm_path, f16, "F16", allow_requantize=True)
    assert frontier.source_precision(f16) is None and frontier.upcast_note(f16) is None


# -- 24: which prompts the prompt cache keeps ------------------------------------------------------
def test_the_readme_says_which_prompts_the_cache_keeps_and_it_does(smollm_path, tmp_path):
    """Kept from 64 tokens (GRAIN), restored only into prompts of 128 or more, at a multiple of 64
    leaving 64 to evaluate; three identical short prompts keep nothing, as the README now says."""
    from localinfer.engine import batching
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    grain = batching.GRAIN
    assert f"a prompt of {grain} tokens or more" in readme and f"of {2 * grain} or more" in readme
    home = tmp_path / "home"

    def run(words: int) -> str:
        result = run_cli("run", str(smollm_path), " ".join(["word"] * words), "--raw", "-n", "1",
                         "--temp", "0", "--draft", "none", "-v", home=home)
        assert result.returncode == 0, result.stderr
        return result.stderr

    def entries() -> int:
        return json.loads(run_cli("cache", "stats", "--json", home=home).stdout)["entries"]
    for _ in range(3):
        run(36)
    assert entries() == 0
    run(grain + 2)
    assert entries() == 1
    assert f"prompt cache: hit · {grain} tokens restored" in run(2 * grain + 8)
