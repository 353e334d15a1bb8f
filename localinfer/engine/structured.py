"""Structured output: a JSON schema or a GBNF grammar from the user, checked and turned into the
GBNF text llama.cpp's grammar sampler runs.

Both arrive from outside, so both are checked here, before any model loads: the size, the JSON,
every schema keyword and its value (schema_check), patterns rewritten to write valid JSON
(schema_pattern), the grammar's expansion and what it can match (gbnf_check), and the grammar
through llama.cpp's own parser. No error quotes the file: it names the place.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localinfer.engine.gbnf_check import check_gbnf
from localinfer.engine.prompt import REPLY_TOKENS
from localinfer.engine.schema_bound import longest_answer
from localinfer.engine.schema_check import ANNOTATIONS, check_schema
from localinfer.engine.schema_loose import loosened
from localinfer.engine.schema_pattern import json_safe_pattern
from localinfer.engine.schema_range import Ranges
from localinfer.errors import UsageError

MAX_SOURCE_BYTES = 1 << 20          # a schema file; real ones are a few KiB
MAX_GRAMMAR_BYTES = 256 << 10       # a grammar file; the converter's output is bounded by the
                                    # schema check's expansion budget instead


@dataclass(frozen=True)
class OutputFormat:
    """What the answer must match: GBNF text, and whether it is one JSON document."""

    gbnf: str
    is_json: bool

    @property
    def longest(self) -> int | None:
        """The most tokens an answer that keeps to it can take; None: no bound of its own."""
        return longest_answer(self.gbnf)


def answer_limit(output: OutputFormat | None, max_tokens: int, *, thinks: bool = False) -> int:
    """The token limit of a constrained answer asked for with no -n (-1): the most its grammar
    allows when that is bounded (maxLength, maxItems, enums, ...), else REPLY_TOKENS, the reply
    room a context is sized for; the answer is closed to fit it (engine/closing.py), so a model
    that loops inside a string or a list ends there. A given -n, an unconstrained answer and a
    thinking model's (whose -n counts its trace, which has no bound of its own) keep max_tokens."""
    if output is None or max_tokens > 0 or thinks:
        return max_tokens
    longest = output.longest
    return max(1, longest) if longest is not None else REPLY_TOKENS


def from_options(json_schema: str | None, grammar: str | None) -> OutputFormat | None:
    """The --json-schema / --grammar options, checked; None when neither is given."""
    if json_schema is not None and grammar is not None:
        raise UsageError("--json-schema and --grammar cannot be used together")
    if json_schema is not None:
        return from_schema(*read_schema(json_schema))
    if grammar is not None:
        where = f"--grammar {grammar}"
        return from_grammar(_read(Path(grammar), where, MAX_GRAMMAR_BYTES), where)
    return None


def read_schema(json_schema: str) -> tuple[Any, str]:
    """--json-schema's JSON (a file's, or inline), parsed, and where it came from as an error
    names it; from_schema checks it."""
    text, where = _schema_text(json_schema)
    return _parse_json(text, where), where


def from_grammar(gbnf: str, where: str) -> OutputFormat:
    """GBNF text (a file's, or the Python API's `grammar`), checked as --grammar's is."""
    if len(gbnf.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise UsageError(f"{where}: over {MAX_GRAMMAR_BYTES:,} bytes")
    _check_grammar(gbnf, where)
    return OutputFormat(gbnf, False)


def from_schema(schema: Any, where: str, *, check_parse: bool = True,
                loose: bool = False) -> OutputFormat:
    """A parsed JSON schema (from a file, or an API request's response_format), checked;
    `check_parse=False` leaves llama.cpp's parse of the converted grammar to the caller.
    `loose` (a tool's parameters): what the grammar cannot enforce is left out rather than
    refused (engine/schema_loose.py); a --json-schema stays strict."""
    return from_checked(checked(schema, where, loose=loose), where, check_parse=check_parse)


def checked(schema: Any, where: str, *, loose: bool = False) -> dict:
    """The schema, a copy, checked as from_schema checks it (loose: loosened first), for a
    caller that puts several together (a tool call's, server/tools.py) before from_checked."""
    if not isinstance(schema, dict):
        raise UsageError(f"{where}: the schema must be a JSON object")
    try:
        schema = loosened(schema) if loose else copy.deepcopy(schema)
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply") from None
    check_schema(schema, where)
    return schema


def from_checked(schema: dict, where: str, *, check_parse: bool = True) -> OutputFormat:
    """A schema `checked` already (alone or as a part of it), as grammar."""
    schema = copy.deepcopy(schema)              # its patterns and ranges are rewritten below
    ranges = Ranges()
    for node in check_schema(schema, where):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = json_safe_pattern(node["pattern"])[0]
        ranges.take(node)
        _any_value(node, root=node is schema)
    from localinfer.backends.llama.grammar import schema_to_gbnf
    try:
        gbnf = ranges.fill(schema_to_gbnf(schema))
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError,
            RecursionError) as e:
        # The converter's messages quote the schema; the check above names the place.
        raise UsageError(f"{where}: cannot turn this schema into a grammar "
                         f"({type(e).__name__})") from e
    _check_grammar(gbnf, where, parse=check_parse)
    return OutputFormat(gbnf, True)


_ANY = ["object", "array", "string", "number", "boolean", "null"]


def _any_value(node: dict, *, root: bool) -> None:
    """A subschema of annotations alone (`{"description": ...}`, Claude Code's Workflow `args`)
    or none (`{}`) allows any value: the converter failed on the first (an assertion) and took
    the second for an object. The root's `{}` stays an object, as before."""
    for key in ANNOTATIONS & node.keys():
        del node[key]
    if not node and not root:
        node["type"] = list(_ANY)


def incomplete(fmt: OutputFormat, text: str, finish_reason: str, *,
               stop_string: bool = False) -> str | None:
    """Why the answer is not a whole JSON document (a limit ended it first), or None.
    `stop_string`: whether a --stop string ended it (finish_reason "stop" is also the model's
    end-of-generation token)."""
    if not fmt.is_json:
        return None
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    why = {"length": "reached -n/--max-tokens", "context": "reached the end of the context",
           "interrupted": "was interrupted", "cancelled": "was cancelled",
           "stop": "reached a --stop string" if stop_string
           else "ended at the model's end-of-generation token"}
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
    from localinfer.backends.llama.grammar import grammar_error
    if not gbnf.strip():
        raise UsageError(f"{where}: the grammar is empty")
    check_gbnf(gbnf, where)
    problem = grammar_error(gbnf) if parse else None
    if problem:
        raise UsageError(f"{where}: the grammar does not parse: {problem}")
