"""A tool's parameter schema as agents write it (zod's output, an MCP server's), made into one
the grammar can hold: what can be enforced is kept, what cannot is left out instead of refused.

A `--json-schema` the user wrote is refused where a keyword would go unenforced: its author is
there to fix it, and the answer must validate. A tool's schema comes from an agent nobody at the
terminal can change, and the tool checks its own arguments anyway, so refusing it only stops the
agent: Claude Code's Read tool carries `minimum`, its WebFetch `format: "uri"`, its Write a
`maxLength` of 524,288. Kept and enforced: numeric bounds (schema_range), string and array
counts up to the repetition bound, formats and patterns the converter spells. Left out (the
model is free there; docs/structured-output.md lists them): other formats, patterns it cannot
spell, counts past the bound (the string or list is then unbounded, as the grammar's budget
needs), assertion keywords (`multipleOf`, `uniqueItems`, `not`, `if`, `patternProperties`, ...),
`propertyNames` beyond plain strings, `$ref`s out of the schema. What is malformed (a `type`
that names no type, `required` that is no list) is still refused, by schema_check.
"""

from __future__ import annotations

from typing import Any

from localinfer.engine.schema_check import (_ALL_OF_MEMBER, _SCHEMA_LISTS, _SCHEMA_TABLES,
                                            ANNOTATIONS, FORMATS, KEYWORDS, is_plain_names)
from localinfer.engine.schema_pattern import MAX_REPEAT, PatternError, json_safe_pattern
from localinfer.engine.schema_range import BOUNDS, RangeError, expression

# Keywords that belong to one type: a list of types is split into one schema per type, each
# keeping its own.
_OF_TYPE = {"string": {"minLength", "maxLength", "pattern", "format"},
            "integer": set(BOUNDS), "number": set(BOUNDS),
            "array": {"items", "prefixItems", "minItems", "maxItems"},
            "object": {"properties", "required", "additionalProperties", "propertyNames"}}
_TYPED = set().union(*_OF_TYPE.values())
MAX_DEPTH = 64


def loosened(schema: dict) -> dict:
    """A copy of `schema` with what the grammar cannot enforce left out (see the notes)."""
    return _node(schema, 0)


def _node(node: Any, depth: int) -> Any:
    if node is True:
        return {}
    if not isinstance(node, dict) or depth > MAX_DEPTH:
        return node                     # schema_check says what is wrong with it
    out = {k: v for k, v in node.items() if k in KEYWORDS or k in ANNOTATIONS}
    _old_exclusive(node, out)
    for key in _SCHEMA_TABLES & out.keys():
        if isinstance(out[key], dict):
            out[key] = {name: _node(sub, depth + 1) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS & out.keys():
        if isinstance(out[key], list):
            out[key] = [_node(sub, depth + 1) for sub in out[key]]
    if isinstance(out.get("items"), (dict, list)):
        out["items"] = _node(out["items"], depth + 1) if isinstance(out["items"], dict) \
            else [_node(sub, depth + 1) for sub in out["items"]]
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _node(out["additionalProperties"], depth + 1)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [{k: v for k, v in m.items() if k in _ALL_OF_MEMBER}
                        if isinstance(m, dict) else m for m in out["allOf"]]
    if isinstance(out.get("$ref"), str) and not out["$ref"].startswith("#/"):
        del out["$ref"]                 # nothing is fetched: any value there
    if "propertyNames" in out and not is_plain_names(out["propertyNames"]):
        del out["propertyNames"]
    _required(out)
    if isinstance(out.get("type"), list):
        return _split_types(out)
    _typed(out)
    return out


def _old_exclusive(node: dict, out: dict) -> None:
    """Draft 4's `exclusiveMinimum: true` beside `minimum`, as today's number."""
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(flag), bool):
            out.pop(flag)
            if node[flag] and bound in out:
                out[flag] = out.pop(bound)


def _required(out: dict) -> None:
    """A required name with no schema of its own may hold any value."""
    required, properties = out.get("required"), out.get("properties", {})
    if isinstance(required, list) and isinstance(properties, dict) and "allOf" not in out:
        missing = [r for r in required if isinstance(r, str) and r not in properties]
        if missing:
            out["properties"] = {**properties, **{r: {} for r in missing}}


def _split_types(out: dict) -> dict:
    """`"type": [..]` beside other keywords: one schema per type, each with its own keywords
    (the converter would drop them); with an enum or a const the values say it all."""
    types = out["type"]
    if not all(isinstance(t, str) for t in types):
        return out
    if "enum" in out or "const" in out:
        return {k: v for k, v in out.items() if k not in _TYPED and k != "type"}
    shared = {k: v for k, v in out.items() if k not in _TYPED and k != "type"}
    if shared.keys() <= ANNOTATIONS and not _TYPED & out.keys():
        return out                      # a plain list of types: the converter's own case
    members = []
    for t in dict.fromkeys(types):
        member = {"type": t, **{k: out[k] for k in _OF_TYPE.get(t, ()) if k in out}}
        _typed(member)
        members.append(member)
    # Whatever else stood beside the list (an anyOf of its own) is left out, with the rest.
    return {**{k: v for k, v in shared.items() if k in ANNOTATIONS}, "anyOf": members}


def _typed(out: dict) -> None:
    """The keywords of one type's schema that the grammar can hold; the others left out."""
    kind = out.get("type") if isinstance(out.get("type"), str) else None
    if "type" in out and kind is None:
        return                          # malformed: schema_check names it
    for key in _TYPED - _OF_TYPE.get(kind, set()):
        if key in out and not (kind is None and key in _OF_TYPE["object"] | _OF_TYPE["array"]):
            del out[key]
    if kind == "string":
        _string(out)
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        _counts(out, low, high)
    if BOUNDS & out.keys():
        _bounds(out)


def _string(out: dict) -> None:
    if isinstance(out.get("format"), str) and out["format"] not in FORMATS:
        del out["format"]
    if isinstance(out.get("pattern"), str):
        try:
            json_safe_pattern(out["pattern"])
        except PatternError:
            del out["pattern"]
    if "pattern" in out or "format" in out:     # they bound the length themselves
        out.pop("minLength", None)
        out.pop("maxLength", None)


def _counts(out: dict, low: str, high: str) -> None:
    """Counts past the repetition bound are left out (the grammar would spell each one: the
    string or list is unbounded then); item counts need `items` to count."""
    for key in (low, high):
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPEAT:
            del out[key]
    if low == "minItems" and "items" not in out:
        out.pop(low, None)
        out.pop(high, None)


def _bounds(out: dict) -> None:
    """Numeric bounds the grammar cannot spell (no number between them, a huge bound, beside
    an enum) are left out."""
    values = [out[k] for k in BOUNDS if k in out]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        return                          # malformed: schema_check names it
    try:
        if "enum" in out or "const" in out:
            raise RangeError("values listed")
        expression(out)
    except (RangeError, OverflowError, ValueError):
        for key in BOUNDS:
            out.pop(key, None)
