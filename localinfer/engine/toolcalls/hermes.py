"""Hermes and Qwen 2.5/3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call,
after any text; recognised from a template that writes `<tool_call>`."""

from __future__ import annotations

import re

from localinfer.engine.toolcalls.common import (Convert, Parsed, ToolFormat, any_call, call_of,
                                                hoisted, json_at, namespaced, with_calls)
from localinfer.engine.toolcalls.partial import HEAD, head

_ROOT = re.compile(r"^root ::=", re.M)
_HEAD = re.compile(r"<tool_call>\s*" + HEAD)


class Hermes(ToolFormat):
    name = "hermes"
    trigger = "<tool_call>"

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        tools = namespaced(tools)
        call = convert(hoisted(any_call(tools), list(tools.values())))
        body = _ROOT.sub("tool-call-object ::=", call, count=1)
        first = ('"\\n" tool-call-object "\\n</tool_call>"' if auto
                 else '"<tool_call>\\n" tool-call-object "\\n</tool_call>"')
        more = ' ("\\n<tool_call>\\n" tool-call-object "\\n</tool_call>")*' if parallel else ""
        return f"root ::= {first}{more}\n{body}"

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        return head(_HEAD, text, at, anchored=False)

    def parse(self, text: str) -> Parsed:
        """The text before the first `<tool_call>` is the content; a block that does not hold
        one whole call leaves the reply as text."""
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        calls, at = [], start
        while (at := text.find(self.trigger, at)) >= 0:
            found = json_at(text, at + len(self.trigger))
            call = call_of(found[0]) if found else None
            if call is None:
                return text, []
            calls.append(call)
            at = found[1]
        return with_calls(text, text[:start].rstrip(), calls)
