"""Structured output (--json-schema, --grammar): answers parse and validate, on both real models,
greedy and sampled, with and without speculation, and bad schemas and grammars are refused in one
line before any model loads. Answers are validated with `jsonschema`, a validator independent of
the grammar that produced them."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from helpers import SMOLLM, load_file, prompt_tokens, run_cli

from localinfer.backends import LoadOptions, available_backends
from localinfer.engine import constrain
from localinfer.engine.constrain import Constraint, ConstrainedSampler
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.sampling import SamplingParams, candidate_probs
from localinfer.engine.structured import OutputFormat, from_schema, incomplete
from localinfer.speculate import choose
from localinfer.speculate.drafters import Draft, PromptLookup
from localinfer.speculate.verify import SamplingPolicy, accept_or_resample

PERSON = {"type": "object", "required": ["name", "age", "city", "languages", "employed"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 30},
                         "languages": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "string", "enum": ["en", "fr", "de"]}},
                         "employed": {"type": "boolean"},
                         "height": {"type": "number"}}}
PEOPLE = {"type": "object", "required": ["people"],
          "properties": {"people": {"type": "array", "items": PERSON,
                                    "minItems": 4, "maxItems": 4}}}
pytestmark = pytest.mark.usefixtures("in_models_home")   # caches in the test home
GREEDY = SamplingParams(temperature=0)
OPTIONS = LoadOptions(n_ctx=2048)


@pytest.fixture(scope="module")
def smollm(smollm_path):
    loaded = load_file(smollm_path, OPTIONS, "llama.cpp")
    yield loaded
    loaded.session.close()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    loaded = load_file(gemma_path, OPTIONS, "llama.cpp")
    yield loaded
    loaded.session.close()


def _constrained(loaded: LoadedModel, schema: dict, text: str, params=GREEDY,
                 max_tokens: int = 400) -> tuple[str, Generation]:
    grammar = loaded.session.grammar(from_schema(schema, "test").gbnf)
    generation = Generation(KVCache(loaded.session, None), prompt_tokens(loaded, text),
                            ConstrainedSampler(params, grammar), Limits(max_tokens))
    return "".join(generation), generation


def _valid(text: str, schema: dict) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


# -- answers validate ---------------------------------------------------------------------------
@pytest.mark.slow   # the real models, through request.getfixturevalue
@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_greedy_answer_validates_and_the_windowed_mask_changes_nothing(request, model,
                                                                       monkeypatch):
    loaded = request.getfixturevalue(model)
    text, generation = _constrained(loaded, PEOPLE, "Four fictional people as JSON:")
    assert generation.stats.finish_reason == "stop"
    assert len(_valid(text, PEOPLE)["people"]) == 4
    # Masks that ask about the likeliest tokens first pick what a mask of the whole vocabulary does.
    monkeypatch.setattr(constrain, "WINDOWS", ())
    assert _constrained(loaded, PEOPLE, "Four fictional people as JSON:")[0] == text


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_answers_validate(smollm, seed):
    params = SamplingParams(temperature=1.0, seed=seed)
    text, _ = _constrained(smollm, PERSON, "Describe someone as JSON.", params)
    _valid(text, PERSON)


def test_sampled_answers_validate_without_top_k_and_with_a_repeat_penalty(gemma):
    params = SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0,
                            repeat_penalty=1.3, seed=7)
    _valid(_constrained(gemma, PERSON, "A person in JSON:", params)[0], PERSON)


# -- speculation ----------------------------------------------------------------------------------
class _Hostile:
    """Proposes tokens the grammar cannot allow (and the model would not pick): all rejected."""

    name = "hostile"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def prepare(self, prompt) -> None:
        pass

    def propose(self, context, n, policy) -> Draft:
        return Draft(tokens=(self.tokens * n)[:n])

    def close(self) -> None:
        pass


def _speculative(loaded: LoadedModel, schema: dict, prompt: list[int], drafter, *,
                 chunk: int | None = None):
    grammar = loaded.session.grammar(from_schema(schema, "test").gbnf)
    generation = choose.speculative(loaded, KVCache(loaded.session, None), prompt, GREEDY,
                                    Limits(400), drafter, max_draft=6, chunk=chunk,
                                    adaptive=False, grammar=grammar)
    return "".join(generation), generation.stats


# Two people, not four: the second repeats the first's keys for lookup to copy, at half the tokens.
PAIR = {**PEOPLE, "properties": {"people": {**PEOPLE["properties"]["people"],
                                            "minItems": 2, "maxItems": 2}}}


def test_speculation_keeps_the_constrained_answer_and_never_a_rejected_guess(smollm):
    prompt = prompt_tokens(smollm, "Two fictional people as JSON:")
    plain, _ = _constrained(smollm, PAIR, "Two fictional people as JSON:")
    assert len(_valid(plain, PAIR)["people"]) == 2
    bad = smollm.session.tokenize(" zebra!!", special=False)
    hostile, stats = _speculative(smollm, PAIR, prompt, _Hostile(bad))
    assert hostile == plain and stats.drafted > 0 and stats.accepted == 0
    lookup, stats = _speculative(smollm, PAIR, prompt, PromptLookup())
    assert lookup == plain and stats.accepted > 0


@pytest.mark.slow   # the real models, through request.getfixturevalue
@pytest.mark.parametrize("model", [pytest.param("smollm", marks=pytest.mark.exhaustive), "gemma"])
def test_speculation_over_a_long_document_equals_plain_constrained(request, model):
    """Copying names out of a long document: lookup drafts are long and mostly right, and the
    grammar's state must follow every kept guess and every correction."""
    names = ["Alice Martin", "Bruno Keller", "Chloé Dubois", "Dmitri Ivanov", "Eva Lind"]
    document = " ".join(f"Record {i}: {n} works in the archive and files report {i * 7}."
                        for i in range(60) for n in [names[i % 5]])
    schema = {"type": "object", "required": ["names"],
              "properties": {"names": {"type": "array", "minItems": 5, "maxItems": 5,
                                       "items": {"type": "string", "enum": names}}}}
    text = f"{document}\nThe five people in these records, as JSON: "
    loaded = request.getfixturevalue(model)
    prompt = prompt_tokens(loaded, text)          # as _constrained prompts it: templated on SmolLM2
    assert len(prompt) > 1000
    plain, _ = _constrained(loaded, schema, text)
    _valid(plain, schema)
    for chunk in (1, 4):
        spec, stats = _speculative(loaded, schema, prompt, PromptLookup(), chunk=chunk)
        assert spec == plain, chunk
        assert stats.drafted > 0


