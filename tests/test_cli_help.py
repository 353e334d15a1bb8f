"""What a new user meets first: the version, the help (on a real terminal), shell completion, and
options that mean one thing on every command (issue 25, items 1-4)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

import terminal
from helpers import SMOLLM, run_cli

COMMANDS = ("run", "chat", "map", "serve", "pull", "list", "rm", "info", "show", "devices", "cache",
            "bench", "quantize", "eval", "frontier")
PANELS = ("Sampling", "Context and memory", "Speculation", "Output", "Backend")


def test_version_names_localinfer_and_its_engine():
    for flag in ("--version", "-V"):
        result = run_cli(flag)
        assert result.returncode == 0 and result.stderr == ""
        assert result.stdout == (f"localinfer {metadata.version('localinfer')} "
                                 f"(llama-cpp-python {metadata.version('llama-cpp-python')})\n")


def test_bare_localinfer_prints_the_help_and_ends_normally():
    result = run_cli()
    assert result.returncode == 0
    assert "Usage: localinfer" in result.stdout and "run" in result.stdout


def test_a_command_without_its_model_is_still_a_usage_error():
    result = run_cli("run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("localinfer: error:")


def test_shell_completion_completes_commands_and_options():
    env = {"_LOCALINFER_COMPLETE": "complete_bash", "COMP_WORDS": "localinfer ru", "COMP_CWORD": "1"}
    assert run_cli(env=env).stdout.split() == ["run"]
    env.update(COMP_WORDS="localinfer chat smollm2 --top", COMP_CWORD="3")
    assert run_cli(env=env).stdout.split() == ["--top-k", "--top-p"]
    # --show-completion finds the shell among its parents (as from a user's terminal); a test
    # worker's may hold none, so the command runs under a bash that stays its parent (a bash
    # given one command would exec it in its own place).
    script = subprocess.run(["bash", "-c", '"$0" -m localinfer --show-completion; exit $?',
                             sys.executable], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "_LOCALINFER_COMPLETE" in script.stdout, script.stderr


def test_run_help_on_a_terminal_groups_options_and_shows_examples():
    screen, code = terminal.run("run", "--help", columns=80, env={"NO_COLOR": "1"})
    screen = terminal.plain(screen)
    assert code == 0
    assert "Usage: localinfer run [OPTIONS] MODEL [PROMPT]" in screen
    for panel in PANELS:
        assert f"─ {panel} " in screen, panel
    assert "range" not in screen and "<float" not in screen and "<int" not in screen
    assert "{model}" not in screen and "hf:OWNER/REPO" in screen
    assert 'localinfer run smollm2 "Why is the sky blue?"' in screen
    # 112 lines in one panel before the panels; 96 with them, 112 again with the Thinking panel
    # and --cpu-moe (issue 27): the bound keeps the help from growing unnoticed.
    # --rpc (issue 30) two more (120 lines at 2f3efca); --frequency-penalty, --presence-penalty,
    # --logit-bias (issue 44) one line each; --logprobs (issue 44) two; --reuse-answers (issue 45)
    # two; --reuse-similarity and --reuse-embedder (issue 45) one each; the Images and audio
    # panel (issue 46) five; --priority (issue 45) one, --truncate's help one shorter.
    assert len(screen.splitlines()) <= 134


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_an_example(command):
    result = run_cli(command, "--help", env={"COLUMNS": "100"})
    assert result.returncode == 0
    assert re.search(rf"^\s*(\S.*\| )?localinfer {command} ", result.stdout, re.M), result.stdout


def _options() -> dict[str, list[tuple[str, object]]]:
    """Each long option -> (command, click parameter) for every command that has it."""
    import typer

    from localinfer.cli.app import app
    group = typer.main.get_command(app)
    found: dict[str, list[tuple[str, object]]] = {}
    for name in COMMANDS:
        for param in group.commands[name].params:
            for opt in param.opts:
                if opt.startswith("--"):
                    found.setdefault(opt, []).append((name, param))
    return found


# Defaults that differ by design, each for a reason the help states: map answers many short
# lines (-n 256, a 2,048-token context each), serve shares one pool, eval and frontier score
# llama-perplexity's 512-token chunks (frontier 4 of them for each of its seven types), and bench
# measures the plain decode llama-bench measures; frontier --router's answers are short (-n 48).
DIFFERENT_DEFAULTS = {"--max-tokens": {"map", "frontier"},
                      "--ctx": {"map", "eval", "frontier", "serve"},
                      "--draft": {"bench"}, "--chunks": {"frontier"}}


def test_an_option_means_one_thing_on_every_command():
    for opt, uses in _options().items():
        shorts = {tuple(o for o in p.opts if not o.startswith("--")) for _, p in uses}
        assert len(shorts) == 1, f"{opt} has short flags {shorts}"
        common = [p for c, p in uses if c not in DIFFERENT_DEFAULTS.get(opt, ())]
        assert len({repr(p.default) for p in common}) <= 1, f"{opt} defaults differ"
        assert len({type(p.type).__name__ for _, p in uses}) == 1, f"{opt} types differ"
    # and a short flag names one option (bench's -p/-n are llama-bench's own, on bench alone)
    by_short: dict[str, set[str]] = {}
    for opt, uses in _options().items():
        for command, param in uses:
            for short in (o for o in param.opts if not o.startswith("--")):
                if command != "bench":
                    by_short.setdefault(short, set()).add(opt)
    assert all(len(longs) == 1 for longs in by_short.values()), by_short


def test_sampling_options_reach_chat_and_map():
    options = _options()
    for opt in ("--top-k", "--top-p", "--min-p", "--repeat-penalty", "--stop", "--raw", "--temp",
                "--seed", "--system"):
        commands = {c for c, _ in options[opt]}
        assert {"run", "chat", "map"} <= commands, (opt, commands)


def test_top_k_changes_what_map_samples(models_home):
    """--top-k 1 is greedy whatever the temperature: two seeds answer alike only with it."""
    lines = "Write a word.\nName a colour.\n"
    args = ("map", SMOLLM, "{}", "-n", "12", "--temp", "1.5", "--top-p", "1", "--min-p", "0")
    greedy = [run_cli(*args, "--top-k", "1", "--seed", seed, input=lines).stdout
              for seed in ("1", "2")]
    assert greedy[0] == greedy[1] == run_cli("map", SMOLLM, "{}", "-n", "12", "--temp", "0",
                                             input=lines).stdout
    sampled = {run_cli(*args, "--top-k", "0", "--seed", seed, input=lines).stdout
               for seed in ("1", "2")}              # two seeds part at that temperature
    assert len(sampled) > 1


@pytest.mark.skipif(not shutil.which("taskset"), reason="needs taskset")
def test_threads_zero_counts_only_the_cpus_this_process_may_use(models_home):
    """Under `taskset -c 0`, 0 threads is one (it was the machine's cores, oversubscribed)."""
    env = {**os.environ, "LOCALINFER_HOME": str(models_home), "NO_COLOR": "1"}
    bench = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "localinfer", "bench",
                            SMOLLM, "-p", "16", "-n", "4", "-r", "1", "--json", "--offline"],
                           capture_output=True, text=True, env=env, timeout=600,
                           stdin=subprocess.DEVNULL)
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["threads"] == 1
    too_many = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "localinfer", "bench",
                               SMOLLM, "-t", "2"], capture_output=True, text=True, env=env,
                              timeout=120, stdin=subprocess.DEVNULL)
    assert too_many.returncode == 2 and "0 (automatic) to 1" in too_many.stderr


