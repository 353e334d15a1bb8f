"""Ollama's API on a live `localinfer serve`, driven by the official `ollama` client (and raw HTTP
for what the client never sends): SmolLM2 (a chat template, behind an API key), Gemma 3 270M (no
chat template: generate only), and SmolLM2 wearing Qwen3-Thinking-2507's published template
(a thinking trace, and Hermes tool calls)."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from helpers import GEMMA, SMOLLM, smollm_wearing, start_server

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

KEY = "s3cret"
SMOLLM_NAME = "smollm2-135m-instruct:Q4_1"
GEMMA_NAME = "gemma-3-270m:Q4_K_M"
QUESTION = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "num_predict": 24}
# A schema the ollama client passes on whole (its Tool model keeps type, properties with type,
# description and enum, and required)
WEATHER = {"type": "object", "required": ["city"],
           "properties": {"city": {"type": "string", "description": "a city"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city",
                                           "parameters": WEATHER}}]


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


@pytest.fixture(scope="module")
def smollm(models_home):
    proc, url = start_server(SMOLLM, "--ctx", "1024", "--parallel", "2", "--api-key", KEY)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def gemma(models_home):
    proc, url = start_server(GEMMA, "--ctx", "512")
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def thinking(models_home, tmp_path_factory):
    """SmolLM2 as Qwen3-Thinking-2507 (its template opens the trace, and has Hermes tools):
    (url, model name)."""
    from chat_templates import QWEN3_THINKING_2507
    path = smollm_wearing(QWEN3_THINKING_2507, tmp_path_factory.mktemp("ollama"), "thinking")
    proc, url = start_server(str(path), "--ctx", "1024", "--think-budget", "8")
    yield url, path.name
    _stop(proc)


def _client(url: str, key: str | None = KEY):
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"} if key else None)


def _raw(url: str, path: str, body: dict | None = None, *, key: str | None = KEY,
         method: str | None = None, host: str | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request, whatever its status."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if host:
        headers["Host"] = host
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _ollama_error(status: int, headers: dict, raw: bytes, expected: int) -> str:
    """The message of an error reply in Ollama's shape: {"error": "..."} and nothing else."""
    assert status == expected, raw
    assert headers["content-type"].startswith("application/json")
    reply = json.loads(raw)
    assert list(reply) == ["error"] and isinstance(reply["error"], str) and reply["error"]
    return reply["error"]


def _figures(done) -> None:
    """The last object's figures, as Ollama reports them (durations in nanoseconds)."""
    assert done.done is True and done.done_reason in ("stop", "length")
    assert done.prompt_eval_count > 5 and done.eval_count > 0
    for name in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert done[name] > 0, name
    assert done.total_duration >= done.prompt_eval_duration + done.eval_duration
    assert done.load_duration == 0