# -- literals JSON escapes: constants, enum values, property names, pattern characters ----------
HOSTILE = "x\"y\\z\n\u0000\t\u001f"        # a quote, a backslash, a newline, NUL, TAB, US
LITERAL_SCHEMAS = [
    {"type": "object", "properties": {"a": {"const": "x\"y\\z\n\u0000"}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"enum": [HOSTILE, "\\", '"', "\n", "\u0000"]}},
     "required": ["a"]},
    {"type": "object", "properties": {'q"b\\n\nx': {"type": "integer"}, HOSTILE: {"const": 1}},
     "required": ['q"b\\n\nx', HOSTILE]},
    {"enum": [{"k\"": ["\\\n"]}, [HOSTILE]]},
    {"type": "object", "properties": {"p": {"type": "string", "pattern": '^a"b\\\\c\\n\\x00$'}},
     "required": ["p"]},
    {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[ -~]{4,8}$"},
                                      "q": {"type": "string", "pattern": "^.{1,6}[^a-z]$"}},
     "required": ["p", "q"]},
]


@pytest.mark.parametrize("schema", LITERAL_SCHEMAS, ids=range(len(LITERAL_SCHEMAS)))
def test_literals_holding_json_escapes_give_valid_json(smollm, schema):
    """Before, the converter left the backslashes of json.dumps' text unescaped: the grammar
    did not parse, or ended the literal early and wrote invalid JSON."""
    text, generation = _constrained(smollm, schema, "Answer in JSON.", max_tokens=120)
    assert generation.stats.finish_reason == "stop", text
    _valid(text, schema)


