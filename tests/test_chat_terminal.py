"""`chat` as a user meets it: /help, messages of several lines (a line ending in `\\`, a `\"\"\"`
block), a marker when a limit cut the answer, and keys typed during an answer kept out of it.

The terminal checks run the real CLI on a pty (pexpect); the piped ones check that the same
syntax holds without prompts and that stdout carries only the answers.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pexpect
import pytest
from helpers import run_cli
from terminal import spawn

from localinfer.engine.prompt import chat_tokens, messages_for

GREEDY = ("--temp", "0", "--offline")
TEXT = "Name three\ncolours."          # the message each multi-line form below must deliver
LONG = "Write a long story about a dragon who learns to bake bread."
STORY = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father "
         "had done, and lit the lamp before the fishing boats came home across the bay. ")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One LOCALINFER_HOME for the module: its chat history and prompt cache are the tests' own."""
    return tmp_path_factory.mktemp("chat") / "home"


@pytest.fixture(scope="module")
def smollm(smollm_path):
    from localinfer.backends.llama.vocab import LlamaVocab
    vocab = LlamaVocab(smollm_path)
    yield vocab
    vocab.close()


def _prompt_counts(stderr: str) -> list[int]:
    """The prompt tokens of each reply, from the -v lines."""
    return [int(n) for n in re.findall(r"prompt:? (\d+) tokens", stderr)]


def _one_turn_count(vocab, text: str) -> int:
    return len(chat_tokens(vocab, messages_for(text, None)))


def _counts_tell_apart(vocab) -> int:
    """TEXT's prompt count, checked to differ from what each plausible misreading would send: the
    test below then proves that the message arrived as TEXT."""
    expected = _one_turn_count(vocab, TEXT)
    for wrong in ("Name three\\\ncolours.", "Name threecolours.", '"""\nName three\ncolours.',
                  '"""Name three\ncolours."""', "Name three", "colours."):
        assert _one_turn_count(vocab, wrong) != expected, wrong
    return expected


# -- piped: the same syntax, no prompts, stdout only the answers ---------------------------------

