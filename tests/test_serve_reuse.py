"""`serve --reuse-answers` (issue 45, section 2): a deterministic request asked again is answered
from the answer store, streamed in each API's own shape with the text pieces the original
streamed, byte for byte, and marked (usage `reused`, the X-Localinfer-Reused header, /metrics); a
sampled request is never stored. One server, in a home of its own whose config.toml turns the
option on (`reuse-answers = true`: the config key), with the official clients."""

from __future__ import annotations

import re
import signal

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers import start_server

from localinfer.server.reuse import HEADER

ASK = "Name three colours."


@pytest.fixture(scope="module")
def server(smollm_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("reuse-home")
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text("[defaults]\nreuse-answers = true\n")
    proc, url = start_server(str(smollm_path), "--ctx", "512", "--parallel", "2",
                             env={"LOCALINFER_HOME": str(home)})
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    yield url, model, home
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.findall(rf"^localinfer_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def _chat_stream(client, model, content, **extra):
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=24, stream=True, stream_options={"include_usage": True}, **extra) as raw:
        chunks = list(raw.parse())
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    logprobs = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    return raw.headers.get(HEADER), pieces, logprobs, chunks[-1].usage


def test_openai_chat_replays_its_pieces_whole_and_streamed(server):
    url, model, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    stored = _metric(url, "answers_stored_total")
    header, pieces, _, usage = _chat_stream(client, model, ASK)
    assert header is None and not (usage.model_extra or {}).get("reused")
    assert _metric(url, "answers_stored_total") == stored + 1
    reused = _metric(url, "answers_reused_total")
    # the same request after normalisation (NFC, whitespace at its ends)
    again_header, again, _, again_usage = _chat_stream(client, model, f"  {ASK}\n")
    assert again == pieces and again_header == "1" and again_usage.model_extra["reused"] is True
    assert again_usage.completion_tokens == usage.completion_tokens
    whole = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=24)
    assert whole.headers[HEADER] == "1"
    reply = whole.parse()
    assert reply.choices[0].message.content == "".join(pieces)
    assert reply.usage.model_extra["reused"] is True
    assert _metric(url, "answers_reused_total") == reused + 2
    # logprobs asked for are part of the key: decoded once, then replayed with the same figures
    first = _chat_stream(client, model, ASK, logprobs=True, top_logprobs=2)
    second = _chat_stream(client, model, ASK, logprobs=True, top_logprobs=2)
    assert first[0] is None and second[0] == "1"
    assert second[1:3] == first[1:3] and first[1] == pieces and len(first[2]) > 0


def test_a_sampled_request_is_never_stored_a_seeded_one_is(server):
    url, model, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    stored = _metric(url, "answers_stored_total")
    for _ in range(2):
        raw = client.completions.with_raw_response.create(
            model=model, prompt="Once upon a time", temperature=0.9, max_tokens=8)
        assert HEADER not in raw.headers and "reused" not in (raw.parse().usage.model_extra or {})
    assert _metric(url, "answers_stored_total") == stored
    seeded = [client.completions.with_raw_response.create(
        model=model, prompt="Once upon a time", temperature=0.9, seed=11, max_tokens=8)
        for _ in range(2)]
    assert [r.headers.get(HEADER) for r in seeded] == [None, "1"]
    assert seeded[1].parse().choices[0].text == seeded[0].parse().choices[0].text
    assert _metric(url, "answers_stored_total") == stored + 1
    # a completion streamed from a stored answer gives the pieces it streamed
    streams = []
    for _ in range(2):
        with client.completions.with_streaming_response.create(
                model=model, prompt="The sky is", temperature=0, max_tokens=12,
                stream=True) as raw:
            streams.append((raw.headers.get(HEADER), [c.choices[0].text for c in raw.parse()]))
    assert streams[0][0] is None and streams[1] == ("1", streams[0][1])


def test_anthropic_messages_replay_and_say_so(server):
    url, model, _ = server
    client = anthropic.Anthropic(base_url=url, api_key="x")
    ask = dict(model=model, max_tokens=24, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": "What is 7 times 6?"}])
    events = []
    for _ in range(2):
        with client.messages.stream(**ask) as stream:
            texts = list(stream.text_stream)
            events.append((texts, stream.get_final_message()))
    assert events[1][0] == events[0][0]
    assert not (events[0][1].usage.model_extra or {}).get("reused")
    assert events[1][1].usage.model_extra["reused"] is True
    raw = client.messages.with_raw_response.create(**ask)
    message = raw.parse()
    assert raw.headers[HEADER] == "1" and message.usage.model_extra["reused"] is True
    assert message.content[0].text == "".join(events[0][0])


def test_ollama_chat_and_generate_replay_and_say_so(server):
    url, model, _ = server
    client = ollama.Client(host=url)
    options = {"temperature": 0, "num_predict": 24}
    said = [[c.message.content for c in client.chat(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}], options=options,
        stream=True)] for _ in range(2)]
    assert said[1] == said[0]
    generated = [[c.response for c in client.generate(model=model, prompt="Name a fruit.",
                                                       options=options, stream=True)]
                 for _ in range(2)]
    assert generated[1] == generated[0] and "".join(generated[0]) == "".join(said[0])
    # the marker is Ollama's last object's extra field (its client keeps no unknown field)
    raw = httpx.post(url + "/api/chat", json={
        "model": model, "messages": [{"role": "user", "content": "Name a fruit."}],
        "options": options, "stream": False}, timeout=60)
    assert raw.headers[HEADER] == "1" and raw.json()["reused"] is True
    assert raw.json()["message"]["content"] == "".join(said[0])


def test_a_damaged_entry_is_dropped_and_decoded_again(server):
    url, model, home = server
    ask = {"model": model, "prompt": "Two plus two is", "temperature": 0, "max_tokens": 6}
    first = httpx.post(url + "/v1/completions", json=ask, timeout=60)
    assert httpx.post(url + "/v1/completions", json=ask, timeout=60).headers[HEADER] == "1"
    entries = list((home / "cache" / "answers").rglob("*.kv"))
    newest = max(entries, key=lambda p: p.stat().st_mtime_ns)
    newest.write_bytes(newest.read_bytes()[:-3] + b"XYZ")
    again = httpx.post(url + "/v1/completions", json=ask, timeout=60)
    assert HEADER not in again.headers
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert httpx.post(url + "/v1/completions", json=ask, timeout=60).headers[HEADER] == "1"


def test_a_request_with_media_has_no_key():
    """Its tokens do not say which image or sound it holds: never stored, never replayed."""
    from localinfer.engine.sampling import SamplingParams
    from localinfer.server import reuse
    greedy = SamplingParams(temperature=0)
    image = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "What is this?"}]}]}
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert reuse.decides(image, greedy, None, None, True) is None
    assert reuse.decides(text, greedy, None, None, True) is not None
