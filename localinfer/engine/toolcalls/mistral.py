"""Mistral's `[TOOL_CALLS]`, in the two spellings its published templates use:
- a JSON list (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...},
  "id": "a1b2c3d4e"}, ...]`;
- one call after another (Mistral Small 3.2, Devstral, Ministral 3):
  `[TOOL_CALLS]NAME[CALL_ID]a1b2c3d4e[ARGS]{...}`, `[CALL_ID]` where the template has it.
The templates refuse a call id other than 9 letters and digits, so the model writes one (the
grammar keeps it to that, as it was trained), but a reply's calls carry ids of the server's own:
each history id is mapped to 9 letters and digits for the template (`template_id`)."""

from __future__ import annotations

import hashlib
import re
import string

from localinfer.engine.toolcalls.common import (Call, Convert, Parsed, ToolFormat, alternatives,
                                                argument_rules, call_of, calls_in, json_at,
                                                literal, with_calls)
from localinfer.engine.toolcalls.partial import HEAD, NAME, head

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
_ID_RULE = "call-id ::= [A-Za-z0-9]{9}"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_NAME_END = re.compile(r"\[CALL_ID\]|\[ARGS\]|\{")
# A call's head: in the JSON list, the first after `[TOOL_CALLS][`, each later one after the
# call before's id; one after another, each after its `[TOOL_CALLS]`.
_JSON_FIRST = re.compile(r"\[TOOL_CALLS\]\s*\[\s*" + HEAD)
_JSON_NEXT = re.compile(r'\s*,\s*"id"\s*:\s*"[A-Za-z0-9]*"\s*\}\s*,\s*' + HEAD)
_ARGS_HEAD = re.compile(r"\[TOOL_CALLS\]\s*" + NAME + r"\s*(?:\[CALL_ID\][A-Za-z0-9]*)?"
                        r"(?:\[ARGS\])?\s*(?=\{)")


class _Mistral(ToolFormat):
    trigger = TOOL_CALLS

    def template_id(self, ident: str) -> str:
        """`ident` where it is 9 letters and digits already, else 9 drawn from its hash: the
        same for a call and its result, and (in practice) apart for two ids."""
        if _ID.fullmatch(ident):
            return ident
        number, chars = int.from_bytes(hashlib.sha256(ident.encode()).digest(), "big"), []
        for _ in range(9):
            number, digit = divmod(number, len(_ID_CHARS))
            chars.append(_ID_CHARS[digit])
        return "".join(chars)


class MistralJson(_Mistral):
    name = "mistral"

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        rules, roots = argument_rules(tools, convert)
        head = "" if auto else f"{literal(TOOL_CALLS)} "
        more = ' (", " call)*' if parallel else ""
        call = alternatives(roots, _json_call)
        return f'root ::= {head}"[" call{more} "]"\ncall ::= {call}\n{_ID_RULE}\n{rules}'

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        return head(_JSON_NEXT, text, at, anchored=True) if at else \
            head(_JSON_FIRST, text, 0, anchored=False)

    def parse(self, text: str) -> Parsed:
        """The text before `[TOOL_CALLS]` is the content."""
        start = text.find(TOOL_CALLS)
        if start < 0:
            return text, []
        found = json_at(text, start + len(TOOL_CALLS))
        return with_calls(text, text[:start].rstrip(), calls_in(found[0]) if found else None)


def _json_call(name: str, args: str) -> str:
    """One call as the template writes it back: the function's JSON with its id last."""
    head, tail = literal('{"name": "' + name + '", "arguments": '), literal(', "id": "')
    return f'{head} {args} {tail} call-id "\\"}}"'


class MistralArgs(_Mistral):
    def __init__(self, with_id: bool) -> None:
        self.with_id = with_id          # the template writes `[CALL_ID]ID` after the name
        self.name = "mistral-call-id" if with_id else "mistral-args"

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        rules, roots = argument_rules(tools, convert)
        head = "" if auto else f"{literal(TOOL_CALLS)} "
        more = f" ({literal(TOOL_CALLS)} call)*" if parallel else ""
        ident = f"{literal(CALL_ID)} call-id " if self.with_id else ""
        call = alternatives(roots, lambda name, args: f"{literal(name)} {ident}{literal(ARGS)} "
                                                      f"{args}")
        id_rule = f"{_ID_RULE}\n" if self.with_id else ""
        return f"root ::= {head}call{more}\ncall ::= {call}\n{id_rule}{rules}"

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        return head(_ARGS_HEAD, text, at, anchored=False)

    def parse(self, text: str) -> Parsed:
        """NAME[CALL_ID]ID[ARGS]{...} (or NAME[ARGS]{...}, NAME{...}) after each
        `[TOOL_CALLS]`; the text before the first is the content."""
        start = text.find(TOOL_CALLS)
        if start < 0:
            return text, []
        calls: list[Call] = []
        for piece in text[start:].split(TOOL_CALLS)[1:]:
            call = _args_call(piece.strip())
            if call is None:
                return text, []
            calls.append(call)
        return with_calls(text, text[:start].rstrip(), calls)


def _args_call(piece: str) -> Call | None:
    end = _NAME_END.search(piece)
    if end is None:
        return None
    name, rest, ident = piece[:end.start()].strip(), piece[end.start():], None
    if rest.startswith(CALL_ID):
        ident, _, rest = rest[len(CALL_ID):].partition(ARGS)
        rest = ARGS + rest
    found = json_at(rest.removeprefix(ARGS), 0)
    call = call_of(found[0], name=name) if found and name else None
    return call._replace(id=ident.strip()) if call and ident else call
