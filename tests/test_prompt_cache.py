"""The persistent prompt cache on the two real models: greedy output is the same token for token with
a cold cache, a warm exact hit and a warm prefix hit; bad entries are caught and recomputed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from localinfer.backends import LoadOptions
from localinfer.cache.prompt_cache import PromptCache
from localinfer.engine.batching import LAYOUT, restore_limit
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.sampling import SamplingParams, make_sampler

GREEDY = make_sampler(SamplingParams(temperature=0))
EXHAUSTIVE = pytest.mark.exhaustive


def _cases(*cases: tuple, exhaustive: tuple = ()) -> list:
    """(model, ...) cases of a test over the module's `session`: the repetitions `exhaustive` names
    run only under `-m exhaustive` (docs/testing.md lists them), each guarantee keeping one case
    on each model by default."""
    return [pytest.param(*case, marks=EXHAUSTIVE if case in exhaustive else ())
            for case in cases]
DOC = Path(__file__).resolve().parents[1] / "README.md"


def _text(n_chars: int) -> str:
    text = DOC.read_text(encoding="utf-8")
    return (text * (1 + n_chars // len(text)))[:n_chars]


@pytest.fixture(scope="module", params=["smollm", "gemma"])
def session(request, smollm_path, gemma_path):
    from localinfer.backends.llama.session import LlamaCppSession
    path = smollm_path if request.param == "smollm" else gemma_path
    s = LlamaCppSession(path, LoadOptions(n_ctx=2048))
    yield s
    s.close()


def _store(session, root: Path, **changes) -> PromptCache:
    identity = {**session.state_identity(), "batching": LAYOUT, **changes}
    return PromptCache(root, identity, label="test", cap_bytes=10 ** 9)


def _generate(session, store, prompt: list[int], n: int = 12) -> tuple[list[int], KVCache]:
    cache = KVCache(session, store)
    gen = Generation(cache, prompt, GREEDY, Limits(max_tokens=n, ignore_eos=True))
    list(gen)
    cache.persist()
    return gen.tokens, cache


def _prompts(session) -> tuple[list[int], list[int]]:
    # A crosses two n_batch boundaries; B shares its first 600 tokens, more than Gemma 3's
    # 512-token sliding window back from where A's state was saved.
    doc = session.tokenize(_text(6000), special=False)
    a = doc[:1100] + session.tokenize("\n\nQuestion: what is this about? Answer:", special=False)
    b = doc[:600] + session.tokenize("\n\nList three commands it describes:", special=False)
    return a, b


def test_cold_warm_exact_and_warm_prefix_give_identical_greedy_output(session, tmp_path):
    a, b = _prompts(session)
    store = _store(session, tmp_path)
    cold_a, cache = _generate(session, store, a)
    assert cache.last_event is not None and not cache.last_event.hit
    warm_a, cache = _generate(session, store, a)
    assert cache.last_event.hit
    assert cache.last_event.restored == restore_limit(len(a), session.sliding_window)
    assert warm_a == cold_a
    assert 512 <= _warm_equals_cold(session, store, b) <= 576


def _warm_equals_cold(session, store, prompt: list[int]) -> int:
    """Run `prompt` without the cache and then with it: the same tokens, from a hit; returns the
    number of tokens the hit restored."""
    cold, _ = _generate(session, None, prompt)
    warm, cache = _generate(session, store, prompt)
    assert cache.last_event.hit
    assert warm == cold
    return cache.last_event.restored


# exhaustive: SmolLM2's case takes Gemma 3's path (both prompts are under the window, so neither
# is rigid); Gemma 3's repacked Q4_K kernels, which group a batch's rows, are the likelier to part
# the smaller batch from the larger one.
@pytest.mark.parametrize("session", _cases(("smollm",), ("gemma",), exhaustive=(("smollm",),)),
                         indirect=True)
def test_prompts_within_one_batch_are_identical_cold_and_warm(session, tmp_path):
    # Shorter than n_batch and Gemma's window: a cold run is one batch, a warm one restores a state
    # made from a longer prompt, trims it back and evaluates the rest in a smaller batch.
    doc = session.tokenize(_text(3000), special=False)
    question = session.tokenize("\n\nSummary in one line:", special=False)
    longer, shorter = doc[:450] + question, doc[:300] + question
    store = _store(session, tmp_path)
    _generate(session, store, longer)
    for prompt in (shorter, longer):
        restored = _warm_equals_cold(session, store, prompt)
        assert restored == restore_limit(len(prompt), session.sliding_window)


def test_state_round_trip_restores_the_same_logits(session):
    a, _ = _prompts(session)
    session.reset()
    session.eval(a[:-1])
    blob = session.state()
    expected = session.eval(a[-1:]).copy()
    session.reset()
    session.restore(blob, len(a) - 1)
    got = session.eval(a[-1:])
    if session.sliding_window == 0:
        assert (got == expected).all()
    else:
        # The saved state leaves out cells outside Gemma's window, so llama.cpp's single-token
        # attention runs over fewer cells: close, not bit-identical (measured here: max logit
        # difference 1.003, KL 0.0097 nats). Judge the distribution, as the MLX agreement check does.
        assert got.argmax() == expected.argmax()
        assert _kl(expected, got) < 0.02
    # A sliding-window state lacks cells out of the window: it refuses to be trimmed far back.
    assert session.trim(100) == (session.sliding_window == 0)


@pytest.mark.parametrize("session, other_ctx", _cases(
    ("smollm", 1536), ("smollm", 4096), ("gemma", 4096), ("gemma", 1536),
    exhaustive=(("smollm", 1536), ("smollm", 4096), ("gemma", 1536))), indirect=["session"])
def test_a_state_restores_into_a_context_of_another_size(session, smollm_path, gemma_path,
                                                          other_ctx, tmp_path):
    """`--ctx 0` sizes each run's context to its prompt, so the prompt cache's key leaves the
    context size out: a state saved with one n_ctx must continue exactly in another."""
    from localinfer.backends.llama.session import LlamaCppSession
    path = smollm_path if session.sliding_window == 0 else gemma_path
    other = LlamaCppSession(path, LoadOptions(n_ctx=other_ctx))
    try:
        assert other.n_ctx != session.n_ctx
        assert _store(other, tmp_path).dir == _store(session, tmp_path).dir
        a, b = _prompts(session)
        store = _store(session, tmp_path)
        cold_here, _ = _generate(session, store, a)
        cold_there, _ = _generate(other, None, a)
        assert cold_there == cold_here          # the context's size changes no computed bit
        warm_there, cache = _generate(other, store, a)
        assert cache.last_event.hit
        assert cache.last_event.restored == restore_limit(len(a), session.sliding_window)
        assert warm_there == cold_here
        assert _warm_equals_cold(other, store, b) > 0
    finally:
        other.close()


@pytest.mark.parametrize("session", _cases(("smollm",), ("gemma",), exhaustive=(("smollm",),)),
                         indirect=True)
def test_an_entry_longer_than_the_context_is_passed_over_and_kept(session, smollm_path,
                                                                 gemma_path, tmp_path):
    from localinfer.backends.llama.session import LlamaCppSession
    a, _ = _prompts(session)
    store = _store(session, tmp_path)
    _generate(session, store, a)
    entries = {p: p.stat().st_size for p in store.dir.glob("*.kv")}
    small = LlamaCppSession(smollm_path if session.sliding_window == 0 else gemma_path,
                            LoadOptions(n_ctx=1024))
    try:
        prompt = a[:900]
        cold, _ = _generate(small, None, prompt)
        warm, cache = _generate(small, store, prompt)
        assert warm == cold
        assert "rejected" not in cache.last_event.note
    finally:
        small.close()
    # The entries of the whole prompt (longer than 1024 tokens) are still there.
    assert all(p.exists() for p in entries)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) in nats between the softmax distributions of two logit rows."""
    p, q = (np.exp(x - x.max()) for x in (p_logits.astype(np.float64), q_logits.astype(np.float64)))
    p, q = p / p.sum(), q / q.sum()
    return float((p * np.log(p / q)).sum())


