"""OpenAI's Responses API (/v1/responses) on a live `localinfer serve`, driven by the official
`openai` client: SmolLM2 as itself (tools in llama.cpp's generic JSON format) and wearing
Qwen3-Thinking-2507's template (a trace, as reasoning items), one server for both. What the
client would never send goes over raw HTTP. The store's bounds are tested on their own."""

from __future__ import annotations

import json
import signal

import pydantic
import pytest
from chat_templates import QWEN3_THINKING_2507
from helpers import post_json, smollm_wearing, start_server

from localinfer.server.responses_store import Store

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2-135m-instruct:Q4_1"
ASK = dict(model=MODEL, instructions="You are terse.", input="Name a colour.",
           max_output_tokens=24, temperature=0)
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER, "strict": True}
PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def server(models_home, tmp_path_factory):
    thinking = smollm_wearing(QWEN3_THINKING_2507, tmp_path_factory.mktemp("responses"),
                              "thinking")
    proc, url = start_server("smollm2", str(thinking), "--ctx", "1024", "--parallel", "2")
    yield url
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_greedy_chat_answer_and_counts_its_tokens(client):
    response = client.responses.create(**ASK)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name a colour."}])
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    counted = client.responses.input_tokens.count(
        model=MODEL, instructions="You are terse.", input="Name a colour.")
    assert counted.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "You are terse." and response.max_output_tokens == 24


