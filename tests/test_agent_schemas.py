"""Tool schemas as coding agents write them (issue 43, items 2 and 4), in-process: zod's numeric
bounds enforced in the grammar, annotation keywords accepted, what would make the grammar huge
bounded instead of refused, an error that names the tool and its own path; a typed answer and
tool calls in one grammar. The agents' own first requests (tests/data/agents/) are replayed
through the server's request checks. Grammars are walked on SmolLM2's real vocabulary."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from chat_templates import LLAMA32, QWEN25, SMOLLM2

from localinfer.engine.structured import from_schema
from localinfer.errors import UsageError
from localinfer.server import anthropic_tools, tools
from localinfer.server.errors import BadRequest

AGENTS = Path(__file__).parent / "data" / "agents"
READ = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "additionalProperties": False, "required": ["file_path"], "properties": {
            "file_path": {"type": "string", "description": "The absolute path"},
            "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
            "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991}}}
FETCH = {"type": "object", "required": ["url"], "properties": {
    "url": {"type": "string", "format": "uri", "title": "URL", "examples": ["https://a.b"]},
    "content": {"type": "string", "maxLength": 524288, "$comment": "zod's .max()"},
    "headers": {"type": "object", "propertyNames": {"type": "string"},
                "additionalProperties": {"type": "string"}},
    "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 600, "default": 30,
                "deprecated": False, "readOnly": False}}}


def _tools(*pairs) -> dict:
    return {"tools": [{"type": "function", "function": {"name": n, "parameters": p}}
                      for n, p in pairs]}


@pytest.fixture(scope="module")
def vocab(smollm_path):
    from localinfer.backends.llama.vocab import LlamaVocab
    return LlamaVocab(smollm_path)


def _spells(vocab, grammar, text: str) -> bool:
    """Whether the grammar takes exactly `text` (its tokens one by one, then the end)."""
    for token in vocab.tokenize(text, special=False):
        if not grammar.allows(np.array([token], dtype=np.int32))[0]:
            return False
        grammar.accept(token)
    return bool(grammar.allows(np.array([vocab.eos_token], dtype=np.int32))[0])


@pytest.mark.parametrize("schema, inside, outside", [
    ({"type": "integer", "minimum": 0, "maximum": 9007199254740991},
     ["0", "7", "9007199254740991", "1234567"], ["-1", "9007199254740992", "01", "1.5"]),
    ({"type": "integer", "exclusiveMinimum": 0}, ["1", "42"], ["0", "-3"]),
    ({"type": "integer", "minimum": -20, "exclusiveMaximum": 5}, ["-20", "-7", "0", "4"],
     ["-21", "5", "-0"]),
    ({"type": "number", "minimum": 0, "maximum": 1}, ["0", "1", "0.25"], ["-0.5", "1.5", "2"]),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 600}, ["30", "599.5", "600"],
     ["0", "-1", "600.5", "601"]),
])
def test_numeric_bounds_are_enforced_by_the_grammar(vocab, schema, inside, outside):
    """zod's integer bounds (today a 400: `the keyword 'minimum' ... is not supported`) are
    spelled digit by digit: every value in range is taken, none outside."""
    gbnf = from_schema(schema, "test").gbnf
    for text in inside + outside:
        assert _spells(vocab, vocab.grammar(gbnf), text) == (text in inside), text


def test_an_agents_tools_are_accepted_and_their_bounds_kept(vocab):
    """Claude Code's Read and a WebFetch-like tool (format uri, maxLength 524288, propertyNames,
    annotations): accepted; the call's grammar keeps the integer bounds."""
    plan = tools.plan(_tools(("Read", READ), ("WebFetch", FETCH)), SMOLLM2)
    gbnf = plan.format.grammar(plan.params, tools._gbnf, parallel=False, auto=False)
    call = '{"tool_call": {"name": "Read", "arguments": {"file_path": "/a", "offset": %s}}}'
    assert _spells(vocab, vocab.grammar(gbnf), call % "10")
    assert not _spells(vocab, vocab.grammar(gbnf), call % "-1")
    fetch = {"url": "not a uri, and that is allowed", "content": "x" * 2000, "headers": {"a": "b"}}
    assert _spells(vocab, vocab.grammar(gbnf), json.dumps(
        {"tool_call": {"name": "WebFetch", "arguments": fetch}}))


