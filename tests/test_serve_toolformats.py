"""serve's tool calls in each family's own format (issue 28 §1): Llama 3.x JSON and Mistral's
`[TOOL_CALLS]` (Nemo's JSON list, Small 3.2's `[CALL_ID]`/`[ARGS]`) on SmolLM2's weights wearing
the published templates, and gpt-oss harmony on a tiny random-weight gpt-oss (mechanics only: its
published template and harmony's control tokens), driven by the official `openai` client; and,
without a server, each format recognised from its template, the calls a template writes back read
by the parser and kept to by the grammar (the history round-trips), the auto gate and the stream."""

from __future__ import annotations

import json
import re

import pytest
from chat_templates import (GPT_OSS_20B, LLAMA31_TOOLS as LLAMA31, MISTRAL_NEMO as NEMO,
                            MISTRAL_SMALL_32 as SMALL32, QWEN25, SMOLLM2)
from helpers import load_file, smollm_wearing, start_server
from test_serve_thinking import _stop
from test_serve_tools import SCHEMAS, TIME, WEATHER

from localinfer.engine import toolcalls
from localinfer.engine.templates import render
from localinfer.server import tools

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEARING = {"llama3": LLAMA31, "mistral": NEMO, "mistral-call-id": SMALL32}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
          "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _history(call_id: str) -> list[dict]:
    """A call and its result, as the chat API hands them to the template."""
    said = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees"}]
    return [{"role": m["role"], "content": m["content"] or "", **tools.history(m, i)}
            for i, m in enumerate(said)]


