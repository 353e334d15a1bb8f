"""`n` choices (issue 44): n jobs that read their shared prompt once in the batch scheduler,
choices reproducible under a seed, usage counting the prompt once; streamed usage only when
stream_options asks, in a last chunk with no choices; Anthropic's streamed usage whole; the
penalties on the OpenAI and Ollama endpoints of a live `serve` (SmolLM2)."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest
from helpers import SMOLLM, prompt_tokens, start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct:Q4_1"
SLOTS = 4
ASK = [{"role": "user", "content": "Name an animal."}]


def _scheduler(path, parallel: int):
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.batched import SequenceBatch
    from localinfer.engine.scheduler import Scheduler
    batch = SequenceBatch(path, LoadOptions(n_ctx=2048), parallel + 1)
    return batch, Scheduler(batch, request_ctx=batch.n_ctx)


def _job(prompt: list[int], seed: int | None):
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams, make_sampler
    from localinfer.engine.scheduler import Job
    params = SamplingParams(temperature=0) if seed is None else SamplingParams(seed=seed)
    return Job(list(prompt), make_sampler(params), Limits(12, ignore_eos=True))


def _evaluated(batch, prompt_len: int) -> list[int]:
    """Counts the prompt positions each llama_decode evaluates (a Piece: seq, tokens, pos)."""
    counted, decode = [0], batch.decode

    def counting(pieces):
        counted[0] += sum(max(0, min(p.pos + len(p.tokens), prompt_len) - p.pos)
                          for p in pieces)
        return decode(pieces)
    batch.decode = counting
    return counted


def test_n_jobs_on_one_prompt_read_it_once(smollm_path, models_home):
    from helpers import load_file
    from localinfer.backends import LoadOptions
    loaded = load_file(smollm_path, LoadOptions(n_ctx=512))
    prompt = prompt_tokens(loaded, "Write three words about the sea and the sky.")
    loaded.session.close()
    batch, scheduler = _scheduler(smollm_path, SLOTS)
    try:
        alone = _job(prompt, None)
        scheduler.run([alone])
        batch.clear()
        batch, scheduler = batch, type(scheduler)(batch, request_ctx=batch.n_ctx)
        counted = _evaluated(batch, len(prompt))
        greedy = [_job(prompt, None) for _ in range(SLOTS)]
        scheduler.run(greedy)
        assert counted[0] == len(prompt)            # not SLOTS times: one read, shared
        assert [j.tokens for j in greedy] == [alone.tokens] * SLOTS   # exact as one alone
        assert all(j.stats.cached_tokens == len(prompt) for j in greedy[1:])
        counted[0] = 0
        batch.clear()
        scheduler = type(scheduler)(batch, request_ctx=batch.n_ctx)
        sampled = [_job(prompt, seed) for seed in range(SLOTS)]
        scheduler.run(sampled)
        assert counted[0] == len(prompt)
        assert len({tuple(j.tokens) for j in sampled}) > 1     # each its own draw
    finally:
        batch.close()


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = start_server(SMOLLM, "--ctx", "2048", "--parallel", str(SLOTS))
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_n_choices_are_the_seeded_single_choices(client):
    asked = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=11)
    many = client.chat.completions.create(n=3, **asked)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    assert len(set(texts)) > 1
    again = client.chat.completions.create(n=3, **asked)
    assert [c.message.content for c in again.choices] == texts
    singles = [client.chat.completions.create(**{**asked, "seed": 11 + i}) for i in range(3)]
    assert [s.choices[0].message.content for s in singles] == texts
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_streamed_adds_up_to_the_whole_choices(client):
    asked = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=5, n=2)
    whole = client.chat.completions.create(**asked)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True},
                                                 **asked))
    texts = ["", ""]
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_past_the_slots_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="'n' may be at most 4") as e:
        client.chat.completions.create(model=MODEL, messages=ASK, n=SLOTS + 1)
    assert e.value.body["param"] == "n"


def test_streamed_usage_only_when_asked_in_a_chunk_of_its_own(client):
    asked = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0, stream=True)
    plain = list(client.chat.completions.create(**asked))
    assert all(chunk.usage is None for chunk in plain) and plain[-1].choices
    counted = list(client.chat.completions.create(stream_options={"include_usage": True},
                                                  **asked))
    assert all(chunk.usage is None for chunk in counted[:-1])
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens >= 1
    assert [c.choices[0].delta.content for c in counted[:-1]] == \
        [c.choices[0].delta.content for c in plain]


def test_anthropic_streamed_usage_has_its_input_tokens(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.input_tokens == start.message.usage.input_tokens > 5
    assert delta.usage.output_tokens >= 1


def _ollama(server: str, body: dict) -> dict:
    request = urllib.request.Request(server + "/api/chat", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def test_penalties_change_the_answer_alike_on_openai_and_ollama(client, server):
    messages = [{"role": "user", "content": "Repeat after me: yes yes yes yes yes yes"}]
    asked = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**asked).choices[0].message.content
    penalised = client.chat.completions.create(frequency_penalty=1.5, presence_penalty=0.5,
                                               **asked).choices[0].message.content
    assert penalised != plain
    ollama = _ollama(server, {"model": MODEL, "messages": messages, "stream": False,
                              "options": {"temperature": 0, "num_predict": 16,
                                          "frequency_penalty": 1.5, "presence_penalty": 0.5}})
    assert ollama["message"]["content"] == penalised
    # A bias of 100 forces its token whatever the prompt; an id past the vocabulary is a 400.
    forced = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        logit_bias={"1234": 100}).choices[0].text
              for prompt in ("One, two,", "The sky is")]
    assert forced[0] == forced[1] != client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=2, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError, match="'logit_bias' names '49152'"):
        client.chat.completions.create(logit_bias={"49152": 1}, **asked)


def test_n_on_completions_whole_and_streamed(client):
    asked = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3,
                 n=2)
    whole = client.completions.create(**asked)
    texts = [c.text for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1] and texts[0] != texts[1]
    single = client.completions.create(**{**asked, "n": 1, "seed": 4})
    assert single.choices[0].text == texts[1]
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    streamed = ["", ""]
    for chunk in client.completions.create(stream=True, **asked):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def _cached(server: str) -> float:
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("localinfer_prompt_tokens_cached_total{"))


def test_n_choices_over_http_read_their_prompt_once(client, server):
    """A prompt no request sent before: without the sharing each of the 4 choices reads it
    all (only the template's start could come from a slot's kept cells)."""
    words = " ".join(f"w{i}x{i * 7 % 13}" for i in range(60))
    before = _cached(server)
    reply = client.chat.completions.create(
        model=MODEL, n=SLOTS, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": f"Repeat: {words}"}])
    shared = _cached(server) - before
    assert shared >= (SLOTS - 1) * reply.usage.prompt_tokens, (shared, reply.usage)
