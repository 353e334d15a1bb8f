"""Ollama's request fields said as the chat request server/requests.py prepares (the fast tier:
no model; tests/test_serve_ollama.py drives the same through a live server)."""

from __future__ import annotations

import json
import math

import pytest

from localinfer.server.errors import BadRequest
from localinfer.server.ollama import _history
from localinfer.server.ollama_options import apply, check_keep_alive, check_num_ctx
from localinfer.server.requests import Defaults


def _apply(body: dict):
    chat: dict = {}
    defaults, steering = apply(body, chat, Defaults())
    return chat, defaults, steering


def test_options_become_the_chat_requests_fields():
    chat, defaults, steering = _apply({"options": {
        "temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "seed": 3,
        "repeat_penalty": 1.1, "num_predict": 7, "stop": ["\n\n", ""], "num_ctx": 256,
        "repeat_last_n": 32, "num_gpu": 99, "num_thread": 4, "mirostat": 0, "typical_p": 1}})
    assert chat == {"temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "seed": 3,
                    "repeat_penalty": 1.1, "max_tokens": 7}
    assert defaults.params.repeat_last_n == 32
    assert steering.stops == ("\n\n",) and steering.num_ctx == 256
    assert check_num_ctx(steering, 512) == 256
    assert check_num_ctx(steering, 128) == 128        # a load setting: the server's context


@pytest.mark.parametrize("num_predict", [-1, -2, None])
def test_num_predict_without_a_limit(num_predict):
    assert "max_tokens" not in _apply({"options": {"num_predict": num_predict}})[0]


@pytest.mark.parametrize("options, words", [
    ({"num_predict": 0}, "num_predict"), ({"num_predict": 1.5}, "num_predict"),
    ({"num_ctx": 0}, "num_ctx"), ({"num_ctx": True}, "num_ctx"),
    ({"repeat_last_n": -1}, "repeat_last_n"), ({"stop": [1]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"), ({"mirostat": 1}, "mirostat"),
    ({"tfs_z": 0.5}, "tfs_z"), ({"temprature": 1}, "temprature"),
])
def test_bad_options_are_refused_by_name(options, words):
    with pytest.raises(BadRequest, match=f"options.{words}"):
        _apply({"options": options})


def test_format_think_and_keep_alive():
    assert _apply({"format": "json"})[0] == {"response_format": {"type": "json_object"}}
    schema = {"type": "object"}
    assert _apply({"format": schema})[0]["response_format"] == {
        "type": "json_schema", "json_schema": {"schema": schema}}
    assert _apply({"format": ""})[0] == {}
    for think, level in ((True, "on"), (False, "off"), ("high", "high")):
        defaults, steering = _apply({"think": think})[1:]
        assert defaults.think.think == level and steering.think == think
    assert _apply({})[1].think.think is None
    assert check_keep_alive("5m") == 300 and check_keep_alive(-1) == math.inf
    assert check_keep_alive(0) == 0 and check_keep_alive(None) is None
    for body in ({"format": "xml"}, {"think": "maybe"}, {"keep_alive": "5 minutes"},
                 {"keep_alive": True}, {"options": []}):
        with pytest.raises(BadRequest):
            _apply(body)


def test_history_ties_each_tool_result_to_its_call():
    said = _history([
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": None, "thinking": "two calls",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                        {"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "get_time", "content": "noon"},
        {"role": "tool", "content": "3 degrees"}])
    calls = said[1]["tool_calls"]
    assert said[1]["content"] == "" and said[1]["reasoning_content"] == "two calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert said[2] == {"role": "tool", "content": "noon", "tool_call_id": calls[1]["id"],
                       "name": "get_time"}
    assert said[3]["tool_call_id"] == calls[0]["id"]


@pytest.mark.parametrize("messages, words", [
    ("hi", "list"), ([{"role": "robot"}], "role"), ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": "x", "images": "aGk="}], "images"),     # not a list
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                          "arguments": "{}"}}]}],
     "arguments"),
    ([{"role": "tool", "content": "x", "tool_name": 3}], "tool_name"),
])
def test_bad_messages_are_refused(messages, words):
    with pytest.raises(BadRequest, match=words):
        _history(messages)