def _written_back(template: str, call_id: str) -> str:
    """The assistant's call as the template writes it into the next prompt."""
    text = render(template, _history(call_id), bos_token="<s>", eos_token="</s>",
                  extra={"tools": TOOLS})
    if template is LLAMA31:
        return text.split("assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    if template is GPT_OSS_20B:
        return "<|start|>assistant" + text.split("<|start|>assistant")[1].split("<|call|>")[0]
    return text.split("[/INST]")[1].split("</s>")[0]


# -- without a server ------------------------------------------------------------------------
def test_each_format_is_told_from_its_template():
    assert toolcalls.format_of(LLAMA31) is toolcalls.LLAMA3
    assert toolcalls.format_of(NEMO) is toolcalls.MISTRAL
    assert toolcalls.format_of(SMALL32) is toolcalls.MISTRAL_ARGS_ID
    assert toolcalls.format_of(GPT_OSS_20B) is toolcalls.HARMONY
    assert toolcalls.format_of(QWEN25) is toolcalls.HERMES
    assert toolcalls.format_of(SMOLLM2) is toolcalls.GENERIC


@pytest.mark.parametrize("template, call_id", [(LLAMA31, "call_1"), (NEMO, "abcdefghi"),
                                               (SMALL32, "abcdefghi"), (GPT_OSS_20B, "call_1")])
def test_a_call_written_back_reads_as_the_same_call(template, call_id):
    fmt = toolcalls.format_of(template)
    content, calls = fmt.parse(_written_back(template, call_id))
    assert [(c.name, c.arguments) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert content == ""
    if fmt in (toolcalls.MISTRAL, toolcalls.MISTRAL_ARGS_ID):
        assert calls[0].id == call_id


def test_the_parsers_read_each_spelling():
    llama3, harmony = toolcalls.LLAMA3.parse, toolcalls.HARMONY.parse
    assert llama3('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", '
                  '"parameters": {"a": 1}}') == ("", [("f", {}, None), ("g", {"a": 1}, None)])
    assert llama3('It is {"name": "f"}') == ('It is {"name": "f"}', [])
    assert llama3('{"name": "f", "parameters": {}} and more') == \
        ('{"name": "f", "parameters": {}} and more', [])
    assert toolcalls.MISTRAL.parse('Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, '
                                   '"id": "a1b2c3d4e"}]') == ("Sure.", [("f", {"x": 1},
                                                                          "a1b2c3d4e")])
    assert toolcalls.MISTRAL_ARGS.parse('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}') == \
        ("", [("f", {"x": 1}, None), ("g", {}, None)])
    assert toolcalls.MISTRAL_ARGS_ID.parse('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x":') == \
        ('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x":', [])
    said = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>'
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}')
    assert harmony(said) == ("", [("get_weather", {"city": "Oslo"}, None)])
    assert harmony("<|channel|>final<|message|>Hi<|return|>") == \
        ("<|channel|>final<|message|>Hi<|return|>", [])


def _plan(template: str, choice="auto", parallel=True) -> tools.Plan:
    return tools.plan({"tools": TOOLS, "tool_choice": choice,
                       "parallel_tool_calls": parallel}, template)


def _streamed(plan, pieces, raw=None) -> tuple[str, str, list[dict]]:
    stream = tools.Stream(plan)
    sent = ""
    for k, piece in enumerate(pieces):
        stream.see((raw or pieces)[k])
        sent += stream.feed(piece)
    rest, calls = stream.finish()
    return sent, rest, calls


def test_the_stream_holds_back_only_what_may_be_a_call():
    llama = _plan(LLAMA31)
    assert _streamed(llama, ["Hello", ' {"name": "x"}']) == ('Hello {"name": "x"}', "", [])
    sent, rest, calls = _streamed(llama, [" ", '{"name": "get_', 'time", "parameters": '
                                          '{"zone": "UTC"}}'])
    assert (sent, rest) == ("", "") and calls[0]["function"]["name"] == "get_time"
    sent, rest, calls = _streamed(_plan(NEMO), ["Sure.", " [TOOL_", 'CALLS][{"name": "get_time",'
                                  ' "arguments": {"zone": "UTC"}, "id": "a1b2c3d4e"}]'])
    assert (sent, rest) == ("Sure. ", "") and CALL_ID.fullmatch(calls[0]["id"])   # not the model's
    # harmony: the answer split hands on the call's body alone; the raw output names the call
    raw = ["<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>",
           '{"zone": "UTC"}']
    sent, rest, calls = _streamed(_plan(GPT_OSS_20B), ["", '{"zone": "UTC"}'], raw)
    assert (sent, rest, json.loads(calls[0]["function"]["arguments"])) == \
        ("", "", {"zone": "UTC"})


def test_tool_choice_none_is_never_read_for_calls():
    """A model told `none` that writes a call anyway gets its text back as content (as
    llama-server): no tool_calls, nothing held back."""
    hermes = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for template in (QWEN25, LLAMA31, NEMO):
        plan = _plan(template, "none")
        written = hermes if template is QWEN25 else _written_back(template, "abcdefghi")
        assert tools.split(plan, written) == (written, [])
        assert _streamed(plan, [written]) == (written, "", [])
        assert tools.grammar(plan, None) is None and tools.template_vars(plan) == {}


class _Vocab:
    """A session's vocabulary as the gate sees it: piece(token) and n_vocab."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces, self.n_vocab = pieces, len(pieces)

    def piece(self, token: int) -> bytes:
        return self.pieces[token].encode()


class _Grammar:
    def __init__(self):
        self.taken = []

    def allows(self, ids):
        import numpy as np
        return np.ones(len(ids), dtype=bool)

    def accept(self, token):
        self.taken.append(token)


def test_an_anchored_trigger_counts_only_at_the_start():
    import numpy as np
    vocab = _Vocab([" ", '{"', 'name', '":', ' "', ' "get', "Hi", "get"])
    gate = toolcalls.trigger_gate(vocab, '{"name": "', _Grammar(), anchored=True)
    for token in (0, 1, 2, 3):
        gate.accept(token)
    # ` "get` would run past the trigger: refused, so the grammar takes the call's first token
    assert gate.allows(np.array([4, 5])).tolist() == [True, False]
    gate.accept(4)
    assert gate.on
    gate.accept(7)
    assert gate.after.taken == [7]
    late = toolcalls.trigger_gate(vocab, '{"name": "', _Grammar(), anchored=True)
    late.accept(6)              # "Hi": the reply began as text; later JSON is text too
    for token in (1, 2, 3, 4):
        late.accept(token)
    assert late.off and not late.on


def test_the_gate_s_token_cache_goes_with_its_session():
    import gc

    from localinfer.engine.toolcalls import gate
    vocab = _Vocab(["a", "b>"])
    toolcalls.trigger_gate(vocab, "<b>", _Grammar())
    assert vocab in gate._CANDIDATES
    before = len(gate._CANDIDATES)
    del vocab
    gc.collect()
    assert len(gate._CANDIDATES) == before - 1


# -- the grammar keeps to the template's own spelling (a real vocabulary) --------------------
@pytest.fixture(scope="module")
def smollm(smollm_path):
    from localinfer.backends import LoadOptions
    loaded = load_file(smollm_path, LoadOptions(n_ctx=512))
    yield loaded.session
    loaded.session.close()


def _walk(session, grammar, *texts: str) -> None:
    """Every token of `texts` (each tokenized alone) allowed in turn, and the end of generation
    after them."""
    import numpy as np
    for text in texts:
        for token in session.tokenize(text, special=False):
            assert grammar.allows(np.array([token]))[0], (text, session.piece(token))
            grammar.accept(token)
    eos = session.tokenize("<|im_end|>", special=True)[0]
    assert grammar.allows(np.array([eos]))[0], texts


@pytest.mark.parametrize("template", [LLAMA31, NEMO, SMALL32], ids=["llama3", "nemo", "small32"])
def test_the_grammar_takes_what_the_template_writes_back(smollm, template):
    call_id = "abcdefghi"
    written = _written_back(template, call_id)
    fmt = toolcalls.format_of(template)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        _walk(smollm, tools.grammar(_plan(template, choice), smollm), written)
    # auto: the gate refuses a token that runs on past the trigger (`][`): the model writes
    # the trigger and the call apart, and so does this walk
    gate = tools.grammar(_plan(template, "auto"), smollm)
    cut = written.index(fmt.trigger) + len(fmt.trigger)
    _walk(smollm, gate, written[:cut], written[cut:])
    assert gate.on


@pytest.fixture(scope="module")
def tiny_oss_path(tmp_path_factory):
    from tiny_gguf import write_tiny
    return write_tiny(tmp_path_factory.mktemp("oss") / "tiny-gpt-oss.gguf", "gpt-oss")


@pytest.fixture(scope="module")
def oss(tiny_oss_path):
    from localinfer.backends import LoadOptions
    loaded = load_file(tiny_oss_path, LoadOptions(n_ctx=512))
    yield loaded.session
    loaded.session.close()


def _walk_special(session, grammar, *texts: str) -> None:
    """As _walk, harmony's markers as the control tokens the model writes."""
    import numpy as np
    for text in texts:
        for token in session.tokenize(text, special=True):
            assert grammar.allows(np.array([token]))[0], (text, session.token_text(token))
            grammar.accept(token)
    end = session.tokenize("<|call|>", special=True)[0]
    assert grammar.allows(np.array([end]))[0], texts


def test_harmony_grammars_on_its_own_tokens(oss):
    """Required: a call on the commentary channel, an analysis message first or not; auto: free
    until ` to=functions.`, then either header spelling (the template's, in the role)."""
    analysis = "<|channel|>analysis<|message|>Check the weather. <b>ok</b><|end|><|start|>assistant"
    call = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Oslo", "unit": "celsius"}')
    for before in ("", analysis):
        _walk_special(oss, tools.grammar(_plan(GPT_OSS_20B, "required"), oss), before + call)
    written = _written_back(GPT_OSS_20B, "call_1").removeprefix("<|start|>assistant")
    gate = tools.grammar(_plan(GPT_OSS_20B, "auto"), oss)
    cut = written.index(" to=functions.") + len(" to=functions.")
    _walk_special(oss, gate, analysis, written[:cut], written[cut:])
    assert gate.on and tools.covers_trace(_plan(GPT_OSS_20B))


# -- live: the openai client against serve ---------------------------------------------------
@pytest.fixture(scope="module")
def served(models_home, tiny_oss_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("formats")
    paths = {name: str(smollm_wearing(t, work, name)) for name, t in WEARING.items()}
    paths["harmony"] = str(tiny_oss_path)
    started = {}
    try:
        for name, path in paths.items():
            started[name] = start_server(path, "--ctx", "2048", "--parallel", "2")
        yield {name: (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0),
                      paths[name].rsplit("/", 1)[1]) for name, (_, url) in started.items()}
    finally:
        for proc, _ in started.values():
            _stop(proc)


def _ask(served, name, **extra):
    """One call a reply: SmolLM2 wearing Mistral's templates writes call after call, and a
    budget that runs out inside one leaves the reply text (see the parsers)."""
    client, model = served[name]
    return client.chat.completions.create(model=model, **{
        "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 160,
        "parallel_tool_calls": False, **extra})


def _valid(name, calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        schema = SCHEMAS[call.function.name]
        if name == "harmony":       # random weights write byte tokens that are no UTF-8: the
            schema = _no_lengths(schema)    # grammar counts their code points, not the U+FFFDs
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert CALL_ID.fullmatch(call.id), call.id     # ours, whatever id the model wrote


def _no_lengths(schema: dict) -> dict:
    return {**schema, "properties": {k: {n: v for n, v in p.items() if n != "maxLength"}
                                     for k, p in schema["properties"].items()}}


FORMATS = [*WEARING, "harmony"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_required_and_named(served, name):
    reply = _ask(served, name, tool_choice="required")
    assert reply.choices[0].finish_reason == "tool_calls"
    _valid(name, reply.choices[0].message.tool_calls)
    reply = _ask(served, name, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    _valid(name, calls)
    assert {c.function.name for c in calls} == {"get_time"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "mistral-call-id"])
# exhaustive: [60] and [160] cut the calls early and late by default; 100 is a third cut point
# on the same budget check.
@pytest.mark.parametrize("budget", [60, pytest.param(100, marks=pytest.mark.exhaustive), 160])
def test_parallel_calls_cut_by_the_budget_still_close_whole(served, name, budget):
    """SmolLM2 wearing Mistral's templates writes call after call: one token starts another
    whole call, and the budget's checks begin early enough to refuse one that cannot close."""
    choice = _ask(served, name, tool_choice="required", parallel_tool_calls=True,
                  max_tokens=budget).choices[0]
    assert choice.finish_reason == "tool_calls"
    _valid(name, choice.message.tool_calls)


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_streamed_calls_equal_the_whole_reply(served, name):
    client, model = served[name]
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
        max_tokens=160, parallel_tool_calls=False, stream=True))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert {c.index for c in calls} == {0} and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = _ask(served, name, tool_choice=named).choices[0].message.tool_calls
    # the arguments as they are decoded (issue 43), joined the whole reply's
    pieces = [c.function.arguments for c in calls[1:]]
    assert len(pieces) > 2 and "".join(pieces) == whole[0].function.arguments, pieces
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_a_reply_s_calls_go_back_as_history(served, name):
    """The calls of one reply, with their results, are the next request's history: the
    template takes them (Mistral's refuses other ids) and the model answers on (SmolLM2 may end
    at once where Nemo's template leaves no generation prompt)."""
    first = _ask(served, name, tool_choice="required")
    message = first.choices[0].message
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        c.model_dump() for c in message.tool_calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees, sunny"}
                for c in message.tool_calls]
    reply = _ask(served, name, messages=history, tool_choice="auto", max_tokens=24)
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens
    _answered(name, reply.choices[0])


@pytest.mark.slow
def test_auto_answers_in_text_or_a_valid_call(served):
    for name in FORMATS:
        _answered(name, _ask(served, name, tool_choice="auto", max_tokens=48).choices[0])


def _answered(name, choice) -> None:
    """Text, or calls whole and valid against their schemas."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _valid(name, choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)
