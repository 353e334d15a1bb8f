"""A prompt's own log-probabilities (engine/echo.py) through serve's worker (server/worker.py's
`between`), on the real model in-process: the figures a decode step gives, while other requests
decode beside them unchanged, and in cells the pool makes room for."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial

import pytest
from helpers import log_probs

from localinfer.backends import LoadOptions
from localinfer.engine.decode import Limits
from localinfer.engine.echo import prompt_logprobs
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.engine.scheduler import Job
from localinfer.server.worker import Between, Worker

GREEDY = SamplingParams(temperature=0)
CLOSE = 1e-4


@pytest.fixture(scope="module")
def batch(smollm_path):
    from localinfer.backends.llama.batched import SequenceBatch
    batch = SequenceBatch(smollm_path, LoadOptions(n_ctx=512), 3)     # two slots and the prefix's
    yield batch
    batch.close()


@pytest.fixture(scope="module")
def single(smollm_path):
    from helpers import load_file
    loaded = load_file(smollm_path, LoadOptions(n_ctx=512))
    yield loaded.session
    loaded.session.close()


def _scored(worker: Worker, tokens: list[int], top: int = 2) -> Future:
    future: Future = Future()
    work = partial(lambda b, seq: prompt_logprobs(b, seq, tokens, top))
    assert worker.between(Between(len(tokens), work, future))
    return future


def _run(worker: Worker, prompt: list[int], n: int) -> Job:
    job = Job(prompt, make_sampler(GREEDY), Limits(n, logprobs=0))
    done: Future = Future()
    assert worker.submit(job, done.set_result)
    return done.result(timeout=120)


def test_scores_while_a_request_decodes_leave_it_as_it_was_alone(batch, single):
    words = single.tokenize("A river runs to the sea, and the sea " * 12, special=False)
    story = single.tokenize("Once upon a time, in a small village,", special=False)
    worker = Worker(batch, capacity=8)
    try:
        alone = _run(worker, story, 40)
        job = Job(story, make_sampler(GREEDY), Limits(40, logprobs=0))
        done: Future = Future()
        assert worker.submit(job, done.set_result)
        scores = [_scored(worker, words) for _ in range(3)]
        beside = done.result(timeout=120)
        figures = [f.result(timeout=120) for f in scores]
    finally:
        worker.stop()
    assert beside.tokens == alone.tokens
    assert [s.logprob for s in beside.logprobs] == [s.logprob for s in alone.logprobs]
    rows = log_probs(single, words)
    for scored in figures:
        assert scored[0] is None and len(scored) == len(words)
        for i in range(1, len(words)):
            assert abs(scored[i].logprob - rows[i - 1][words[i]]) < CLOSE
            assert scored[i].top[0][0] == int(rows[i - 1].argmax())


def test_scores_take_the_cells_free_slots_keep(batch, single):
    """A finished request's cells stay as its slot's (a cache); a prompt that needs them gets
    them, and is scored as on an empty pool."""
    worker = Worker(batch, capacity=8)
    long_words = single.tokenize("one two three four five six seven " * 40, special=False)[:300]
    words = single.tokenize("The quick brown fox jumps over the lazy dog. " * 20,
                            special=False)[:250]
    try:
        _run(worker, long_words, 8)         # about 300 of the 512 cells kept by its slot
        scored = _scored(worker, words).result(timeout=120)
    finally:
        worker.stop()
    rows = log_probs(single, words)
    assert max(abs(scored[i].logprob - rows[i - 1][words[i]]) for i in range(1, len(words))) \
        < CLOSE



def test_a_large_vocabulary_is_scored_a_few_rows_at_a_time_as_well(gemma_path):
    """Gemma 3's 262,144-token rows: 16 per decode (echo.LOGITS_BYTES), the same figures."""
    from helpers import load_file
    from localinfer.backends.llama.batched import SequenceBatch
    from localinfer.engine import echo
    batch = SequenceBatch(gemma_path, LoadOptions(n_ctx=256), 2)
    single = load_file(gemma_path, LoadOptions(n_ctx=256)).session
    try:
        assert echo.LOGITS_BYTES // (4 * batch.session.n_vocab) == 16
        words = single.tokenize("Rain falls on the hills and runs down to the river. " * 4,
                                special=False)
        scored = prompt_logprobs(batch, 1, words, 3)
        rows = log_probs(single, words)
    finally:
        batch.close()
        single.close()
    assert len(words) > 40 and len(scored) == len(words)
    assert max(abs(scored[i].logprob - rows[i - 1][words[i]]) for i in range(1, len(words))) \
        < CLOSE
