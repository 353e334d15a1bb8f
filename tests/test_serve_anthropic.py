"""Anthropic's Messages API on a live `localinfer serve` (SmolLM2), driven by the official
`anthropic` client, and by raw HTTP for what the client would never send."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import pytest
from test_serve import MODEL, _start

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
KEY = "s3cret"
# greedy; this client has no temperature argument, the API has the field
ASK = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
           system="You are terse.", messages=[{"role": "user", "content": "Name a colour."}])
RAW = {**{k: v for k, v in ASK.items() if k != "extra_body"}, "temperature": 0}


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = _start("--api-key", KEY)
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def _post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_reply_is_the_same_greedy_text_as_openai_chat(client, server):
    message = client.messages.create(**ASK)
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 24 and message.usage.input_tokens > 5
    chat = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    same = chat.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name a colour."}])
    assert same.choices[0].message.content == message.content[0].text
    assert same.usage.prompt_tokens == message.usage.input_tokens


def test_a_stream_sends_anthropics_events_adding_up_to_the_whole_reply(client):
    whole = client.messages.create(**ASK)
    with client.messages.stream(**ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["text"]
    text = "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") \
        < kinds.index("message_delta")


def test_the_raw_event_sequence(server):
    request = urllib.request.Request(server + "/v1/messages", method="POST",
                                     data=json.dumps({**RAW, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "x-api-key": KEY})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    for frame, name in zip(frames, names):
        assert json.loads(frame.split("\n", 1)[1].removeprefix("data: "))["type"] == name


def test_max_tokens_and_stop_sequences(client):
    short = client.messages.create(**{**ASK, "max_tokens": 2})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    text = client.messages.create(**ASK).content[0].text
    word = text.split()[1] if len(text.split()) > 1 else text[1:3]
    stopped = client.messages.create(**ASK, stop_sequences=["zzzq", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]


def test_count_tokens_equals_the_input_tokens(client):
    counted = client.messages.count_tokens(model=MODEL, system=ASK["system"],
                                           messages=ASK["messages"])
    assert counted.input_tokens == client.messages.create(**ASK).usage.input_tokens


def test_the_key_as_x_api_key_or_bearer_and_a_wrong_key_is_a_401(server):
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(**ASK).content[0].text
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**ASK)
    assert refused.value.status_code == 401
    assert refused.value.body["type"] == "error"
    status, body = _post(server + "/v1/messages", RAW, {"x-api-key": "wrong"})
    assert status == 401 and body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"messages": []}, "messages"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},       # read (issue 46)
     "messages[0].content[0].source must be base64 or url"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "text blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom tool"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_bad_requests_are_400s_in_anthropics_shape(server, change, words):
    body = {k: v for k, v in {**RAW, **change}.items() if v is not None}
    status, reply = _post(server + "/v1/messages", body, {"x-api-key": KEY})
    assert status == 400, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert words in reply["error"]["message"]


def test_the_client_raises_on_a_bad_request_and_unknown_paths_answer_anthropics_shape(client,
                                                                                  server):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "assistant", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**ASK, "model": "claude-nope"})
    status, reply = _post(server + "/v1/messages/nope", RAW, {"x-api-key": KEY})
    assert status == 404 and reply["error"]["type"] == "not_found_error"
    request = urllib.request.Request(server + "/v1/messages", headers={"x-api-key": KEY})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405 and json.loads(refused.value.read())["type"] == "error"


def test_a_thinking_models_trace_is_a_thinking_block_before_the_text(models_home, tmp_path):
    from chat_templates import QWEN3_THINKING_2507
    from helpers import smollm_wearing
    from test_serve_thinking import _start as start_path, _stop
    path = smollm_wearing(QWEN3_THINKING_2507, tmp_path, "thinking")
    proc, url = start_path(str(path), "--think-budget", "8")
    try:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        ask = {**ASK, "model": path.name, "max_tokens": 30}
        whole = client.messages.create(**ask)
        assert [b.type for b in whole.content] == ["thinking", "text"]
        trace, text = whole.content[0], whole.content[1].text
        assert trace.thinking and trace.signature == "" and text
        assert whole.stop_reason == "max_tokens"
        # as OpenAI's endpoint tells trace and answer apart (SmolLM2 may write a "</think>" of
        # its own after the gate closed the trace: that is answer text, on both APIs)
        same = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        message = same.chat.completions.create(
            model=path.name, max_tokens=30, temperature=0,
            messages=[{"role": "system", "content": ASK["system"]}, *ASK["messages"]]
        ).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (trace.thinking,
                                                                                text)
        with client.messages.stream(**ask) as stream:
            events = list(stream)
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text"]
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == trace.thinking
        assert "".join(d.text for d in deltas if d.type == "text_delta") == text
    finally:
        _stop(proc)


def test_tools_map_onto_openais_tool_calls(models_home, tmp_path):
    """SmolLM2 wearing Qwen 2.5's template (Hermes calls): the same call as OpenAI's endpoint
    makes, whole and streamed, and a conversation carrying the call and its result on."""
    from chat_templates import QWEN25
    from helpers import smollm_wearing
    from test_serve_thinking import _start as start_path, _stop
    from test_serve_tools import SCHEMAS, TOOLS
    jsonschema = pytest.importorskip("jsonschema")
    path = smollm_wearing(QWEN25, tmp_path, "qwen25")
    proc, url = start_path(str(path))
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
              **({"description": t["function"]["description"]}
                 if "description" in t["function"] else {})} for t in TOOLS]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model=path.name, max_tokens=120, messages=question, tools=tools,
               extra_body={"temperature": 0})
    try:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        whole = client.messages.create(**ask, tool_choice={"type": "any"})
        calls = [b for b in whole.content if b.type == "tool_use"]
        assert calls and whole.stop_reason == "tool_use"
        for call in calls:
            assert call.id.startswith("toolu_")
            jsonschema.validate(call.input, SCHEMAS[call.name])
        same = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        made = same.chat.completions.create(model=path.name, max_tokens=120, temperature=0,
                                            messages=question, tools=TOOLS,
                                            tool_choice="required").choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in made] == \
            [(c.name, c.input) for c in calls]

        named = {**ask, "tool_choice": {"type": "tool", "name": "get_time"}}
        with client.messages.stream(**named) as stream:
            events = list(stream)
            final = stream.get_final_message()
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts[-1] == "tool_use" and final.stop_reason == "tool_use"
        streamed = [b for b in final.content if b.type == "tool_use"]
        assert [b.name for b in streamed] == ["get_time"] * len(streamed)
        whole = client.messages.create(**named)
        assert [(b.name, b.input) for b in streamed] == \
            [(b.name, b.input) for b in whole.content if b.type == "tool_use"]

        history = [*question, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "unit": "celsius"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "21 degrees, sunny"}]}]
        on = client.messages.create(**{**ask, "messages": history, "max_tokens": 16,
                                       "tool_choice": {"type": "none"}})
        assert [b.type for b in on.content] == ["text"] and on.content[0].text
        counted = client.messages.count_tokens(model=path.name, messages=history, tools=tools,
                                               tool_choice={"type": "none"})
        assert counted.input_tokens == on.usage.input_tokens
        with_tools = client.messages.count_tokens(model=path.name, messages=history, tools=tools)
        assert with_tools.input_tokens == client.messages.create(
            **{**ask, "messages": history, "max_tokens": 1}).usage.input_tokens
    finally:
        _stop(proc)
