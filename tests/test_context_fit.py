"""Context sized to the request (issue 16, item 1): `--ctx 0` sizes the context to the prompt and
the reply's room, a prompt that does not fit is refused in one line or cut with `--truncate`, the
prompt cache keeps hitting across context sizes, and chat grows its context before it drops turns.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from localinfer.backends import LoadOptions
from localinfer.engine.decode import Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.prompt import (PromptText, most_tokens, prompt_tokens, reply_reserve,
                                      truncated)
from localinfer.errors import ContextOverflow
from localinfer.fit import memory, request, rules
from localinfer.measure import quality

QUESTION = "Summarize the text above in one sentence."


def _document(n_chars: int) -> str:
    text = quality.default_text()
    return (text * (1 + n_chars // len(text)))[:n_chars]


@pytest.mark.parametrize("n_prompt, reply, trained, expected", [
    (30, 1024, 8192, 4096),        # a short prompt: the default context, as before
    (4995, 1024, 8192, 6144),      # the prompt and the reply's room, in whole 256-cell pages
    (4995, 16, 8192, 5120),        # -n 16 leaves less room
    (7900, 1024, 8192, 8192),      # never past the trained context
    (30, 1024, 2048, 2048),        # a model trained for less than 4096 keeps its own
    (5000, 1024, 0, 6144),         # a file that does not say: no cap
])
def test_the_context_holds_the_prompt_and_the_reply(n_prompt, reply, trained, expected):
    assert request.sized_context(n_prompt, reply, trained) == expected


def test_the_reply_keeps_its_room_within_a_fixed_context():
    assert reply_reserve(8192, -1) == 1024       # REPLY_TOKENS
    assert reply_reserve(2048, -1) == 512        # a quarter at most
    assert reply_reserve(8192, 16) == 16
    assert reply_reserve(512, 4000) == 256       # half at most


SMALL = memory.ModelFacts(
    architecture="llama", file_size=100_000_000, n_layer=30, n_embd=576, n_ff=1536,
    n_vocab=49_152, kv_dims=(3 * 128,) * 30, swa_layers=(False,) * 30, sliding_window=0,
    repackable_bytes=0, context_length=32768)


def test_the_budget_never_shortens_the_context_below_the_prompt():
    machine = rules.Machine(8 * 10**9, 8 * 10**9, repacks=False)
    fits_6000 = memory.estimate(SMALL, memory.Request(6000, kv_type="q8_0", repack=False))
    budget = rules.Budget(fits_6000.required, 0, "--memory")
    placed = rules.place(SMALL, machine, budget, n_ctx=16384, min_ctx=5000)
    assert placed.fits and 5000 <= placed.n_ctx < 16384
    assert any("context shortened" in note for note in placed.notes)
    tight = rules.Budget(fits_6000.required // 2, 0, "--memory")
    refused = rules.place(SMALL, machine, tight, n_ctx=16384, min_ctx=5000)
    assert not refused.fits and refused.n_ctx == 5000       # the shortest try is the prompt's
    # Without a prompt the old rule stands: halve down to 512.
    assert rules.place(SMALL, machine, tight, n_ctx=16384).n_ctx < 5000


def test_a_fit_on_a_likely_bound_is_checked_against_the_count():
    from localinfer.fit import auto
    resolved = auto.Resolved(None, 4096, "f16", ())
    likely = request.Sized(resolved, PromptText("x"), trained=8192, counted=False)
    assert request.holds(likely, 3000, ctx=0, reply=1024)
    assert not request.holds(likely, 3200, ctx=0, reply=1024)      # wants 4,352
    assert request.holds(likely, 4000, ctx=4096, reply=1024)       # a fixed context: the prompt
    assert not request.holds(likely, 4100, ctx=4096, reply=1024)
    assert request.holds(replace(likely, counted=True), 9999, ctx=0, reply=1024)


# -- with the models' own vocabularies ---------------------------------------------------------------
@pytest.fixture(scope="module", params=["smollm", "gemma"])
def vocab(request, smollm_path, gemma_path):
    from localinfer.backends.llama.vocab import LlamaVocab
    v = LlamaVocab(smollm_path if request.param == "smollm" else gemma_path)
    yield v
    v.close()


def test_the_bound_known_without_the_vocabulary_holds(vocab):
    for text in ("Hi", "naïve café, 日本語, 🙂🙂", _document(3000), "<|im_start|>user\n\n<bos>"):
        for prompt in (PromptText(text), PromptText(text, system="Be brief."),
                       PromptText(text, raw=True)):
            bound = most_tokens(prompt, vocab.chat_template)
            assert bound is not None and bound >= len(prompt_tokens(vocab, prompt)), (text, prompt)


def test_truncate_keeps_the_question_and_the_end_of_the_piped_input(vocab):
    doc = _document(20_000)
    prompt = PromptText(f"{doc}\n\n{QUESTION}", cuttable=len(doc), system="Be brief.")
    short, tokens = truncated(vocab, prompt, 1000)
    assert 990 <= len(tokens) <= 1000
    assert tokens == prompt_tokens(vocab, short)
    assert short.text.endswith(f"\n\n{QUESTION}") and short.system == "Be brief."
    kept = short.text[:short.cuttable]
    assert len(kept) < len(doc) and doc.endswith(kept)     # the end of the input, nothing else
    # Nothing to cut, or not enough: refused, never cut into the question.
    with pytest.raises(ContextOverflow):
        truncated(vocab, replace(prompt, cuttable=0), 1000)
    with pytest.raises(ContextOverflow):
        truncated(vocab, PromptText(f"a b c\n\n{QUESTION * 100}", cuttable=5), 100)


# -- chat grows before it drops ------------------------------------------------------------------------
class ChatVocab:
    """One token per byte (id = byte + 1; 0 ends generation) and a plain chat template."""

    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    bos_token, eos_token, add_bos = None, 0, False
    n_vocab = 257

    def __init__(self, n_ctx: int) -> None:
        self.n_ctx, self.n_past = n_ctx, 0

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return [b + 1 for b in text.encode()]

    def token_text(self, token: int) -> str:
        return "" if token == 0 else bytes([token - 1]).decode("latin-1")

    def piece(self, token: int) -> bytes:
        return b"" if token == 0 else bytes([token - 1])

    def reset(self) -> None:
        self.n_past = 0

    def eval(self, tokens, *, logits="last"):
        return np.zeros(self.n_vocab, np.float32)


def _loaded(n_ctx: int) -> LoadedModel:
    return LoadedModel(None, Path("model.gguf"), ChatVocab(n_ctx), "fake", "", 0.0)


@pytest.mark.parametrize("can_grow", [True, False])
def test_chat_grows_its_context_before_it_drops_old_turns(can_grow):
    from localinfer.cli import chat
    asked = []

    def grow(loaded, need):
        asked.append(need)
        return _loaded(4096) if can_grow else None

    first = _loaded(256)
    messages = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y" * 100},
                {"role": "user", "content": "z" * 100}]
    state = chat._Chat(first, KVCache(first.session), use_cache=False, grow=grow, system=None,
                       messages=messages)
    tokens = chat._fitted_tokens(state, Limits(max_tokens=40))
    assert asked and asked[0] > 256
    if can_grow:
        assert state.loaded.session.n_ctx == 4096 and len(messages) == 3
        assert state.cache.session is state.loaded.session
    else:
        assert state.loaded is first and len(messages) == 1    # the oldest exchange went
    assert len(tokens) <= state.loaded.session.n_ctx - 40


def test_a_chat_context_grows_by_doubling_up_to_the_trained_context(smollm_path):
    grown = request.grown(smollm_path, n_ctx=4096, need=4500, kv_type=None, memory_budget=None,
                          gpu_layers=None)
    assert grown is not None and grown.fits and grown.n_ctx == 8192
    assert request.grown(smollm_path, n_ctx=8192, need=9000, kv_type=None, memory_budget=None,
                         gpu_layers=None) is None


# -- the real command line on SmolLM2 (trained for 8,192 tokens) and Gemma 3 ----------------------
@pytest.fixture(scope="module")
def documents(tmp_path_factory, smollm_path) -> dict[int, str]:
    """Piped documents of about 2,000 and 10,000 SmolLM2 tokens."""
    from localinfer.backends.llama.vocab import LlamaVocab
    v = LlamaVocab(smollm_path)
    try:
        text = _document(60_000)
        tokens = v.tokenize(text, special=False)
        return {n: v.detokenize(tokens[:n]).decode("utf-8", "ignore") for n in (2000, 10000)}
    finally:
        v.close()


def _n_ctx(stderr: str) -> int:
    """The context llama.cpp made, from its own log (-vv lets it through)."""
    line = next(line for line in stderr.splitlines() if line.startswith("llama_context: n_ctx "))
    return int(line.split("=")[1])


@pytest.fixture(scope="module")
def gemma_document(gemma_path) -> str:
    """A piped document of about 4,200 Gemma 3 tokens."""
    from localinfer.backends.llama.vocab import LlamaVocab
    v = LlamaVocab(gemma_path)
    try:
        return v.detokenize(v.tokenize(_document(60_000), special=False)[:4200]).decode(
            "utf-8", "ignore")
    finally:
        v.close()


@pytest.mark.slow
def test_a_long_piped_document_gets_the_context_it_needs(gemma_path, gemma_document, tmp_path):
    # On Gemma 3, whose sliding-window layers and repacked weights prefill this document much
    # faster than SmolLM2's, and whose cache restores it from a checkpoint.
    args = ("run", str(gemma_path), "--temp", "0", "--draft", "none", "-vv")
    # Past the default 4,096 cells, by as little as keeps the prefill short on one CPU.
    first = run_cli(*args, QUESTION, "-n", "16", input=gemma_document, home=tmp_path,
                    timeout=3600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.strip()
    assert _n_ctx(first.stderr) == 4352                  # ~4,210 tokens and 16 for the reply
    assert "prompt cache: saved" in first.stderr
    # A longer question on the same document, and the default reply's room: another context
    # size, and still the cached document.
    second = run_cli(*args, "Which animals appear in the text above, and what do they do?",
                     "-n", "200", input=gemma_document, home=tmp_path, timeout=3600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert _n_ctx(second.stderr) != _n_ctx(first.stderr)
    assert "prompt cache: hit" in second.stderr


@pytest.mark.slow
def test_a_document_longer_than_the_trained_context_is_refused(smollm_path, documents, tmp_path):
    refused = run_cli("run", str(smollm_path), QUESTION, input=documents[10000], home=tmp_path)
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "8,192" in lines[0] and "--truncate" in lines[0], refused.stderr
    assert refused.stdout == ""


def _dropped(stderr: str) -> int:
    note = next(line for line in stderr.splitlines() if "--truncate: dropped" in line)
    return int(note.split("dropped the first ")[1].split(" ")[0].replace(",", ""))


@pytest.mark.slow
def test_truncate_keeps_the_question_and_the_end_of_the_input(smollm_path, documents, tmp_path):
    # A fixed --ctx takes the same cut as the trained context (below), at a sixteenth of the
    # prefill.
    cut = run_cli("run", str(smollm_path), QUESTION, "--ctx", "512", "--truncate", "-n", "16",
                  "--temp", "0", "--draft", "none", input=documents[2000], home=tmp_path,
                  timeout=3600)
    assert cut.returncode == 0, cut.stderr[-2000:]
    assert cut.stdout.strip()
    assert 1512 <= _dropped(cut.stderr) <= 1612      # ~2,030 tokens into 512 - 16


@pytest.mark.exhaustive
def test_truncate_to_the_trained_context(smollm_path, documents, tmp_path):
    """An 8,192-token prefill: minutes on 2 cores with the row-by-row attention kernel."""
    cut = run_cli("run", str(smollm_path), QUESTION, "--truncate", "-n", "16", "--temp", "0",
                  "--draft", "none", input=documents[10000], home=tmp_path, timeout=3600)
    assert cut.returncode == 0, cut.stderr[-2000:]
    assert cut.stdout.strip()
    assert 1800 <= _dropped(cut.stderr) <= 2200      # ~10,050 tokens into 8,192 - 16


def test_a_dense_prompt_that_looked_short_is_counted_after_loading(smollm_path, tmp_path):
    # Digits take a token each: 1,800 bytes look like ~600 tokens but are ~1,800, more than
    # --ctx 1024 holds. The loaded model counts them, and the refusal is the counted one.
    digits = "3.14159 2.71828 " * 112
    result = run_cli("run", str(smollm_path), digits, "--raw", "--ctx", "1024", "-n", "4",
                     home=tmp_path)
    assert result.returncode == 1
    assert "but --ctx 1024 holds 1,024" in result.stderr, result.stderr


@pytest.mark.slow
def test_a_dense_prompt_gets_a_larger_context_after_loading(gemma_path, tmp_path):
    # ~1,200 bytes look like ~400 tokens, and with room for a 3,300-token reply like a fit in the
    # default 4,096; counted, they are ~1,200 tokens, which with the reply's room need more. The
    # reply itself ends at its first space or newline. On Gemma 3, which also spends a token on
    # each digit, and prefills faster than SmolLM2 (repacked weights).
    digits = "3.14159 2.71828 " * 75
    result = run_cli("run", str(gemma_path), digits, "--raw", "-n", "3300", "--stop", " ",
                     "--stop", "\n", "--temp", "0", "--draft", "none", "-vv", home=tmp_path,
                     timeout=3600)
    assert result.returncode == 0, result.stderr[-2000:]
    contexts = [int(line.split("=")[1]) for line in result.stderr.splitlines()
                if line.startswith("llama_context: n_ctx ")]
    assert contexts[0] == 4096 and contexts[-1] > 4096       # loaded again, larger


def test_a_context_past_any_model_is_a_usage_error(smollm_path, tmp_path):
    result = run_cli("run", str(smollm_path), "hi", "--ctx", "999999999", home=tmp_path)
    assert result.returncode == 2 and "--ctx" in result.stderr
