"""`localinfer serve` as a live process on a free port, driven by the official `openai` client and
by raw HTTP for what a client library would never send."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct:Q4_1"


def _start(*args: str, env: dict | None = None, ctx: str = "512") -> tuple[subprocess.Popen, str]:
    return start_server("smollm2", "--ctx", ctx, *args, env=env)


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = _start("--parallel", "2", "--queue", "2")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_served_model_and_the_context_a_request_may_use(client, models_home):
    from localinfer.models.store import Store
    from localinfer.models.hub import stored_name
    listed = client.models.list().data
    # the loaded model first, with what a request may use: --ctx 512 is the pool the two slots
    # share, one request may fill it all; then every other model on disk, loaded on demand
    assert listed[0].id == MODEL and listed[0].model_extra["context_length"] == 512
    store = Store(models_home / "data" / "models")
    on_disk = {f"{stored_name(store, m.name)}:{m.quant}" for m in store.installed()}
    assert {m.id for m in listed} == on_disk and len(listed) == len(on_disk)
    assert all("context_length" not in m.model_extra for m in listed[1:])


def test_a_whole_chat_completion_is_greedy_and_counted(client, models_home):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
               temperature=0, max_tokens=12)
    first, second = (client.chat.completions.create(**ask) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content != ""
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 12 and first.usage.prompt_tokens > 5
    from helpers import run_cli
    run = run_cli("run", "smollm2", "Name a colour.", "--temp", "0", "-n", "12", "--offline",
                  "--draft", "none")
    assert first.choices[0].message.content == run.stdout.rstrip("\n")


def test_a_streamed_chat_completion_adds_up_to_the_whole_one(client):
    ask = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is rain?"}],
               temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_response_format_json_schema_gives_a_valid_document(client):
    import jsonschema
    schema = {"type": "object", "required": ["colour", "hex"], "additionalProperties": False,
              "properties": {"colour": {"type": "string", "maxLength": 20},
                             "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour and its hex code."}],
        temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "strict": True,
                                                                "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"


def test_a_completion_with_a_stop_string(client):
    done = client.completions.create(model=MODEL, prompt="One, two, three, four,", temperature=0,
                                     max_tokens=20, stop=[","])
    assert "," not in done.choices[0].text and done.choices[0].finish_reason == "stop"


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body, words", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"model": MODEL}).encode(), "'messages'"),
    (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), "role"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(), "content"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), "'n' may be at most 2"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "seed": -5}).encode(), "'seed' must be an integer from -1"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}]}).encode(),
     "a request here may use"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                     "type": "integer", "multipleOf": 3}}}}).encode(),
     "response_format: the keyword 'multipleOf' at /multipleOf is not supported"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "yaml"}}).encode(), "response_format.type"),
])
def test_bad_bodies_are_400s_in_openai_shape(server, body, words):
    status, reply = _post(server + "/v1/chat/completions", body)
    assert status == 400 and words in reply["error"]["message"], reply


def test_a_client_that_leaves_mid_stream_frees_its_slot(client, server):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
        temperature=0, max_tokens=400, stream=True)
    next(iter(stream))
    stream.close()                       # gone after the first chunk
    time.sleep(0.5)
    # Both slots (and the queue) serve again at once: two requests side by side finish.
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(answers) == 2 and all(a.usage.completion_tokens >= 1 for a in answers)


def test_off_loopback_needs_an_api_key(models_home):
    from helpers import run_cli
    refused = run_cli("serve", "smollm2", "--host", "0.0.0.0", "--offline")
    assert refused.returncode == 2 and "needs --api-key" in refused.stderr
    proc, url = _start("--api-key", "s3cret")
    try:
        assert urllib.request.urlopen(url + "/health").status == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.models.list().data[0].id == MODEL
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_beyond_the_slots_and_the_queue_requests_get_429_and_the_server_recovers(server, client):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
                       "max_tokens": 60, "temperature": 0}).encode()
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        _post_with_headers(server + "/v1/chat/completions", body))) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    statuses = sorted(status for status, _ in results)
    assert statuses.count(200) == 4 and statuses.count(429) == 6, statuses   # 2 slots + 2 waiting
    assert all(headers.get("retry-after") == "1" for status, headers in results if status == 429)
    again = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert again.usage.completion_tokens >= 1


def _post_with_headers(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def test_no_cors_headers_unless_asked(server):
    request = urllib.request.Request(server + "/v1/models", headers={"Origin": "http://evil.test"})
    with urllib.request.urlopen(request) as r:
        assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_eight_concurrent_greedy_requests_answer_as_eight_sent_one_at_a_time(models_home):
    proc, url = _start("--parallel", "8")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        questions = [f"Give one fact about the number {i}." for i in range(8)]

        def ask(q):
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], temperature=0,
                max_tokens=24).choices[0].message.content
        alone = [ask(q) for q in questions]
        together: dict = {}
        threads = [threading.Thread(target=lambda q=q: together.__setitem__(q, ask(q)))
                   for q in questions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        same = sum(together[q] == a for q, a in zip(questions, alone))
        print(f"{same} of 8 identical")
        # Batched kernels round differently from one sequence's (docs/batching.md): measured 8 of
        # 8 here; a mix-up of sequences would leave next to none.
        assert same >= 6, (alone, together)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_a_body_over_the_size_limit_is_refused_before_it_is_read(server):
    import http.client
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(5 << 20))
    conn.endheaders(b'{"model": ')            # the rest never comes: the header says enough
    reply = conn.getresponse()
    assert reply.status == 400 and "over 4 MB" in json.loads(reply.read())["error"]["message"]


def _counting(n: int) -> str:
    return ", ".join(str(i) for i in range(1, n)) + ","


# Under exhaustive (the fourth round): test_serve_hostile's in-process scheduler tests show the
# same sharing (with and without max_tokens) by default.
@pytest.mark.exhaustive
def test_two_long_requests_share_the_pool_without_overfilling_it(client):
    """--ctx 512 for both slots: with max_tokens each waits for its room and gets all of it;
    without, both run until the pool is full, and neither fails."""
    def ask(results, **extra):
        results.append(client.completions.create(model=MODEL, prompt=_counting(40),
                                                 temperature=0, **extra))
    for extra in ({"max_tokens": 150}, {}):
        results: list = []
        threads = [threading.Thread(target=ask, args=(results,), kwargs=extra) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(results) == 2, extra
        for r in results:
            assert r.choices[0].finish_reason == "length" and r.choices[0].text
            assert r.usage.prompt_tokens + r.usage.completion_tokens <= 513
            if extra:
                assert r.usage.completion_tokens == 150


@pytest.fixture(scope="module")
def whole_context(models_home):
    """A server with --ctx 0: SmolLM2's trained 8,192 tokens, one request able to use them."""
    proc, url = _start("--parallel", "2", "--threads", "1", ctx="0")   # steady on shared cores
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_ctx_0_sizes_the_pool_to_the_trained_context(whole_context):
    assert whole_context.models.list().data[0].model_extra["context_length"] == 8192


