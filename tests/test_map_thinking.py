"""`map` on a thinking model (issue 27): SmolLM2's weights wearing Qwen3-4B-Thinking-2507's
published template, whose generation prompt opens `<think>` itself, so everything SmolLM2 writes
starts inside the trace. `--think-budget` writes the close so that an answer follows; map's lines
carry that answer alone, the same answers `run` gives, and a line still thinking when -n runs out
has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import QWEN3_THINKING_2507
from gguf_patch import set_value
from helpers import run_cli

pytestmark = pytest.mark.slow

# SmolLM2 answers these without writing `</think>` again after the close (it does for some prompts:
# that text is its answer then, as run prints it too).
LINES = ["What is 2+2?", "Who wrote Hamlet?", "What is the capital of Italy?"]
BUDGET = ["--temp", "0", "-n", "20", "--think-budget", "6", "--offline"]


@pytest.fixture(scope="module")
def thinking(smollm_path: Path, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("thinking") / "smollm2-thinking-2507.gguf"
    return str(set_value(smollm_path, path, "tokenizer.chat_template", QWEN3_THINKING_2507))


def _map(model: str, *args: str, lines=LINES):
    return run_cli("map", model, "{}", *args, input="".join(f"{line}\n" for line in lines))


def _as_map_line(answer: str) -> str:
    """An answer as map writes it: on one line."""
    return answer.strip().replace("\\", "\\\\").replace("\n", "\\n")


def test_map_writes_the_answers_run_gives_and_never_the_trace(thinking):
    result = _map(thinking, *BUDGET)
    assert result.returncode == 0, result.stderr
    assert "<think>" not in result.stdout and "</think>" not in result.stdout
    assert "thinking" not in result.stderr          # off a terminal the trace is dropped
    answers = result.stdout.split("\n")
    assert answers[-1] == "" and len(answers) == len(LINES) + 1
    runs = [run_cli("run", thinking, line, "--draft", "none", *BUDGET) for line in LINES]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert answers[:-1] == [_as_map_line(r.stdout) for r in runs]
    assert all(answers[:-1]), answers

    records = [json.loads(r) for r in _map(thinking, *BUDGET, "--jsonl").stdout.splitlines()]
    assert [r["input"] for r in records] == LINES
    assert [_as_map_line(r["answer"]) for r in records] == answers[:-1]
    assert all(r["reasoning"] and "<think>" not in r["reasoning"] for r in records), records

    shown = _map(thinking, *BUDGET, "--show-thinking")
    assert shown.returncode == 0 and shown.stdout == result.stdout
    for i, r in enumerate(records):
        assert f"line {i + 1}, thinking:\n{r['reasoning']}\n\n" in shown.stderr, shown.stderr


def test_a_line_still_thinking_when_n_runs_out_has_no_answer(thinking):
    result = _map(thinking, "--temp", "0", "-n", "4", "--offline", lines=LINES[:2])
    assert result.returncode == 1
    assert result.stdout == "\n\n"
    warnings = [w for w in result.stderr.splitlines() if w.startswith("localinfer: warning: ")]
    assert warnings == [f"localinfer: warning: line {i}: no answer: the model was still thinking "
                        "when -n 4 ran out; raise -n, or give --think-budget N so that the trace "
                        "ends after N tokens" for i in (1, 2)] + \
        ["localinfer: warning: 2 of 2 lines failed"], result.stderr
    records = [json.loads(r) for r in _map(thinking, "--temp", "0", "-n", "4", "--offline",
                                           "--jsonl", lines=LINES[:2]).stdout.splitlines()]
    assert all("no answer" in r["error"] and r["reasoning"] and "answer" not in r
               for r in records), records


def test_a_grammar_keeps_the_answer_after_the_trace(thinking, tmp_path):
    digits = tmp_path / "digits.gbnf"
    digits.write_text("root ::= [0-9]+\n")
    args = ["--grammar", str(digits), *BUDGET]
    lines = ["What is 3+5?", "What is 2+2?"]
    result = _map(thinking, *args, "--jsonl", lines=lines)
    assert result.returncode == 0, result.stderr
    records = [json.loads(r) for r in result.stdout.splitlines()]
    assert all(r["answer"].isdigit() and not r["reasoning"].isdigit() for r in records), records
    runs = [json.loads(run_cli("run", thinking, line, "--draft", "none", "--json", *args).stdout)
            for line in lines]
    assert [(r["answer"], r["reasoning"]) for r in records] == \
        [(r["text"], r["reasoning"]) for r in runs]


def test_a_model_without_a_trace_has_no_reasoning_field(models_home):
    result = _map("smollm2", "--temp", "0", "-n", "2", "--offline", "--jsonl", lines=LINES[:1])
    assert result.returncode == 0, result.stderr
    assert list(json.loads(result.stdout)) == ["input", "answer", "finish_reason"]


def test_map_takes_the_thinking_options():
    result = run_cli("map", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    for option in ("--think", "--no-think", "--think-budget", "--show-thinking"):
        assert option in result.stdout, option
