"""llama.cpp's generic format, for a template that knows no tools: the tools described in a
system message and the whole answer one JSON object, `{"tool_call": {...}}`,
`{"tool_calls": [...]}` or (with `auto`) `{"response": "..."}`. The wrapper is the format's, not
the answer's: a text answer is the response's string, read out as it is written."""

from __future__ import annotations

import json
import re

from localinfer.engine.toolcalls.common import (Convert, Parsed, ToolFormat, any_call, call_of,
                                                calls_in, hoisted, namespaced, with_calls)
from localinfer.engine.toolcalls.partial import HEAD, head

INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) "
               "or with `response` reply to the user's request")


# The opening of a text answer, spaces where JSON allows them; then a string's pieces: plain
# text, a surrogate pair, one \u escape, a short escape.
_OPENING = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_PIECE = re.compile(r'[^"\\]+|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}'
                    r'|\\u[0-9a-fA-F]{4}|\\["\\/bfnrt]')
_LOW_BEGUN = re.compile(r'(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?\Z')
# A call's head: the first at the reply's start, each later one after the call before's id.
_FIRST = re.compile(r'\s*\{\s*(?:"tool_call"\s*:\s*|"tool_calls"\s*:\s*\[\s*)' + HEAD)
_NEXT = re.compile(r'\s*,\s*"id"\s*:\s*"(?:[^"\\]|\\.)*"\s*\}\s*,\s*' + HEAD)


class Generic(ToolFormat):
    name = "generic"
    renders_tools = False
    wraps_text = True

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        """A call (or several) or, with `auto`, a text response."""
        tools = namespaced(tools)
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
        """A text answer cut short (by max_tokens) is still its text, without the wrapper."""
        try:
            value = json.loads(text)
        except ValueError:
            start = self.text_start(text)
            return (text if start is None else self.text_from(text, start)[0]), []
        if not isinstance(value, dict):
            return text, []
        if isinstance(value.get("response"), str) and len(value) == 1:
            return self.text_from(text, self.text_start(text) or 0)[0], []
        if "tool_call" in value:
            call = call_of(value["tool_call"])
            return with_calls(text, "", [call] if call else None)
        return with_calls(text, "", calls_in(value.get("tool_calls")))

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        return head(_NEXT if at else _FIRST, text, at, anchored=True)

    def text_start(self, text: str) -> int | None:
        opening = _OPENING.match(text)
        return opening.end() if opening else None

    def text_from(self, text: str, at: int) -> tuple[str, int]:
        """The response's string from `at`, its escapes decoded, up to its closing quote or an
        escape not yet whole; a lone surrogate (no text) is U+FFFD."""
        out = []
        while (piece := _PIECE.match(text, at)) is not None:
            escaped = piece.group()
            if escaped[0] != "\\":
                out.append(escaped)
            elif len(escaped) == 6 and 0xD800 <= int(escaped[2:], 16) <= 0xDFFF:
                if escaped[2] in "dD" and escaped[3] in "89abAB" \
                        and _LOW_BEGUN.match(text, piece.end()):
                    break           # its pair may still come
                out.append("\ufffd")
            else:
                out.append(json.loads(f'"{escaped}"'))
            at = piece.end()
        return "".join(out), at
