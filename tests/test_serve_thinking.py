"""`serve` with thinking models: SmolLM2's weights wearing published reasoning templates (its
vocabulary has the same ChatML tokens), driven by the official `openai` client. The trace comes
back as `reasoning_content` and `reasoning`, never inside `content`; a model without one answers
exactly as before."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request

import pytest
from chat_templates import GPT_OSS_20B, QWEN3, QWEN3_THINKING_2507, SMOLLM2
from helpers import smollm_wearing, start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Name a colour."}]
TRACE_FIELDS = ("reasoning_content", "reasoning")
SCHEMA = {"type": "object", "required": ["colour"], "additionalProperties": False,
          "properties": {"colour": {"type": "string", "maxLength": 12}}}


def _start(model: str, *args: str) -> tuple[subprocess.Popen, str]:
    return start_server(model, "--ctx", "512", "--parallel", "2", *args)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


@pytest.fixture(scope="module")
def served(models_home, tmp_path_factory):
    """name -> (openai client, model name, url): SmolLM2 as Qwen3-Thinking-2507 (--think-budget 8
    by default), as Qwen3 (--no-think by default), and as itself."""
    work = tmp_path_factory.mktemp("thinking")
    wearing = {"thinking": (QWEN3_THINKING_2507, "--think-budget", "8"),
               "qwen3": (QWEN3, "--no-think")}
    started, out = [], {}
    try:
        for name, (template, *args) in wearing.items():
            path = smollm_wearing(template, work, name)
            started.append(_start(str(path), *args))
            out[name] = path.name, started[-1][1]
        started.append(_start("smollm2"))
        out["plain"] = "smollm2-135m-instruct:Q4_1", started[-1][1]
        yield {name: (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
                      model, url) for name, (model, url) in out.items()}
    finally:
        for proc, _ in started:
            _stop(proc)


def _ask(served, name: str, **extra):
    client, model, _ = served[name]
    return client.chat.completions.create(model=model, **{"messages": QUESTION,
                                                          "temperature": 0, **extra})


def _joined(chunks) -> tuple[str, str, str]:
    """(content, reasoning_content, reasoning) of a stream's deltas, each joined."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return tuple("".join((getattr(d, f, None) or "") for d in deltas)
                 for f in ("content", *TRACE_FIELDS))


def test_the_trace_comes_apart_from_the_answer(served):
    # The whole reply (a trace of at most 8 tokens, then the answer) ran past 30 tokens on the
    # Xeon and to 29 on the EPYC: 24 ends it inside the answer on both.
    reply = _ask(served, "thinking", max_tokens=24)
    message = reply.choices[0].message
    trace = message.model_extra["reasoning_content"]
    assert trace and message.model_extra["reasoning"] == trace
    assert message.content and "<think>" not in message.content + trace
    assert "</think>" not in message.content + trace
    assert reply.usage.completion_tokens == 24 and reply.choices[0].finish_reason == "length"


