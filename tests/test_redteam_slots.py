"""Issue 41, item 30: what a request gets from the slots it shares: a greedy request's text does
not hang on what the server answered before it (a free slot's kept cells are continued only from
a point where the logits stay a cold run's: docs/batching.md)."""

from __future__ import annotations

import signal

import pytest
from helpers import GEMMA, SMOLLM, start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

_DOC = " ".join(f"Item {i} is a {('red', 'blue', 'green')[i % 3]} box." for i in range(40))
SHORT = "The three primary colours are"
LONG = _DOC + " Which colour is item 7?"
# What the server answers before each repeat of a target: each shares a start of another length
# with it (the chat template's or the text's first words, half of it, a long document, all of it).
BEFORE = {SHORT: ["The capital of France is", _DOC + " What is item 3?", SHORT, "The three"],
          LONG: [LONG, _DOC[:len(_DOC) // 2] + " zebra", _DOC + " What is item 3?",
                 "The capital of France is"]}


def _scheduler(path, n_ctx: int, parallel: int):
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.batched import SequenceBatch
    from localinfer.engine.scheduler import Scheduler
    batch = SequenceBatch(path, LoadOptions(n_ctx=n_ctx), parallel + 1)
    return batch, Scheduler(batch, request_ctx=batch.n_ctx)


def _job(prompt: list[int], n: int):
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams, make_sampler
    from localinfer.engine.scheduler import Job
    return Job(prompt, make_sampler(SamplingParams(temperature=0)), Limits(n, ignore_eos=True))


def test_a_greedy_answer_does_not_depend_on_what_the_slots_held_before(smollm_path, gemma_path):
    """In process, every target after every earlier request, both models: the first token's
    logits are equal bit for bit, and so is the text."""
    from types import SimpleNamespace

    import numpy as np

    from helpers import prompt_tokens
    for path in (smollm_path, gemma_path):
        batch, scheduler = _scheduler(path, 2048, 2)
        vocab = SimpleNamespace(session=batch.session)

        def job(text: str):
            greedy, rows = _job([], 16).sampler, []

            def sampler(logits, history):
                rows.append(np.array(logits))
                return greedy(logits, history)
            made = _job(prompt_tokens(vocab, text), 16)
            made.sampler, made.rows = sampler, rows
            return made
        for target, before in BEFORE.items():
            cold = job(target)
            scheduler.run([cold])
            for earlier in before:
                scheduler.run([job(earlier)])
                warm = job(target)
                scheduler.run([warm])
                assert np.array_equal(warm.rows[0], cold.rows[0]), (path.name, earlier[:30])
                assert warm.tokens == cold.tokens, (path.name, earlier[:30])
        batch.close()


# -- through the HTTP API -------------------------------------------------------------------
@pytest.fixture(scope="module", params=[SMOLLM, GEMMA])
def served(request, models_home):
    proc, url = start_server(request.param, "--ctx", "2048", "--parallel", "2")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    yield request.param, client, model
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


def _ask(served, text: str, **extra) -> str:
    name, client, model = served
    if name == SMOLLM:          # a chat model: a chat turn; Gemma 3 270M is a base model
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], temperature=0,
            max_tokens=24, **extra)
        return reply.choices[0].message.content
    return client.completions.create(model=model, prompt=text, temperature=0, max_tokens=24,
                                     **extra).choices[0].text


def test_the_same_greedy_request_gets_the_same_text_whatever_came_before(served):
    for target, before in BEFORE.items():
        cold = _ask(served, target)
        for earlier in before:
            _ask(served, earlier)
            assert _ask(served, target) == cold, (served[0], target[:30], earlier[:30])
