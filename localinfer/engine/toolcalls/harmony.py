"""gpt-oss's harmony: a call is a message to `functions.NAME` on the commentary channel,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (or, as the
template writes an earlier call back, `to=functions.NAME` in the role's header); the reasoning
(`analysis`) may come first, the final channel is the content. One call a turn: `<|call|>` ends
the generation. Recognised from a template with `<|channel|>`.

The grammar spans the whole output, the analysis included (written freely), so thinking/'s gate
is not put around it; it stops at the arguments' end, where `<|call|>` (an end-of-generation
token, which llama.cpp's grammar takes only at a grammar's end) closes the message."""

from __future__ import annotations

import re

from localinfer.engine.toolcalls.common import (Call, Convert, Parsed, ToolFormat, alternatives,
                                                argument_rules, call_of, json_at, literal,
                                                with_calls)
from localinfer.engine.toolcalls.partial import NAME, head

_CALL = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)[^\n]*?<\|message\|>")
_HEAD = re.compile(r"to=functions\." + NAME + r"[^\n]*?<\|message\|>\s*(?=\{)")
_FINAL = "<|channel|>final<|message|>"
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# The header after the name: on the channel (the model's way) or in the role (the template's).
_HEADER_REST = ('header-rest ::= ("<|channel|>" ("commentary" | "analysis"))? '
                '(" " "<|constrain|>"? "json")? "<|message|>"')
# An analysis message before the call: text without `<|` (its markers), then on to the next.
_ANALYSIS = ('analysis ::= "<|channel|>analysis<|message|>" analysis-text '
             '"<|end|><|start|>assistant"\nanalysis-text ::= ([^<] | "<" [^|])*')


class Harmony(ToolFormat):
    name = "harmony"
    trigger = " to=functions."
    parallel = False
    covers_trace = True

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        rules, roots = argument_rules(tools, convert)
        if auto:        # after the trigger, either header the model may write
            call = alternatives(roots, lambda name, args: f"{literal(name)} header-rest {args}")
            return f"root ::= call\ncall ::= {call}\n{_HEADER_REST}\n{rules}"
        call = alternatives(roots, lambda name, args: (
            f"{literal(name + ' <|constrain|>json<|message|>')} {args}"))
        opening = literal("<|channel|>commentary" + self.trigger)
        return f"root ::= analysis? {opening} call\ncall ::= {call}\n{_ANALYSIS}\n{rules}"

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        """In the raw output (markers shown): the one call a turn holds."""
        return None if at else head(_HEAD, text, 0, anchored=False)

    def parse(self, text: str) -> Parsed:
        """Each `to=functions.NAME ...<|message|>{...}`; the final channel's text is the
        content. Reads the raw output (the markers shown), not the reasoning split's answer."""
        calls: list[Call] = []
        for match in _CALL.finditer(text):
            found = json_at(text, match.end())
            call = call_of(found[0], name=match.group(1)) if found else None
            if call is None:
                return text, []
            calls.append(call)
        final = text.rfind(_FINAL)
        content = "" if final < 0 else text[final + len(_FINAL):]
        for end in _ENDS:
            content = content.split(end)[0]
        return with_calls(text, content, calls)