def test_help_is_one_block_on_stderr_and_stdout_stays_empty(smollm_path, home):
    result = run_cli("chat", str(smollm_path), *GREEDY, "-n", "4",
                     input="/help\n/?\n/nope\n/exit\n", home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    for shown in ("/help, /?", "/clear", "/system TEXT", "/exit, /bye, /quit", "a line ending in \\",
                  '""" ... """', "Ctrl-C"):
        assert result.stderr.count(shown) == 2, (shown, result.stderr)
    assert "unknown command /nope; /help lists the commands" in result.stderr
    assert "unknown command /help" not in result.stderr and "unknown command /?" not in result.stderr


def test_piped_messages_of_several_lines_reach_the_model_whole(smollm_path, smollm, home):
    expected = _counts_tell_apart(smollm)
    forms = ["Name three\\\ncolours.\n",            # a backslash continues the line
             '"""\nName three\ncolours.\n"""\n',    # quotes alone open and close a block
             '"""Name three\ncolours."""\n',        # text after the opening, before the closing
             '"""Name three\ncolours."""  \n']      # spaces after the closing quotes
    script = "/clear\n".join(forms) + '"""/exit"""\n/exit\n'   # a block is never a command
    result = run_cli("chat", str(smollm_path), *GREEDY, "-n", "1", "-v", input=script, home=home)
    assert result.returncode == 0, result.stderr
    counts = _prompt_counts(result.stderr)
    assert counts[:4] == [expected] * 4, result.stderr
    # '"""/exit"""' was a message (a fifth turn, after the fourth one's answer), then /exit left.
    assert len(counts) == 5 and counts[4] > expected, result.stderr
    assert ">>>" not in result.stderr + result.stdout and "..." not in result.stderr


def test_piped_input_that_ends_inside_a_block_ends_the_chat_cleanly(smollm_path, home):
    result = run_cli("chat", str(smollm_path), *GREEDY, "-n", "4", "-v",
                     input='Hi\n"""\nnever\nclosed\n', home=home)
    assert result.returncode == 0, result.stderr
    assert len(_prompt_counts(result.stderr)) == 1, result.stderr     # "Hi" only
    assert "the input ended inside a message of several lines; it was not sent" in result.stderr
    assert "error" not in result.stderr and "Traceback" not in result.stderr


def test_an_answer_cut_by_a_limit_is_marked_on_stderr(smollm_path, home):
    script = f"{LONG}\n/clear\nSay yes.\n"
    result = run_cli("chat", str(smollm_path), *GREEDY, "-n", "12", "-v", input=script,
                     home=home)
    assert result.returncode == 0, result.stderr
    assert "[answer cut at -n 12 tokens]" in result.stderr
    # One marker per reply that ended at -n, none for one that ended by itself.
    assert result.stderr.count("[answer cut") == result.stderr.count("(length)") >= 1
    assert "cut" not in result.stdout and "[" not in result.stdout
    # A full context cuts too (--ctx fixes it: it cannot grow); a long prompt leaves it little.
    story = "Go on with this story. " + STORY * 4
    full = run_cli("chat", str(smollm_path), *GREEDY, "--ctx", "256", "-v", input=story + "\n",
                   home=home)
    assert full.returncode == 0, full.stderr
    assert "(context)" in full.stderr, full.stderr
    assert "[answer cut: the context of 256 tokens is full]" in full.stderr
    assert "[answer cut" not in full.stdout


# -- on a terminal ---------------------------------------------------------------------------------

def _chat(smollm_path: Path, home: Path, *args: str) -> pexpect.spawn:
    child = spawn("chat", str(smollm_path), *GREEDY, "-v", *args, home=home,
                  env={"NO_COLOR": "1"}, timeout=180)
    child.expect_exact(">>> ")
    return child


def test_multiline_input_on_a_terminal(smollm_path, smollm, home):
    expected = _counts_tell_apart(smollm)
    child = _chat(smollm_path, home, "-n", "1")
    child.sendline("Name three\\")
    child.expect_exact("... ")              # the continuation prompt
    child.sendline("colours.")
    child.expect(r"prompt:? (\d+) tokens")
    assert int(child.match.group(1)) == expected
    child.expect_exact(">>> ")
    child.sendline("/help")
    child.expect_exact("several lines")
    child.expect_exact(">>> ")
    # Ctrl-C inside a block drops that message, not the chat.
    child.sendline('"""')
    child.expect_exact("... ")
    child.sendline("dropped")
    child.expect_exact("... ")
    child.sendintr()
    child.expect_exact(">>> ")
    child.sendline("/clear")
    child.expect_exact(">>> ")
    child.sendline('"""Name three')
    child.expect_exact("... ")
    child.sendline('colours."""')
    child.expect(r"prompt:? (\d+) tokens")
    assert int(child.match.group(1)) == expected      # "dropped" never reached the model
    child.expect_exact(">>> ")
    # Ctrl-D inside a block ends the chat cleanly.
    child.sendline('"""')
    child.expect_exact("... ")
    child.sendeof()
    child.expect_exact("it was not sent")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    # The history holds each line as typed: up-arrow recalls a message line by line.
    history = (home / "data" / "chat_history").read_text().splitlines()
    assert history[-9:] == ["Name three\\", "colours.", "/help", '"""', "dropped", "/clear",
                            '"""Name three', 'colours."""', '"""'], history


def test_keys_typed_during_an_answer_stay_out_of_it_and_start_the_next_line(smollm_path, home):
    child = _chat(smollm_path, home, "-n", "80")
    child.sendline(LONG)
    child.expect_exact("bread.")
    child.expect(r"\S{4}")                  # the answer is streaming
    child.send("next question")
    child.expect(r"\((length|stop)\)")
    answer_after_keys = child.before
    assert "next question" not in answer_after_keys
    assert len(answer_after_keys.split()) > 5, "the keys came after the answer had ended"
    # The next prompt starts with them, as if typed there; Enter sends them with the rest.
    child.expect_exact(">>> ")
    child.expect_exact("next question")
    child.sendline(" about dragons")
    child.expect(r"prompt:? \d+ tokens")
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = (home / "data" / "chat_history").read_text().splitlines()
    assert history[-2:] == ["next question about dragons", "/exit"], history


def test_ctrl_c_during_an_answer_gives_the_terminal_back_as_it_was(smollm_path, home):
    # A shell after the chat shows the terminal's settings: echo and line editing are back on.
    env = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1", "TERM": "xterm"}
    # `trap : INT`: the shell outlives the Ctrl-C meant for the chat (which gets the default
    # handling, as a trapped signal is reset in a child; ignoring it would be inherited).
    command = (f"trap : INT; {sys.executable} -m localinfer chat {smollm_path} --temp 0 "
               "--offline -n 300 -v; echo settings; stty -a")
    child = pexpect.spawn("sh", ["-c", command], env=env, encoding="utf-8", timeout=180,
                          dimensions=(50, 200))
    child.expect_exact(">>> ")
    child.sendline(LONG)
    child.expect_exact("bread.")
    child.expect(r"\S{4}")
    time.sleep(0.3)
    child.sendintr()
    child.expect_exact("(interrupted)")     # it came during the answer
    child.expect_exact(">>> ")
    child.sendline("/bye")
    child.expect_exact("settings")
    child.expect(pexpect.EOF)
    settings = child.before.split()
    child.close()
    assert child.exitstatus == 0
    assert "echo" in settings and "icanon" in settings, settings
