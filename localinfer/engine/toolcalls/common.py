"""What every tool-call format shares: a call as read back from a reply, the JSON readers the
parsers use, the pieces their grammars are built from, and the base each format fills in."""

from __future__ import annotations

import copy
import json
import re
from typing import Callable, NamedTuple, Sequence


class Call(NamedTuple):
    name: str
    arguments: dict
    id: str | None = None       # the id the model wrote, where its format has one: never used


Parsed = tuple[str, list[Call]]         # (the reply's content, its calls)
Convert = Callable[[dict], str]         # a JSON schema -> GBNF whose first rule is `root`


class ToolFormat:
    """One model family's way of writing calls. `trigger` is the text that begins a call, where
    `auto` switches the call's grammar on ("": the whole reply is constrained from the start);
    `anchored`: the trigger counts only at the reply's start; `parallel`: a reply may hold several
    calls; `renders_tools`: the template takes `tools` itself; `covers_trace`: the grammar spans
    the model's whole output, its reasoning included, and parse reads that raw output;
    `wraps_text`: a text answer is written inside the format's JSON, and `text_start` and
    `text_from` read it out as it comes."""

    name = ""
    trigger = ""
    anchored = False
    parallel = True
    renders_tools = True
    covers_trace = False
    wraps_text = False      # a text answer comes inside the format's own JSON (generic's)

    def grammar(self, tools: dict[str, dict], convert: Convert, *, parallel: bool,
                auto: bool) -> str:
        """GBNF of a reply that calls one of `tools` (name -> parameters schema): the whole
        reply, or with `auto` what follows the trigger."""
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def call_head(self, text: str, at: int) -> tuple[str, int] | None:
        """The next call's name and where its arguments' object begins in the reply so far,
        looked for from `at` (0, or where the call before's arguments end), for a stream that
        sends the arguments as they come (engine/toolcalls/partial.py); None: not written yet,
        or a format whose arguments are not sent before the call is whole."""
        return None

    def template_id(self, ident: str) -> str:
        """A call id of the history as this format's template takes it."""
        return ident

    def text_start(self, text: str) -> int | None:
        """Where a text answer's own text begins in the reply so far (None: not known yet)."""
        return 0

    def text_from(self, text: str, at: int) -> tuple[str, int]:
        """The answer's text from `at` up to what is written whole, and where that ends."""
        return text[at:], len(text)

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"


# -- reading calls back ------------------------------------------------------------------------
def call_of(value, *, name: str | None = None) -> Call | None:
    """{"name": ..., "arguments" (or Llama's "parameters"): {...}} as a Call (arguments may be a
    JSON string, as some models write them); `name` given: `value` is the arguments alone."""
    if name is not None:
        value = {"name": name, "arguments": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    ident = value.get("id") if isinstance(value.get("id"), str) else None
    return Call(value["name"], args, ident) if isinstance(args, dict) else None


def json_at(text: str, at: int) -> tuple[object, int] | None:
    """The JSON value that starts at `at` (spaces before it skipped) and where it ends."""
    at = len(text) - len(text[at:].lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None


def calls_in(values) -> list[Call] | None:
    """A JSON list of call objects as Calls; None unless it is a non-empty list of whole calls."""
    if not isinstance(values, list) or not values:
        return None
    calls = [call_of(v) for v in values]
    return None if None in calls else calls


def with_calls(text: str, content: str, calls: list[Call] | None) -> Parsed:
    """The parse's result: (content, calls) when every call was read whole, else the reply left
    as text — half a call is never handed on."""
    return (content, calls) if calls else (text, [])


# -- schemas of whole calls (formats whose call is one JSON object) ------------------------------
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


_TABLES = ("#/$defs/", "#/definitions/")


def namespaced(tools: dict[str, dict]) -> dict[str, dict]:
    """Each tool's parameters with its top-level `$defs`/`definitions` renamed `t<k>-NAME`, and
    the references to them, so that hoisting them side by side (`hoisted`) cannot give one
    tool another's definition of the same name (two MCP tools' `#/$defs/Item`)."""
    out = {}
    for k, (name, params) in enumerate(tools.items()):
        prefix = f"t{k}-"
        params = _refs_renamed(params, prefix)
        for key in ("$defs", "definitions"):
            if isinstance(params.get(key), dict):
                params = {**params, key: {prefix + n: v for n, v in params[key].items()}}
        out[name] = params
    return out


def _refs_renamed(node, prefix: str):
    if isinstance(node, list):
        return [_refs_renamed(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            table = next((t for t in _TABLES if value.startswith(t)), None)
            out[key] = value if table is None else table + prefix + value[len(table):]
        else:
            out[key] = _refs_renamed(value, prefix)
    return out


def any_call(tools: dict[str, dict], *, with_id: bool = False) -> dict:
    """A call of any of `tools` (name -> parameters schema)."""
    calls = [call_schema(n, p, with_id=with_id) for n, p in tools.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


# -- grammar pieces (formats that write the name outside the arguments) ------------------------
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|([A-Za-z][A-Za-z0-9-]*)')


def literal(text: str) -> str:
    """`text` as a GBNF string literal (JSON's escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def renamed(gbnf: str, prefix: str) -> str:
    """Every rule of `gbnf` renamed `prefix` + name, so that several tools' grammars live in one
    (string literals, character classes and comments left as they are)."""
    return _GBNF_TOKEN.sub(lambda m: prefix + m.group(1) if m.group(1) else m.group(0), gbnf)


def argument_rules(tools: dict[str, dict], convert: Convert) -> tuple[str, dict[str, str]]:
    """Each tool's arguments as GBNF rules in one text, and the rule that is each tool's
    arguments object (name -> rule)."""
    texts, roots = [], {}
    for k, (name, params) in enumerate(tools.items()):
        texts.append(renamed(convert(params), f"t{k}-"))
        roots[name] = f"t{k}-root"
    return "\n".join(texts), roots


def alternatives(roots: dict[str, str], call: Callable[[str, str], str]) -> str:
    """`call(name, arguments rule)` for each tool, as one GBNF alternation."""
    return " | ".join(f"( {call(name, rule)} )" for name, rule in roots.items())
