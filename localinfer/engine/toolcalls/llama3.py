"""Llama 3.1/3.2/3.3: the whole reply one JSON object, {"name": ..., "parameters": {...}}, as the
published templates ask for it and write an earlier call back (one call a turn: they refuse
more); recognised from a template with an `ipython` turn (the tool results' role)."""

from __future__ import annotations

import re

from localinfer.engine.toolcalls.common import (Call, Convert, Parsed, ToolFormat, alternatives,
                                                argument_rules, call_of, json_at, literal,
                                                with_calls)
from localinfer.engine.toolcalls.partial import HEAD, head

PYTHON_TAG = "<|python_tag|>"     # Llama 3.1 may open a call with it (its built-in tools' way)
_HEAD = re.compile(r"\s*(?:<\|python_tag\|>)?\s*" + HEAD)


class Llama3(ToolFormat):
    name = "llama3"
    trigger = '{"name": "'
    anchored = True         # a call is the whole reply; `{"name": "` later on is text
    parallel = False

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        rules, roots = argument_rules(tools, convert)
        call = alternatives(roots, _spelled)
        head = "" if auto else f"{literal(self.trigger)} "
        return f"root ::= {head}call\ncall ::= {call}\n{rules}"

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        """The one call a reply holds (the grammar allows no second)."""
        return None if at else head(_HEAD, text, 0, anchored=True)

    def parse(self, text: str) -> Parsed:
        """One object (or, as some fine-tunes write them, several separated by `;`), with or
        without `<|python_tag|>` before it; anything else is text."""
        body = text.strip().removeprefix(PYTHON_TAG)
        calls: list[Call] = []
        at = 0
        while body[at:].strip():
            found = json_at(body, at)
            call = call_of(found[0]) if found else None
            if call is None:
                return text, []
            calls.append(call)
            rest = body[found[1]:].lstrip()
            at = len(body) - len(rest.removeprefix(";"))
        return with_calls(text, "", calls)


def _spelled(name: str, args: str) -> str:
    """The call spelled as the template writes it back: {"name": "NAME", "parameters": ARGS}
    (the trigger before it)."""
    head = literal(name + '", "parameters": ')
    return f'{head} {args} "}}"'