# -- chat and generate -----------------------------------------------------------------------
def test_chat_whole_and_streamed(smollm):
    client = _client(smollm)
    whole = client.chat(model="smollm2", messages=QUESTION, options=GREEDY)
    assert whole.model == "smollm2" and whole.message.role == "assistant"
    assert whole.message.content and whole.message.thinking is None
    _figures(whole)
    chunks = list(client.chat(model="smollm2:latest", messages=QUESTION, options=GREEDY,
                              stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].message.content == "" and chunks[-1].model == "smollm2:latest"
    assert (chunks[-1].eval_count, chunks[-1].done_reason) == (whole.eval_count,
                                                               whole.done_reason)
    _figures(chunks[-1])


def test_a_stream_is_ndjson_by_default(smollm):
    status, headers, raw = _raw(smollm, "/api/chat", {"model": SMOLLM_NAME, "messages": QUESTION,
                                                      "options": GREEDY})
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = raw.decode().splitlines()
    objects = [json.loads(line) for line in lines]
    assert len(objects) > 2 and [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]
    assert objects[0]["created_at"].endswith("Z") and objects[-1]["done_reason"]
    whole = json.loads(_raw(smollm, "/api/chat", {"model": SMOLLM_NAME, "messages": QUESTION,
                                                  "options": GREEDY, "stream": False})[2])
    assert whole["done"] is True
    assert whole["message"]["content"] == "".join(o["message"]["content"] for o in objects)


def test_generate_is_one_turn_of_the_template_or_raw(smollm):
    client = _client(smollm)
    chat = client.chat(model="smollm2", messages=QUESTION, options=GREEDY)
    whole = client.generate(model="smollm2", system=QUESTION[0]["content"],
                            prompt=QUESTION[1]["content"], options=GREEDY)
    assert whole.response == chat.message.content and whole.thinking is None
    assert whole.prompt_eval_count == chat.prompt_eval_count
    _figures(whole)
    chunks = list(client.generate(model="smollm2", system=QUESTION[0]["content"],
                                  prompt=QUESTION[1]["content"], options=GREEDY, stream=True))
    assert "".join(c.response for c in chunks) == whole.response and chunks[-1].done
    raw = client.generate(model="smollm2", prompt="The sky is", raw=True, options=GREEDY)
    same = openai.OpenAI(base_url=smollm + "/v1", api_key=KEY, max_retries=0).completions.create(
        model=SMOLLM_NAME, prompt="The sky is", temperature=0, max_tokens=24)
    assert raw.response == same.choices[0].text
    assert raw.prompt_eval_count == same.usage.prompt_tokens


def test_gemma_generates_from_its_prompt_as_is_and_chat_says_to_use_generate(gemma):
    client = _client(gemma, None)
    reply = client.generate(model="gemma-3-270m", prompt="The capital of France is",
                            options={"temperature": 0, "num_predict": 12})
    assert reply.response and reply.eval_count <= 12
    as_raw = client.generate(model="gemma-3-270m", prompt="The capital of France is", raw=True,
                             options={"temperature": 0, "num_predict": 12})
    assert as_raw.response == reply.response
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="gemma-3-270m", messages=QUESTION[1:])
    assert refused.value.status_code == 400 and "/api/generate" in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="gemma-3-270m", prompt="x", system="be terse")
    assert refused.value.status_code == 400 and "chat template" in refused.value.error


def test_no_prompt_or_no_messages_loads_the_model(smollm):
    client = _client(smollm)
    loaded = client.generate(model="smollm2", prompt="", keep_alive="10m")
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    assert [m.model for m in client.ps().models] == [SMOLLM_NAME]
    unloaded = client.chat(model="smollm2", messages=[], keep_alive=0)
    assert (unloaded.done, unloaded.done_reason, unloaded.message.content) == (True, "unload", "")
    assert client.ps().models == []                 # keep_alive 0 and nothing asked: unloaded
    again = client.chat(model="smollm2:latest", messages=[], keep_alive=0)
    assert again.done_reason == "unload" and client.ps().models == []     # nothing loaded for it
    client.generate(model="smollm2", prompt="", keep_alive=-1)     # loaded again, and kept
    [running] = client.ps().models
    assert running.model == SMOLLM_NAME and running.expires_at.year > 2300


