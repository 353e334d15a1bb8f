"""gpt-oss's harmony on llama.cpp 0.3.36's own vocabulary handling, on a tiny random-weight gpt-oss
GGUF with harmony's control tokens and the published template: `<|end|>` does not end generation
(`<|return|>` does), the markers that render as no text are shown to the splitter, the template's
`reasoning_effort` follows --think, and a spent budget writes the close from the real tokens."""

from __future__ import annotations

import numpy as np
import pytest

from localinfer.backends import LoadOptions
from localinfer.engine.prompt import chat_tokens
from localinfer.thinking import setup
from localinfer.thinking.split import ANSWER, REASONING
from localinfer.thinking.style import Style, Think
from helpers import load_file
from tiny_gguf import write_tiny


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("oss") / "tiny-gpt-oss.gguf", "gpt-oss")
    loaded = load_file(path, LoadOptions(n_ctx=512))
    yield loaded.session
    loaded.session.close()


def _token(session, text: str) -> int:
    tokens = session.tokenize(text, special=True)
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def test_end_of_message_is_not_end_of_generation(oss):
    assert not oss.is_eog(_token(oss, "<|end|>"))
    assert oss.is_eog(_token(oss, "<|return|>"))


def test_the_prompt_gives_the_harmony_style_and_effort(oss):
    messages = [{"role": "user", "content": "hi"}]
    tokens = chat_tokens(oss, messages, setup.template_vars(oss.chat_template, "high"))
    style = setup.style_of(oss, tokens, raw=False)
    assert style == Style("harmony", header="assistant", switch="reasoning_effort")
    rendered = oss.detokenize(tokens).decode()
    assert "Reasoning: high" in rendered
    # Every marker the splitter reads reaches it as text: rendered by the engine (0.3.36 renders
    # these four for gpt-oss) or shown by the decode loop.
    shown = setup.shown_markers(oss, style)
    for marker in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>"):
        token = _token(oss, marker)
        assert (oss.piece(token) or shown.get(token)) == marker.encode()


def test_a_spent_budget_writes_the_close_from_real_tokens(oss):
    style = setup.style_of(oss, chat_tokens(oss, [{"role": "user", "content": "hi"}]), raw=False)
    gate = setup.gate_for(oss, style, Think(budget=2), None)
    for token in oss.tokenize("<|channel|>analysis<|message|>", special=True):
        gate.accept(token)
    trace = oss.tokenize("ab", special=False)[:2]
    for token in trace:
        gate.accept(token)
    assert gate.cut.kind == REASONING
    close = oss.tokenize(style.close_text, special=True)
    every = np.arange(oss.n_vocab)
    for token in close:                         # only the closing marker is allowed, in order
        allowed = gate.allows(every)
        assert allowed.sum() == 1 and allowed[token]
        gate.accept(token)
    assert gate.cut.phase == "body" and gate.cut.kind == ANSWER


def test_an_answer_grammar_starts_after_the_final_header(oss):
    """The header's `<|message|>` opens the answer but is not fed to the answer's grammar
    (which would refuse it: llama.cpp aborts the process on a refused token)."""
    style = setup.style_of(oss, chat_tokens(oss, [{"role": "user", "content": "hi"}]), raw=False)
    gate = setup.gate_for(oss, style, Think(), oss.grammar('root ::= "{" [a-z]* "}"'))
    for text in ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant",
                 "<|channel|>final<|message|>", "{ab}"):
        for token in oss.tokenize(text, special=True):
            assert gate.allows(np.array([token]))[0], (text, token)
            gate.accept(token)
    assert not gate.allows(np.array(oss.tokenize("x", special=False)))[0]