@pytest.mark.exhaustive          # ~110 s at 1 thread
def test_a_conversation_longer_than_4096_tokens_is_answered(whole_context):
    turn = "Tell me more about the long history of the old city by the river. " * 12
    messages = []
    for i in range(25):
        messages += [{"role": "user", "content": f"{i}: {turn}"},
                     {"role": "assistant", "content": f"Here is part {i} of the story."}]
    messages.append({"role": "user", "content": "Sum it up in one line."})
    reply = whole_context.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                  max_tokens=8)
    assert 4_900 < reply.usage.prompt_tokens < 5_400, reply.usage      # 22 turns: 4,527
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content


@pytest.mark.exhaustive          # ~60 s; the context a request may fill is asserted above
def test_a_3984_token_prompt_gets_its_200_tokens(whole_context, smollm_path):
    from localinfer.backends.llama.vocab import LlamaVocab
    from localinfer.engine.prompt import raw_tokens
    vocab = LlamaVocab(smollm_path)
    try:
        n = next(n for n in range(700, 2000, 5) if len(raw_tokens(vocab, _counting(n))) >= 3_984)
    finally:
        vocab.close()
    done = whole_context.completions.create(model=MODEL, prompt=_counting(n), temperature=0,
                                            max_tokens=200)
    # With 4,096 tokens a request, it stopped after 113: the context, not max_tokens, ended it.
    assert 3_984 <= done.usage.prompt_tokens < 4_000
    assert done.usage.completion_tokens == 200 and done.choices[0].finish_reason == "length"
