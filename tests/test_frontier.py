"""The efficient frontier: the marking rule on described points, and the command end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from localinfer.measure.frontier import Point, mark_frontier


def point(name: str, kl: float, tps: float, mem: int) -> Point:
    return Point(name, "", mem, mem, mem, 100.0, tps, 10.0, kl, 0.9)


def test_frontier_keeps_variants_not_beaten_on_quality_and_speed_or_memory():
    points = [point("Q8_0", 0.01, 20, 300), point("Q6_K", 0.02, 18, 280),   # slower, not smaller
              point("Q4_0", 0.20, 45, 240), point("Q3_K", 0.30, 40, 250)]   # beaten on all counts
    mark_frontier(points)
    assert {p.qtype: p.frontier for p in points} == {"Q8_0": True, "Q6_K": True, "Q4_0": True,
                                                     "Q3_K": False}


@pytest.mark.slow
def test_frontier_command_with_two_types(smollm_path: Path, tmp_path: Path):
    plot = tmp_path / "frontier.png"
    result = run_cli("frontier", str(smollm_path), "--types", "Q8_0,Q4_0", "--ctx", "128",
                     "--chunks", "1", "--json", "--plot", str(plot), home=tmp_path / "home",
                     timeout=900)
    assert result.returncode == 0, result.stderr
    # The reference is the shipped Q4_1 upcast to F16, and its files stay for `cache clear`.
    assert json.loads(result.stdout)["reference_upcast_from"] == "Q4_1"
    assert "Q4_1 weights upcast" in result.stderr and "cache clear frontier" in result.stderr
    variants = json.loads(result.stdout)["variants"]
    assert [v["qtype"] for v in variants] == ["Q8_0", "Q4_0"]
    q8, q4 = variants
    assert q8["mean_kl"] < q4["mean_kl"] and q8["file_size"] > q4["file_size"]
    assert all(abs(v["memory_estimated"] / v["memory_measured"] - 1) < 0.1 for v in variants)
    assert any(v["frontier"] for v in variants)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # the dev extra installs matplotlib