def _longest_entry(store: PromptCache) -> Path:
    # Gemma 3 keeps an entry every 512 tokens too; the longest one is the one a rerun restores.
    return max(store.dir.glob("*.kv"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("session, damage", _cases(
    ("smollm", "flip"), ("smollm", "truncate"), ("smollm", "other_model"),
    ("gemma", "truncate"), ("gemma", "other_model"), ("gemma", "flip"),
    exhaustive=(("smollm", "truncate"), ("smollm", "other_model"), ("gemma", "flip"))),
    indirect=["session"])
def test_bad_entry_is_detected_dropped_and_recomputed(session, tmp_path, damage):
    a, _ = _prompts(session)
    if not session.sliding_window:
        # One entry per prompt here (Gemma 3's checkpoints every 512 tokens need the long one, to
        # fall back on an intact shorter one): a short prompt is checked alike, for a third of
        # the prefill.
        a = a[:300]
    if damage == "other_model":
        # The same prompt cached for another model file, copied where this model looks.
        other = _store(session, tmp_path, model_mtime_ns=1)
        _generate(session, other, a, n=1)
        store = _store(session, tmp_path)
        shutil.copytree(other.dir, store.dir)
        cold = _generate(session, None, a)[0]
    else:
        store = _store(session, tmp_path)
        cold = _generate(session, store, a)[0]
    path = _longest_entry(store)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        data[-1000] ^= 0xFF
        path.write_bytes(data)
    out, cache = _generate(session, store, a)
    # Nothing came from the damaged entry: a miss or, for Gemma, an intact shorter checkpoint.
    assert not cache.last_event.hit or \
        cache.last_event.restored < restore_limit(len(a), session.sliding_window)
    assert out == cold
    # The bad entry is gone and a good one took its place.
    out, cache = _generate(session, store, a)
    assert cache.last_event.hit and out == cold


def test_run_twice_hits_the_cache_and_prints_the_same(smollm_path, tmp_path):
    # About 150 tokens: past the 64 a kept entry needs (the long prompts run in-process above).
    prompt = _text(600)
    args = ("run", str(smollm_path), prompt, "--temp", "0", "-n", "16", "--draft", "none", "-v")
    cold = run_cli(*args, home=tmp_path)
    warm = run_cli(*args, home=tmp_path)
    off = run_cli(*args, "--no-cache", home=tmp_path)
    assert cold.returncode == warm.returncode == off.returncode == 0, cold.stderr
    assert cold.stdout == warm.stdout == off.stdout
    assert "prompt cache: miss" in cold.stderr and "prompt cache: saved" in cold.stderr
    assert "prompt cache: hit" in warm.stderr and "tokens restored in" in warm.stderr
    assert "prompt cache" not in off.stderr
    listing = run_cli("cache", "ls", home=tmp_path)
    assert smollm_path.name in listing.stdout
    assert run_cli("cache", "stats", home=tmp_path).stdout.startswith("1 entry ·")
    cleared = run_cli("cache", "clear", home=tmp_path)
    assert "removed 1 entry " in cleared.stderr
    assert run_cli("cache", "stats", home=tmp_path).stdout.startswith("0 entries")


def test_chat_drops_oldest_turns_when_the_context_is_full(smollm_path, tmp_path):
    script = "".join(f"Tell me fact number {i} about cats.\n" for i in range(6))
    result = run_cli("chat", str(smollm_path), "--temp", "0", "-n", "40", "--ctx", "256",
                     "-s", "Be brief.", input=script, home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dropped the 2 oldest messages (the system message stays)" in result.stderr
    assert "error" not in result.stderr
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 6