# -- the models ------------------------------------------------------------------------------
def test_tags_ps_show_and_version(smollm, smollm_path):
    client = _client(smollm)
    listed, *on_disk = client.list().models         # the model loaded first, then the others
    assert listed.model == SMOLLM_NAME and listed.size == smollm_path.stat().st_size
    assert SMOLLM_NAME not in {m.model for m in on_disk}
    from helpers import sha256_of
    # the digest is computed in the background: "" until it is known, then the file's sha256
    deadline = time.monotonic() + 60
    while listed.digest != sha256_of(smollm_path):
        assert listed.digest == "" and time.monotonic() < deadline, listed.digest
        time.sleep(0.1)
        listed = client.list().models[0]
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    assert listed.details.parameter_size == "135M"
    assert listed.details.quantization_level == "Q4_1"
    [running] = client.ps().models
    assert running.model == SMOLLM_NAME and running.context_length == 1024
    assert running.expires_at.year > 2300 and running.digest == listed.digest
    # the memory it holds, as the fit estimated it: more than the weights, all in RAM on a CPU
    assert running.size > listed.size and 0 <= running.size_vram <= running.size
    shown = client.show("smollm2")
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == 8192
    assert info["llama.block_count"] == 30 and info["tokenizer.ggml.tokens"] is None
    assert "tokenizer.chat_template" not in info
    assert "<|im_start|>" in shown.template and shown.capabilities == ["completion", "tools"]
    assert "num_ctx        1024" in shown.parameters and "temperature" in shown.parameters
    assert shown.modelfile.startswith("# Modelfile") and str(smollm_path) in shown.modelfile
    status, headers, raw = _raw(smollm, "/api/version")
    assert status == 200 and json.loads(raw)["version"].count(".") == 2
    for method in ("GET", "HEAD"):
        status, headers, raw = _raw(smollm, "/", method=method)
        assert status == 200 and raw == (b"Ollama is running" if method == "GET" else b"")


def test_gemma_is_described_from_its_own_header(gemma):
    client = _client(gemma, None)
    details = client.list().models[0].details
    assert (details.family, details.quantization_level) == ("gemma3", "Q4_K_M")
    assert details.parameter_size == "268M"
    shown = client.show("gemma-3-270m:latest")
    assert shown.modelinfo["general.architecture"] == "gemma3"
    assert shown.modelinfo["gemma3.context_length"] == 32768
    assert shown.capabilities == ["completion"] and shown.template == ""


def test_an_unknown_model_is_a_404(smollm):
    client = _client(smollm)
    for call in (lambda: client.chat(model="llama3", messages=QUESTION),
                 lambda: client.generate(model="smollm2:7b", prompt="hi"),
                 lambda: client.show("nope")):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 404 and SMOLLM_NAME in refused.value.error


# -- options, format, think, tools -----------------------------------------------------------
def test_num_predict_seed_and_stop(smollm):
    client = _client(smollm)
    short = client.chat(model="smollm2", messages=QUESTION, options={"temperature": 0,
                                                                      "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    sampled = [client.chat(model="smollm2", messages=QUESTION,
                           options={"temperature": 1.0, "seed": 7, "num_predict": 16})
               for _ in range(2)]
    assert sampled[0].message.content == sampled[1].message.content
    text = client.chat(model="smollm2", messages=QUESTION, options=GREEDY).message.content
    word = text.split()[1]
    stopped = client.chat(model="smollm2", messages=QUESTION,
                          options={**GREEDY, "stop": ["zzzq", word]})
    assert stopped.message.content == text[:text.index(word)]
    assert stopped.done_reason == "stop"
    small = client.chat(model="smollm2", messages=QUESTION,
                        options={"temperature": 0, "num_ctx": short.prompt_eval_count + 2})
    assert small.eval_count == 2 and small.done_reason == "length"
    # clients send num_ctx with every request as a load setting: past --ctx it means the server's
    large = client.chat(model="smollm2", messages=QUESTION, options={**GREEDY, "num_ctx": 131072})
    assert large.message.content == text


def test_format_json_and_a_schema(smollm):
    client = _client(smollm)
    ask = [{"role": "user", "content": "Give a colour and its hex code as JSON."}]
    anything = client.chat(model="smollm2", messages=ask, format="json",
                           options={"temperature": 0, "num_predict": 64})
    assert isinstance(json.loads(anything.message.content), dict)
    schema = {"type": "object", "required": ["name", "hex"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}}
    for stream in (False, True):
        reply = client.generate(model="smollm2", prompt=ask[0]["content"], format=schema,
                                options={"temperature": 0, "num_predict": 64}, stream=stream)
        text = reply.response if not stream else "".join(c.response for c in reply)
        jsonschema.validate(json.loads(text), schema)


