"""Hostile schemas and grammars (issue 24, item 11): each is refused in one line on stderr, exit
2, before any model loads (the model named does not exist), and no error quotes the file; a
fuzz of every keyword the schema check reads with values of every wrong JSON type ends in a
UsageError, never another exception; and what is refused is refused before anything large is
allocated."""

from __future__ import annotations

import itertools
import json
import re
import resource
import time

import pytest
from helpers import run_cli

from localinfer.engine import structured
from localinfer.engine.schema_check import KEYWORDS
from localinfer.engine.structured import from_schema
from localinfer.errors import UsageError

CANARY = "CANARY-7f3a9c"       # in every hostile file; never in what the user is told
NESTED_PAIRS = "(" * 3 + '"a"' + ")" * 3

SCHEMAS = [
    ({"type": {"a": CANARY}}, "/type must be a type name or a list of type names"),
    ({"type": 7}, "/type must be a type name"),
    ({"type": []}, "/type must be a type name or a non-empty list"),
    ({"type": ["string", "string"]}, "distinct type names"),
    ({"type": ["object", "null"], "properties": {}}, "a list of types with 'properties'"),
    ({"type": ["strin"]}, "/type: unknown type 'strin'"),
    ({"type": "string", "format": ["date"]}, "/format must be a string"),
    ({"type": "string", "format": {"x": CANARY}}, "/format must be a string"),
    ({"type": "string", "format": 3}, "/format must be a string"),
    ({"properties": [CANARY]}, "/properties must be an object"),
    ({"properties": {"a": 5}}, "/properties/a must be a schema"),
    ({"required": CANARY, "properties": {}}, "/required must be a list of property names"),
    ({"required": [1], "properties": {}}, "/required must be a list of property names"),
    ({"type": "array", "items": 3}, "/items must be a schema"),
    ({"type": "array", "items": []}, "/items must be a schema or a non-empty list"),
    ({"enum": {"a": CANARY}}, "/enum must be a non-empty list"),
    ({"enum": []}, "/enum must be a non-empty list"),
    ({"anyOf": {}}, "/anyOf must be a non-empty list"),
    ({"anyOf": []}, "/anyOf must be a non-empty list"),
    ({"allOf": [3]}, "/allOf/0 must be a schema"),
    ({"$ref": 5}, "/$ref must be a string"),
    ({"$ref": "#/$defs/" + CANARY}, "/$ref points to nothing in this schema"),
    ({"$ref": "#/$defs/a", "$defs": {"a": [CANARY]}}, "/$ref must point to a schema"),
    ({"additionalProperties": CANARY}, "additionalProperties must be true, false or a schema"),
    ({"type": "string", "pattern": 5}, "/pattern must be a string"),
    ({"type": "string", "minLength": "3"}, "/minLength must be a whole number from 0 to 1000"),
    ({"type": "string", "maxLength": -1}, "/maxLength must be a whole number"),
    ({"type": "string", "maxLength": True}, "/maxLength must be a whole number"),
    ({"type": "string", "maxLength": 2.5}, "/maxLength must be a whole number"),
    # Repetition counts the converter would write out one by one (4.3 GB and 56 s for this one).
    ({"type": "string", "pattern": "^a{200000000}$"}, "a repetition count is over 1000"),
    ({"type": "string", "pattern": "^a{0," + "9" * 5000 + "}$"}, "a repetition count is over"),
    ({"type": "string", "pattern": "^((ab{1000}){1000}){1000}$"}, "grammar would be too large"),
    ({"type": "object", "required": [], "properties": {
        f"p{i}": {"type": "string", "maxLength": 1000} for i in range(1001)}},
     "grammar would be too large"),
    # Patterns that can match nothing (this one poisoned the server) or that it cannot write.
    ({"type": "string", "pattern": "^[]$"}, "matches no character a JSON string can hold"),
    ({"type": "string", "pattern": "^[\\n\\r]+$"}, "matches no character a JSON string"),
    ({"type": "string", "pattern": "^(?=" + CANARY + ")$"}, '"(?" groups are not supported'),
    ({"type": "string", "pattern": "^(a)\\1$"}, "the escape \\1 is not supported"),
    ({"type": "string", "pattern": CANARY}, 'it must start with "^" and end with "$"'),
    ({"type": "string", "pattern": "^a{2,1}$"}, "has m larger than n"),
    ({"type": "string", "pattern": "^(ab$"}, "a group is not closed"),
    ({"type": "string", "pattern": "^[ab$"}, "a [ class is not closed"),
    # A name with a newline stays one line, escaped; a very long one is shortened.
    ({"properties": {"a\nb": {"minimum": 1}}}, "/properties/a\\u000ab/minimum is not supported"),
    ({"properties": {"p" * 5000: {"minimum": 1}}}, "/properties/" + "p" * 37 + ".../minimum"),
    ({"const": float("nan")}, "is not JSON (NaN or Infinity)"),
]

