"""Structured output: a JSON schema or a GBNF grammar from the user, checked and turned into the
GBNF text llama.cpp's grammar sampler runs.

Both arrive from outside, so both are checked here, before any model loads: the size, the JSON,
every schema keyword (the converter silently ignores keywords it does not know, which would let
an answer through that the schema forbids), the repetition counts (the converter writes a rule
per repetition), and the grammar through llama.cpp's own parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localinfer.errors import UsageError

MAX_SOURCE_BYTES = 1 << 20          # a schema file; real ones are a few KiB
# llama.cpp's grammar parser recurses per nesting level and per rule it follows: it overflowed
# the stack (a crash) at 20,000 nested groups and at a 100,000-rule chain, and ran at 10,000 and
# 60,000. Grammar files stay far below both; the converter's output needs about 1,000.
MAX_GRAMMAR_BYTES = 256 << 10
MAX_NESTING = 2_000
MAX_REPEAT = 1000                   # minItems/maxItems/minLength/maxLength
MAX_DEPTH = 64                      # nesting of subschemas
MAX_NODES = 10_000                  # subschemas in all

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "deprecated", "readOnly", "writeOnly"}
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
            "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
            "definitions", "pattern", "format", "minLength", "maxLength"}
TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_ALL_OF_MEMBER = {"type", "properties", "required", "$ref", "anyOf"} | ANNOTATIONS


@dataclass(frozen=True)
class OutputFormat:
    """What the answer must match: GBNF text, and whether it is one JSON document."""

    gbnf: str
    is_json: bool


def from_options(json_schema: str | None, grammar: str | None) -> OutputFormat | None:
    """The --json-schema / --grammar options, checked; None when neither is given."""
    if json_schema is not None and grammar is not None:
        raise UsageError("--json-schema and --grammar cannot be used together")
    if json_schema is not None:
        text, where = _schema_text(json_schema)
        return from_schema(_parse_json(text, where), where)
    if grammar is not None:
        where = f"--grammar {grammar}"
        text = _read(Path(grammar), where, MAX_GRAMMAR_BYTES)
        _check_grammar(text, where)
        return OutputFormat(text, False)
    return None


def from_schema(schema: Any, where: str, *, check_parse: bool = True) -> OutputFormat:
    """A parsed JSON schema (from a file, or an API request's response_format), checked;
    `check_parse=False` leaves llama.cpp's parse of the converted grammar to the caller."""
    if not isinstance(schema, dict):
        raise UsageError(f"{where}: the schema must be a JSON object")
    check_schema(schema, where)
    from localinfer.backends.llama_grammar import schema_to_gbnf
    try:
        gbnf = schema_to_gbnf(schema)
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UsageError(f"{where}: cannot turn this schema into a grammar: {e}") from e
    _check_grammar(gbnf, where, parse=check_parse)
    return OutputFormat(gbnf, True)


def incomplete(fmt: OutputFormat, text: str, finish_reason: str) -> str | None:
    """Why the answer is not a whole JSON document (a limit ended it first), or None."""
    if not fmt.is_json:
        return None
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    why = {"length": "reached -n/--max-tokens", "context": "reached the end of the context",
           "stop": "reached a --stop string", "interrupted": "was interrupted"}
    return (f"the answer {why.get(finish_reason, 'ended')} before its JSON document was "
            "complete; stdout holds the partial document")


# -- reading ------------------------------------------------------------------------------------
def _schema_text(value: str) -> tuple[str, str]:
    if value.lstrip().startswith("{"):
        if len(value.encode()) > MAX_SOURCE_BYTES:
            raise UsageError(f"--json-schema: the schema is over {MAX_SOURCE_BYTES >> 20} MiB")
        return value, "--json-schema"
    where = f"--json-schema {value}"
    return _read(Path(value), where, MAX_SOURCE_BYTES), where


def _read(path: Path, where: str, limit: int) -> str:
    """The file's text, read no further than `limit` (a device or pipe has no size to trust)."""
    try:
        if not path.is_file():
            raise UsageError(f"{where}: not a regular file" if path.exists()
                             else f"{where}: no such file")
        with path.open("rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise UsageError(f"{where}: the file is over {limit >> 10} KiB")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot read it: {e.strerror}") from None


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not JSON: {e.msg} at line {e.lineno}, column {e.colno}") \
            from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply") from None


def _check_grammar(gbnf: str, where: str, *, parse: bool = True) -> None:
    from localinfer.backends.llama_grammar import grammar_error
    if not gbnf.strip():
        raise UsageError(f"{where}: the grammar is empty")
    if _nesting(gbnf) > MAX_NESTING:
        raise UsageError(f"{where}: groups nested more than {MAX_NESTING} deep")
    problem = grammar_error(gbnf) if parse else None
    if problem:
        raise UsageError(f"{where}: the grammar does not parse: {problem}")


