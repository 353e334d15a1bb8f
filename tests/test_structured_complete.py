"""A constrained answer always completes (issue 28 §1): when the tokens left are just enough to
close the document, decoding is narrowed to a closing, so a --json-schema answer is a whole, valid
document, in run, map and serve, with and without speculation. The failure it mends is
reproduced first: greedy answers on both real models that loop inside a string until -n runs out."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

import anthropic
import jsonschema
import numpy as np
import openai
import pytest
from chat_templates import GEMMA3, QWEN25, QWEN3_THINKING_2507
from helpers import (GEMMA, SMOLLM, start_server, load_file, prompt_tokens, run_cli,
                     smollm_wearing)

from localinfer.backends import LoadOptions
from localinfer.engine import closing
from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.sampling import SamplingParams
from localinfer.engine.structured import from_schema

pytestmark = pytest.mark.usefixtures("in_models_home")
GREEDY = SamplingParams(temperature=0)
FRUITS = {"type": "object", "required": ["fruits"],
          "properties": {"fruits": {"type": "array", "items": {"type": "string"}}}}
CITY = {"type": "object", "required": ["city", "population"],
        "properties": {"city": {"type": "string"}, "population": {"type": "string"}}}
PERSON = {"type": "object", "required": ["name", "age", "city", "languages", "employed"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 30},
                         "languages": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "string", "enum": ["en", "fr", "de"]}},
                         "employed": {"type": "boolean"},
                         "height": {"type": "number"}}}
COUNTRY = {"type": "object", "required": ["city", "country"],
           "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
# A tool whose call cannot fit EVENT_TOKENS unless closed early.
EVENT = {"type": "object", "required": ["title", "place", "guests", "notes"],
         "properties": {"title": {"type": "string"}, "place": {"type": "string"},
                        "guests": {"type": "integer"}, "notes": {"type": "string"}}}
EVENT_TOOL = {"type": "function", "function": {
    "name": "add_event", "description": "Add an event to the calendar", "parameters": EVENT}}
EVENT_ASK = "Plan a birthday party for Anna in Lyon with 12 guests; write detailed notes."
EVENT_TOKENS = 40
# Greedy answers that loop inside the document until -n 96 runs out (measured on 0.3.36).
LOOPS = [(SMOLLM, "smollm", FRUITS, "List three fruits.", '"mango", "mango"'),
         (GEMMA, "gemma", CITY, "A person in JSON:", '"population":"100000000000000000')]


@pytest.fixture(scope="module")
def smollm(smollm_path):
    loaded = load_file(smollm_path, LoadOptions(n_ctx=512), "llama.cpp")
    yield loaded
    loaded.session.close()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    loaded = load_file(gemma_path, LoadOptions(n_ctx=512), "llama.cpp")
    yield loaded
    loaded.session.close()


def _valid(text: str, schema: dict) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


def _closing(session, schema: dict, prefix: str = "") -> tuple[str, int]:
    """The walk's closing from the grammar after `prefix`: its text and its length in tokens."""
    grammar = session.grammar(from_schema(schema, "test").gbnf)
    for token in session.tokenize(prefix, special=False):
        grammar.accept(token)
    spell = closing.speller(session)
    probe = np.array([session.eos_token, *spell.chars], dtype=np.int32)
    path = closing.walk(grammar, probe, closing.MAX_WALK)
    grammar.close()
    assert path is not None
    text = "".join(spell.char_of[t] for t in path)
    return text, len(spell.spell(text))


def _generate(loaded, schema: dict, text: str, max_tokens: int) -> tuple[str, Generation]:
    grammar = loaded.session.grammar(from_schema(schema, "test").gbnf)
    generation = Generation(KVCache(loaded.session, None), prompt_tokens(loaded, text),
                            ConstrainedSampler(GREEDY, grammar), Limits(max_tokens))
    return "".join(generation), generation


# -- the closing itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("schema, prefix, closed", [
    (PERSON, "", '{"name":"","age":0,"city":"","languages":["fr"],"employed":true}'),
    (PERSON, '{"name": "Bob', '","age":0,"city":"","languages":["fr"],"employed":true}'),
    (PERSON, '{"name": "Bob", "age": 12', ',"city":"","languages":["fr"],"employed":true}'),
    (FRUITS, '{"fruits": ["frui-frui-frui', '"]}'),
    ({"type": "object", "properties": {"x": {"type": "number"}}}, '{"x": 1000', "}"),
    ({"type": "array", "minItems": 2, "items": {"type": "object", "required": ["a"],
                                                 "properties": {"a": {"type": "boolean"}}}},
     "[", '{"a":true},{"a":true}]'),
    ({"type": "object", "required": ["hex"],
      "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}},
     '{"hex": "#a', '00000"}'),
])
def test_the_closing_writes_required_keys_with_minimal_values(smollm, gemma, schema, prefix,
                                                              closed):
    for loaded in (smollm, gemma):
        text, tokens = _closing(loaded.session, schema, prefix)
        assert text == closed
        _valid(prefix + text, schema)
        assert tokens <= len(text)           # spelled longest first: fewer tokens than characters


