"""`serve` with tool calls (issue 28 §1), driven by the official `openai` client: SmolLM2's weights
wearing Qwen 2.5's template (Hermes `<tool_call>` format, its tools in the template) and SmolLM2
as itself (no tools in its template: llama.cpp's generic JSON format)."""

from __future__ import annotations

import json

import pytest
from chat_templates import QWEN25
from helpers import smollm_wearing
from test_serve_thinking import _start, _stop

from localinfer.engine import toolcalls

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
          "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(models_home, tmp_path_factory):
    work = tmp_path_factory.mktemp("tools")
    started = [_start(str(smollm_wearing(QWEN25, work, "qwen25"))), _start("smollm2")]
    try:
        yield {"hermes": (openai.OpenAI(base_url=started[0][1] + "/v1", api_key="x",
                                        max_retries=0), "qwen25.gguf"),
               "generic": (openai.OpenAI(base_url=started[1][1] + "/v1", api_key="x",
                                         max_retries=0), "smollm2-135m-instruct:Q4_1")}
    finally:
        for proc, _ in started:
            _stop(proc)


def _ask(served, name, **extra):
    client, model = served[name]
    return client.chat.completions.create(model=model, **{
        "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 120, **extra})


def _valid(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hermes", "generic"])
def test_required_and_named(served, name):
    reply = _ask(served, name, tool_choice="required")
    assert reply.choices[0].finish_reason == "tool_calls"
    _valid(reply.choices[0].message.tool_calls)
    reply = _ask(served, name, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    _valid(calls)
    assert {c.function.name for c in calls} == {"get_time"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hermes", "generic"])
def test_none_answers_in_text(served, name):
    reply = _ask(served, name, tool_choice="none", max_tokens=16)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hermes", "generic"])
def test_streamed_calls(served, name):
    client, model = served[name]
    chunks = list(client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=120, stream=True))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].id and calls[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = _ask(served, name, tool_choice="required")
    assert whole.choices[0].message.tool_calls[0].function.arguments == \
        calls[0].function.arguments


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hermes", "generic"])
def test_tool_result_round_trip(served, name):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    reply = _ask(served, name, messages=history, tool_choice="auto", max_tokens=24)
    message = reply.choices[0].message
    assert message.content or message.tool_calls


@pytest.mark.slow
@pytest.mark.parametrize("extra, param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]},
     "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400(served, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(served, "hermes", **extra)
    assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.slow
def test_tool_choice_without_tools_is_400(served):
    client, model = served["hermes"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, tool_choice="required")


# -- the parsers, without a model ----------------------------------------------------------------
def test_parsers():
    hermes, generic = toolcalls.HERMES.parse, toolcalls.GENERIC.parse
    assert hermes('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>') == \
        ("Sure.", [("f", {"a": 1}, None)])
    assert hermes("<tool_call>\n{\"name\": ") == ("<tool_call>\n{\"name\": ", [])
    assert generic('{"tool_call": {"name": "f", "arguments": {}}}') == ("", [("f", {}, None)])
    assert generic('{"tool_calls": [{"name": "f", "arguments": {}, "id": "c1"}]}') == \
        ("", [("f", {}, "c1")])
    assert generic('{"tool_calls": [{"name": "f"}, 3]}') == \
        ('{"tool_calls": [{"name": "f"}, 3]}', [])
    assert generic('{"response": "hi"}') == ("hi", [])
