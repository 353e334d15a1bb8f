"""Auto-fit end to end on the real SmolLM2: when no variant fits the budget, `run` quantizes one
that does, keeps it in the store, and the next `run` (and `chat`) use it without quantizing again."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import run_cli

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
QUICK = ("-n", "4", "--temp", "0", "--offline")


@pytest.fixture
def smol_home(smollm_path: Path, home: Path) -> Path:
    """A fresh store holding only the shipped Q4_1 (a copy: this test writes next to it)."""
    store = home / "data/models" / NAME
    store.mkdir(parents=True)
    shutil.copy(smollm_path, store / smollm_path.name)
    return home


def test_run_quantizes_to_fit_then_reuses_it(smol_home: Path):
    store = smol_home / "data/models" / NAME
    # 100 MB: not even the smallest quant fits. One line says what is needed and what would do.
    refused = run_cli("run", "smollm2", "Hi", *QUICK, "--memory", "100MB", home=smol_home)
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "100.0 MB is available" in line, line
    assert re.search(r"needs at least \d+\.\d MB", line), line
    assert [p.name for p in store.iterdir()] == [f"{NAME}-Q4_1.gguf"]     # nothing written

    # The budget the message names is enough: Q4_1 is too big for it, so a smaller quant is made.
    enough = re.search(r"a budget of (\S+) or more", line).group(1)
    first = run_cli("run", "smollm2", "Hi", *QUICK, "--draft", "none", "--memory", enough,
                    home=smol_home)
    assert first.returncode == 0 and first.stdout.strip(), first.stderr
    made = re.search(rf"quantizing {NAME}:Q4_1 to (Q\w+) to fit", first.stderr)
    assert made, first.stderr
    qtype = made.group(1)
    cached = store / f"{NAME}-{qtype}.gguf"
    assert cached.is_file() and not list(store.glob(".*partial"))
    stamp = cached.stat().st_mtime_ns

    # Next time it is simply the most precise variant on disk that fits: no quantizing.
    again = run_cli("run", "smollm2", "Hi", *QUICK, "--draft", "none", "--memory", enough,
                    home=smol_home)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert "quantizing" not in again.stderr and f"using {NAME}:{qtype}" in again.stderr
    chat = run_cli("chat", "smollm2", *QUICK, "--memory", enough, input="Hi\n", home=smol_home)
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
    assert "quantizing" not in chat.stderr and f"using {NAME}:{qtype}" in chat.stderr
    assert cached.stat().st_mtime_ns == stamp
