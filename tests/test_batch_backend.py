"""map and serve through the backend boundary: a BatchSession from the backend that batches
(llama.cpp), and one clear refusal, before anything is pulled or loaded, from one that cannot
(issue 26 item 4)."""

from __future__ import annotations

import pytest

from conftest import run_cli
from localinfer import backends
from localinfer.errors import UsageError


@pytest.mark.parametrize("name", ["mlx", "onnx"])
def test_a_backend_that_cannot_batch_is_refused_naming_the_one_that_can(name):
    with pytest.raises(UsageError, match=f"the {name} backend cannot decode several requests "
                       "together; map and serve run on llama.cpp"):
        backends.select_batch(name, None)


def test_auto_and_llama_cpp_batch():
    for requested in ("auto", "llama.cpp"):
        chosen, _ = backends.select_batch(requested, "llama")
        assert chosen.name == "llama.cpp" and chosen.load_batch is not None


@pytest.mark.parametrize("command", [["map", "smollm2", "{}"], ["serve", "smollm2", "--port", "8097"]])
def test_map_and_serve_refuse_it_in_one_line_before_any_pull(home, command):
    result = run_cli(*command, "--backend", "mlx", home=home, input="hi\n")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "localinfer: error: the mlx backend cannot decode several requests together; map and "
        "serve run on llama.cpp (--backend auto)"]
    assert not (home / "data" / "models").exists() or not any((home / "data" / "models").iterdir())


def test_map_runs_on_the_batch_llama_cpp_hands_out(models_home):
    chosen = run_cli("map", "smollm2", "Repeat: {}", "-n", "4", "--temp", "0", "--backend",
                     "llama.cpp", input="hi\n")
    auto = run_cli("map", "smollm2", "Repeat: {}", "-n", "4", "--temp", "0", input="hi\n")
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout == auto.stdout and chosen.stdout.strip()
