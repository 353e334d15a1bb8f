"""`map` reads stdin as it comes: lines end at `\\n` alone (as `wc -l` and `while read` count
them), each line is bounded rather than the input, answers print before the input ends, and what
is held is the window of lines under way, not the input (issue 24, item 10)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import run_cli

from localinfer.cli import shell
from localinfer.engine.decode import Limits
from localinfer.engine.sampling import SamplingParams
from localinfer.errors import UsageError

GREEDY = SamplingParams(temperature=0)

# Line separators of str.splitlines() that a shell does not split at, each inside a line.
INSIDE = ["red\rdot", "blue\fdot", "green\x1cdot\x1ddot\x1edot", "white\x85dot",
          "black\u2028dot\u2029dot\vdot"]


class _Piped(io.BytesIO):
    """Bytes as a pipe gives them, at most `step` at a time; counts what was read."""

    def __init__(self, data: bytes, step: int = 1 << 16) -> None:
        super().__init__(data)
        self.step, self.taken = step, 0

    def isatty(self) -> bool:
        return False

    def read1(self, n: int = -1) -> bytes:
        chunk = super().read1(min(n, self.step) if n > 0 else self.step)
        self.taken += len(chunk)
        return chunk


class _Endless(_Piped):
    """A producer that never writes a newline (`yes | tr -d '\\n'`)."""

    def read1(self, n: int = -1) -> bytes:
        self.taken += n
        return b"y" * n


def _lines(monkeypatch, data: bytes | _Piped, limit: int = 1 << 20) -> list[str]:
    stream = data if isinstance(data, _Piped) else _Piped(data)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stream))
    return [line for read in shell.stdin_lines(limit) for line in read]


@pytest.mark.parametrize("data, lines", [
    (b"", []),
    (b"\n", [""]),
    (b"a\n\n", ["a", ""]),
    (b"a\nb", ["a", "b"]),                    # a last line without a newline is a line
    (b"a\r\nb\r\n", ["a", "b"]),              # one \r before the newline goes with it
    (b"a\r\r\n", ["a\r"]),
    ("\n".join(INSIDE).encode() + b"\n", INSIDE),
])
def test_lines_end_at_newline_alone(monkeypatch, data, lines):
    assert _lines(monkeypatch, data) == lines
    # as many as `wc -l` counts, and one more for a last line without a newline
    assert len(lines) == data.count(b"\n") + (not data.endswith(b"\n") and bool(data))


def test_lines_across_reads(monkeypatch):
    data = b"".join(b"%d\r\n" % i for i in range(5000)) + "é".encode() * 40_000
    assert _lines(monkeypatch, _Piped(data, step=7)) == [str(i) for i in range(5000)] + ["é" * 40_000]


def test_a_line_over_the_bound_ends_the_input_after_the_lines_before_it(monkeypatch):
    assert _lines(monkeypatch, b"0123456789\r\nok", limit=10) == ["0123456789", "ok"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Piped(b"ok\n" + b"x" * 11 + b"\n")))
    reads = shell.stdin_lines(10)
    assert next(reads) == ["ok"]
    with pytest.raises(UsageError, match="stdin line 2 holds more than 10 B.*LOCALINFER_STDIN"):
        next(reads)


def test_a_line_that_never_ends_is_refused_at_the_bound(monkeypatch):
    endless = _Endless(b"")
    with pytest.raises(UsageError, match="stdin line 1 holds more than 1.0 MB"):
        _lines(monkeypatch, endless, limit=1 << 20)
    assert endless.taken <= (1 << 20) + 2 * (1 << 16)


@pytest.mark.parametrize("bad, words", [
    (b"\xff", "invalid byte at offset 80003, line 2"),
    (b"\0", "NUL character"),
])
def test_a_line_that_is_not_text_is_refused_with_where(monkeypatch, bad, words):
    data = b"ok\n" + "é".encode() * 40_000 + bad + b"\nnever read\n"   # past the first read
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Piped(data)))
    given = []
    with pytest.raises(UsageError, match=words):
        for read in shell.stdin_lines(1 << 20):
            given += read
    assert given == ["ok"]


# -- through the CLI, on the real model -------------------------------------------------------------
@pytest.mark.slow
def test_one_answer_per_input_line(models_home):
    text = "\r\n".join(INSIDE)                            # CRLF endings, the last line without
    result = run_cli("map", "smollm2", "Name a fruit that is {}.", "--temp", "0", "-n", "4",
                     "--offline", "--jsonl", input=text)
    assert result.returncode == 0, result.stderr
    assert [json.loads(r)["input"] for r in result.stdout.split("\n")[:-1]] == INSIDE
    plain = run_cli("map", "smollm2", "Name a fruit that is {}.", "--temp", "0", "-n", "4",
                    "--offline", input=text)
    assert plain.returncode == 0 and plain.stdout.count("\n") == len(INSIDE), plain.stdout


MAP_RED = ["map", "smollm2", "Name a fruit that is {}.", "--temp", "0", "-n", "4", "--offline"]


def _first_answer_with_stdin_open(home: Path) -> tuple[subprocess.Popen, str]:
    """A map whose producer wrote one line and keeps the pipe open; its first answer line."""
    child = subprocess.Popen([sys.executable, "-m", "localinfer", *MAP_RED], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1"})
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.append(child.stdout.readline()), daemon=True)
    reader.start()
    child.stdin.write("red\n")
    child.stdin.flush()
    reader.join(timeout=120)               # loading and one answer: seconds
    if not (first and first[0].strip()):
        child.kill()
        pytest.fail("no answer while stdin was open")
    return child, first[0]


@pytest.mark.slow
def test_first_answer_prints_before_stdin_closes(models_home):
    child, first = _first_answer_with_stdin_open(models_home)
    try:
        assert child.poll() is None        # still reading
        child.stdin.write("blue\n")
        rest, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    alone = run_cli(*MAP_RED, input="red\nblue\n")
    assert first + rest == alone.stdout


@pytest.mark.slow
def test_ctrl_c_while_waiting_for_a_line_is_a_clean_interrupt(models_home):
    """The reading thread is blocked in a read of stdin then: it must hold no lock that Python's
    exit waits for (it did: "Fatal Python error: _enter_buffered_busy", exit 134)."""
    import signal
    child, _ = _first_answer_with_stdin_open(models_home)
    try:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=60)             # stdin still open: the thread still blocked in a read
        err = child.stderr.read()
    finally:
        child.kill()
        child.stdin.close()
    assert child.returncode == 130, err
    assert "Fatal" not in err and "Traceback" not in err, err


def _peak_rss(args: list[str], stdin: Path, home: Path) -> tuple[int, str]:
    """(the child's own peak resident memory in bytes, its stdout)."""
    with open(stdin, "rb") as given, open(stdin.with_suffix(".out"), "w+") as out:
        child = subprocess.Popen([sys.executable, "-m", "localinfer", *args], stdin=given,
                                 stdout=out, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1"})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return usage.ru_maxrss * 1024, out.read()


@pytest.mark.slow
def test_many_lines_hold_no_more_memory_than_a_few(models_home, tmp_path):
    """Empty lines through a raw "{}" are empty prompts, each refused at once (no model time),
    so 100,000 of them cost what holding them costs: before streaming, 1.7 KB each (+170 MB)."""
    args = ["map", "smollm2", "{}", "--raw", "--jsonl", "--offline"]
    peaks = {}
    for n in (1_000, 100_000):
        given = tmp_path / f"{n}.txt"
        given.write_bytes(b"\n" * n)
        peaks[n], out = _peak_rss(args, given, models_home)
        records = out.split("\n")[:-1]
        assert len(records) == n and json.loads(records[-1]) == {"input": "",
                                                                  "error": "the prompt is empty"}
    print(f"peak RSS: {peaks[1_000] / 2**20:.1f} MB at 1,000 lines, "
          f"{peaks[100_000] / 2**20:.1f} MB at 100,000")
    assert peaks[100_000] - peaks[1_000] < 16 * 2**20, peaks




# -- the shared prefix, known from the template before the lines ------------------------------------
ODD = ["red", "7 apples", "", " spaced", "Über", "(x)", "?", "日本", "a\rb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm", "gemma"])
@pytest.mark.parametrize("template", ["Name a fruit that is {}.", "Translate to French: {}", "{}"])
def test_the_template_prefix_is_what_every_line_shares(request, name, template):
    """Computed from the template and the first line, it is what the prompts of all these lines
    have in common, as the prefix of all prompts was when map read them all first."""
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.session import LlamaCppSession
    from localinfer.cli.batch import _Lines, _shared_prefix
    path = request.getfixturevalue("smollm_path" if name == "smollm" else "gemma_path")
    session = LlamaCppSession(path, LoadOptions(n_ctx=256))
    for raw in (False, True):
        lines = _Lines(template, GREEDY, Limits(2), system=None, raw=raw, gbnf=None)
        expected = _shared_prefix([lines.tokens(session, line) for line in ODD])
        assert lines.prefix(session, ODD[0]) == expected, (raw, template)
    session.close()


@pytest.mark.slow
def test_map_evaluates_the_prefix_once(smollm_path, monkeypatch, capsys):
    """Each line's prompt takes the template's prefix from the prefix's sequence: only the rest
    of each prompt is evaluated."""
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.batched import SequenceBatch
    from localinfer.cli import batch as mapping
    batch = SequenceBatch(smollm_path, LoadOptions(n_ctx=256 * 2), 3)
    lines = mapping._Lines("Name a fruit that is {}.", GREEDY, Limits(2), system=None, raw=False,
                           gbnf=None)
    prefix = lines.prefix(batch.session, ODD[0])
    lengths = [len(lines.tokens(batch.session, line)) for line in ODD]
    seen = []
    finished = mapping._InOrder.finished
    monkeypatch.setattr(mapping._InOrder, "finished",
                        lambda self, job: (seen.append((job.index, job.stats)), finished(self, job)))
    feed = mapping._Feed(iter([ODD[:3], ODD[3:]]), ahead=4)     # two reads of stdin
    printer = mapping._answer(batch, feed, lines, jsonl=False, use_cache=False)
    batch.close()
    assert printer.count == len(ODD) and printer.failed == 0
    assert capsys.readouterr().out.count("\n") == len(ODD)
    seen = [stats for _, stats in sorted(seen, key=lambda done: done[0])]
    assert [s.prompt_tokens for s in seen] == lengths
    assert all(s.cached_tokens >= len(prefix) for s in seen), [s.cached_tokens for s in seen]
    evaluated = sum(s.prompt_tokens - s.cached_tokens for s in seen)
    print(f"prefix {len(prefix)} tokens; prompts {sum(lengths)} tokens, {evaluated} evaluated")
    assert evaluated <= sum(lengths) - len(ODD) * len(prefix)


# -- a line whose prompt cannot be made -------------------------------------------------------------
CHATML = ("{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('no boom "
          "here') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}<|im_start|>assistant\n")


@pytest.mark.slow
def test_a_line_the_chat_template_refuses_fails_alone(models_home, smollm_path, tmp_path):
    from gguf_patch import set_value
    path = set_value(smollm_path, tmp_path / "boom.gguf", "tokenizer.chat_template", CHATML)
    args = ["map", str(path), "Name a fruit that is {}.", "--temp", "0", "-n", "4", "--offline"]
    result = run_cli(*args, input="red\nboom\nblue\n")
    assert result.returncode == 1, result.stderr
    out = result.stdout.split("\n")
    assert len(out) == 4 and out[1] == "" and out[0] and out[2], out
    assert "line 2: the model's chat template failed: no boom here" in result.stderr
    assert "1 of 3 lines failed" in result.stderr
    # A template that fails for every line fails the run once, before any line is answered.
    always = set_value(smollm_path, tmp_path / "never.gguf", "tokenizer.chat_template",
                       "{{ raise_exception('not this one') }}")
    result = run_cli("map", str(always), *args[2:], input="red\nblue\n")
    assert result.returncode == 1 and result.stdout == ""
    assert [line for line in result.stderr.splitlines() if "not this one" in line] == \
        [line for line in result.stderr.splitlines() if line.startswith("localinfer: ")]
    assert result.stderr.count("localinfer: error:") == 1, result.stderr


@pytest.mark.slow
def test_a_bad_line_ends_the_input_after_the_lines_before_it_are_answered(models_home):
    args = [sys.executable, "-m", "localinfer", "map", "smollm2", "Name a fruit that is {}.",
            "--temp", "0", "-n", "4", "--offline"]
    env = {**os.environ, "LOCALINFER_HOME": str(models_home), "NO_COLOR": "1"}
    result = subprocess.run(args, input=b"red\nblue\n\xff\nnever\n", capture_output=True, env=env,
                            timeout=300)
    assert result.returncode == 2
    assert result.stdout.decode().count("\n") == 2 and all(result.stdout.decode().split("\n")[:2])
    assert result.stderr.decode().splitlines() == [
        "localinfer: error: stdin is not UTF-8 text (invalid byte at offset 9, line 3); pipe text, "
        "or convert it first, e.g. with `iconv -f latin1 -t utf-8`"]
    # A bad first line is refused before the model is even looked up.
    unknown = [a if a != "smollm2" else "no-such-model" for a in args]
    first = subprocess.run(unknown, input=b"\xffred\n", capture_output=True, env=env, timeout=300)
    assert first.returncode == 2 and first.stdout == b""
    assert first.stderr.decode().startswith("localinfer: error: stdin is not UTF-8 text")
