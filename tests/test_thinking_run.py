"""A thinking model's trace kept apart end to end, on SmolLM2's real weights wearing the published
templates of thinking families (its ChatML vocabulary is theirs): `run` never writes the trace to
stdout, `--think-budget` ends it so that an answer follows, the answer alone keeps to a schema,
speculation stays exact across the trace's end, the prompt cache and the Python API agree, and an
answer that never started is one stderr line and exit 1 (issue 27 §1)."""

from __future__ import annotations

import io
import json

import pytest

import terminal
from chat_templates import DEEPSEEK_R1_DISTILL_QWEN, QWEN3, QWEN3_THINKING_2507
from helpers import error_line, run_cli, smollm_wearing

pytestmark = pytest.mark.usefixtures("models_home")

QUESTION = "What is 2+2?"
GREEDY = ("--temp", "0", "--draft", "none")
SCHEMA = '{"type":"object","properties":{"answer":{"type":"integer"}},"required":["answer"]}'


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, models_home):
    """SmolLM2 under Qwen3 Thinking-2507's template: the prompt opens `<think>`."""
    return str(smollm_wearing(QWEN3_THINKING_2507, tmp_path_factory.mktemp("m"), "thinking"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, models_home):
    return str(smollm_wearing(QWEN3, tmp_path_factory.mktemp("m"), "qwen3"))


def _json(*args: str) -> dict:
    result = run_cli("run", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_budget_ends_the_trace_and_only_the_answer_reaches_stdout(thinking):
    result = run_cli("run", thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget", "6")
    assert result.returncode == 0, result.stderr
    record = _json(thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget", "6")
    assert record["reasoning"] and record["text"].strip()
    assert result.stdout == record["text"] + ("" if record["text"].endswith("\n") else "\n")
    for marker in ("<think>", "</think>"):
        assert marker not in result.stdout and marker not in record["reasoning"]
    assert record["reasoning"] not in result.stderr       # off a terminal the trace is dropped
    shown = run_cli("run", thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget", "6",
                    "--show-thinking")
    assert shown.stdout == result.stdout and record["reasoning"] in shown.stderr
    assert record["generated_tokens"] <= 40                # -n counts the trace's tokens too


def test_no_answer_when_the_tokens_run_out_inside_the_trace(thinking):
    result = run_cli("run", thinking, QUESTION, *GREEDY, "-n", "4")
    line = error_line(result)                              # stdout empty, one line
    assert result.returncode == 1
    assert "still thinking" in line and "-n 4" in line and "--think-budget" in line


def test_the_schema_constrains_the_answer_after_the_trace(thinking):
    record = _json(thinking, QUESTION, *GREEDY, "-n", "60", "--think-budget", "5",
                   "--json-schema", SCHEMA)
    assert record["reasoning"]
    assert isinstance(json.loads(record["text"])["answer"], int)


@pytest.mark.parametrize("drafter", ["lookup", "self"])
def test_speculation_is_exact_across_the_end_of_the_trace(thinking, drafter):
    plain = _json(thinking, QUESTION, *GREEDY, "-n", "48", "--think-budget", "7")
    drafted = _json(thinking, QUESTION, "--temp", "0", "--draft", drafter, "-n", "48",
                    "--think-budget", "7")
    assert (drafted["reasoning"], drafted["text"]) == (plain["reasoning"], plain["text"])


def test_prompt_cache_cold_equals_warm_with_a_trace(thinking, tmp_path):
    # The cache keeps prompts of whole batches (64 tokens and more): notes, then the question;
    # about 300 tokens of them, several such batches, at a third of the prefill of a page.
    notes = " ".join(f"Note {i}: the sky was clear on day {i}." for i in range(20))
    args = (thinking, f"{notes}\n\n{QUESTION}", *GREEDY, "-n", "32", "--think-budget", "5")
    home = tmp_path / "home"
    cold = run_cli("run", *args, "--json", home=home)
    warm = run_cli("run", *args, "--json", home=home)
    assert cold.returncode == warm.returncode == 0, cold.stderr + warm.stderr
    cold, warm = json.loads(cold.stdout), json.loads(warm.stdout)
    assert warm["cached_tokens"] > 0
    assert (warm["reasoning"], warm["text"]) == (cold["reasoning"], cold["text"])


def test_no_think_renders_the_template_switch(qwen3):
    default = _json(qwen3, QUESTION, *GREEDY, "-n", "24")
    off = _json(qwen3, QUESTION, *GREEDY, "-n", "24", "--no-think")
    # Qwen3's template writes the empty trace itself for enable_thinking=false.
    assert off["prompt_tokens"] > default["prompt_tokens"]
    assert off["reasoning"] == "" and "</think>" not in off["text"]
    same = _json(qwen3, QUESTION, *GREEDY, "-n", "24", "--think", "off")
    assert [same[k] for k in ("prompt_tokens", "text")] == [off[k] for k in ("prompt_tokens", "text")]


def test_no_think_on_a_template_without_a_switch_writes_an_empty_trace(tmp_path):
    deepseek = str(smollm_wearing(DEEPSEEK_R1_DISTILL_QWEN, tmp_path, "r1"))
    default = _json(deepseek, QUESTION, *GREEDY, "-n", "16")
    off = _json(deepseek, QUESTION, *GREEDY, "-n", "16", "--no-think")
    assert off["prompt_tokens"] > default["prompt_tokens"] and off["reasoning"] == ""


def test_think_values_are_checked_before_loading(thinking):
    assert "--think must be one of" in error_line(run_cli("run", thinking, "hi", "--think=max"))
    assert "opposite" in error_line(run_cli("run", thinking, "hi", "--think", "high", "--no-think"))
    assert run_cli("run", thinking, "hi", "--think-budget", "-1").returncode == 2


def test_a_model_without_a_trace_has_no_reasoning_field():
    record = _json("smollm2", QUESTION, *GREEDY, "-n", "8")
    assert "reasoning" not in record


def test_on_a_terminal_the_trace_is_dimmed_on_stderr(thinking):
    screen, code = terminal.run("run", thinking, QUESTION, *GREEDY, "-n", "40",
                                "--think-budget", "6")
    record = _json(thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget", "6")
    assert code == 0
    assert "\x1b[2m" in screen and record["reasoning"] in terminal.plain(screen)
    hidden, _ = terminal.run("run", thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget",
                             "6", "--hide-thinking")
    assert record["reasoning"] not in terminal.plain(hidden)
    assert record["text"].strip() in terminal.plain(hidden)


def test_chat_shows_the_trace_dimmed_and_the_answer(thinking):
    child = terminal.spawn("chat", thinking, "--temp", "0", "-n", "40", "--think-budget", "6")
    child.logfile_read = screen = io.StringIO()
    child.expect("ready")
    child.sendline(QUESTION)
    record = _json(thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget", "6")
    child.expect_exact(record["text"].strip().splitlines()[0])
    child.sendline("/bye")
    child.expect(terminal.pexpect.EOF)
    shown = screen.getvalue()
    assert f"\x1b[2m{record['reasoning'].split()[0]}" in shown     # the trace, dimmed
    assert "<think>" not in shown and "</think>" not in shown


def test_the_api_returns_what_run_prints(thinking, in_models_home):
    import localinfer
    record = _json(thinking, QUESTION, *GREEDY, "-n", "40", "--think-budget", "6")
    with localinfer.load(thinking) as model:
        answer = model.generate(QUESTION, temperature=0, draft="none", max_tokens=40,
                                think_budget=6)
        assert (model.reasoning, answer) == (record["reasoning"], record["text"])
        parts = list(model.stream_parts(QUESTION, temperature=0, draft="none", max_tokens=40,
                                        think_budget=6))
        assert "".join(t for k, t in parts if k == "answer") == answer
        with pytest.raises(localinfer.errors.LocalinferError, match="still thinking"):
            model.generate(QUESTION, temperature=0, max_tokens=4)
