"""`localinfer run` and `chat` through the real CLI on the two real models."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import GEMMA, SMOLLM, run_cli

QUESTION = "Why is the sky blue?"
GREEDY = ("--temp", "0", "--offline")


@pytest.mark.parametrize("model, args", [
    (SMOLLM, (QUESTION,)),
    (GEMMA, ("The capital of France is",)),
])
def test_greedy_is_deterministic_and_json_matches_stream(models_home, model, args):
    first = run_cli("run", model, *args, *GREEDY, "-n", "16")
    second = run_cli("run", model, *args, *GREEDY, "-n", "16")
    as_json = run_cli("run", model, *args, *GREEDY, "-n", "16", "--json")
    assert first.returncode == second.returncode == as_json.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    record = json.loads(as_json.stdout)
    assert first.stdout == record["text"] + "\n"
    assert record["finish_reason"] == "length" and record["generated_tokens"] == 16
    for key in ("load_s", "prompt_tokens", "ttft_s", "prefill_tps", "decode_tps"):
        assert record[key] > 0, key


def test_chat_template_is_applied_unless_raw(models_home):
    chat = run_cli("run", SMOLLM, QUESTION, *GREEDY, "-n", "12", "--json")
    raw = run_cli("run", SMOLLM, QUESTION, *GREEDY, "-n", "12", "--json", "--raw")
    # The template wraps the question in role markers and a default system prompt: many more tokens.
    assert json.loads(chat.stdout)["prompt_tokens"] > json.loads(raw.stdout)["prompt_tokens"] + 10
    assert json.loads(chat.stdout)["text"] != json.loads(raw.stdout)["text"]


def test_system_message_changes_the_prompt(models_home):
    plain = json.loads(run_cli("run", SMOLLM, "Hi", *GREEDY, "-n", "4", "--json").stdout)
    system = json.loads(run_cli("run", SMOLLM, "Hi", *GREEDY, "-n", "4", "--json",
                                "--system", "Answer in French.").stdout)
    assert plain["prompt_tokens"] != system["prompt_tokens"]


def test_generation_ends_at_end_of_generation_token(models_home):
    result = run_cli("run", SMOLLM, "Say just the word yes.", *GREEDY, "--json")
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "stop"
    assert record["generated_tokens"] < 200


def test_stop_string_ends_generation_before_it(models_home):
    full = json.loads(run_cli("run", GEMMA, "1, 2, 3, 4,", *GREEDY, "-n", "16", "--json").stdout)
    assert " 6," in full["text"]
    cut = json.loads(run_cli("run", GEMMA, "1, 2, 3, 4,", *GREEDY, "-n", "16", "--json",
                             "--stop", " 6,").stdout)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][:full["text"].index(" 6,")]


def test_piped_stdin_is_combined_and_stdout_holds_only_the_answer(models_home):
    piped = run_cli("run", SMOLLM, "What colour is it?", *GREEDY, "-n", "16", "-v",
                    input="The sky is blue.\n")
    direct = run_cli("run", SMOLLM, "The sky is blue.\n\nWhat colour is it?", *GREEDY, "-n", "16")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout
    # Figures go to stderr, never stdout.
    assert "decode" in piped.stderr and "t/s" in piped.stderr
    assert "t/s" not in piped.stdout


def test_dash_prompt_reads_stdin_alone(models_home):
    dash = run_cli("run", SMOLLM, "-", *GREEDY, "-n", "8", input="Name a fruit.")
    plain = run_cli("run", SMOLLM, "Name a fruit.", *GREEDY, "-n", "8")
    assert dash.stdout == plain.stdout and dash.returncode == 0


def test_verbose_reports_every_figure(models_home):
    result = run_cli("run", GEMMA, "Once upon a time", *GREEDY, "-n", "8", "-v")
    for word in ("load", "prompt", "ttft", "prefill", "decode", "tokens"):
        assert word in result.stderr
    # One figure a line, as Ollama's --verbose prints them (not one line of escaped breaks).
    lines = result.stderr.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["model", "load", "prompt", "reply"]
    assert "\\n" not in result.stderr
    # -v is our figures, not the engine's loader log: that is -vv's (or --debug's).
    assert "print_info" not in result.stderr and len(result.stderr.splitlines()) < 15
    engine = run_cli("run", GEMMA, "Once upon a time", *GREEDY, "-n", "8", "-vv")
    assert "print_info" in engine.stderr and "ttft" in engine.stderr
    assert engine.stdout == result.stdout
    quiet = run_cli("run", GEMMA, "Once upon a time", *GREEDY, "-n", "8")
    assert quiet.stderr == ""


def test_output_is_valid_utf8_for_non_ascii_text(models_home):
    result = subprocess.run([sys.executable, "-m", "localinfer", "run", SMOLLM,
                             "Write the word café five times, separated by commas.", *GREEDY,
                             "-n", "40"], capture_output=True,
                            env={**os.environ, "LOCALINFER_HOME": str(models_home)})
    result.stdout.decode("utf-8")               # strict: raises on a broken character
    assert "\ufffd" not in result.stdout.decode("utf-8")


def test_ctrl_c_flushes_text_and_exits_130(models_home):
    env = {**os.environ, "LOCALINFER_HOME": str(models_home)}
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "run", GEMMA, "Once upon a time",
                             *GREEDY, "-n", "100000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    first = proc.stdout.read(1)                  # generation has started
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(first + rest) > 1
    assert b"Traceback" not in err


def _turn_figures(stderr: str) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each reply, from the -v lines."""
    import re
    found = re.findall(r"prompt: ([\d,]+) tokens?(?: \(([\d,]+) cached\))?", stderr)
    return [(int(p.replace(",", "")), int((c or "0").replace(",", ""))) for p, c in found]


def test_chat_keeps_history_reuses_the_cache_and_obeys_commands(models_home):
    script = "My name is Ada.\nWhat is my name?\n/system Answer in one word.\nHello\n/clear\nHi\n/exit\n"
    result = run_cli("chat", SMOLLM, "--temp", "0", "-n", "16", "--offline", "-v", input=script)
    assert result.returncode == 0, result.stderr
    assert "system message set" in result.stderr and "conversation cleared" in result.stderr
    (p1, c1), (p2, c2), (p3, _), (p4, c4) = _turn_figures(result.stderr)
    # Turn two carries turn one (question and answer) and evaluates only the new part.
    assert p2 > p1 + 10
    assert c2 >= p1 - 1
    # /system restarts the conversation with the new system message; /clear empties the cache.
    assert p3 < p2
    assert c4 == 0
    assert len([line for line in result.stdout.splitlines() if line.strip()]) == 4
