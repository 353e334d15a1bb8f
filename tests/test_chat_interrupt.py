"""Ctrl-C during a reply: the KV cache and the bookkeeping over it never come apart, and `chat`
keeps the interrupted answer and goes on.

Python runs a SIGINT handler when the C call it arrived during is back, so a Ctrl-C pressed while
llama.cpp decodes raises KeyboardInterrupt right after `llama_decode` returns, its cells written.
The unit tests make that happen deterministically by raising as the real C function returns; the
pty test presses Ctrl-C in a real `chat` at several moments.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import termios
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from localinfer.backends import LoadOptions
from localinfer.backends.llama.engine import engine
from localinfer.backends.llama.session import LlamaCppSession
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.speculate.drafters import DraftModel, PromptLookup
from localinfer.speculate.verify import SpeculativeGeneration

TEXT = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father "
        "had done, and lit the lamp before the fishing boats came home across the bay. ")
GREEDY = SamplingParams(temperature=0)
CODE = ("Add type hints to this function:\n\n"
        "def total(items, tax):\n    result = 0\n    for item in items:\n"
        "        result += item.price * item.count\n    return result * (1 + tax)\n")


@pytest.fixture(scope="module")
def sessions(smollm_path):
    """A session the tests interrupt, and a fresh one that computes what the answer should be."""
    pair = [LlamaCppSession(smollm_path, LoadOptions(n_ctx=1024, n_threads=2)) for _ in range(2)]
    yield pair
    for session in pair:
        session.close()


@pytest.fixture
def session(sessions):
    sessions[0].reset()
    return sessions[0]


def _cells(session) -> int:
    """How many positions sequence 0 holds in llama.cpp's KV cache, asked of llama.cpp itself."""
    return engine().llama_memory_seq_pos_max(session._mem, 0) + 1


def _interrupt(monkeypatch, name: str, *, on_call: int = 1) -> None:
    """Let llama.cpp's `name` run, and on its `on_call`-th call raise KeyboardInterrupt as it
    returns, as a Ctrl-C that arrived during the call does."""
    lib = engine()
    real, calls = getattr(lib, name), [0]

    def interrupted(*args):
        result = real(*args)
        calls[0] += 1
        if calls[0] == on_call:
            monkeypatch.setattr(lib, name, real)
            raise KeyboardInterrupt
        return result
    monkeypatch.setattr(lib, name, interrupted)


def _tokens(session, text: str = TEXT * 8) -> list[int]:
    return session.tokenize(text, special=False)


def _assert_continues_like_a_fresh_session(cache: KVCache, prompt: list[int], fresh) -> None:
    """A prefill of `prompt` after the interrupt gives the logits a cold evaluation gives."""
    logits, _ = cache.prefill(prompt)
    assert cache.session.n_past == _cells(cache.session) == len(prompt) == len(cache.tokens)
    fresh.reset()
    expected = fresh.eval(prompt)
    np.testing.assert_allclose(logits, expected, atol=2e-2)
    assert logits.argmax() == expected.argmax()


# -- the session: n_past counts what the KV cache holds, whenever the interrupt lands -------------

@pytest.mark.parametrize("chunked", [False, True], ids=["one-batch", "several-batches"])
def test_an_interrupt_as_a_decode_returns_leaves_n_past_counting_its_cells(session, monkeypatch,
                                                                            chunked):
    tokens = _tokens(session)
    session.eval(tokens[:10])
    # logits="all" evaluates in batches of 64 at most: 200 tokens make several.
    part = tokens[10:210] if chunked else tokens[10:11]
    _interrupt(monkeypatch, "llama_decode", on_call=2 if chunked else 1)
    with pytest.raises(KeyboardInterrupt):
        session.eval(part, logits="all")
    assert session.n_past == _cells(session) > 10
    session.eval(tokens[session.n_past:session.n_past + 1])     # the next position decodes
    assert session.n_past == _cells(session)


