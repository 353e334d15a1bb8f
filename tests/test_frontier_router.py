"""`frontier --router`: the labelled prompt set, the scoring against the oracle, and the command
on a real cascade of two SmolLM2 variants (a few prompts), whose extreme thresholds must give the
single models' own points."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import error_line, home_with, run_cli

from localinfer.errors import UsageError
from localinfer.measure import prompt_set
from localinfer.measure.prompt_set import matches_reference, prefix_agreement


def test_the_prompt_set_is_well_formed():
    prompts = prompt_set.load()
    kinds = Counter(p.kind for p in prompts)
    assert len(prompts) >= 300 and set(kinds) == set(prompt_set.KINDS)
    assert min(kinds.values()) >= 60
    assert len({p.prompt for p in prompts}) == len(prompts)
    # Extraction and arithmetic have answers by construction; a reference sits in its prompt
    # for extraction (the value was put there).
    for p in prompts:
        if p.kind in ("extraction", "reasoning"):
            assert p.reference, p.id
        if p.kind == "extraction":
            assert p.reference in p.prompt, p.id
    first = prompt_set.select(prompts, 8)
    assert Counter(p.kind for p in first) == {k: 2 for k in prompt_set.KINDS}


def test_scoring_rules():
    assert matches_reference("Ingrid has 29 coins.", "29")
    assert not matches_reference("290 coins", "29") and not matches_reference("2.29", "29")
    assert matches_reference("The capital is  BUENOS aires.", "Buenos Aires")
    assert matches_reference("It costs 39.15 dollars", "39.15")
    assert not matches_reference("maria.lopez@example.org.uk", "maria.lopez@example.org")
    assert prefix_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5      # nothing after a difference
    assert prefix_agreement([1, 2], [1, 2, 3, 4]) == 0.5           # stopped early
    assert prefix_agreement([1, 2, 3, 4], [1, 2]) == 0.5           # went on past the oracle


@pytest.mark.parametrize("line, says", [
    ('{"id": "a", "kind": "poetry", "prompt": "x"}', "kind 'poetry'"),
    ('{"id": "a", "kind": "qa"}', "needs id, kind and prompt"),
    ('[1]', "not a JSON object"),
    ('{"id": "a", "kind": "qa", "prompt": "x", "reference": 3}', "reference must be"),
])
def test_a_bad_prompt_file_is_one_line(line, says):
    with pytest.raises(UsageError, match=says):
        prompt_set.parse(line, "p.jsonl")


@pytest.fixture(scope="module")
def cascade_home(smollm_path: Path, tmp_path_factory) -> Path:
    """A home whose config.toml declares `pair`: SmolLM2 at Q4_0 (made here) up to the Q4_1 it
    ships as; and `by-rule`, a rule router."""
    from localinfer.quant import quantize
    tmp = tmp_path_factory.mktemp("frontier-router")
    small = tmp / "smollm2-Q4_0.gguf"
    quantize.quantize_file(smollm_path, small, "Q4_0", allow_requantize=True)
    config = (f'[routers.pair]\nmodels = ["{small}", "{smollm_path}"]\npolicy = "cascade"\n'
              f'\n[routers.by-rule]\nmodels = ["{smollm_path}"]\npolicy = "rule"\n')
    return home_with(tmp, config, models=True)


def test_frontier_router_points_are_consistent(cascade_home: Path, tmp_path: Path):
    plot = tmp_path / "router.png"
    result = run_cli("frontier", "--router", "pair", "--prompts", "4", "-n", "16",
                     "--thresholds=-inf,inf", "--json", "--plot", str(plot), home=cascade_home)
    assert result.returncode == 0, result.stderr
    points = json.loads(result.stdout, parse_constant=_no_constant)["points"]
    small, large, keep_all, keep_none = points
    assert [p["threshold"] for p in points] == [None, None, "-inf", "inf"]
    assert [p["label"] for p in points] == ["small", "large", "cascade", "cascade"]
    assert all(p["prompts"] == 4 for p in points)          # one of each kind
    quality = ("agreement", "token_agreement", "reference_accuracy", "by_kind", "answer_tokens")
    # -inf keeps every answer of the cheap model: nothing goes up, the same answers as it alone.
    assert keep_all["routed_up"] == 0.0 and small["routed_up"] == 0.0
    assert {k: keep_all[k] for k in quality} == {k: small[k] for k in quality}
    # inf keeps none: every request goes up and is answered as the precise model alone does.
    assert keep_none["routed_up"] == 1.0 and large["routed_up"] == 1.0
    assert {k: keep_none[k] for k in quality} == {k: large[k] for k in quality}
    assert large["agreement"] == 1.0 and large["token_agreement"] == 1.0    # the oracle itself
    # Going up costs the cheap model's decision tokens first.
    assert keep_none["ttft_s"] > 0 and keep_none["mean_s"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _no_constant(name: str):
    raise AssertionError(f"{name} is not JSON")


@pytest.mark.parametrize("args, says", [
    (("--router", "nosuch"), "no router named 'nosuch'"),
    (("--router", "by-rule"), "rule router"),
    (("--router", "pair", "smollm2"), "not both"),
    ((), "needs a MODEL"),
    (("--router", "pair", "--thresholds", "high"), "--thresholds takes numbers"),
])
def test_frontier_router_refusals_are_one_line(cascade_home: Path, args, says):
    result = run_cli("frontier", *args, home=cascade_home)
    assert result.returncode == 2 and says in error_line(result), result.stderr


def test_the_wheel_carries_the_prompt_set_and_every_package():
    """A wheel holds what pyproject lists: the prompt set (package data) and every package,
    localinfer.routing included (frontier --router and every router need it)."""
    import fnmatch
    import tomllib
    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = tool["package-data"]["localinfer"]
    assert any(fnmatch.fnmatch(f"data/{prompt_set.DEFAULT_FILE}", glob) for glob in data)
    prefix = {"localinfer": "localinfer", "backends": "localinfer.backends"}
    found = {".".join((prefix[top], *init.parent.relative_to(root / top).parts))
             for top in prefix for init in (root / top).rglob("__init__.py")}
    assert found - set(tool["packages"]) == set()