def test_a_stream_sends_the_events_in_order_adding_up_to_the_whole_response(client):
    whole = client.responses.create(**ASK)
    with client.responses.stream(**{**ASK, "max_output_tokens": 200}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    # a keepalive, numbered with the rest, comes wherever the stream is silent for a while
    kinds = [e.type for e in events if e.type != "keepalive"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and text.startswith(whole.output_text)
    assert final.id == events[0].response.id and final.status == "completed"


def test_previous_response_id_continues_the_conversation_until_deleted(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    said = [{"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]
    chat = client.chat.completions.create(model=MODEL, messages=said, max_tokens=8,
                                          temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    for gone in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(model=MODEL, input="Hi",
                                                 previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_function_call_round_trip(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(model=MODEL, input=asked, tools=[TOOL],
                                     tool_choice="required", parallel_tool_calls=False,
                                     temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(            # the result read, not another call
        model=MODEL, tools=[TOOL], tool_choice="none", temperature=0, max_output_tokens=24,
        input=[*asked, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 degrees"}])
    assert [item.type for item in answer.output] == ["message"]
    chat = client.chat.completions.create(     # the same conversation said as chat
        model=MODEL, tool_choice="none", temperature=0, max_tokens=24,
        tools=[{"type": "function", "function": {k: TOOL[k] for k in
                                                 ("name", "description", "parameters")}}],
        messages=[*asked, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees"}])
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    # streamed, the call is an item of its own with its arguments' events
    with client.responses.stream(model=MODEL, input=asked, tools=[TOOL],
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events if e.type != "keepalive"]
    deltas = kinds.count("response.function_call_arguments.delta")    # as decoded (issue 43)
    assert deltas > 1 and kinds[2:5 + deltas] == [
        "response.output_item.added", *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done"], kinds
    assert final.output[0].arguments == call.arguments


def test_a_json_schema_text_format_gives_a_valid_document(client):
    response = client.responses.create(
        model=MODEL, input="Describe a fictional person.", temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_a_thinking_models_trace_is_a_reasoning_item(client):
    ask = dict(model="thinking.gguf", input="Name a colour.", max_output_tokens=40,
               temperature=0, extra_body={"thinking_budget": 8},
               include=["reasoning.encrypted_content"])
    response = client.responses.create(**ask)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    trace = reasoning.content[0].text
    assert trace and reasoning.encrypted_content == trace and "</think>" not in trace
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 10
    assert message.type == "message" and "<think>" not in response.output_text
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == trace
    off = client.responses.create(**{**ask, "reasoning": {"effort": "none"}})
    assert [item.type for item in off.output] == ["message"]


def test_tools_of_other_kinds_are_left_out_and_listed(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2,
            "tools": [{"type": "web_search"}, {"type": "local_shell"}, TOOL,
                      {"type": "custom", "name": "apply_patch", "description": "Edit files"},
                      {"type": "namespace", "name": "mcp", "description": "x", "tools": []}]}
    status, reply = post_json(server + "/v1/responses", body)
    assert status == 200, reply
    assert reply["ignored_tools"] == [{"type": "web_search"}, {"type": "local_shell"},
                                      {"type": "custom", "name": "apply_patch"},
                                      {"type": "namespace", "name": "mcp"}]
    assert [t["name"] for t in reply["tools"]] == ["get_weather"]
    counts = [post_json(server + "/v1/responses/input_tokens", {**body, "tools": tools})[1]
              for tools in (body["tools"], [TOOL])]
    assert counts[0] == counts[1] and counts[0]["object"] == "response.input_tokens"


def test_codex_s_ollama_mode_finds_a_version_with_the_responses_api(server):
    import urllib.request
    with urllib.request.urlopen(server + "/api/version") as reply:
        version = json.loads(reply.read())["version"]
    assert tuple(map(int, version.split("."))) >= (0, 13, 4)
    status, reply = post_json(server + "/v1/responses",
                              {"model": "smollm2:latest", "input": "Hi", "max_output_tokens": 2})
    assert status == 200 and reply["status"] in ("completed", "incomplete")


def test_a_result_no_call_asked_for_is_said_to_the_model(server):
    """Codex sends its goal tool's result with a name and namespace and no call_id, after the
    calls and results of a turn (seen as a 400 on its second request)."""
    turn = [{"type": "message", "role": "user", "content": "Run echo hi."},
            {"type": "function_call", "call_id": "c1", "name": "exec_command",
             "arguments": '{"cmd": "echo hi"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "hi"}]
    goal = {"type": "function_call_output", "name": "goal_objective", "namespace": "agent",
            "output": "localinfer-was-here"}
    body = {"model": MODEL, "input": [*turn, goal], "max_output_tokens": 2, "temperature": 0}
    status, reply = post_json(server + "/v1/responses", body)
    assert status == 200 and reply["status"] in ("completed", "incomplete"), reply
    counts = [post_json(server + "/v1/responses/input_tokens", {**body, "input": said})[1]
              for said in ([*turn, goal], turn)]
    assert counts[0]["input_tokens"] > counts[1]["input_tokens"], counts


@pytest.mark.parametrize("change, status, words", [
    ({"input": 7}, 400, "'input' must be a string or a list"),
    ({"input": []}, 400, "'input' must be a string or a list"),
    ({"input": [{"type": "message", "role": "boss", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0] is not base64"),     # images are read (issue 46): this one is not
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     400, "only text parts"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     400, "input[0].arguments must be a JSON object"),
    ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, 400,
     "input[0].call_id must be a string"),
    ({"input": [{"type": "function_call_output", "name": ["x"], "output": "x"}]}, 400,
     "input[0].name"),
    ({"input": [{"type": "telepathy"}]}, 400, "(not telepathy)"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, 400, "holds no message"),
    ({"instructions": ["x"]}, 400, "'instructions' must be a string"),
    ({"tools": {"type": "function"}}, 400, "'tools' must be a list"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400,
     "not among the function tools"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, 400, "needs a function"),
    ({"tools": [{**TOOL, "parameters": "x"}]}, 400, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema"}}}, 400, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"max_output_tokens": 0}, 400, "'max_output_tokens' must be an integer"),
    ({"max_output_tokens": 10**400}, 400, "'max_output_tokens' must be an integer"),
    ({"temperature": "hot"}, 400, "'temperature'"),
    ({"store": "yes"}, 400, "'store' must be true or false"),
    ({"metadata": {"k": 1}}, 400, "'metadata'"),
    ({"background": True}, 400, "background"),
    ({"conversation": "conv_1"}, 400, "previous_response_id"),
    ({"include": "everything"}, 400, "'include'"),
    ({"previous_response_id": "resp_nope"}, 404, "resp_nope"),
    ({"previous_response_id": 5}, 400, "'previous_response_id' must be a string"),
    ({"model": "nope"}, 404, "nope"),
    ({"model": None}, 400, "'model'"),
])
def test_bad_requests_are_refused_in_openai_s_error_shape(server, change, status, words):
    got, reply = post_json(server + "/v1/responses",
                           {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **change})
    assert got == status, reply
    assert set(reply) == {"error"} and words in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"


def test_unknown_ids_and_paths_are_404s(server):
    import urllib.error
    import urllib.request
    for method, path in (("GET", "/v1/responses/resp_unknown"),
                         ("DELETE", "/v1/responses/resp_unknown"),
                         ("GET", "/v1/responses/" + "x" * 5000)):
        request = urllib.request.Request(server + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        assert caught.value.code == 404
        reply = json.loads(caught.value.read())
        assert reply["error"]["type"] == "invalid_request_error"
        assert len(reply["error"]["message"]) < 400


def test_a_silent_stream_sends_numbered_keepalive_events():
    """Not an SSE comment, which Codex's client skips before its idle timeout ends the turn:
    OpenAI's `keepalive` event, numbered in the stream's sequence."""
    import asyncio

    from localinfer.server import jobs, responses

    reply = object.__new__(responses._KeptAlive)
    reply.sequence = 2

    async def slow():
        yield "first"
        await asyncio.sleep(0.35)
        reply.event("response.output_text.delta")
        yield "last"

    async def frames():
        return [f async for f in jobs.kept_alive(slow(), reply.keep_alive, seconds=0.1)]
    got = asyncio.run(frames())
    beats = [json.loads(f.split("data: ", 1)[1]) for f in got[1:-1]]
    assert got[0] == "first" and got[-1] == "last" and len(beats) >= 2
    assert all(f.startswith("event: keepalive\n") for f in got[1:-1])
    assert [b["sequence_number"] for b in beats] == list(range(2, 2 + len(beats)))
    assert {b["type"] for b in beats} == {"keepalive"} and reply.sequence == 3 + len(beats)


def _kept(ident: str, text: str = "x") -> tuple[dict, list[dict]]:
    return {"id": ident, "object": "response"}, [{"role": "user", "content": text}]


def test_the_store_keeps_at_most_its_count_and_bytes_the_oldest_going_first():
    store = Store(count=2)
    for ident in ("a", "b", "c"):
        store.put(*_kept(ident))
    assert [store.get(i) is not None for i in "abc"] == [False, True, True]
    store = Store(size=600)
    store.put(*_kept("big", "x" * 300))
    store.put(*_kept("next", "y" * 300))
    assert store.get("big") is None and store.get("next") is not None
    store.put(*_kept("huge", "z" * 1000))           # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("next") is not None


def test_the_store_forgets_a_response_past_its_age_or_deleted():
    now = [0.0]
    store = Store(age_s=60, clock=lambda: now[0])
    store.put(*_kept("old"))
    now[0] = 30
    store.put(*_kept("young"))
    assert store.delete("young") and not store.delete("young")
    store.put(*_kept("young"))
    now[0] = 61
    assert store.get("old") is None and store.get("young") is not None
    now[0] = 91
    assert store.get("young") is None and not store.delete("young")


# -- the OpenAI Agents SDK, its default model (the Responses API) --------------------------------
@pytest.fixture
def agents(server):
    """The Agents SDK with this server as its default client, tracing off (it would export to
    OpenAI)."""
    sdk = pytest.importorskip("agents")
    sdk.set_default_openai_client(openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused",
                                                     max_retries=0), use_for_tracing=False)
    sdk.set_default_openai_api("responses")
    sdk.set_tracing_disabled(True)
    return sdk


def _weather_tool(sdk, asked: list[str]):
    @sdk.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny and 21 degrees in {city}."
    return get_weather


def test_an_agents_sdk_agent_calls_a_function_tool_and_answers_from_its_result(agents):
    asked: list[str] = []
    tool = _weather_tool(agents, asked)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48)
    agent = agents.Agent(name="weather", model=MODEL, instructions="Answer briefly.",
                         tools=[tool], model_settings=settings,
                         tool_use_behavior="stop_on_first_tool")
    called = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert [item.type for item in called.new_items] == ["tool_call_item",
                                                        "tool_call_output_item"]
    assert called.final_output == f"Sunny and 21 degrees in {asked[0]}."
    # the SDK's own items of that run (its call and the tool's output) as the next input
    answer = agents.Runner.run_sync(
        # room to finish: a cut answer is `response.incomplete`, which the SDK raises, as
        # it does for OpenAI's own
        agent.clone(model_settings=settings.resolve(agents.ModelSettings(
            tool_choice="none", max_tokens=400)), tool_use_behavior="run_llm_again"),
        [*called.to_input_list(), {"role": "user", "content": "Say it in one sentence."}],
        max_turns=1)
    assert isinstance(answer.final_output, str) and answer.final_output and len(asked) == 1


class _City(pydantic.BaseModel):
    city: str
    sunny: bool


def test_an_agents_sdk_agent_gives_a_typed_output(agents):
    agent = agents.Agent(name="typed", model=MODEL, instructions="Describe Paris.",
                         output_type=_City,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=48))
    result = agents.Runner.run_sync(agent, "Is it sunny in Paris?", max_turns=1)
    assert isinstance(result.final_output, _City)


def test_an_agents_sdk_agent_with_a_tool_gives_a_typed_output(agents):
    asked: list[str] = []
    agent = agents.Agent(name="typed", model=MODEL, instructions="Answer briefly.",
                         tools=[_weather_tool(agents, asked)], output_type=_City,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=48))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert isinstance(result.final_output, _City)