def test_an_interrupted_trim_leaves_n_past_counting_what_is_left(session, monkeypatch):
    session.eval(_tokens(session)[:40])
    _interrupt(monkeypatch, "llama_memory_seq_rm")
    with pytest.raises(KeyboardInterrupt):
        session.trim(25)
    assert session.n_past == _cells(session) == 25


def test_an_interrupted_reset_leaves_n_past_zero(session, monkeypatch):
    session.eval(_tokens(session)[:40])
    _interrupt(monkeypatch, "llama_memory_clear")
    with pytest.raises(KeyboardInterrupt):
        session.reset()
    assert session.n_past == _cells(session) == 0


def test_an_interrupted_restore_leaves_n_past_counting_the_restored_cells(session, monkeypatch):
    tokens = _tokens(session)
    session.eval(tokens[:30])
    blob = session.state()
    session.eval(tokens[30:50])
    _interrupt(monkeypatch, "llama_state_seq_set_data")
    with pytest.raises(KeyboardInterrupt):
        session.restore(blob, 30)
    assert session.n_past == _cells(session) == 30


# -- the decode loops: the next prompt after an interrupt is evaluated right ----------------------

@pytest.mark.parametrize("on_call", [1, 2, 6], ids=["prefill", "first-step", "later-step"])
def test_a_generation_interrupted_anywhere_lets_the_next_prompt_through(sessions, session,
                                                                        monkeypatch, on_call):
    cache = KVCache(session)
    prompt = _tokens(session, TEXT)
    generation = Generation(cache, prompt, make_sampler(GREEDY), Limits(max_tokens=40))
    _interrupt(monkeypatch, "llama_decode", on_call=on_call)
    emitted = []
    with pytest.raises(KeyboardInterrupt):
        for piece in generation:
            emitted.append(piece)
    # As chat does: the next prompt holds the reply as far as it went (every token emitted, the
    # last one never evaluated), then more.
    follow = prompt + generation.tokens + _tokens(session, " And then?")
    _assert_continues_like_a_fresh_session(cache, follow, sessions[1])


@pytest.mark.parametrize("name, on_call, draft", [
    ("llama_decode", 2, False), ("llama_memory_seq_rm", 1, False),
    ("llama_decode", 3, True), ("llama_decode", 4, True)],
    ids=["verify", "rollback", "draft-catch-up", "draft-step"])
def test_speculation_interrupted_in_verify_or_rollback_lets_the_next_prompt_through(
        sessions, session, smollm_path, monkeypatch, name, on_call, draft):
    cache = KVCache(session)
    # Prompt lookup drafts from the code, and most drafts are rejected part way through a
    # verification batch: rollbacks happen (5 in these 60 tokens). A draft model (the model
    # itself, on its own session) decodes and trims between the target's calls.
    prompt = _tokens(session, CODE)
    drafter = DraftModel(LlamaCppSession(smollm_path, LoadOptions(n_ctx=1024, n_threads=2))) \
        if draft else PromptLookup()
    generation = SpeculativeGeneration(cache, prompt, GREEDY, Limits(max_tokens=60), drafter,
                                       max_draft=6, chunk=4, adaptive=False)
    _interrupt(monkeypatch, name, on_call=on_call)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in generation:
                pass
        follow = prompt + generation.tokens + _tokens(session, " And then?")
        _assert_continues_like_a_fresh_session(cache, follow, sessions[1])
        if draft:    # the draft model follows the next sequence as the target does
            assert drafter.session.n_past == _cells(drafter.session)
            assert len(drafter.cache.tokens) <= drafter.session.n_past
            drafter.prepare(follow)
            assert drafter.cache.tokens == follow
            assert drafter.session.n_past == _cells(drafter.session) == len(follow)
    finally:
        drafter.close()


@dataclass
class _Entry:
    tokens: list[int]


class _OneEntryStore:
    """A prompt cache holding one saved state: which entry restores is up to the test."""

    def __init__(self, tokens: list[int], state: bytes) -> None:
        self.entry, self.state = _Entry(tokens), state

    def longest_prefix(self, tokens, *, limit, rigid_over=None, longest=None):
        shared = 0
        while shared < min(len(tokens), len(self.entry.tokens), limit) and \
                tokens[shared] == self.entry.tokens[shared]:
            shared += 1
        return (self.entry, shared) if shared else None

    def load(self, head):
        return self.state

    def drop(self, head):
        pass

    def save(self, tokens, state):
        return None


