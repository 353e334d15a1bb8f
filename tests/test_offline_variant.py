"""Offline (`run --offline`, `serve` without --pull) the fit chooses among the variants on disk: a
more precise catalogue variant that would have to be pulled is no candidate. Before, the fit chose
it and the load failed ("not on disk and --offline forbids pulling it"; a 500 on the server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import run_cli

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
# The catalogue knows a Q8_0 of SmolLM2 but not its size, so the fit never weighs it; a user's
# models.toml that gives the size makes it a candidate more precise than the Q4_1 on disk.
WITH_Q8_SIZE = f'[models.{NAME}.quants.Q8_0]\nsize = 144806912\n'


@pytest.fixture(scope="module")
def q4_only_home(smollm_path: Path, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("offline") / "home"
    store = home / "data/models" / NAME
    store.mkdir(parents=True)
    os.link(smollm_path, store / smollm_path.name)       # read only here: a link, not a copy
    (home / "config").mkdir()
    (home / "config/models.toml").write_text(WITH_Q8_SIZE)
    return home


def test_run_offline_uses_the_variant_on_disk(q4_only_home: Path):
    result = run_cli("run", "smollm2", "Hi", "-n", "2", "--temp", "0", "--offline", "--draft",
                     "none", "--no-cache", "-v", home=q4_only_home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "Q8_0" not in result.stderr


def test_server_without_pull_plans_the_variant_on_disk(q4_only_home: Path, monkeypatch):
    """What a request's load plans with `serve` without --pull (its loader's fit is offline)."""
    from localinfer.fit.options import FitOptions
    from localinfer.server.loading import Loader
    monkeypatch.setenv("LOCALINFER_HOME", str(q4_only_home))
    plan = Loader(FitOptions(offline=True, quantize_to_fit=False)).plan("smollm2")
    named, fitted = plan.detail
    assert fitted.ref.quant == "Q4_1" and fitted.path.is_file()