@pytest.mark.parametrize("pattern, inside, outside", [
    ('^a"b\\\\c\\n$', ['a"b\\c\n'], ["ab\\c\n", 'a"bc\n', 'a"b\\c']),
    ("^[ -~]{2,3}$", ['"\\', "a b", '\\\\'], ["a", "abcd", "\t\t"]),
    ("^.+$", ['say "hi"', "\\", "é中😀"], ["", "a\nb"]),
    ("^[^a]\\d$", ['"1', "\\9", "b0"], ["a1", "bb"]),
    ("^(\\x41|\\u00e9)+\\.$", ["A.", "éAé."], ["A", "B."]),
])
def test_patterns_spell_exactly_their_strings_as_json(smollm, pattern, inside, outside):
    """The grammar of a pattern, walked token by token along each string's JSON text: it takes
    the strings the pattern matches (a quote, a backslash, a newline escaped as JSON requires)
    and none it does not. A class is narrowed to what JSON holds unescaped, a quote and a
    backslash: `[^a]` does not take a newline (written \\n) nor a NUL."""
    gbnf = from_schema({"type": "string", "pattern": pattern}, "test").gbnf
    for string in inside + outside:
        assert bool(re.fullmatch(pattern[1:-1], string)) == (string in inside), string
        assert _spells(smollm.session, gbnf, json.dumps(string, ensure_ascii=False)) == \
            (string in inside), string
    if pattern == "^[^a]\\d$":
        assert not _spells(smollm.session, gbnf, json.dumps("\n1"))


def _spells(session, gbnf: str, text: str) -> bool:
    """Whether the grammar takes exactly this text (its tokens one by one, then the end)."""
    grammar = session.grammar(gbnf)
    for token in session.tokenize(text, special=False):
        if not grammar.allows(np.array([token], dtype=np.int32))[0]:
            return False
        grammar.accept(token)
    return bool(grammar.allows(np.array([session.eos_token], dtype=np.int32))[0])


def test_an_answer_the_model_ended_does_not_blame_a_stop_string():
    """finish_reason "stop" is also the end-of-generation token: the message says which."""
    fmt = OutputFormat("root ::= x", True)
    assert "end-of-generation token" in incomplete(fmt, '{"a": ', "stop")
    assert "--stop string" in incomplete(fmt, '{"a": ', "stop", stop_string=True)
    assert "was cancelled" in incomplete(fmt, "{", "cancelled")
    assert incomplete(fmt, '{"a": 1}', "stop") is None


# -- the constrained distribution (a fake grammar: exact counts need a fixed vocabulary) -----------
class _Allowed:
    """A grammar that allows a fixed set of token ids, for the sampler's arithmetic."""

    def __init__(self, allowed: set[int], n_vocab: int) -> None:
        self.allowed, self.n_vocab = allowed, n_vocab

    def allows(self, ids):
        return np.array([int(i) in self.allowed for i in ids])

    def mask(self, logits):
        ok = self.allows(np.arange(self.n_vocab))
        return np.where(ok, logits, -np.inf)


def test_choose_draws_from_the_distribution_the_speculative_rule_uses():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, 300).astype(np.float32)
    grammar = _Allowed(set(range(0, 300, 7)), 300)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=11)
    constraint = Constraint(params)
    ids, probs = constraint.distribution(logits, [], grammar)
    assert set(ids.tolist()) <= grammar.allowed and abs(probs.sum() - 1) < 1e-9
    counts = np.zeros(300)
    draws = 40_000
    for _ in range(draws):
        counts[constraint.choose(logits, [], grammar)] += 1
    expected = np.zeros(300)
    expected[ids] = probs
    assert np.abs(counts / draws - expected).max() < 0.01
    assert counts[[t for t in range(300) if t not in grammar.allowed]].sum() == 0


