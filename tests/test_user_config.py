"""config.toml: the user's own defaults, through the real CLI.

[defaults] and [defaults.MODEL] are the commands' defaults, checked by each option's own type and
range; the command line wins. A problem in the file is one stderr line naming the file and the key
(exit 2); a key no command has is one warning line; stdout carries what it always carried.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import error_line, home_with, run_cli

from localinfer.cli import defaults

PROMPT = "Write one sentence about the sea."
QUICK = ("--offline", "--draft", "none")


def one_error(result, *words: str) -> str:
    """The single stderr line of a refusal (exit 2), which must name every one of `words`."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    line = error_line(result)
    for word in words:
        assert word in line, (word, line)
    return line


# -- the file ------------------------------------------------------------------------------------
def test_unknown_keys_are_one_warning_line_and_change_nothing_else(tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\ntmep = 0\n[defaults.smollm2]\nnope = 1\n"
                               "[colours]\nauto = true\n")
    plain = run_cli("list", "--catalogue", home=tmp_path / "empty")
    warned = run_cli("list", "--catalogue", home=home)
    assert warned.returncode == 0 and warned.stdout == plain.stdout
    lines = warned.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localinfer: warning: "), warned.stderr
    for word in ("config.toml", "'tmep' in [defaults]", "'nope' in [defaults.smollm2]",
                 "'colours'", "ignored"):
        assert word in lines[0], (word, lines[0])


def test_a_lone_typo_gets_a_suggestion(tmp_path: Path):
    result = run_cli("list", home=home_with(tmp_path, "[defaults]\ntop_kk = 5\n"))
    assert result.returncode == 0
    assert "did you mean 'top_k'?" in result.stderr, result.stderr


def test_syntax_error_names_file_line_and_column(tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\ntemp = 0\ntop_k = 4 0\n")
    one_error(run_cli("list", home=home), str(home / "config" / "config.toml"), "line 3",
              "column")


@pytest.mark.parametrize("line, words", [
    ('temp = "hot"', ["[defaults] temp", "not a valid float"]),
    ("top_k = 2.5", ["[defaults] top_k", "whole number"]),
    ("raw = 1", ["[defaults] raw", "true or false"]),
    ("temp = [0.5]", ["[defaults] temp", "one value"]),
    ("top-k = 1\ntop_k = 2", ["top-k", "top_k", "twice"]),
    ('[defaults.smollm2]\nmax-tokens = "many"', ["[defaults.smollm2] max-tokens"]),
])
def test_a_value_no_option_takes_is_refused_by_every_command(tmp_path: Path, line: str,
                                                             words: list[str]):
    """Checked whichever command runs (here `list`, which has none of these options): the file
    is wrong, not the command."""
    home = home_with(tmp_path, f"[defaults]\n{line}\n")
    one_error(run_cli("list", home=home), "config.toml", *words)


def test_defaults_must_be_a_table(tmp_path: Path):
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "config.toml").write_text("defaults = 3\n")
    one_error(run_cli("list", home=home), "config.toml", "defaults must be a table")


def test_a_value_out_of_the_options_range_names_the_file(tmp_path: Path):
    """Refused before any model is looked for (this home has none)."""
    home = home_with(tmp_path, "[defaults]\ntemp = -1\n")
    one_error(run_cli("run", "smollm2", "Hi", "--offline", home=home),
              "config.toml", "[defaults] temp = -1", "range")


def test_a_range_an_option_checks_itself_names_the_file(tmp_path: Path):
    """--threads' bound is a callback of the option, run when `run` parses: the line still blames
    the file, and no model is looked for (this home has none)."""
    home = home_with(tmp_path, "[defaults]\nthreads = 100000\n")
    one_error(run_cli("run", "smollm2", "Hi", "--offline", home=home),
              "config.toml", "[defaults] threads = 100000", "must be 0")
    # The command line wins over the file, so it is not consulted: the model's absence is next.
    given = run_cli("run", "smollm2", "Hi", "--offline", "-t", "1", home=home)
    assert given.returncode == 1 and "not on disk" in given.stderr, given.stderr