def test_a_closing_token_leaves_one_token_less(smollm):
    """The first token of a closing, taken, leaves the rest of it: what keeps narrowing safe."""
    session = smollm.session
    grammar = session.grammar(from_schema(PERSON, "test").gbnf)
    spell = closing.speller(session)
    probe = np.array([session.eos_token, *spell.chars], dtype=np.int32)
    lengths = []
    while (path := closing.walk(grammar, probe, 512)):
        spelled = spell.spell("".join(spell.char_of[t] for t in path))
        lengths.append(len(spelled))
        grammar.accept(spelled[0])
    grammar.close()
    assert lengths == list(range(lengths[0], 0, -1))


def test_a_token_that_stops_inside_a_character_is_refused_near_the_limit(smollm):
    """Near the limit, a byte token that begins a longer UTF-8 character is refused: the walk
    cannot finish the character, so nothing after it would fit, and the next step had no token
    left. (Seen on an AMD EPYC: SmolLM2 wearing Qwen 2.5 took b"\\xd0" inside a tool call's
    string at max_tokens 38 and 39, and serve answered a 400.) The logits here favour that byte
    at every step, as the model's did once."""
    session = smollm.session
    schema = {"type": "object", "required": ["a", "b"],
              "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    byte = next(t for t in range(session.n_vocab) if session.piece(t) == b"\xd0")
    prefix = session.tokenize('{"a": "', special=False)
    _, close_len = _closing(session, schema, '{"a": "')
    grammar = closing.fit(session.grammar(from_schema(schema, "test").gbnf), session,
                          len(prefix) + close_len + 2)
    for token in prefix:
        grammar.accept(token)
    logits = np.zeros(session.n_vocab, dtype=np.float32)
    logits[byte] = 50.0
    out = b""
    for _ in range(close_len + 2):
        row = grammar.mask(logits.copy())
        assert np.isfinite(row).any(), out            # never a step with no token
        token = int(np.argmax(row))
        if token == session.eos_token:
            break
        grammar.accept(token)
        out += session.piece(token)
    grammar.close()
    _valid('{"a": "' + out.decode(), schema)


# -- the failure, reproduced, and mended -----------------------------------------------------------
@pytest.mark.slow   # the real models, through request.getfixturevalue
@pytest.mark.parametrize("model, name, schema, prompt, loop", LOOPS, ids=["smollm2", "gemma3"])
def test_a_looping_answer_is_closed_within_n(request, monkeypatch, model, name, schema, prompt,
                                             loop):
    loaded = request.getfixturevalue(name)
    with monkeypatch.context() as off:        # as before: the budget never narrows
        off.setattr(closing, "fit", lambda grammar, *a, **k: grammar)
        before, generation = _generate(loaded, schema, prompt, 96)
    assert generation.stats.finish_reason == "length" and loop in before
    with pytest.raises(ValueError):
        json.loads(before)
    after, generation = _generate(loaded, schema, prompt, 96)
    _valid(after, schema)
    assert generation.stats.closed_at > 0 and generation.stats.generated_tokens <= 96
    # Up to where narrowing began, the answer is the model's own.
    cut = len(loaded.session.detokenize(generation.tokens[:generation.stats.closed_at]))
    assert after.encode()[:cut] == before.encode()[:cut]


@pytest.mark.slow   # the real models, through request.getfixturevalue
@pytest.mark.parametrize("model, name, schema, prompt, loop", [
    pytest.param(*LOOPS[0], id="smollm2"),
    pytest.param(*LOOPS[1], id="gemma3", marks=pytest.mark.exhaustive)])
def test_run_exits_0_with_a_valid_document_at_every_n(request, model, name, schema, prompt, loop):
    """From the closing's own length (the fewest tokens that can hold a document) up: exit 0, a
    valid document, a note on stderr, the same with --draft lookup; one token fewer fails."""
    loaded = request.getfixturevalue(name)
    _, least = _closing(loaded.session, schema)
    args = ("run", model, prompt, "--json-schema", json.dumps(schema), "--temp", "0", "--offline")
    for n in (least, least + 3, 24, 96):
        plain = run_cli(*args, "-n", str(n), "--draft", "none", "--json", "-v")
        assert plain.returncode == 0, (n, plain.stderr)
        record = json.loads(plain.stdout)
        _valid(record["text"], schema)
        assert record["generated_tokens"] <= n and record["closed_early"] is True
        assert "schema: closed early to fit the limit" in plain.stderr
        assert f"the answer was cut to fit -n {n}: its last " in plain.stderr
        drafted = run_cli(*args, "-n", str(n), "--draft", "lookup")
        assert drafted.returncode == 0, (n, drafted.stderr)
        assert drafted.stdout == record["text"] + "\n"
    short = run_cli(*args, "-n", str(least - 1), "--draft", "none")
    assert short.returncode == 1 and "before its JSON document was complete" in short.stderr


def test_an_answer_that_fits_is_untouched(smollm):
    """Far from the budget nothing narrows: the answer that ends by itself is the same."""
    schema = COUNTRY
    text, generation = _generate(smollm, schema, "Paris is in France. Extract city and country.",
                                 400)
    assert generation.stats.closed_at == -1 and generation.stats.finish_reason == "stop"
    assert "closed_early" not in generation.stats.as_dict()
    n = generation.stats.generated_tokens + 1            # just room for it and the end
    again, generation = _generate(smollm, schema, "Paris is in France. Extract city and country.",
                                  n)
    # So near the budget each token is checked from the start (closed_at may say a token the
    # model did not choose was refused, as on an AMD EPYC), but the model's own answer fits.
    assert again == text


def test_a_thinking_models_answer_is_closed_after_its_trace(tmp_path, models_home):
    """The narrowing wraps the trace gate: the trace is free, the answer after it closes in time."""
    thinking = str(smollm_wearing(QWEN3_THINKING_2507, tmp_path, "thinking"))
    args = ("run", thinking, "List three fruits.", "--temp", "0", "--think-budget", "5",
            "--json-schema", json.dumps(FRUITS), "--json")
    for n in (30, 60):
        plain = run_cli(*args, "-n", str(n), "--draft", "none")
        assert plain.returncode == 0, plain.stderr
        record = json.loads(plain.stdout)
        assert record["reasoning"] and record["generated_tokens"] <= n
        _valid(record["text"], FRUITS)
        drafted = run_cli(*args, "-n", str(n), "--draft", "lookup")
        assert json.loads(drafted.stdout)["text"] == record["text"]


# -- map and serve -------------------------------------------------------------------------------
def test_map_closes_every_line_within_n_and_says_so(models_home):
    """Each --jsonl record of a line closed early carries closed_early (as run --json does), and
    stderr counts them; an answer that ends by itself carries nothing."""
    lines = "List three fruits.\nName a fruit.\nA person in JSON:\n"
    for n in (12, 40):
        mapped = run_cli("map", SMOLLM, "{}", "--temp", "0", "-n", str(n), "--json-schema",
                         json.dumps(FRUITS), "--jsonl", "--offline", input=lines)
        assert mapped.returncode == 0, mapped.stderr
        records = [json.loads(line) for line in mapped.stdout.splitlines()]
        assert len(records) == 3
        for record in records:
            _valid(record["answer"], FRUITS)
        closed = [r for r in records if r.get("closed_early")]
        assert all(0 < r["closed_tokens"] <= n for r in closed)
        if n == 12:         # too few for any of them to finish by itself
            assert len(closed) == 3
        if closed:
            assert f"{len(closed)} of 3 answers closed their document early to fit -n {n}" \
                in mapped.stderr
    fits = run_cli("map", SMOLLM, "{} Extract city and country.", "--temp", "0", "-n", "400",
                   "--json-schema", json.dumps(COUNTRY), "--jsonl", "--offline",
                   input="Paris is in France.\n")
    record = json.loads(fits.stdout)
    _valid(record["answer"], COUNTRY)
    assert "closed_early" not in record and "closed their document" not in fits.stderr


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    client: openai.OpenAI
    model: str
    unread: bytes = b""         # stderr read past the last line `logged` returned

    def logged(self, needle: str, seconds: float = 30) -> str:
        """The next line of the request log that holds `needle` (the log line is written once
        the response is over, so it may come a moment after the client has its answer)."""
        deadline, fd = time.monotonic() + seconds, self.proc.stderr.fileno()
        buffered = self.unread
        while True:
            *whole, buffered = buffered.split(b"\n")
            for line in (w.decode(errors="replace") for w in whole):
                if needle in line:
                    self.unread = buffered
                    return line
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"no request log line with {needle!r}")
            buffered += os.read(fd, 65536)