@pytest.mark.parametrize("schema, said", [
    ({"type": "string", "format": "uri"}, "the format 'uri' at /format is not supported"),
    ({"type": "string", "maxLength": 524288}, "/maxLength must be a whole number from 0 to 1000"),
    ({"type": "object", "propertyNames": {"pattern": "^a$"}},
     'propertyNames other than {"type": "string"} at /propertyNames is not supported'),
    ({"type": "integer", "multipleOf": 2}, "the keyword 'multipleOf' at /multipleOf"),
    ({"type": "number", "minimum": 0.2, "maximum": 0.7}, "no number the grammar can write"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "no number the grammar can write"),
])
def test_a_schema_the_user_wrote_keeps_its_strictness(schema, said):
    """--json-schema (and response_format) refuse what the grammar would not enforce; the same
    schema as a tool's parameters is accepted, the keyword left to the tool."""
    with pytest.raises(UsageError, match=None) as e:
        from_schema(schema, "--json-schema")
    assert said in str(e.value)
    assert from_schema(schema, "tools", loose=True).gbnf
    plan = tools.plan(_tools(("t", {"type": "object", "properties": {"p": schema}})), SMOLLM2)
    assert "p" in plan.params["t"]["properties"]


def test_plain_property_names_and_annotations_are_accepted_strictly():
    from_schema({"type": "object", "propertyNames": {"type": "string"}, "title": "T",
                 "additionalProperties": {"type": "integer", "minimum": 0},
                 "examples": [{}], "$comment": "c", "deprecated": True}, "--json-schema")


def test_loose_rule_splits_a_list_of_types_and_keeps_each_types_keywords(vocab):
    schema = {"type": ["string", "integer", "null"], "maxLength": 3, "minimum": 0}
    gbnf = from_schema(schema, "tools", loose=True).gbnf
    for text, ok in [('"abc"', True), ('"abcd"', False), ("5", True), ("-5", False),
                     ("null", True)]:
        assert _spells(vocab, vocab.grammar(gbnf), text) == ok, text


def test_an_error_about_a_tool_names_the_tool_and_its_own_path():
    """Not a pointer into the generated call schema (`/anyOf/0/properties/tool_calls/...`)."""
    body = _tools(("Read", READ), ("Broken", {"type": "object", "properties": {
        "offset": {"type": "integer", "minimum": "zero"}}}))
    for template in (SMOLLM2, QWEN25):
        with pytest.raises(BadRequest) as e:
            tools.plan(body, template)
        assert str(e.value) == "tools[1] 'Broken': parameters: /properties/offset/minimum " \
                               "must be a number"


def test_two_tools_definitions_of_one_name_stay_apart(vocab):
    """Each tool's `$defs` are hoisted beside the others': one `Item` no longer replaces
    another's (tool a's integer item was constrained as tool b's string)."""
    def tool(item):
        return {"type": "object", "required": ["x"], "$defs": {"Item": item},
                "properties": {"x": {"$ref": "#/$defs/Item"}}}
    body = _tools(("a", tool({"type": "integer"})), ("b", tool({"type": "string"})))
    for template, call in [(SMOLLM2, '{"tool_call": {"name": "%s", "arguments": {"x": %s}}}'),
                           (QWEN25, '<tool_call>\n{"name": "%s", "arguments": {"x": %s}}\n'
                                    '</tool_call>')]:
        plan = tools.plan(body, template)
        gbnf = plan.format.grammar(plan.params, tools._gbnf, parallel=False, auto=False)
        assert _spells(vocab, vocab.grammar(gbnf), call % ("a", "7"))
        assert _spells(vocab, vocab.grammar(gbnf), call % ("b", '"seven"'))
        assert not _spells(vocab, vocab.grammar(gbnf), call % ("a", '"seven"'))


# -- a typed answer and tools in one grammar (item 4) -----------------------------------------
ANSWER = {"type": "object", "properties": {"city": {"type": "string"},
                                           "temp": {"type": "integer", "minimum": -100}},
          "required": ["city", "temp"], "additionalProperties": False}


@pytest.mark.parametrize("template, call", [
    (SMOLLM2, '{"tool_call": {"name": "Read", "arguments": {"file_path": "/a"}}}'),
    (QWEN25, '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/a"}}\n</tool_call>'),
    (LLAMA32, '{"name": "Read", "parameters": {"file_path": "/a"}}'),
], ids=["generic", "hermes", "llama3"])
def test_one_grammar_takes_a_call_or_the_typed_answer(vocab, template, call):
    """Today a 400 ('response_format' and tool calls cannot be combined)."""
    body = {**_tools(("Read", READ)), "parallel_tool_calls": False}
    plan = tools.with_answer(tools.plan(body, template), ANSWER, "rf")
    gbnf = tools.call_or_answer(plan)
    assert _spells(vocab, vocab.grammar(gbnf), call)
    assert _spells(vocab, vocab.grammar(gbnf), '{"city": "Paris", "temp": 21}')
    assert not _spells(vocab, vocab.grammar(gbnf), '{"city": "Paris", "temp": -101}')
    assert not _spells(vocab, vocab.grammar(gbnf), '{"response": "hi"}')
    text, calls = tools.split(plan, call)
    assert [c["function"]["name"] for c in calls] == ["Read"]
    assert tools.split(plan, '{"city": "Paris", "temp": 21}') == ('{"city": "Paris", "temp": 21}',
                                                                  [])


