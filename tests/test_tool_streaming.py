"""A streamed call's arguments as they are decoded (issue 43): the pieces serve sends, joined,
are the arguments of the whole reply, in every tool format whose calls are read in order; over
HTTP (the official openai and anthropic clients, on the servers tests/test_serve_tools.py
starts) see that file's test_streamed_arguments_*. Here, without a model: the JSON echo and each
format's stream of a reply fed a few characters at a time."""

from __future__ import annotations

import json
import random

import pytest

from localinfer.engine import toolcalls
from localinfer.engine.toolcalls.partial import JsonEcho
from localinfer.server import tools
from localinfer.server.tool_stream import CallStream

TEXTS = [
    '{}', '{ }', '{"a":1}', '{"a": -0, "b": 1.50, "c": 1e5, "d": 2E-3, "e": 12345678901234567890}',
    '{"s": "caf\\u00e9 \\u00E9 é 😀 \\ud83d\\ude00 \\ud83d \\/ \\" \\\\ \\n\\t\\b\\f\\r"}',
    '{\n  "nested": {"list": [1, [], {}, [true, false, null], "x"]},\n  "k" : "v"\n}',
    '{"unicode key é": ["\\u0000", "\\u001f", "~\\u007f"]}',
]


def _chunks(text: str, seed: int) -> list[str]:
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 4)
        out.append(text[at:at + step])
        at += step
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_the_echo_writes_what_json_dumps_writes(text):
    for seed in range(3):
        echo = JsonEcho()
        out = "".join(echo.feed(piece) for piece in _chunks(text + " tail", seed))
        assert echo.done and not echo.broken and echo.used == len(text)
        assert out == json.dumps(json.loads(text)), (text, out)


@pytest.mark.parametrize("text", ['{"a": tru}', '{"a": 1.2.3}', '{"a": "x\ny"}', '[1]',
                                  '{"a": "\\x"}', '{"a": ]'])
def test_the_echo_stops_at_what_is_no_json(text):
    echo = JsonEcho()
    echo.feed(text)
    assert echo.broken


ARGS = ['{"city": "Paris", "unit": "celsius"}', '{"zone":"CET","note":"a \\"b\\" é"}']
HARMONY_RAW = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>'
               'commentary to=functions.f <|constrain|>json<|message|>' + ARGS[0])
REPLIES = {     # format -> (reply, the calls' names, raw output for harmony)
    "generic": ('{"tool_calls": [{"name": "f", "arguments": ' + ARGS[0] + ', "id": "1234"}, '
                '{"name": "g", "arguments": ' + ARGS[1] + ', "id": "abcd"}]}', ["f", "g"]),
    "generic-one": ('{"tool_call": {"name": "g", "arguments": ' + ARGS[1] + '}}', ["g"]),
    "hermes": ('Sure.\n<tool_call>\n{"name": "f", "arguments": ' + ARGS[0] + '}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": ' + ARGS[1] + '}\n</tool_call>',
               ["f", "g"]),
    "llama3": ('{"name": "f", "parameters": ' + ARGS[0] + '}', ["f"]),
    "mistral": ('[TOOL_CALLS][{"name": "f", "arguments": ' + ARGS[0] + ', "id": "a1b2c3d4e"}, '
                '{"name": "g", "arguments": ' + ARGS[1] + ', "id": "zzzzzzzzz"}]', ["f", "g"]),
    "mistral-call-id": ('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]' + ARGS[0] + '[TOOL_CALLS]g'
                        '[CALL_ID]b1b2c3d4e[ARGS]' + ARGS[1], ["f", "g"]),
    "harmony": (HARMONY_RAW, ["f"]),
}
FORMATS = {f.name: f for f in toolcalls.FORMATS} | {"generic-one": toolcalls.GENERIC}


def _stream(name: str, seed: int, most: int | None = None):
    reply, _ = REPLIES[name]
    fmt = FORMATS[name]
    plan = tools.Plan([], {"f": {}, "g": {}}, "auto", True, fmt)
    stream, content, deltas = CallStream(plan, most), "", []
    for piece in _chunks(reply, seed):
        stream.see(piece)
        content += stream.feed("" if fmt.covers_trace else piece)
        deltas += stream.pending()
    return content, deltas, stream.ending()


@pytest.mark.parametrize("name", REPLIES)
def test_each_calls_arguments_stream_and_join_to_the_whole_replys(name):
    reply, names = REPLIES[name]
    whole = tools.split(tools.Plan([], {"f": {}, "g": {}}, "auto", True, FORMATS[name]),
                        "" if FORMATS[name].covers_trace else reply, reply)[1]
    for seed in range(3):
        content, deltas, ending = _stream(name, seed)
        assert content == ("Sure.\n" if name == "hermes" else "") and ending.rest == ""
        assert not ending.cut and [c["function"]["name"] for c in ending.calls] == names
        for k, call in enumerate(ending.calls):
            mine = [d for d in deltas if d["index"] == k]
            assert mine[0]["id"] == call["id"] and mine[0]["function"]["name"] == names[k]
            pieces = [d["function"]["arguments"] for d in mine[1:]]
            assert len(pieces) > 3, pieces        # as decoded, not in one piece
            assert "".join(pieces) == call["function"]["arguments"] \
                == whole[k]["function"]["arguments"]
        assert all("id" not in d for d in ending.deltas)   # nothing left to send whole


def test_a_call_beyond_max_tool_calls_is_never_begun():
    _, deltas, ending = _stream("hermes", 0, most=1)
    assert {d["index"] for d in deltas} == {0} and len(ending.calls) == 1


def test_a_call_the_output_ends_inside_ends_as_far_as_it_got():
    reply = REPLIES["hermes"][0][:60]
    stream = CallStream(tools.Plan([], {"f": {}}, "auto", True, toolcalls.HERMES))
    stream.feed(reply)
    sent = "".join(d["function"]["arguments"] for d in stream.pending())
    ending = stream.ending()
    assert ending.cut and ending.rest == "" and sent
    assert ending.calls[0]["function"]["arguments"] == sent


def test_a_key_written_twice_keeps_what_was_sent():
    reply = '{"tool_call": {"name": "f", "arguments": {"a": 1, "a": 2}}}'
    stream = CallStream(tools.Plan([], {"f": {}}, "auto", False, toolcalls.GENERIC))
    stream.feed(reply)
    sent = "".join(d["function"]["arguments"] for d in stream.pending())
    ending = stream.ending()
    assert sent == '{"a": 1, "a": 2}' == ending.calls[0]["function"]["arguments"]
    assert not ending.deltas