def gemma_wearing(template: str, gemma_path, directory) -> str:
    """Gemma 3 270M (a base model: its GGUF has no chat template) with its instruct model's."""
    from gguf_patch import add_value
    return str(add_value(gemma_path, directory / "gemma3-it.gguf", "tokenizer.chat_template",
                         template, 8))          # 8: a GGUF string


# Three servers: SmolLM2 as itself and Gemma 3 wearing its instruct template (no tools in
# either: llama.cpp's generic JSON format), SmolLM2 wearing Qwen 2.5's (the Hermes format).
# exhaustive: SmolLM2 as itself repeats the generic format gemma3 runs by default, on the weights
# and vocabulary hermes runs by default (the closing is serve's for every template).
@pytest.fixture(scope="module", params=[pytest.param("smollm2", marks=pytest.mark.exhaustive),
                                        "gemma3", "hermes"])
def served(request, models_home, gemma_path, tmp_path_factory):
    """A server with -v (its request log on stderr), the openai client, the model's name."""
    work = tmp_path_factory.mktemp(request.param)
    model = {"smollm2": lambda: SMOLLM, "gemma3": lambda: gemma_wearing(GEMMA3, gemma_path, work),
             "hermes": lambda: str(smollm_wearing(QWEN25, work, "qwen25"))}[request.param]()
    proc, url = start_server(model, "--ctx", "512", "--parallel", "2", "-v")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    yield Served(proc, url, client, client.models.list().data[0].id)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