def test_a_prompt_cache_restore_interrupted_lets_the_next_prompt_through(sessions, session,
                                                                         monkeypatch):
    doc = _tokens(session, TEXT * 12)
    assert len(doc) > 300
    session.eval(doc[:256])
    store = _OneEntryStore(doc[:256], session.state())
    session.reset()
    cache = KVCache(session, store)
    other = _tokens(session, "A different start. " * 4) + doc[:100]
    cache.prefill(other)                            # the session holds a prompt unlike the entry
    _interrupt(monkeypatch, "llama_state_seq_set_data")
    with pytest.raises(KeyboardInterrupt):
        cache.prefill(doc)          # the entry shares more of it than the session holds
    _assert_continues_like_a_fresh_session(cache, other + _tokens(session, " Again."), sessions[1])


# -- chat through a terminal -----------------------------------------------------------------------

class _Terminal:
    """`localinfer chat` on a pseudo-terminal, as a user runs it: Ctrl-C is the byte 0x03, which
    the terminal turns into SIGINT for the chat's process group."""

    def __init__(self, args: list[str], home: Path) -> None:
        master, slave = os.openpty()
        env = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "localinfer", *args], stdin=slave,
                                     stdout=slave, stderr=slave, env=env,
                                     preexec_fn=_controlling_terminal)
        os.close(slave)
        self.master, self.output, self._lock = master, bytearray(), threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:      # the chat blocks once the terminal's buffer is full
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.output.extend(data)

    def text(self, start: int = 0) -> str:
        with self._lock:
            return self.output[start:].decode("utf-8", "replace")

    def mark(self) -> int:
        with self._lock:
            return len(self.output)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait_for(self, needle: str, start: int, timeout: float = 120) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if needle in self.text(start):
                return True
            time.sleep(0.02)
        return needle in self.text(start)

    def close(self) -> int | None:
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None
        finally:
            time.sleep(0.1)         # the last bytes reach the reader
            os.close(self.master)


def _controlling_terminal() -> None:
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _turns(stderr: str) -> list[tuple[int, int, str]]:
    """(prompt tokens, generated tokens, why it ended) of each reply, from the -v lines."""
    import re
    # "prompt: P tokens ...", then "reply: G tokens · ... (why)" on the next line of the block.
    return [(int(p), int(g), why) for p, g, why in
            re.findall(r"prompt:? (\d+) tokens.*?(\d+) tokens?[^\n(]*\((\w+)\)", stderr, re.S)]


def test_ctrl_c_during_answers_keeps_the_chat_going(smollm_path, tmp_path):
    term = _Terminal(["chat", str(smollm_path), "--temp", "0", "-n", "400", "--ctx", "4096", "-v"],
                     tmp_path / "home")
    try:
        assert term.wait_for(">>> ", 0, timeout=180), term.text()
        # Ctrl-C at several moments: as the line's echo ends, during prefill, at the first words,
        # and well into the answer. Not in the same write as the line: the terminal then drops
        # the unread rest of the line, and readline, in the middle of inserting what was typed
        # ahead, waits inside C for the next key before Python sees the signal; no hand types
        # that fast (the window between reading a line and the reply is tested in-process below).
        for delay in (0.0, 0.05, 0.3, 1.0, 2.0):
            start = term.mark()
            term.send(b"Write a long story about a dragon who learns to bake bread.\r")
            assert term.wait_for("bread.", start), term.text(start)
            time.sleep(delay)
            pressed = term.mark()
            term.send(b"\x03")
            assert term.wait_for(">>> ", pressed), term.text(start)
            assert term.proc.poll() is None, term.text(start)
        start = term.mark()
        term.send(b"What is the capital of France? Answer in one word.\r")
        assert term.wait_for("word.", start), term.text(start)
        assert term.wait_for(">>> ", term.mark()), term.text(start)
        assert "(stop)" in term.text(start) or "(length)" in term.text(start), term.text(start)
        term.send(b"/exit\r")
        assert term.close() == 0, term.text()
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    output = term.text()
    assert "localinfer: error" not in output and "Traceback" not in output, output
    # The lines typed are kept for the next chat, in a file only its owner reads.
    history = tmp_path / "home" / "data" / "chat_history"
    assert history.read_text().splitlines()[-2:] == [
        "What is the capital of France? Answer in one word.", "/exit"]
    assert history.stat().st_mode & 0o077 == 0
    turns = _turns(output)
    # A Ctrl-C pressed at once after the echo may come before the reply begins (the prompt is
    # still being rendered on a loaded machine): then there is no turn.
    assert len(turns) >= 4 and turns[-1][2] in ("stop", "length"), output
    assert sum(why == "interrupted" and n > 0 for _, n, why in turns) >= 2, turns
    # An interrupted answer stays in the conversation as far as it went: the next prompt holds it.
    for (prompt, generated, why), (next_prompt, _, _) in zip(turns, turns[1:]):
        if why == "interrupted" and generated:
            assert next_prompt >= prompt + generated, turns