def test_think_puts_the_trace_in_thinking(thinking):
    url, name = thinking
    client = _client(url, None)
    whole = client.chat(model=name, messages=QUESTION, think=True, options=GREEDY)
    assert whole.message.thinking and whole.message.content
    same = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions \
        .create(model=name, messages=QUESTION, temperature=0, max_tokens=24).choices[0].message
    assert (whole.message.thinking, whole.message.content) == \
        (same.model_extra["reasoning_content"], same.content)
    chunks = list(client.chat(model=name, messages=QUESTION, think=True, options=GREEDY,
                              stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == whole.message.thinking
    assert "".join(c.message.content for c in chunks) == whole.message.content
    generated = client.generate(model=name, system=QUESTION[0]["content"],
                                prompt=QUESTION[1]["content"], think=True, options=GREEDY)
    assert (generated.thinking, generated.response) == (whole.message.thinking,
                                                        whole.message.content)
    off = client.chat(model=name, messages=QUESTION, think=False, options=GREEDY)
    assert off.message.thinking is None and off.message.content
    assert "thinking" in client.show(name).capabilities


def test_think_on_a_model_that_does_not_think_is_a_400(smollm):
    with pytest.raises(ollama.ResponseError) as refused:
        _client(smollm).chat(model="smollm2", messages=QUESTION, think=True)
    assert refused.value.status_code == 400 and "does not think" in refused.value.error
    assert _client(smollm).chat(model="smollm2", messages=QUESTION, think=False,
                                options={"num_predict": 2}).eval_count == 2


def test_tool_calls_in_ollamas_shape(thinking):
    """SmolLM2 writes a call when it is shown one (it calls no tool of its own accord): the
    server reads it as OpenAI's endpoint does and gives it in Ollama's shape, arguments an
    object, whole and streamed; a conversation carrying the call and its result goes on."""
    url, name = thinking
    client = _client(url, None)
    ask = [{"role": "user", "content": 'Write the call: <tool_call>{"name": "get_weather", '
                                       '"arguments": {"city": "Paris", "unit": "celsius"}}'
                                       '</tool_call>'}]
    options = {"temperature": 0, "num_predict": 100}
    whole = client.chat(model=name, messages=ask, tools=TOOLS, think=True, options=options)
    calls = whole.message.tool_calls
    assert calls and whole.done_reason == "stop"
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(call.function.arguments, WEATHER)
    same = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions \
        .create(model=name, messages=ask, tools=TOOLS, temperature=0, max_tokens=100) \
        .choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in same] == \
        [(c.function.name, c.function.arguments) for c in calls]
    chunks = list(client.chat(model=name, messages=ask, tools=TOOLS, think=True,
                              options=options, stream=True))
    streamed = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]
    history = [*ask, {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather",
                                                   "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "21 degrees, sunny"}]
    on = client.chat(model=name, messages=history, tools=TOOLS,
                     options={"temperature": 0, "num_predict": 16})
    as_openai = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "21 degrees, sunny"}]
    again = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions \
        .create(model=name, messages=as_openai, tools=TOOLS, temperature=0, max_tokens=16)
    assert on.prompt_eval_count == again.usage.prompt_tokens
    assert on.message.content == (again.choices[0].message.content or "")


# -- refusals and the server's doors ---------------------------------------------------------
@pytest.mark.parametrize("change, words", [
    ({"options": {"temperature": 5}}, "options.temperature"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"options": {"temprature": 0.5}}, "options.temprature"),
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"repeat_last_n": 100000}}, "options.repeat_last_n"),
    ({"options": "hot"}, "options"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"format": "xml"}, "format"),
    ({"format": {"type": "object", "properties": {"a": {"type": "wat"}}}}, "format"),
    ({"think": "maybe"}, "think"),
    ({"keep_alive": "5 minutes"}, "keep_alive"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
])
def test_bad_chat_requests_are_400s_in_ollamas_shape(smollm, change, words):
    body = {"model": "smollm2", "messages": QUESTION, **change}
    assert words in _ollama_error(*_raw(smollm, "/api/chat", body), 400)


