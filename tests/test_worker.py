"""serve's worker (server/worker.py) on the real model: an interactive request being prepared holds
the steps of batch jobs, for as long as it takes to arrive and never longer than HOLD_SECONDS."""

from __future__ import annotations

import time

from localinfer.backends import LoadOptions
from localinfer.backends.llama.batched import SequenceBatch
from localinfer.engine.decode import Limits
from localinfer.engine.prompt import chat_tokens, messages_for
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.engine.scheduler import Job
from localinfer.server.worker import HOLD_SECONDS, Worker

GREEDY = SamplingParams(temperature=0)


def _tokens_after(job: Job, seconds: float) -> int:
    """How many tokens the job gained in `seconds`."""
    before = len(job.tokens)
    time.sleep(seconds)
    return len(job.tokens) - before


def _until(condition, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_batch_steps_wait_for_an_expected_interactive_request(smollm_path):
    batch = SequenceBatch(smollm_path, LoadOptions(n_ctx=512 * 4), 4)
    worker = Worker(batch, capacity=8)
    prompt = chat_tokens(batch.session, messages_for("Tell me a long story.", None))
    ended = []
    long_batch = Job(prompt, make_sampler(GREEDY), Limits(400), batch=True)
    try:
        assert worker.submit(long_batch, ended.append)
        _until(lambda: len(long_batch.tokens) >= 2)
        assert _tokens_after(long_batch, 0.1) >= 2          # it decodes on its own

        arrived = worker.expect()
        time.sleep(0.02)                                    # the step under way ends
        assert _tokens_after(long_batch, 0.1) == 0          # held while the request is prepared
        interactive = Job(prompt, make_sampler(GREEDY), Limits(4))
        assert worker.submit(interactive, ended.append)
        arrived()
        _until(lambda: interactive in ended)
        assert interactive.stats.finish_reason == "length"
        assert _tokens_after(long_batch, 0.1) >= 2          # both arrived: batch goes on

        never = worker.expect()                             # a request that never comes
        time.sleep(0.02)
        assert _tokens_after(long_batch, HOLD_SECONDS / 2) == 0
        _until(lambda: len(long_batch.tokens) >= 390 or long_batch in ended,
               seconds=60)                                  # the hold ran out: it goes on
        never()
        never()                                             # a second call changes nothing
        _until(lambda: long_batch in ended)
        assert worker._expected == 0 and worker.error is None
    finally:
        long_batch.cancelled = True
        worker.stop()
        batch.close()


def test_an_interactive_job_running_is_never_held(smollm_path):
    """With an interactive job decoding, an expected one holds nothing: its tokens would wait."""
    batch = SequenceBatch(smollm_path, LoadOptions(n_ctx=512 * 4), 4)
    worker = Worker(batch, capacity=8)
    prompt = chat_tokens(batch.session, messages_for("Tell me a long story.", None))
    ended = []
    talking = Job(prompt, make_sampler(GREEDY), Limits(400))
    try:
        assert worker.submit(talking, ended.append)
        _until(lambda: len(talking.tokens) >= 2)
        arrived = worker.expect()
        time.sleep(0.02)
        assert _tokens_after(talking, 0.1) >= 2
        arrived()
        _until(lambda: talking in ended)
    finally:
        talking.cancelled = True
        worker.stop()
        batch.close()