def test_not_a_regular_file_is_refused_without_blocking(tmp_path: Path):
    home = home_with(tmp_path, "")
    path = home / "config" / "config.toml"
    path.unlink()
    os.mkfifo(path)             # reading a pipe with no writer would wait forever
    one_error(run_cli("list", home=home, timeout=30), "config.toml", "not a regular file")
    path.unlink()
    path.mkdir()
    one_error(run_cli("list", home=home), "config.toml", "not a regular file")


def test_an_oversized_file_is_refused(tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\n" + "# padding\n" * 120_000)
    one_error(run_cli("list", home=home), "config.toml", "KB")


def test_defaults_in_models_toml_warn_where_they_belong(tmp_path: Path):
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "models.toml").write_text("[defaults]\ntemp = 0\n")
    result = run_cli("list", home=home)
    assert result.returncode == 0
    lines = result.stderr.strip().splitlines()
    warning = [line for line in lines if "warning" in line]
    assert len(warning) == 1, result.stderr
    assert "models.toml" in warning[0] and "'defaults'" in warning[0] \
        and "config.toml" in warning[0], warning[0]


# -- which table applies --------------------------------------------------------------------------
def test_names_a_model_goes_by(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("LOCALINFER_HOME", str(tmp_path / "home"))
    names = defaults.names_of("smollm2:q8_0")     # least specific first: later tables win
    assert names[0] == "smollm2-135m-instruct"
    assert names[-3:] == ["smollm2", "smollm2-135m-instruct:q8_0", "smollm2:q8_0"]
    assert defaults.names_of("hf:Owner/Repo:Q4_K_M") == ["hf:Owner/Repo", "hf:Owner/Repo:Q4_K_M"]
    assert defaults.names_of("models/Small.Q4.gguf") == ["Small.Q4", "Small.Q4.gguf",
                                                         "models/Small.Q4.gguf"]


# -- the defaults at work, on SmolLM2 -------------------------------------------------------------
def _answer(home: Path, *args: str) -> str:
    result = run_cli("run", "smollm2", PROMPT, *QUICK, *args, home=home)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _tokens(home: Path, *args: str) -> int:
    result = run_cli("run", "smollm2", PROMPT, *QUICK, "--json", *args, home=home)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["generated_tokens"]


@pytest.mark.slow
def test_temp_zero_in_defaults_is_greedy_and_the_command_line_wins(models_home, tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\ntemp = 0\n", models=True)
    greedy = _answer(models_home, "-n", "16", "--temp", "0")
    assert _answer(home, "-n", "16", "--seed", "1") == greedy
    assert _answer(home, "-n", "16", "--seed", "2") == greedy
    hot = [_answer(home, "-n", "16", "--temp", "2", "--seed", str(s)) for s in (1, 2)]
    assert hot[0] != hot[1], hot


@pytest.mark.slow
def test_a_model_table_applies_to_that_model_by_any_name(models_home, smollm_path: Path,
                                                        tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\ntemp = 0\nmax_tokens = 7\n"
                               "[defaults.smollm2-135m-instruct]\nmax-tokens = 3\n"
                               "[defaults.gemma-3-270m]\nmax_tokens = 1\n"
                               f'[defaults."{smollm_path.stem}"]\nmax_tokens = 2\n', models=True)
    assert _tokens(home) == 3                 # typed as the alias, table under the catalogue name
    assert _tokens(home, "-n", "5") == 5      # the command line wins
    by_path = run_cli("run", str(smollm_path), PROMPT, *QUICK, "--json", home=home)
    assert by_path.returncode == 0, by_path.stderr
    assert json.loads(by_path.stdout)["generated_tokens"] == 2     # the file's stem
    gemma = run_cli("run", "gemma-3-270m", "The sea is", *QUICK, "--json", home=home)
    assert json.loads(gemma.stdout)["generated_tokens"] == 1


@pytest.mark.slow
def test_a_model_system_message_changes_the_answer(models_home, tmp_path: Path):
    system = "You are a pirate. Answer like one."
    home = home_with(tmp_path, f'[defaults]\ntemp = 0\n[defaults.smollm2]\nsystem = "{system}"\n',
                     models=True)
    plain = _answer(models_home, "-n", "24", "--temp", "0")
    told = _answer(models_home, "-n", "24", "--temp", "0", "--system", system)
    assert told != plain
    assert _answer(home, "-n", "24") == told
    assert _answer(home, "-n", "24", "--system", "") == plain    # an empty one: none at all


# -- whatever the file holds ------------------------------------------------------------------------
def _random_value(rng):
    import datetime
    return rng.choice([0, -1, 2.5, 1e309, float("nan"), True, "", "x\ny", "auto", "0.5", [],
                       ["a", 2], [[1]], {"k": 1}, datetime.date(2024, 1, 2),
                       datetime.time(7, 32), 10 ** 30, "\u202e", "q" * 300])


def _random_document(rng, keys: list[str]) -> str:
    from localinfer.user_config import toml_key, toml_value

    def table(n: int) -> str:
        return "".join(f"{toml_key(rng.choice(keys))} = {toml_value(_random_value(rng))}\n"
                       for _ in range(n))
    parts = [f"[defaults]\n{table(rng.randrange(4))}"]
    for name in rng.sample(["smollm2", "smollm2:Q8_0", "hf:a/b", "x.gguf", "a\nb"], 2):
        parts.append(f"[defaults.{toml_key(name)}]\n{table(rng.randrange(3))}")
    if rng.random() < 0.2:
        parts.append(f"[{toml_key(rng.choice(keys))}]\na = 1\n")
    return "".join(parts)


def test_any_document_is_defaults_one_error_line_or_one_warning_line(tmp_path: Path,
                                                                     monkeypatch, capsys):
    """Hundreds of documents of odd keys and values, in-process: each gives click defaults it
    parses `run` with, or one ConfigError line; never another exception, never a second line."""
    import random

    import typer

    from localinfer.cli.app import app
    from localinfer.user_config import ConfigError
    root = typer.main.get_command(app)
    known = sorted({k for _, c in defaults.commands(root) for k in defaults.options(c)})
    keys = [*known[:40], "tmep", "", "a b", "top-k", "TOP_K", "defaults"]
    rng = random.Random(25)
    monkeypatch.setenv("LOCALINFER_HOME", str(tmp_path))
    path = tmp_path / "config" / "config.toml"
    path.parent.mkdir()
    args = ["run", "smollm2", "Hi", "-n", "2"]
    for _ in range(300):
        path.write_text(_random_document(rng, keys))
        try:
            found = defaults.default_map(root, args)
            ctx = root.make_context("localinfer", list(args), default_map=found)
            run = root.commands["run"]
            try:
                run.make_context("run", args[1:], parent=ctx)
            except defaults.ClickUsageError as e:
                defaults.blame(e)
                raise
        except ConfigError as e:
            assert "\n" not in str(e) and str(path) in str(e)
        assert len(capsys.readouterr().err.splitlines()) <= 1


def test_help_and_version_stay_reachable_with_a_broken_file(tmp_path: Path):
    home = home_with(tmp_path, '[defaults]\ntemp = "hot"\n')
    for args in (["--version"], ["run", "--help"]):
        result = run_cli(*args, home=home)
        assert result.returncode == 0 and result.stdout, result.stderr
        assert "config.toml" in result.stderr and "temp" in result.stderr


def test_help_shows_the_defaults_of_the_file(tmp_path: Path):
    shown = run_cli("run", "--help", home=home_with(tmp_path, "[defaults]\ntop-k = 17\n"))
    assert shown.returncode == 0 and "[default: 17]" in shown.stdout
