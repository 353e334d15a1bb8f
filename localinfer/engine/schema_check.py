"""The JSON-schema check before conversion: every keyword the converter reads, with a value of
the JSON type it expects, and an expansion the grammar can hold.

The converter silently ignores keywords it does not know (which would let an answer through
that the schema forbids) and fails deep inside on a value of the wrong type (`"type": {}` was a
TypeError), so both are refused here with the JSON pointer of the place. Errors never quote the
schema's values: a file given as a schema may be anything (/proc/self/environ was echoed).
"""

from __future__ import annotations

import json
import math
from typing import Any

from localinfer.engine.schema_pattern import MAX_REPEAT, PatternError, json_safe_pattern
from localinfer.engine.schema_range import BOUNDS, RangeError, expression
from localinfer.errors import UsageError

MAX_DEPTH = 64                      # nesting of subschemas
MAX_NODES = 10_000                  # subschemas in all
# Grammar elements the converter may write in all: minLength/maxLength and a pattern's counts
# are written out one element per repetition, a constant's text one per character.
MAX_EXPANSION = 1_000_000

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "deprecated", "readOnly", "writeOnly"}
TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_COUNTS = {"minItems", "maxItems", "minLength", "maxLength"}
_SCHEMA_TABLES = {"properties", "$defs", "definitions"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
KEYWORDS = ({"type", "required", "additionalProperties", "items", "enum", "const", "$ref",
             "pattern", "format", "propertyNames"} | _COUNTS | _SCHEMA_TABLES | _SCHEMA_LISTS
            | set(BOUNDS))
_ALL_OF_MEMBER = {"type", "properties", "required", "$ref", "anyOf"} | ANNOTATIONS


def check_schema(schema: dict, where: str) -> list[dict]:
    """Refuse what the converter would ignore or cannot bound, naming the place (a JSON
    pointer); returns the subschemas, each once, for the caller to rewrite their patterns."""
    nodes: list[dict] = []
    cost = [0]

    def visit(node: Any, at: str, depth: int) -> None:
        if not isinstance(node, dict):
            if isinstance(node, bool):
                raise _unsupported(where, at, "a true/false schema")
            raise UsageError(f"{where}: {at or '/'} must be a schema (a JSON object)")
        nodes.append(node)
        if depth > MAX_DEPTH or len(nodes) > MAX_NODES:
            raise UsageError(f"{where}: the schema is too large or nested too deeply (at "
                             f"{at or '/'})")
        for key in node:
            if key not in KEYWORDS and key not in ANNOTATIONS:
                raise _unsupported(where, pointer(at, key), f"the keyword {shown(key)}")
        cost[0] += _check_node(node, at, where, schema)
        if cost[0] > MAX_EXPANSION:
            raise UsageError(f"{where}: the schema's grammar would be too large (over "
                             f"{MAX_EXPANSION:,} elements at {at or '/'}): lower its counts")
        for child, child_at in _children(node, at, where):
            visit(child, child_at, depth + 1)

    visit(schema, "", 0)
    return nodes


def pointer(at: str, key: str | int) -> str:
    """A JSON pointer one step down; a long or unprintable name is shortened and escaped, so an
    error stays one short line."""
    text = str(key).replace("~", "~0").replace("/", "~1")
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{at}/{_printable(text)}"


def shown(value: Any) -> str:
    """A short, printable form of a name or value from the schema, for an error message."""
    text = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:36] + "...'"


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


def _unsupported(where: str, at: str, what: str) -> UsageError:
    return UsageError(f"{where}: {what} at {at or '/'} is not supported "
                      "(docs/structured-output.md lists what is)")


def _check_node(node: dict, at: str, where: str, root: dict) -> int:
    """Check one subschema's own keywords; returns the grammar elements they expand to."""
    _check_types(node, at, where)
    if "format" in node:
        if not isinstance(node["format"], str):
            raise UsageError(f"{where}: {at}/format must be a string")
        if node["format"] not in FORMATS:
            raise _unsupported(where, f"{at}/format", f"the format {shown(node['format'])}")
    _check_ref(node, at, where, root)
    _check_required(node, at, where)
    cost = _check_counts(node, at, where, "minItems", "maxItems", needs="items")
    cost += _check_counts(node, at, where, "minLength", "maxLength", needs=None)
    if ("minLength" in node or "maxLength" in node) and (
            node.get("type") != "string" or "pattern" in node or "format" in node):
        raise _unsupported(where, at, "minLength/maxLength other than on a plain "
                                      '"type": "string"')
    cost += _check_bounds(node, at, where) + _check_names(node, at, where)
    return cost + _check_constants(node, at, where) + _check_pattern(node, at, where)


def _check_bounds(node: dict, at: str, where: str) -> int:
    """minimum, maximum and their exclusive forms: numbers, on an integer or number alone
    (schema_range spells them); returns their expression's size."""
    keys = [k for k in BOUNDS if k in node]
    if not keys:
        return 0
    for key in keys:
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (isinstance(value, float) and not math.isfinite(value)):
            raise UsageError(f"{where}: {at}/{key} must be a number")
    if node.get("type") not in ("integer", "number") or "enum" in node or "const" in node:
        raise _unsupported(where, f"{at}/{keys[0]}", f"the keyword {shown(keys[0])} other than "
                                                     'on a "type" "integer" or "number"')
    try:
        return len(expression(node)) // 4
    except RangeError as e:
        raise UsageError(f"{where}: {at or '/'}: {e}") from None