@pytest.mark.parametrize("change, words", [
    ({"suffix": "}"}, "suffix"), ({"images": ["aGk="]}, "images"),
    ({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
    ({"raw": True, "system": "be terse"}, "raw"), ({"prompt": 5}, "prompt"),
])
def test_bad_generate_requests_are_400s_in_ollamas_shape(smollm, change, words):
    body = {"model": "smollm2", "prompt": "hi", **change}
    assert words in _ollama_error(*_raw(smollm, "/api/generate", body), 400)


def test_the_client_raises_a_400_on_images(smollm, tmp_path):
    image = tmp_path / "dot.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ollama.ResponseError) as refused:
        _client(smollm).generate(model="smollm2", prompt="What is this?", images=[image])
    assert refused.value.status_code == 400 and "images" in refused.value.error


def test_the_key_and_the_host_guard_the_ollama_paths(smollm):
    for key in ("s3cre", None):
        with pytest.raises(ollama.ResponseError) as refused:
            _client(smollm, key).chat(model="smollm2", messages=QUESTION)
        assert refused.value.status_code == 401
        for path, body in (("/api/chat", {"model": "smollm2", "messages": QUESTION}),
                           ("/api/generate", {"model": "smollm2", "prompt": "hi"}),
                           ("/api/show", {"model": "smollm2"}), ("/api/tags", None),
                           ("/api/ps", None), ("/api/version", None)):
            assert "API key" in _ollama_error(*_raw(smollm, path, body, key=key), 401)
    for path, body in (("/api/chat", {"model": "smollm2", "messages": QUESTION}),
                       ("/api/tags", None)):
        message = _ollama_error(*_raw(smollm, path, body, host="evil.example"), 403)
        assert "--allowed-hosts" in message
    assert "/api/chat" in _ollama_error(*_raw(smollm, "/api/nothing"), 404)
    assert "POST" in _ollama_error(*_raw(smollm, "/api/chat"), 405)


# -- one answer, three APIs ------------------------------------------------------------------
def test_the_same_greedy_request_gives_the_same_text_through_all_three_clients(smollm, gemma):
    """temperature 0, the same messages, the same most tokens: OpenAI's chat, Anthropic's
    Messages and Ollama's chat on SmolLM2; on Gemma 3 (no chat template: Messages refuses it)
    OpenAI's completions and Ollama's generate. Each model is asked once first, so that every
    compared request continues from the same kept cells: where a request continues from is
    batch make-up, which moves the last bits (docs/batching.md), not what the APIs say."""
    _client(smollm).chat(model="smollm2", messages=QUESTION, options=GREEDY)
    _client(gemma, None).generate(model=GEMMA_NAME, prompt="The three primary colours are",
                                  options=GREEDY)
    ollama_text = _client(smollm).chat(model="smollm2", messages=QUESTION,
                                       options=GREEDY).message.content
    openai_text = openai.OpenAI(base_url=smollm + "/v1", api_key=KEY, max_retries=0) \
        .chat.completions.create(model=SMOLLM_NAME, messages=QUESTION, temperature=0,
                                 max_tokens=24).choices[0].message.content
    anthropic_text = anthropic.Anthropic(base_url=smollm, api_key=KEY, max_retries=0) \
        .messages.create(model=SMOLLM_NAME, max_tokens=24, system=QUESTION[0]["content"],
                         messages=QUESTION[1:], extra_body={"temperature": 0}).content[0].text
    assert ollama_text and ollama_text == openai_text == anthropic_text
    prompt = "The three primary colours are"
    generated = _client(gemma, None).generate(model=GEMMA_NAME, prompt=prompt,
                                              options=GREEDY).response
    completed = openai.OpenAI(base_url=gemma + "/v1", api_key="x", max_retries=0) \
        .completions.create(model=GEMMA_NAME, prompt=prompt, temperature=0,
                            max_tokens=24).choices[0].text
    assert generated and generated == completed
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic.Anthropic(base_url=gemma, api_key="x", max_retries=0).messages.create(
            model=GEMMA_NAME, max_tokens=24, messages=QUESTION[1:])
    assert "chat template" in str(refused.value)
