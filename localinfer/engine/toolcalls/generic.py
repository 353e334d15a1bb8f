"""llama.cpp's generic format, for a template that knows no tools: the tools described in a
system message and the whole answer one JSON object, `{"tool_call": {...}}`,
`{"tool_calls": [...]}` or (with `auto`) `{"response": "..."}`."""

from __future__ import annotations

import json

from localinfer.engine.toolcalls.common import (Convert, Parsed, ToolFormat, any_call, call_of,
                                                calls_in, hoisted, with_calls)

INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) "
               "or with `response` reply to the user's request")


class Generic(ToolFormat):
    name = "generic"
    renders_tools = False

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        """A call (or several) or, with `auto`, a text response."""
        call = any_call(tools, with_id=parallel)
        called = ({"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": call, "minItems": 1}}, "required": ["tool_calls"]}
            if parallel else
            {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]})
        called["additionalProperties"] = False
        schema = called
        if auto:
            response = {"type": "object", "properties": {"response": {"type": "string"}},
                        "required": ["response"], "additionalProperties": False}
            schema = {"anyOf": [called, response]}
        return convert(hoisted(schema, list(tools.values())))

    def parse(self, text: str) -> Parsed:
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(value, dict):
            return text, []
        if isinstance(value.get("response"), str) and len(value) == 1:
            return value["response"], []
        if "tool_call" in value:
            call = call_of(value["tool_call"])
            return with_calls(text, "", [call] if call else None)
        return with_calls(text, "", calls_in(value.get("tool_calls")))
