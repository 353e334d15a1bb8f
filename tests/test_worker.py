"""serve's worker (server/worker.py) on the real model: an interactive request being prepared holds
the steps of batch jobs, for as long as it takes to arrive and never longer than HOLD_SECONDS.

Nothing here depends on how fast this machine decodes: a hold is seen as a count of tokens that
stops moving (the step under way when it began may still add one), progress as a count that
moves within a generous timeout."""

from __future__ import annotations

import time

from localinfer.backends import LoadOptions
from localinfer.backends.llama.batched import SequenceBatch
from localinfer.engine.decode import Limits
from localinfer.engine.prompt import chat_tokens, messages_for
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.engine.scheduler import Job
from localinfer.server import worker as worker_module
from localinfer.server.worker import Worker

GREEDY = SamplingParams(temperature=0)
LONG_HOLD = 30.0        # while a test watches a hold, it does not run out
STILL = 0.3             # a count unchanged this long, twice: no step is being taken


def _until(condition, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _moves(job: Job) -> None:
    """The job gains two tokens (within a minute, however loaded the machine)."""
    start = len(job.tokens)
    _until(lambda: len(job.tokens) >= start + 2 or job.stats.finish_reason)
    assert len(job.tokens) >= start + 2


def _held(job: Job) -> None:
    """The job's count stops (after the step under way) and stays put."""
    before = -1
    while before != len(job.tokens):
        before = len(job.tokens)
        time.sleep(STILL)
    time.sleep(STILL)
    assert len(job.tokens) == before


def _setup(smollm_path):
    batch = SequenceBatch(smollm_path, LoadOptions(n_ctx=512 * 4), 4)
    prompt = chat_tokens(batch.session, messages_for("Tell me a long story.", None))
    return batch, Worker(batch, capacity=8), prompt


def test_batch_steps_wait_for_an_expected_interactive_request(smollm_path, monkeypatch):
    batch, worker, prompt = _setup(smollm_path)
    ended = []
    long_batch = Job(prompt, make_sampler(GREEDY), Limits(1500), batch=True)
    try:
        assert worker.submit(long_batch, ended.append)
        _moves(long_batch)                                  # it decodes on its own

        monkeypatch.setattr(worker_module, "HOLD_SECONDS", LONG_HOLD)
        arrived = worker.expect()
        _held(long_batch)                                   # held while the request is prepared
        interactive = Job(prompt, make_sampler(GREEDY), Limits(4))
        assert worker.submit(interactive, ended.append)
        arrived()
        _until(lambda: interactive in ended)
        assert interactive.stats.finish_reason == "length"
        _moves(long_batch)                                  # both arrived: batch goes on

        monkeypatch.setattr(worker_module, "HOLD_SECONDS", 2.0)
        never = worker.expect()                             # a request that never comes
        _held(long_batch)
        _moves(long_batch)                                  # its hold ran out: batch goes on
        never()
        never()                                             # a second call changes nothing
        assert worker._expected == 0 and worker.error is None
    finally:
        long_batch.cancelled = True
        worker.stop()
        batch.close()


def test_an_interactive_job_running_is_never_held(smollm_path, monkeypatch):
    """With an interactive job decoding, an expected one holds nothing: its tokens would wait."""
    batch, worker, prompt = _setup(smollm_path)
    ended = []
    talking = Job(prompt, make_sampler(GREEDY), Limits(1500))
    try:
        assert worker.submit(talking, ended.append)
        _moves(talking)
        monkeypatch.setattr(worker_module, "HOLD_SECONDS", LONG_HOLD)
        arrived = worker.expect()
        _moves(talking)
        _moves(talking)
        arrived()
    finally:
        talking.cancelled = True
        worker.stop()
        batch.close()