def _chat_in_process(smollm_path, home: Path, lines: str, monkeypatch, capsys,
                     max_tokens: int = 8) -> tuple[int, str]:
    """`localinfer chat -v` in this process on piped `lines`: (exit code, stderr)."""
    import io

    from localinfer.cli.app import main
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    with pytest.raises(SystemExit) as end:
        main(["chat", str(smollm_path), "--temp", "0", "-n", str(max_tokens), "--ctx", "1024",
              "-v"])
    return end.value.code or 0, capsys.readouterr().err


@pytest.mark.parametrize("step", ["_dropped", "_fitted_tokens"],
                         ids=["before-the-message-joins", "after-it-joins"])
def test_a_ctrl_c_before_the_reply_begins_drops_that_message_and_the_chat_goes_on(
        smollm_path, tmp_path, monkeypatch, capsys, step):
    # Python raises KeyboardInterrupt wherever the main thread is when Ctrl-C comes: here in a
    # step between reading the line and the reply (the first message's imports take long enough
    # for a Ctrl-C pressed with Enter to land there).
    from localinfer.cli import chat
    real, calls = getattr(chat, step), []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args)
    second = "What is the capital of France?\n"
    alone_code, alone = _chat_in_process(smollm_path, tmp_path / "alone", second, monkeypatch,
                                         capsys)
    monkeypatch.setattr(chat, step, interrupted)
    code, err = _chat_in_process(smollm_path, tmp_path / "home", "Tell me a story.\n" + second,
                                 monkeypatch, capsys)
    assert (code, alone_code) == (0, 0), err
    # The dropped message is not in the conversation: the next prompt is the one it has alone.
    assert [t[0] for t in _turns(err)] == [t[0] for t in _turns(alone)] != [], (err, alone)


class _RaisesOnCollection:
    """An object whose __del__ is where a Ctrl-C lands: Python prints it as ignored."""

    def __del__(self):
        raise KeyboardInterrupt


def test_a_ctrl_c_that_lands_in_a_del_or_a_gc_callback_still_ends_the_reply(
        smollm_path, tmp_path, monkeypatch, capsys):
    from localinfer.cli.thinking import Output
    real, pieces = Output.feed, []

    def feed(self, piece):
        pieces.append(piece)
        if len(pieces) == 3:
            _RaisesOnCollection()       # made and collected at once, mid-reply
        return real(self, piece)
    monkeypatch.setattr(Output, "feed", feed)
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    code, err = _chat_in_process(smollm_path, tmp_path / "home",
                                 "Write a long story about a dragon.\nAnd then?\n", monkeypatch,
                                 capsys, max_tokens=200)
    turns = _turns(err)
    assert code == 0 and len(turns) == 2, err
    assert turns[0][2] == "interrupted" and turns[0][1] < 50, err
    assert "Exception ignored" not in err, err