def test_verbose_in_chat_is_the_figures_not_the_engine_log(models_home):
    result = run_cli("chat", SMOLLM, "--temp", "0", "-n", "4", "-v", "--offline", input="Hi\n")
    assert result.returncode == 0, result.stderr
    assert "decode" in result.stderr and "t/s" in result.stderr
    assert "llama_" not in result.stderr and "print_info" not in result.stderr


def test_ctx_zero_is_automatic_on_every_command(models_home, tmp_path):
    """`ctx = 0` in config.toml's [defaults] must suit map as it suits run (0: map's 2,048)."""
    config = tmp_path / "home" / "config"
    config.mkdir(parents=True)
    (config / "config.toml").write_text("[defaults]\nctx = 0\ntemp = 0\n")
    home = tmp_path / "home"
    (home / "data").mkdir()
    (home / "data" / "models").symlink_to(models_home / "data" / "models")
    mapped = run_cli("map", SMOLLM, "Repeat: {}", "-n", "4", "--jsonl", input="hi\n", home=home)
    assert mapped.returncode == 0, mapped.stderr
    assert mapped.stdout == run_cli("map", SMOLLM, "Repeat: {}", "-n", "4", "--jsonl",
                                    "--ctx", "2048", "--temp", "0", input="hi\n").stdout
    short = run_cli("map", SMOLLM, "{}", "--ctx", "10", input="hi\n")
    assert short.returncode == 2 and "at least 64" in short.stderr
