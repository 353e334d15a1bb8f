"""`map --server URL`: the lines answered by a running `localinfer serve` as batch requests, printed
as map prints its own; what only a local model uses refused; a line the server refuses fails alone;
anything that would fail every line ends the run in one line."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import SMOLLM, error_line, run_cli, start_server

PROMPT = "Is {} a prime number? Answer yes or no."
SCHEMA = {"type": "object", "properties": {"fruit": {"type": "string"},
                                           "colour": {"type": "string"}},
          "required": ["fruit", "colour"]}


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = start_server(SMOLLM, "--parallel", "4", "--ctx", "2048", "-v")
    yield proc, url
    proc.terminate()
    proc.wait(timeout=60)


def test_the_answers_are_map_s_own_in_input_order(server):
    """Greedy: the server's answers are map's. One line at a time on both sides, after a first
    line the server has answered, so that each line is evaluated alone from the same point:
    lines part from each other where `{}` is, where the server's kept cells and map's shared
    prefix both end (a batch's make-up moves the last bits: docs/batching.md)."""
    _, url = server
    lines = "".join(f"{n}\n" for n in range(1, 11))
    args = ("map", SMOLLM, PROMPT, "--temp", "0", "-n", "12", "--parallel", "1")
    assert run_cli(*args, "--server", url, input="0\n").returncode == 0
    here = run_cli(*args, input=lines)
    there = run_cli(*args, "--server", url, input=lines)
    assert here.returncode == 0 and there.returncode == 0, there.stderr
    assert there.stdout == here.stdout
    assert len(there.stdout.splitlines()) == 10


def test_raw_lines_are_completions(server):
    """--raw: each line is a /v1/completions request, as is. (Its text is not compared with a
    local run: lines that part at their first token are batched from different cells and
    neighbours here and there, which moves a near tie: docs/batching.md.)"""
    proc, url = server
    result = run_cli("map", SMOLLM, "The capital of {} is", "--raw", "--temp", "0", "-n", "6",
                     "--server", url, input="France\nItaly\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2 and all(result.stdout.splitlines())
    assert len(_logged(proc, "POST /v1/completions 200", 2)) == 2


def _logged(proc, start: str, count: int) -> list[str]:
    """The next `count` lines of serve -v's log for requests starting so, each a batch request
    (the log is written when a request is over)."""
    found = []
    while len(found) < count:
        line = proc.stderr.readline()
        assert line, "the server's log ended"
        if line.startswith(start) and "prompt=" in line:
            assert "priority=batch" in line, line
            found.append(line)
    return found


def test_jsonl_with_a_schema_and_each_request_marked_batch(server):
    proc, url = server
    fruits = ["apple", "banana", "cherry", "plum"]
    result = run_cli("map", SMOLLM, "Give a JSON object with the fruit {} and its colour.",
                     "--temp", "0", "-n", "48", "--json-schema", json.dumps(SCHEMA), "--jsonl",
                     "--server", url, input="".join(f"{f}\n" for f in fruits))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["input"] for r in records] == fruits
    for record in records:
        jsonschema.validate(json.loads(record["answer"]), SCHEMA)
        assert record["finish_reason"] == "stop"
    assert len(_logged(proc, "POST /v1/chat/completions 200", len(fruits))) == len(fruits)


def test_a_line_the_server_refuses_fails_alone(server):
    _, url = server
    long_line = "word " * 3000                  # over the server's 2,048-token context
    result = run_cli("map", SMOLLM, "Say {}", "--temp", "0", "-n", "4", "--server", url,
                     input=f"hello\n{long_line}\nagain\n")
    assert result.returncode == 1
    printed = result.stdout.split("\n")
    assert printed[0] and printed[1] == "" and printed[2], result.stdout   # its place kept
    assert "line 2:" in result.stderr and "2,048" in result.stderr
    assert "1 of 3 lines failed" in result.stderr


def test_an_unknown_model_ends_the_run_in_one_line(server):
    _, url = server
    result = run_cli("map", "no-such-model", PROMPT, "--server", url, input="1\n2\n")
    assert result.returncode == 1
    assert "404" in error_line(result) and "no-such-model" in error_line(result)


@pytest.mark.parametrize("args, said", [
    (["--ctx", "512", "--quant", "Q8_0"], "--ctx, --quant set how a model is loaded here"),
    (["--threads", "1"], "--threads set how a model is loaded here"),
    (["--grammar", "g.gbnf"], "--grammar set how a model is loaded here"),
    (["--raw", "--system", "Be brief."], "--system has no place in a --raw prompt"),
])
def test_options_only_a_local_model_uses_are_refused(args, said, tmp_path):
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    args = [str(grammar) if a == "g.gbnf" else a for a in args]
    result = run_cli("map", SMOLLM, PROMPT, "--server", "http://127.0.0.1:9", *args, input="1\n",
                     home=tmp_path / "home")
    assert result.returncode == 2
    assert said in error_line(result)


@pytest.mark.parametrize("url, said", [
    ("ftp://127.0.0.1", "--server must be an http:// or https:// address"),
    ("http://", "--server must be an http:// or https:// address with a host"),
    ("http://[::1", "--server must be an http:// or https:// address with a host"),
    ("http://127.0.0.1:9", "no server answered at http://127.0.0.1:9"),
])
def test_a_server_that_is_not_there_is_one_line(url, said, tmp_path):
    result = run_cli("map", SMOLLM, PROMPT, "--server", url, input="1\n2\n",
                     home=tmp_path / "home")
    assert result.returncode in (1, 2)
    assert said in error_line(result)