def test_a_typed_answer_streams_once_its_first_key_shows_it_is_no_call():
    plan = tools.with_answer(tools.plan(_tools(("Read", READ)), SMOLLM2),
                             {"type": "object"}, "rf")
    held = tools.Stream(plan)
    sent = [held.feed(p) for p in ['{', ' "', 'response', '": "hi"}']]
    assert sent == ["", "", '{ "response', '": "hi"}'] and held.finish() == ("", [])
    held = tools.Stream(plan)
    assert [held.feed(p) for p in ['{"tool_', 'call": ']] == ["", ""]


def test_a_typed_answer_is_refused_only_where_the_format_spans_the_trace():
    from chat_templates import GPT_OSS_20B
    plan = tools.plan(_tools(("Read", READ)), GPT_OSS_20B)
    with pytest.raises(BadRequest, match="together with tools is not supported"):
        tools.with_answer(plan, ANSWER, "response_format")


# -- call ids unique across the conversation (item 3) -----------------------------------------
def test_history_ids_met_again_become_unique_and_still_pair():
    def turn(ident, result):
        return [{"role": "assistant", "content": "", "tool_calls": [
                    {"id": ident, "type": "function", "function": {"name": "a", "arguments": {}}}]},
                {"role": "tool", "tool_call_id": ident, "content": result}]
    out = tools.for_template(None, turn("call_1", "r1") + turn("call_1", "r2") + turn("", "r3")
                             + turn("", "r4"), SMOLLM2)
    ids = [m["tool_calls"][0]["id"] for m in out if m["role"] == "assistant"]
    results = [m["tool_call_id"] for m in out if m["role"] == "tool"]
    assert len(set(ids)) == 4 and ids == results


# -- streams that never fall silent (item 5) --------------------------------------------------
def test_a_silent_stream_sends_the_apis_keep_alive():
    from localinfer.server import anthropic, api, jobs

    async def slow():
        yield "a"
        await asyncio.sleep(0.35)
        yield "b"

    async def frames():
        return [f async for f in jobs.kept_alive(slow(), ": keep-alive\n\n", seconds=0.1)]
    got = asyncio.run(frames())
    assert got[0] == "a" and got[-1] == "b" and got.count(": keep-alive\n\n") >= 2
    assert api._Reply.keep_alive.startswith(":")            # an SSE comment
    assert anthropic._Reply.keep_alive.startswith("event: ping\n")


def test_a_subschema_of_annotations_alone_takes_any_value(vocab):
    """Claude Code's Workflow tool: `"args": {"description": ...}`, which the converter failed
    on (AssertionError), so all 24 tools were refused together; `{}` took only objects."""
    gbnf = from_schema({"type": "object", "required": ["args", "any"], "properties": {
        "args": {"description": "any JSON"}, "any": {}}}, "test").gbnf
    for value in ('[1, "a"]', '"text"', "3.5", "null", '{"k": true}'):
        assert _spells(vocab, vocab.grammar(gbnf), '{"args": %s, "any": %s}' % (value, value))


# -- the agents' own first requests (captured by tests/test_agents_claude_opencode.py) --------
def test_the_agents_first_requests_are_prepared_as_the_server_prepares_them(vocab):
    """Claude Code's first request (24 tools, a system turn inside `messages`, thinking
    adaptive, output_config, context_management, cache_control) and OpenCode's (10 tools):
    each made into its job, template, tokens and the tools' grammar, on SmolLM2's vocabulary
    and template (llama.cpp's generic format), as /v1/messages and /v1/chat/completions do."""
    from types import SimpleNamespace

    from localinfer.server import anthropic, requests
    claude = json.loads((AGENTS / "claude-code.json").read_text())
    opencode = json.loads((AGENTS / "opencode.json").read_text())
    assert len(claude["tools"]) == 24 and claude["messages"][-1]["role"] == "system"
    served = SimpleNamespace(names=(claude["model"],), session=vocab, request_ctx=10**6,
                             defaults=requests.Defaults())
    prepared = anthropic._prepare(claude, served)
    assert len(prepared.tools.params) == 24 and len(prepared.job.prompt) > 15_000
    prepared = requests.prepare(opencode, vocab, (opencode["model"],), 10**6, chat=True)
    assert len(prepared.tools.params) == len(opencode["tools"])
    for body in (claude["tools"], opencode["tools"]):
        fields = {"tools": body} if "function" in body[0] else \
            anthropic_tools.request_fields({"tools": body})
        plan = tools.plan(fields, QWEN25)                   # and in Hermes' format
        assert plan.format.grammar(plan.params, tools._gbnf, parallel=True, auto=True)