GRAMMARS = [
    ('root ::= "x"{200000000}\n', "line 1, column 13: a repetition count over 1000"),
    ('root ::= "x"{0,5000}\n', "a repetition count over 1000"),        # llama.cpp: "x"*
    # 100,000 characters repeated 2,000 times took llama.cpp's parser 3.6 GB and 13 s.
    ('root ::= "' + "a" * 100_000 + '"{1000}\n', "expands to over 1,000,000 elements"),
    ('root ::= ("xy"{1000}){1000}\n', "expands to over 1,000,000 elements"),
    ("root ::= []\n", "line 1, column 10: a character class that matches no character"),
    ("root ::= [^\\x00-\\U0010FFFF]\n", "a character class that matches no character"),
    ('root ::= "a\\x00"\n', "a NUL character, which llama.cpp's grammar engine cannot match"),
    ("root ::= [\\x00]\n", "a character class that matches no character"),
    # Like /proc/self/environ: NUL-separated; llama.cpp would read up to the first NUL only.
    (f"SECRET={CANARY}\0PATH=/usr/bin\0", "line 1, column 21: a NUL byte"),
    (f'root ::= "a" | @ {CANARY}\n', "line 1, column 16: expecting"),
    (f'root ::= "a" "\\q{CANARY}"\n', "unknown escape"),
    (f"root ::= x {CANARY}\nx ::= [a]\n", "line 1, column 12: a rule that is never defined"),
    ("root ::= " + NESTED_PAIRS, None),                # a control: this one is fine
]


def _refused(tmp_path, option: str, content: str):
    path = tmp_path / "hostile"
    path.write_bytes(content.encode("utf-8", "surrogatepass"))
    return run_cli("run", "no-such-model", "hi", option, str(path), "--offline",
                   home=tmp_path / "home")


def _one_line(result, said: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
    shown = re.sub(r"/\S*/hostile", "FILE", lines[0])     # bounded whatever tmp_path's length
    assert lines[0].startswith("localinfer: error: ") and len(shown) < 300
    assert CANARY not in result.stderr and "no-such-model" not in result.stderr


@pytest.mark.parametrize("schema, said", SCHEMAS, ids=[s[:40] for _, s in SCHEMAS])
def test_hostile_schemas_are_refused_in_one_line_before_loading(tmp_path, schema, said):
    _one_line(_refused(tmp_path, "--json-schema", json.dumps(schema)), said)


@pytest.mark.parametrize("grammar, said", GRAMMARS, ids=[str(s)[:40] for _, s in GRAMMARS])
def test_hostile_grammars_are_refused_in_one_line_before_loading(tmp_path, grammar, said):
    result = _refused(tmp_path, "--grammar", grammar)
    if said is None:              # checked, then the model is looked for: not found (exit 2)
        assert "no-such-model" in result.stderr and result.returncode == 2, result.stderr
        return
    _one_line(result, said)


def test_proc_self_environ_is_never_echoed(tmp_path):
    for option, said in (("--grammar", "a NUL byte"), ("--json-schema", "not JSON")):
        result = run_cli("run", "no-such-model", "hi", option, "/proc/self/environ", "--offline",
                         home=tmp_path / "home", env={"LOCALINFER_SECRET": CANARY})
        _one_line(result, said)


def test_a_refused_expansion_costs_neither_time_nor_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    for pattern in ("^a{200000000}$", "^(ab{1000}){1000}$", "^[a-z]{0,1000000}$"):
        with pytest.raises(UsageError):
            from_schema({"type": "string", "pattern": pattern}, "t")
    with pytest.raises(UsageError):
        structured._check_grammar('root ::= "' + "a" * 200_000 + '"{1000}', "t", parse=False)
    assert time.perf_counter() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024   # KiB


# -- a fuzz of the checker: every keyword, every wrong JSON type -----------------------------------
WRONG = [None, True, 0, -3, 2.5, 10**40, "", "x", "^[]$", [], [1], ["string"], [{}], {},
         {"a": 1}, {"type": 3}, float("inf")]
BASES = [{}, {"type": "string"}, {"type": "array", "items": {}}, {"type": "object"}]


@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_every_keyword_with_every_wrong_value_is_a_usage_error_or_a_grammar(keyword):
    for base, value in itertools.product(BASES, WRONG):
        schema = {**base, keyword: value}
        for nested in (schema, {"type": "object", "properties": {"p": schema}},
                       {"anyOf": [schema]}, {"$defs": {"d": schema}, "$ref": "#/$defs/d"}):
            try:
                from_schema(nested, "fuzz")
            except UsageError as e:
                assert "\n" not in str(e) and len(str(e)) < 300, str(e)