def test_without_filters_the_constrained_distribution_is_the_masked_one():
    logits = np.random.default_rng(1).normal(0, 1, 200).astype(np.float32)
    grammar = _Allowed({3, 50, 51, 199}, 200)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    ids, probs = Constraint(params).distribution(logits, [], grammar)
    want_ids, want = candidate_probs(grammar.mask(logits), params)
    got = dict(zip(ids.tolist(), probs.tolist()))
    assert got == pytest.approx(dict(zip(want_ids.tolist(), want.tolist())))


def test_the_acceptance_rule_never_keeps_a_guess_the_grammar_rejects():
    logits = np.random.default_rng(2).normal(0, 1, 100).astype(np.float32)
    grammar = _Allowed({1, 2, 3}, 100)
    policy = SamplingPolicy(SamplingParams(temperature=1.0, seed=5))
    p = policy.distribution(logits, [], grammar)
    for guess in (0, 50, 99):       # each disallowed, proposed with certainty or with q
        for q in (None, (np.array([guess]), np.array([1.0]))):
            for _ in range(200):
                assert accept_or_resample(p, guess, q, policy.rng) in grammar.allowed


# -- other backends: their grammar runs over the same llama.cpp vocabulary ----------------------
@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_other_backends_answers_validate(smollm_path, backend):
    if not available_backends()[backend]:
        pytest.skip(f"{backend} is not installed here")
    loaded = load_file(smollm_path, OPTIONS, backend)
    try:
        schema = {"type": "object", "required": ["city", "country"],
                  "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
        _valid(_constrained(loaded, schema, "Paris is in France. Extract city and country.",
                            max_tokens=60)[0], schema)
    finally:
        loaded.session.close()


# -- the command line ------------------------------------------------------------------------------
def test_run_prints_one_valid_document_and_the_cache_and_speculation_keep_it(models_home,
                                                                            tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    # Long enough for the prompt cache (it keeps prompts from 128 tokens).
    story = " ".join(f"Day {i}: the village baker opened at six and sold bread." for i in range(12))
    args = ("run", SMOLLM, f"{story}\nDescribe the baker as a person.", "--json-schema",
            str(schema), "--temp", "0", "--offline")
    first = run_cli(*args, "--draft", "none")
    assert first.returncode == 0, first.stderr
    _valid(first.stdout, PERSON)
    again = run_cli(*args, "--json")                 # prompt cache warm, --draft auto
    record = json.loads(again.stdout)
    assert record["text"] + "\n" == first.stdout and record["cached_tokens"] > 0


def test_grammar_file_and_stop_strings(models_home, tmp_path):
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "The answer is " ("yes" | "no") "."\n')
    args = ("run", SMOLLM, "Is water wet?", "--grammar", str(grammar), "--temp", "0", "--offline")
    full = run_cli(*args)
    assert full.returncode == 0, full.stderr
    assert full.stdout in ("The answer is yes.\n", "The answer is no.\n")
    stopped = run_cli(*args, "--stop", " is")
    assert stopped.returncode == 0 and stopped.stdout == "The answer\n"


def test_an_answer_cut_short_is_a_failure_in_one_line(models_home):
    cut = run_cli("run", SMOLLM, "A person.", "--json-schema", json.dumps(PERSON), "--temp", "0",
                  "-n", "5", "--offline")
    assert cut.returncode == 1
    assert cut.stderr.strip().splitlines() == [
        "localinfer: error: the answer reached -n/--max-tokens before its JSON document was "
        "complete; stdout holds the partial document"]


def test_an_answer_a_stop_string_cut_says_so(models_home):
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    cut = run_cli("run", SMOLLM, "Paris is in France. The city, as JSON:", "--json-schema",
                  json.dumps(schema), "--temp", "0", "--stop", "city", "--offline")
    assert cut.returncode == 1
    assert cut.stderr.strip().splitlines() == [
        "localinfer: error: the answer reached a --stop string before its JSON document was "
        "complete; stdout holds the partial document"]


def test_map_and_chat_constrain_every_answer(models_home):
    schema = {"type": "object", "required": ["city", "country"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
    lines = "Paris is the capital of France.\nBerlin is in Germany.\n"
    mapped = run_cli("map", SMOLLM, "Extract the city and country: {}", "--temp", "0",
                     "--json-schema", json.dumps(schema), "--offline", input=lines)
    assert mapped.returncode == 0, mapped.stderr
    assert [_valid(line, schema)["city"] for line in mapped.stdout.splitlines()] == \
        ["Paris", "Berlin"]
    chat = run_cli("chat", SMOLLM, "--temp", "0", "--json-schema", json.dumps(schema),
                   "--offline", input=lines)
    assert chat.returncode == 0, chat.stderr
    replies = [line for line in chat.stdout.splitlines() if line.strip()]
    assert len(replies) == 2 and all(_valid(r, schema) for r in replies)


# -- bad input: one line, exit 2, before any model loads (the model named does not exist) ----------
BAD = [
    (["--json-schema", '{"type": "object",'], "--json-schema: not JSON: "
     "Expecting property name enclosed in double quotes at line 1, column 19"),
    (["--json-schema", '{"type": "object", "properties": {"age": {"type": "integer", '
      '"multipleOf": 2}}}'], "the keyword 'multipleOf' at /properties/age/multipleOf is not "
     "supported"),
    (["--json-schema", '{"type": "array", "items": {"type": "string"}, "maxItems": 1000000000}'],
     "/maxItems must be a whole number from 0 to 1000"),
    (["--json-schema", '{"$ref": "https://example.org/schema.json"}'],
     "a $ref outside this schema (nothing is fetched) at /$ref is not supported"),
    (["--json-schema", '{"type": "object", "required": ["name"]}'],
     "a required property with no schema in properties ('name') at /required is not supported"),
    (["--json-schema", '{"type": "strin"}'], "/type: unknown type 'strin'"),
    (["--json-schema", "no-such-schema.json"], "--json-schema no-such-schema.json: no such file"),
    (["--grammar", "GRAMMAR:root ::= (\"a\" | \"b\"\n"], "line 2, column 1: expecting ')'"),
    (["--grammar", 'GRAMMAR:root ::= "a" tail\n'], "line 1, column 14: a rule that is never defined"),
    (["--grammar", 'GRAMMAR:start ::= "a"\n'], "grammar does not contain a 'root' symbol"),
    (["--grammar", "GRAMMAR:root ::= root \"a\"\n"], "left recursion"),
    (["--grammar", "GRAMMAR:x", "--json-schema", "{}"], "cannot be used together"),
    # llama.cpp's parser overflows its stack (a crash) on nesting like this.
    (["--grammar", "GRAMMAR:root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000],
     "groups nested more than 2000 deep"),
    (["--grammar", "GRAMMAR:root ::= \"a\"\n" + "# padding\n" * 30_000], "is over 256 KiB"),
    # A device reports size 0 and never ends: refused, not read forever.
    (["--json-schema", "/dev/zero"], "--json-schema /dev/zero: not a regular file"),
    (["--grammar", "/dev/urandom"], "--grammar /dev/urandom: not a regular file"),
]


@pytest.mark.parametrize("options, said", BAD, ids=[said[:40] for _, said in BAD])
def test_bad_schemas_and_grammars_are_refused_before_loading(tmp_path, options, said):
    options = list(options)
    for i, value in enumerate(options):
        if value.startswith("GRAMMAR:"):
            path = tmp_path / "g.gbnf"
            path.write_text(value[len("GRAMMAR:"):])
            options[i] = str(path)
    result = run_cli("run", "no-such-model", "hi", *options, "--offline", home=tmp_path / "home")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