def is_plain_names(names) -> bool:
    """Whether `propertyNames` says no more than every JSON object does: names are strings."""
    return isinstance(names, dict) and names.get("type", "string") == "string" \
        and not set(names) - {"type"} - ANNOTATIONS


def _check_names(node: dict, at: str, where: str) -> int:
    if "propertyNames" in node and not is_plain_names(node["propertyNames"]):
        raise _unsupported(where, f"{at}/propertyNames",
                           'propertyNames other than {"type": "string"}')
    return 0


def _check_types(node: dict, at: str, where: str) -> None:
    if "type" not in node:
        return
    types = node["type"]
    if isinstance(types, list):
        if not types or not all(isinstance(t, str) for t in types) or len(set(types)) < len(types):
            raise UsageError(f"{where}: {at}/type must be a type name or a non-empty list of "
                             "distinct type names")
        # The converter turns a list into one plain schema per type and drops the rest.
        others = set(node) - {"type"} - ANNOTATIONS
        if others:
            raise _unsupported(where, at, f'a list of types with {shown(sorted(others)[0])} '
                                          '(write anyOf with one schema per type)')
    elif not isinstance(types, str):
        raise UsageError(f"{where}: {at}/type must be a type name or a list of type names")
    for t in types if isinstance(types, list) else [types]:
        if t not in TYPES:
            raise UsageError(f"{where}: {at}/type: unknown type {shown(t)}")


def _check_ref(node: dict, at: str, where: str, root: dict) -> None:
    if "$ref" not in node:
        return
    ref = node["$ref"]
    if not isinstance(ref, str):
        raise UsageError(f"{where}: {at}/$ref must be a string")
    if not ref.startswith("#/"):
        raise _unsupported(where, f"{at}/$ref", "a $ref outside this schema (nothing is fetched)")
    target: Any = root
    for step in ref[2:].split("/"):      # as the converter resolves it: no ~0/~1 unescaping
        if not isinstance(target, dict) or step not in target:
            raise UsageError(f"{where}: {at}/$ref points to nothing in this schema")
        target = target[step]
    if not isinstance(target, dict):
        raise UsageError(f"{where}: {at}/$ref must point to a schema (a JSON object)")


def _check_counts(node: dict, at: str, where: str, low: str, high: str, *,
                  needs: str | None) -> int:
    values = {k: node[k] for k in (low, high) if k in node}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT:
            raise UsageError(f"{where}: {at}/{key} must be a whole number from 0 to {MAX_REPEAT}")
    if values.get(low, 0) > values.get(high, MAX_REPEAT):
        raise UsageError(f"{where}: {at}: {low} is larger than {high}")
    if values and needs and needs not in node:
        raise _unsupported(where, at, f"{low}/{high} without {needs!r}")
    return values.get(high, values.get(low, 0) + 1) if values else 0


def _check_required(node: dict, at: str, where: str) -> None:
    required = node.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise UsageError(f"{where}: {at}/required must be a list of property names")
    properties = node.get("properties", {})
    if required and "allOf" not in node and isinstance(properties, dict):
        missing = [r for r in required if r not in properties]
        if missing:
            raise _unsupported(where, f"{at}/required", f"a required property with no schema "
                                                        f"in properties ({shown(missing[0])})")


def _check_constants(node: dict, at: str, where: str) -> int:
    """const and enum values: any JSON; the grammar spells each one's json.dumps text."""
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise UsageError(f"{where}: {at}/enum must be a non-empty list")
    values = ([node["const"]] if "const" in node else []) + node.get("enum", [])
    try:
        return sum(len(json.dumps(v, allow_nan=False)) for v in values)
    except RecursionError:
        raise UsageError(f"{where}: {at}: a const or enum value is nested too deeply") from None
    except ValueError:          # NaN or an infinity (Python's json reads them; JSON has none)
        raise UsageError(f"{where}: {at}: a const or enum value is not JSON (NaN or Infinity)") \
            from None


def _check_pattern(node: dict, at: str, where: str) -> int:
    if "pattern" not in node:
        return 0
    if not isinstance(node["pattern"], str):
        raise UsageError(f"{where}: {at}/pattern must be a string")
    try:
        return json_safe_pattern(node["pattern"])[1]
    except PatternError as e:
        raise UsageError(f"{where}: {at}/pattern: {e}") from None


def _children(node: dict, at: str, where: str) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    for key in sorted(_SCHEMA_TABLES & node.keys()):
        table = node[key]
        if not isinstance(table, dict):
            raise UsageError(f"{where}: {at}/{key} must be an object")
        out += [(sub, pointer(f"{at}/{key}", name)) for name, sub in table.items()]
    for key in sorted(_SCHEMA_LISTS & node.keys()):
        members = node[key]
        if not isinstance(members, list) or not members:
            raise UsageError(f"{where}: {at}/{key} must be a non-empty list")
        out += [(sub, f"{at}/{key}/{i}") for i, sub in enumerate(members)]
    for i, member in enumerate(node.get("allOf", [])):
        extra = set(member) - _ALL_OF_MEMBER if isinstance(member, dict) else set()
        if extra:
            raise _unsupported(where, f"{at}/allOf/{i}", f"{shown(sorted(extra)[0])} inside allOf")
    items = node.get("items")
    if items == []:
        raise UsageError(f"{where}: {at}/items must be a schema or a non-empty list")
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