def test_the_stream_adds_up_to_the_whole_reply(served):
    whole = _ask(served, "thinking", max_tokens=24).choices[0].message
    chunks = list(_ask(served, "thinking", max_tokens=24, stream=True))
    content, reasoning_content, reasoning = _joined(chunks)
    assert content == whole.content and reasoning_content == reasoning == whole.reasoning_content
    # a delta holds the answer or the trace, never both
    assert not any(c.choices[0].delta.content and getattr(c.choices[0].delta, "reasoning", None)
                   for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_budget_of_a_request_over_the_servers(served):
    short = _ask(served, "thinking", max_tokens=30, extra_body={"thinking_budget": 2})
    assert len(short.choices[0].message.reasoning_content) \
        < len(_ask(served, "thinking", max_tokens=30).choices[0].message.reasoning_content)


def test_max_tokens_spent_inside_the_trace_leaves_no_answer(served):
    """As llama-server answers: the trace so far, an empty content and finish_reason length."""
    reply = _ask(served, "thinking", max_tokens=4, extra_body={"thinking_budget": 100})
    assert reply.choices[0].message.content == ""
    assert reply.choices[0].message.reasoning_content and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 4


def test_a_schema_constrains_the_answer_after_the_trace(served):
    import jsonschema
    reply = _ask(served, "thinking", max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].message.reasoning_content and reply.choices[0].finish_reason == "stop"


def test_thinking_switched_off_writes_the_empty_trace_and_no_reasoning_field(served):
    off = _ask(served, "qwen3", max_tokens=8)        # the server's --no-think
    on = _ask(served, "qwen3", max_tokens=8,
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    # the empty trace, "<think>\n\n</think>\n\n", is in the prompt of `off` alone
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.content
    assert not set(TRACE_FIELDS) & set(off.choices[0].message.model_extra)
    # reasoning_effort is accepted, and ignored by a template that has enable_thinking instead
    assert _ask(served, "qwen3", max_tokens=8, reasoning_effort="high").usage.prompt_tokens \
        == off.usage.prompt_tokens


def test_a_model_without_a_trace_has_no_reasoning_fields(served):
    reply = _ask(served, "plain", max_tokens=12, reasoning_effort="low",
                 extra_body={"thinking_budget": 2})
    assert reply.choices[0].message.content
    assert not set(TRACE_FIELDS) & set(reply.choices[0].message.model_extra)
    for chunk in _ask(served, "plain", max_tokens=12, stream=True):
        for choice in chunk.choices:
            assert not set(TRACE_FIELDS) & set(choice.delta.model_extra or {})


def test_an_earlier_trace_reaches_only_a_template_that_reads_it(served):
    turns = [*QUESTION, {"role": "assistant", "content": "Blue.",
                         "reasoning_content": "A colour: blue is one, and a short answer."}]
    without = [*QUESTION, {"role": "assistant", "content": "Blue."}]
    prompt = {name: [_ask(served, name, messages=m, max_tokens=1).usage.prompt_tokens
                     for m in (turns, without)] for name in ("qwen3", "plain")}
    assert prompt["qwen3"][0] > prompt["qwen3"][1]        # Qwen3's template puts it in <think>
    assert prompt["plain"][0] == prompt["plain"][1]       # SmolLM2's has no place for it: dropped


@pytest.mark.parametrize("extra, words", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "must be a JSON object"),
    ({"chat_template_kwargs": {"enable_thinking": {"a": 1}}}, "must be a JSON object"),
    ({"chat_template_kwargs": {"x": "y" * 5000}}, "4,096 bytes"),
    ({"chat_template_kwargs": {"bad name": 1}}, "letters, digits"),
    ({"chat_template_kwargs": {"messages": "[]", "bos_token": "x"}}, "may not set bos_token, "
                                                                     "messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "may not set"),
    ({"reasoning_effort": "max"}, "low, medium, high"),
    ({"reasoning_effort": 3}, "low, medium, high"),
    ({"thinking_budget": -1}, "thinking_budget"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "Blue.",
                               "reasoning_content": 7}]}, "must be a string"),
])
def test_bad_thinking_fields_are_400s(served, extra, words):
    _, model, url = served["qwen3"]
    body = json.dumps({"model": model, "messages": QUESTION, "max_tokens": 2, **extra}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 400
    error = json.loads(e.value.read())["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"


# -- the template variables a request renders with (no model) ----------------------------------
def test_reasoning_effort_is_gpt_oss_variable_and_kwargs_win():
    from localinfer.engine.templates import render
    from localinfer.server.reasoning import template_vars
    from localinfer.thinking.style import Think
    high = template_vars({"reasoning_effort": "high"}, GPT_OSS_20B, Think())
    assert high == {"reasoning_effort": "high"}
    assert "Reasoning: high" in render(GPT_OSS_20B, QUESTION, extra=high)
    assert template_vars({"reasoning_effort": "high"}, QWEN3, Think()) == {}
    assert template_vars({"reasoning_effort": "high"}, SMOLLM2, Think()) == {}
    # the server's --think, then the request's reasoning_effort, then its chat_template_kwargs
    assert template_vars({"reasoning_effort": "low"}, GPT_OSS_20B, Think("high")) \
        == {"reasoning_effort": "low"}
    assert template_vars({"reasoning_effort": "low",
                          "chat_template_kwargs": {"reasoning_effort": "medium"}},
                         GPT_OSS_20B, Think()) == {"reasoning_effort": "medium"}
    assert template_vars({}, QWEN3, Think("off")) == {"enable_thinking": False}
    assert template_vars({"chat_template_kwargs": {"enable_thinking": True}}, QWEN3,
                         Think("off")) == {"enable_thinking": True}
