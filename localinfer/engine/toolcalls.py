"""Tool calls in a model's own format: the grammar a call keeps to, the gate that switches that
grammar on when the model starts a call, and the parsers that read calls back out of a reply.

Formats: "hermes" (Hermes, Qwen 2.5/3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, recognised from a template that writes `<tool_call>`), and "generic" (llama.cpp's
generic handler, for a template without tools: the tools described in a system message and the
whole answer one JSON object, `{"tool_call": {...}}`, `{"tool_calls": [...]}` or
`{"response": "..."}`). Parsers for Llama 3.x JSON, Mistral's `[TOOL_CALLS]` and gpt-oss's harmony
`to=functions.NAME` read those formats' replies.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Callable, Sequence

import numpy as np

from localinfer.backends import Grammar

HERMES, GENERIC = "hermes", "generic"
TRIGGER = "<tool_call>"
GENERIC_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) "
                       "or with `response` reply to the user's request")
_ROOT = re.compile(r"^root ::=", re.M)


def format_of(template: str) -> str:
    """The tool-call format a chat template speaks: its own where recognised, else generic."""
    return HERMES if TRIGGER in template else GENERIC


# -- schemas and grammars --------------------------------------------------------------------
def call_schema(name: str, parameters: dict, *, with_id: bool = False) -> dict:
    """One call of the tool `name` as a JSON object: {"name": name, "arguments": {...}}."""
    props = {"name": {"const": name}, "arguments": parameters}
    required = ["name", "arguments"]
    if with_id:
        props["id"] = {"type": "string", "minLength": 4, "maxLength": 32}
        required.append("id")
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def hoisted(schema: dict, parameters: Sequence[dict]) -> dict:
    """`schema` (the tools' parameters nested inside it) with each parameters' `$defs` and
    `definitions` moved to its top, where their `#/$defs/...` references point."""
    schema = copy.deepcopy(schema)
    for params in parameters:
        for key in ("$defs", "definitions"):
            if isinstance(params.get(key), dict):
                schema.setdefault(key, {}).update(params[key])
    return schema


def any_call(tools: dict[str, dict], *, with_id: bool = False) -> dict:
    """A call of any of `tools` (name -> parameters schema)."""
    calls = [call_schema(n, p, with_id=with_id) for n, p in tools.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def generic_schema(tools: dict[str, dict], *, parallel: bool, reply: bool) -> dict:
    """llama.cpp's generic format: a call (or several) or, with `reply`, a text response."""
    call = any_call(tools, with_id=parallel)
    called = ({"type": "object", "properties": {"tool_calls": {
        "type": "array", "items": call, "minItems": 1}}, "required": ["tool_calls"]} if parallel
        else {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]})
    called["additionalProperties"] = False
    if not reply:
        return hoisted(called, list(tools.values()))
    response = {"type": "object", "properties": {"response": {"type": "string"}},
                "required": ["response"], "additionalProperties": False}
    return hoisted({"anyOf": [called, response]}, list(tools.values()))


def hermes_gbnf(call_gbnf: str, *, parallel: bool, after_trigger: bool) -> str:
    """The grammar of Hermes calls around `call_gbnf` (one call's JSON object, whose rule is
    `root`): the whole reply, or (`after_trigger`) what follows a `<tool_call>` already written."""
    body = _ROOT.sub("tool-call-object ::=", call_gbnf, count=1)
    first = ('"\\n" tool-call-object "\\n</tool_call>"' if after_trigger
             else '"<tool_call>\\n" tool-call-object "\\n</tool_call>"')
    more = ' ("\\n<tool_call>\\n" tool-call-object "\\n</tool_call>")*' if parallel else ""
    return f"root ::= {first}{more}\n{body}"


# -- the gate ----------------------------------------------------------------------------------
_CANDIDATES: dict[tuple[int, str], np.ndarray] = {}


def _ending_ids(session, char: str, text_of: Callable[[int], str]) -> np.ndarray:
    """The tokens whose text holds `char` (the trigger's last), found once per model."""
    key = (id(session), char)
    if key not in _CANDIDATES:
        _CANDIDATES[key] = np.array([t for t in range(session.n_vocab) if char in text_of(t)],
                                    dtype=np.int32)
    return _CANDIDATES[key]