def test_serve_closes_a_json_schema_answer_within_max_tokens(served):
    """The content is whole; the choice says closed_early (the finish reason cannot: the model may
    still end it itself), and so does the request's line in serve -v's log."""
    fmt = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": FRUITS}}
    ask = dict(model=served.model, temperature=0, response_format=fmt,
               messages=[{"role": "user", "content": "List three fruits."}])
    for n in (12, 40):
        reply = served.client.chat.completions.create(max_tokens=n, **ask)
        choice = reply.choices[0]
        _valid(choice.message.content, FRUITS)
        assert reply.usage.completion_tokens <= n
        assert choice.finish_reason in ("length", "stop")
        if n == 12:
            extra = choice.model_extra
            assert extra["closed_early"] is True and 0 < extra["closed_tokens"] <= n
            line = served.logged("closed_early=")
            assert "POST /v1/chat/completions 200" in line
            assert f"closed_early={extra['closed_tokens']}" in line
    # Streamed, the flag is on the last chunk's choice, with the finish reason.
    chunks = list(served.client.chat.completions.create(max_tokens=12, stream=True, **ask))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _valid(text, FRUITS)
    last = next(c.choices[0] for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    assert last.model_extra["closed_early"] is True


def test_serve_closes_a_tool_call_within_max_tokens(served):
    """tool_choice required, a few tokens: the call is whole, its arguments valid, closed_early
    on the choice."""
    reply = served.client.chat.completions.create(
        model=served.model, temperature=0, max_tokens=EVENT_TOKENS, tools=[EVENT_TOOL],
        tool_choice="required", messages=[{"role": "user", "content": EVENT_ASK}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "add_event"
    jsonschema.validate(json.loads(call.function.arguments), EVENT)
    assert choice.model_extra["closed_early"] is True
    assert reply.usage.completion_tokens <= EVENT_TOKENS


def test_anthropic_tool_use_closed_early_says_so(served):
    """The same through /v1/messages with Anthropic's client: a whole tool_use block, and
    closed_early beside stop_reason, on the message and on a stream's message_delta."""
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    # greedy: this client has no temperature argument, the API has the field
    ask = dict(model=served.model, max_tokens=EVENT_TOKENS, extra_body={"temperature": 0},
               tools=[{"name": "add_event", "description": EVENT_TOOL["function"]["description"],
                       "input_schema": EVENT}],
               tool_choice={"type": "any"}, messages=[{"role": "user", "content": EVENT_ASK}])
    message = client.messages.create(**ask)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, EVENT)
    assert message.model_extra["closed_early"] is True and message.model_extra["closed_tokens"] > 0
    with client.messages.stream(**ask) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
        final = stream.get_final_message()
    assert deltas[-1].delta.model_extra["closed_early"] is True
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