def _nesting(gbnf: str) -> int:
    """The deepest nesting of ( ) groups, outside "literals", [classes] and # comments."""
    depth = deepest = 0
    closing, escaped = "", False
    for c in gbnf:
        if closing:                      # inside a literal, a class or a comment
            if escaped:
                escaped = False
            elif c == "\\" and closing != "\n":
                escaped = True
            elif c == closing:
                closing = ""
        elif c in '"[#':
            closing = {'"': '"', "[": "]", "#": "\n"}[c]
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
    return deepest


# -- the schema check ---------------------------------------------------------------------------
def check_schema(schema: dict, where: str) -> None:
    """Refuse what the converter would ignore or cannot bound, naming the place (a JSON pointer)."""
    seen = [0]

    def visit(node: Any, at: str, depth: int) -> None:
        if not isinstance(node, dict):
            if isinstance(node, bool):
                raise _unsupported(where, at, "a true/false schema")
            raise UsageError(f"{where}: {at or '/'} must be a schema (a JSON object)")
        seen[0] += 1
        if depth > MAX_DEPTH or seen[0] > MAX_NODES:
            raise UsageError(f"{where}: the schema is too large or nested too deeply (at {at})")
        for key in node:
            if key not in KEYWORDS and key not in ANNOTATIONS:
                raise _unsupported(where, f"{at}/{key}", f"the keyword {key!r}")
        _check_node(node, at, where)
        for child, child_at in _children(node, at, where):
            visit(child, child_at, depth + 1)

    visit(schema, "", 0)


def _unsupported(where: str, at: str, what: str) -> UsageError:
    return UsageError(f"{where}: {what} at {at or '/'} is not supported "
                      "(docs/structured-output.md lists what is)")


def _check_node(node: dict, at: str, where: str) -> None:
    types = node.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in TYPES:
            raise UsageError(f"{where}: {at}/type: unknown type {t!r}")
    if "format" in node and node["format"] not in FORMATS:
        raise _unsupported(where, f"{at}/format", f"the format {node['format']!r}")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#/")):
        raise _unsupported(where, f"{at}/$ref", "a $ref outside this schema (nothing is fetched)")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise UsageError(f"{where}: {at}/enum must be a non-empty list")
    _check_counts(node, at, where, "minItems", "maxItems", needs="items")
    _check_counts(node, at, where, "minLength", "maxLength", needs=None)
    if ("minLength" in node or "maxLength" in node) and (
            types != "string" or "pattern" in node or "format" in node):
        raise _unsupported(where, at, "minLength/maxLength other than on a plain "
                                      '"type": "string"')
    _check_required(node, at, where)


def _check_counts(node: dict, at: str, where: str, low: str, high: str, *,
                  needs: str | None) -> None:
    values = {k: node[k] for k in (low, high) if k in node}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT:
            raise UsageError(f"{where}: {at}/{key} must be a whole number from 0 to {MAX_REPEAT}")
    if values.get(low, 0) > values.get(high, MAX_REPEAT):
        raise UsageError(f"{where}: {at}: {low} is larger than {high}")
    if values and needs and needs not in node:
        raise _unsupported(where, at, f"{low}/{high} without {needs!r}")


def _check_required(node: dict, at: str, where: str) -> None:
    required = node.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise UsageError(f"{where}: {at}/required must be a list of property names")
    if required and "allOf" not in node:
        missing = [r for r in required if r not in node.get("properties", {})]
        if missing:
            raise _unsupported(where, f"{at}/required", f"a required property with no schema "
                                                        f"in properties ({missing[0]!r})")


def _children(node: dict, at: str, where: str) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    for key in ("properties", "$defs", "definitions"):
        table = node.get(key, {})
        if not isinstance(table, dict):
            raise UsageError(f"{where}: {at}/{key} must be an object")
        out += [(sub, f"{at}/{key}/{name}") for name, sub in table.items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        members = node.get(key, [])
        if not isinstance(members, list):
            raise UsageError(f"{where}: {at}/{key} must be a list")
        out += [(sub, f"{at}/{key}/{i}") for i, sub in enumerate(members)]
    for i, member in enumerate(node.get("allOf", [])):
        extra = set(member) - _ALL_OF_MEMBER if isinstance(member, dict) else set()
        if extra:
            raise _unsupported(where, f"{at}/allOf/{i}", f"{sorted(extra)[0]!r} inside allOf")
    items = node.get("items")
    if isinstance(items, list):
        out += [(sub, f"{at}/items/{i}") for i, sub in enumerate(items)]
    elif items is not None:
        out.append((items, f"{at}/items"))
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out.append((extra, f"{at}/additionalProperties"))
    elif extra is not None and not isinstance(extra, bool):
        raise UsageError(f"{where}: {at}/additionalProperties must be true, false or a schema")
    return out