class TriggerGate:
    """Any text until the reply writes `trigger`, then `after` (the call's grammar) for the rest.

    A token whose text would complete the trigger with more text after it is refused, so the
    trigger always ends at a token's end and the grammar takes the very next token. Each choice
    depends only on the tokens accepted before (speculation stays exact), as thinking/gate.py's."""

    def __init__(self, trigger: str, after: Grammar, text_of: Callable[[int], str],
                 candidates: np.ndarray) -> None:
        self.trigger, self.after, self.text_of = trigger, after, text_of
        self.candidates = candidates
        self.tail = ""                # the last characters written, a trigger's length less one
        self.on = False

    def _refused(self, token: int) -> bool:
        joined = self.tail + self.text_of(token)
        at = joined.find(self.trigger)
        return at >= 0 and at + len(self.trigger) != len(joined)

    def allows(self, ids: np.ndarray) -> np.ndarray:
        if self.on:
            return self.after.allows(ids)
        return np.array([not self._refused(int(t)) for t in ids], dtype=bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if self.on:
            return self.after.mask(logits)
        row = logits.copy()
        for t in self.candidates:
            if self._refused(int(t)):
                row[t] = -np.inf
        return row

    def accept(self, token: int) -> None:
        if self.on:
            self.after.accept(token)
            return
        joined = self.tail + self.text_of(token)
        if joined.endswith(self.trigger):
            self.on = True
        self.tail = joined[-(len(self.trigger) - 1):]

    def clone(self) -> TriggerGate:
        twin = copy.copy(self)
        twin.after = self.after.clone()
        return twin

    def close(self) -> None:
        self.after.close()


def trigger_gate(session, trigger: str, after: Grammar) -> TriggerGate:
    def text_of(token: int) -> str:
        return session.piece(token).decode("utf-8", "ignore")
    return TriggerGate(trigger, after, text_of, _ending_ids(session, trigger[-1], text_of))


# -- parsers: (content, [(name, arguments as a dict)]) -----------------------------------------
Calls = list[tuple[str, dict]]


def _call(value) -> tuple[str, dict] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (value["name"], args) if isinstance(args, dict) else None


def _json_at(text: str, at: int) -> tuple[object, int] | None:
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None


def parse_hermes(text: str) -> tuple[str, Calls]:
    """`<tool_call>\\n{...}\\n</tool_call>` blocks; the text before the first is the content.
    A block that does not hold one whole call leaves the reply as text."""
    start = text.find(TRIGGER)
    if start < 0:
        return text, []
    calls, at = [], start
    while (at := text.find(TRIGGER, at)) >= 0:
        body_at = len(text) - len(text[at + len(TRIGGER):].lstrip())
        found = _json_at(text, body_at)
        call = _call(found[0]) if found else None
        if call is None:
            return text, []
        calls.append(call)
        at = found[1]
    return text[:start].rstrip(), calls


def parse_generic(text: str) -> tuple[str, Calls]:
    """{"tool_call": {...}}, {"tool_calls": [...]} or {"response": "..."}; else text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if not isinstance(value, dict):
        return text, []
    if isinstance(value.get("response"), str) and len(value) == 1:
        return value["response"], []
    found = [value["tool_call"]] if "tool_call" in value else value.get("tool_calls")
    calls = [_call(c) for c in found] if isinstance(found, list) else [None]
    return ("", calls) if calls and None not in calls else (text, [])


def parse_llama3(text: str) -> tuple[str, Calls]:
    """Llama 3.x: the reply one JSON object {"name": ..., "parameters": {...}} (or
    `<|python_tag|>` before it), or several separated by `;`."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls, at = [], 0
    while at < len(body):
        found = _json_at(body, at)
        call = _call(found[0]) if found else None
        if call is None:
            return text, []
        calls.append(call)
        at = found[1]
        rest = body[at:].lstrip()
        at = len(body) - len(rest.removeprefix(";").lstrip())
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, Calls]:
    """Mistral: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (or, in newer
    templates, NAME[ARGS]{...} / NAME{...} per call)."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    rest = text[start + len("[TOOL_CALLS]"):].strip()
    if rest.startswith("["):
        found = _json_at(rest, 0)
        calls = [_call(c) for c in found[0]] if found and isinstance(found[0], list) else [None]
    else:
        calls = []
        for piece in filter(None, (p.strip() for p in rest.split("[TOOL_CALLS]"))):
            name, _, args = piece.partition("[ARGS]") if "[ARGS]" in piece else \
                (piece[:piece.find("{")], "", piece[piece.find("{"):])
            found = _json_at(args.strip(), 0)
            calls.append(_call({"name": name.strip(), "arguments": found[0]}) if found else None)
    return (text[:start].rstrip(), calls) if calls and None not in calls else (text, [])


_HARMONY_CALL = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+).*?<\|message\|>")


def parse_harmony(text: str) -> tuple[str, Calls]:
    """gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` per
    call (ended by <|call|>); the final channel's message is the content."""
    calls = []
    for match in _HARMONY_CALL.finditer(text):
        found = _json_at(text, match.end())
        call = _call({"name": match.group(1), "arguments": found[0]}) if found else None
        if call is None:
            return text, []
        calls.append(call)
    final = text.rfind("<|channel|>final<|message|>")
    content = "" if final < 0 else text[final + len("<|channel|>final<|message|>"):]
    content = content.split("<|end|>")[0].split("<|return|>")[0]
    return (content, calls) if calls else (text, [])


PARSERS = {HERMES: parse_hermes, GENERIC: parse_generic, "llama3": parse_llama3,
           "mistral": parse_mistral, "harmony": parse_harmony}
