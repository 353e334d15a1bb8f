"""serve's /metrics on a real model (SmolLM2), driven with the official openai client: requests
by endpoint and status as sent, tokens as the responses' usage said, the latency histograms'
counts and buckets, the gauges back to zero once every answer is in, the model's memory, and the
endpoint behind the API key and GET only. The text is read by tests/metrics_text.py's parser."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request

import pytest
from helpers import start_server
from metrics_text import parse, samples

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

KEY = "m3trics"
CTX = 1024
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(smollm_path):
    proc, url = start_server(str(smollm_path), "--ctx", str(CTX), "--parallel", "2",
                             "--api-key", KEY)
    yield url
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


def _get(url: str, path: str, headers: dict | None = None, method: str = "GET"):
    """(status, content type, body) of a plain request, errors included."""
    request = urllib.request.Request(url + path, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def _drive(client, model: str) -> list:
    """Three answers (chat whole, chat streamed, a completion), a 400 and a 404 on chat: the
    usages the answers reported."""
    usages = [client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                             temperature=0).usage]
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    usages.append(client.completions.create(model=model, prompt="The sky is", max_tokens=10,
                                            temperature=0).usage)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert len(usages) == 3
    return usages


def test_metrics_count_what_was_sent(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    name = client.models.list().data[0].id
    usages = _drive(client, name)
    assert _get(server, "/no/such/path", {"Authorization": f"Bearer {KEY}"})[0] == 404
    assert _get(server, "/metrics")[0] == 401                   # no key
    assert _get(server, "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(server, "/metrics", {"x-api-key": KEY}, method="POST")[0] == 405
    status, content_type, text = _get(server, "/metrics", {"x-api-key": KEY})
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    f = parse(text)
    for family in ("localinfer_requests_total", "localinfer_time_to_first_token_seconds",
                   "localinfer_queue_depth", "localinfer_model_memory_bytes"):
        assert f[family]["help"] and f[family]["type"], family

    requests = {tuple(v for _, v in k): n for k, n in
                samples(f, "localinfer_requests_total").items()}
    assert requests.pop(("/health", "200")) >= 1                # start_server's polling
    assert requests == {("/v1/models", "200"): 1, ("/v1/chat/completions", "200"): 2,
                        ("/v1/completions", "200"): 1, ("/v1/chat/completions", "400"): 1,
                        ("/v1/chat/completions", "404"): 1, ("other", "404"): 1,
                        ("/metrics", "401"): 2, ("/metrics", "405"): 1}

    model = (("model", name),)
    assert samples(f, "localinfer_prompt_tokens_total") == {model: sum(u.prompt_tokens
                                                                       for u in usages)}
    generated = [u.completion_tokens for u in usages]
    assert all(generated)
    assert samples(f, "localinfer_generated_tokens_total") == {model: sum(generated)}
    assert sum(samples(f, "localinfer_generations_total").values()) == 3
    _histogram(f, "localinfer_time_to_first_token_seconds", model, count=3)
    _histogram(f, "localinfer_time_per_output_token_seconds", model,
               count=sum(n - 1 for n in generated))

    # every answer is in: nothing waits or runs; the slots' kept cells stay (a cache)
    assert samples(f, "localinfer_queue_depth") == {model: 0}
    assert samples(f, "localinfer_running_sequences") == {model: 0}
    assert samples(f, "localinfer_kv_cells") == {model: CTX}
    assert 0 < samples(f, "localinfer_kv_cells_used")[model] <= CTX
    assert samples(f, "localinfer_models_loaded") == {(): 1}
    memory = samples(f, "localinfer_model_memory_bytes")
    assert memory[(*model, ("memory", "ram"))] > 50e6           # a 98 MB file and its cache


def _histogram(f: dict, name: str, labels: tuple, *, count: int) -> None:
    """count as expected, buckets cumulative and ending at +Inf with it, a positive sum."""
    assert samples(f, name + "_count") == {labels: count}
    assert samples(f, name + "_sum")[labels] > 0
    buckets = [(dict(k)["le"], n) for k, n in samples(f, name + "_bucket").items()]
    bounds = [float(le) for le, _ in buckets]
    counts = [n for _, n in buckets]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf")
    assert counts == sorted(counts) and counts[-1] == count
