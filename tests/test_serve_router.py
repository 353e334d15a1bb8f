"""Routers in `serve` (issue 45 section 1): config.toml's `[routers.NAME]` are listed by all
three APIs, a request naming one is answered by the model it chooses, greedy byte for byte as
that model's own answer, a cascade's stream shows nothing of an answer it passed on, and the
choice is visible (X-Localinfer-Routed-To, usage routed_to, /metrics). One server with SmolLM2
and Gemma 3 (a base model: raw prompts) in a home of its own, with the official clients."""

from __future__ import annotations

import re
import signal

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers import start_server

from localinfer.server.routers import HEADER

PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,")
SMALL, LARGE = "smollm2:Q4_1", "gemma-3-270m:Q4_K_M"


@pytest.fixture(scope="module")
def server(models_home, tmp_path_factory):
    """serve with no model loaded at start and a budget that holds one of the two at a time
    (SmolLM2 131 MB, Gemma 3 317 MB by the fit, 386 MB left of 450 MB), in a home of its own
    whose store is the test models' (linked)."""
    home = tmp_path_factory.mktemp("router-home")
    (home / "data").symlink_to(models_home / "data")
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text(f"""
[routers.up]
models = ["{SMALL}", "{LARGE}"]
threshold = inf
[routers.keep]
models = ["{SMALL}", "{LARGE}"]
threshold = -inf
[routers.margin]
models = ["{SMALL}", "{LARGE}"]
measure = "margin"
threshold = -inf
[routers.mid]
models = ["{SMALL}", "{LARGE}"]
tokens = 4
threshold = -0.6
[routers.pick]
models = ["{SMALL}", "{LARGE}"]
policy = "rule"
[[routers.pick.rules]]
priority = "high"
model = "{LARGE}"
[routers.short]
models = ["{SMALL}", "{LARGE}"]
policy = "rule"
default = "{LARGE}"
[[routers.short.rules]]
max-prompt-tokens = 8
model = "{SMALL}"
""")
    proc, url = start_server("--memory=450MB", "--ctx", "512", "--parallel", "2",
                             env={"LOCALINFER_HOME": str(home)})
    yield url, SMALL, LARGE
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


def _complete(client, model, prompt, **extra):
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt,
                                                      temperature=0, max_tokens=12, **extra)
    reply = raw.parse()
    return raw.headers.get(HEADER), reply.choices[0].text, (reply.usage.model_extra or {})


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for got, value in re.findall(rf"^localinfer_{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', got))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def test_routers_are_listed_by_every_api(server):
    url, _, _ = server
    ids = {m.id for m in openai.OpenAI(base_url=url + "/v1", api_key="x").models.list()}
    assert {"up", "keep", "mid", "pick"} <= ids
    ids = {m.id for m in anthropic.Anthropic(base_url=url, api_key="x").models.list()}
    assert {"up", "keep", "mid", "pick"} <= ids
    tags = {m.model for m in ollama.Client(host=url).list().models}
    assert {"up:latest", "keep:latest", "mid:latest", "pick:latest"} <= tags
    shown = ollama.Client(host=url).show("up")
    assert shown.details.format == "router"
    assert shown.modelinfo["router.models"] == [SMALL, LARGE]


def test_a_cascade_answers_as_its_chosen_model_and_shows_nothing_passed_on(server):
    url, small, large = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    own = {small: [_complete(client, small, p)[1] for p in PROMPTS]}
    for prompt, expected in zip(PROMPTS, own[small]):
        header, text, usage = _complete(client, "keep", prompt)
        assert (header, text, usage["routed_to"]) == (small, expected, small)
        (step,) = usage["routing"]["route"]         # kept on its confidence, -inf: always
        assert usage["routing"]["threshold"] == "-inf" and step["model"] == small
        assert step["accepted"] is True and step["confidence"] <= 0
    own[large] = [_complete(client, large, p)[1] for p in PROMPTS]
    passed = _metric(url, "routed_passed_on_total", router="up", model=small)
    header, text, usage = _complete(client, "up", PROMPTS[0])
    assert (header, text, usage["routed_to"]) == (large, own[large][0], large)
    assert usage["routing"]["threshold"] == "inf"
    assert [(s["model"], s["accepted"]) for s in usage["routing"]["route"]] == [
        (small, False), (large, True)]
    # the two do not fit together: the small one was unloaded to make room
    assert [m.model for m in ollama.Client(host=url).ps().models] == [f"{large}"]
    # streamed: nothing of the small model's held text reaches the client
    with client.completions.with_streaming_response.create(
            model="up", prompt=PROMPTS[1], temperature=0, max_tokens=12, stream=True) as raw:
        assert raw.headers[HEADER] == large
        assert "".join(c.choices[0].text for c in raw.parse() if c.choices) == own[large][1]
    assert _metric(url, "routed_passed_on_total", router="up", model=small) == passed + 2
    assert _metric(url, "routed_total", router="up", model=large) == 2
    # a measured decision: whichever model it keeps, the answer is that model's own (measured
    # here: Gemma 3 for the first two, SmolLM2 kept for the third)
    chosen = set()
    for i, prompt in enumerate(PROMPTS):
        header, text, usage = _complete(client, "mid", prompt)
        assert text == own[header][i] and usage["routed_to"] == header
        assert usage["routing"]["threshold"] == -0.6
        assert usage["routing"]["route"][-1]["model"] == header
        chosen.add(header)
    assert chosen == {small, large}


def test_a_margin_cascade_shows_only_the_alternatives_asked_for(server):
    """The margin measure scores two alternatives a token; the client sees as many as it asked."""
    url = server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for top in (0, 1):
        reply = client.chat.completions.create(
            model="margin", messages=[{"role": "user", "content": "Name a colour."}],
            temperature=0, max_tokens=8, logprobs=True, top_logprobs=top)
        content = reply.choices[0].logprobs.content
        assert content and {len(t.top_logprobs) for t in content} == {top}
    plain = client.chat.completions.create(
        model="margin", messages=[{"role": "user", "content": "Name a colour."}],
        temperature=0, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_token_counts_on_a_router_are_its_first_models(server):
    """Claude Code and Codex count before they send: a router's count is its first model's."""
    url, small, _ = server
    ask = [{"role": "user", "content": "Count these words, please."}]
    counted = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.count_tokens
    assert counted(model="pick", messages=ask).input_tokens \
        == counted(model=small, messages=ask).input_tokens > 0
    tokens = [httpx.post(url + "/v1/responses/input_tokens", json={"model": name, "input": "Hi"},
                         timeout=60) for name in ("keep", small)]
    assert [t.status_code for t in tokens] == [200, 200], tokens[0].text
    assert tokens[0].json()["input_tokens"] == tokens[1].json()["input_tokens"] > 0


def test_a_rule_router_routes_by_priority_in_every_api(server):
    url, small, large = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    assert _complete(client, "pick", PROMPTS[1])[0] == small
    header, text, usage = _complete(client, "pick", PROMPTS[1], extra_body={"priority": "high"})
    assert header == large and usage["routed_to"] == large
    assert usage["routing"] == {"router": "pick", "rule": "rule 1"}
    assert text == _complete(client, large, PROMPTS[1])[1]
    said = ollama.Client(host=url).generate(model="pick", prompt=PROMPTS[1], raw=True,
                                            options={"temperature": 0, "num_predict": 12,
                                                     "priority": "high"})
    assert said.response == text
    raw = httpx.post(url + "/api/generate", json={
        "model": "pick:latest", "prompt": PROMPTS[1], "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": 12, "priority": "high"}}, timeout=60)
    assert raw.headers[HEADER] == large and raw.json()["routed_to"] == large
    # by the prompt's length in the first model's tokens (8 at most: the small one)
    assert _complete(client, "short", "1, 2, 3,")[0] == small
    assert _complete(client, "short", "Count on: " + ", ".join(map(str, range(20))))[0] == large


def test_chat_through_a_router_in_the_anthropic_and_ollama_apis(server):
    url, small, _ = server
    ask = [{"role": "user", "content": "Name three colours."}]
    messages = anthropic.Anthropic(base_url=url, api_key="x").messages
    own = messages.create(model=small, max_tokens=16, messages=ask,
                          extra_body={"temperature": 0})
    raw = messages.with_raw_response.create(model="keep", max_tokens=16, messages=ask,
                                            extra_body={"temperature": 0})
    routed = raw.parse()
    assert raw.headers[HEADER] == small and routed.usage.model_extra["routed_to"] == small
    assert routed.content[0].text == own.content[0].text
    options = {"temperature": 0, "num_predict": 16}
    chat = ollama.Client(host=url).chat
    pieces = [c.message.content for c in chat(model="keep", messages=ask, options=options,
                                              stream=True)]
    assert "".join(pieces) == chat(model=small, messages=ask, options=options).message.content


def test_a_broken_router_is_one_line_before_anything_loads(tmp_path):
    from helpers import error_line, run_cli
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text(
        '[routers.loop]\nmodels = ["smollm2", "loop"]\npolicy = "rule"\n')
    result = run_cli("serve", "smollm2", "--offline", "--port", "1", home=tmp_path)
    assert result.returncode == 2 and "reaches itself" in error_line(result)


def test_the_responses_api_takes_a_router(server):
    url, small, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    ask = dict(input="Name three colours.", temperature=0, max_output_tokens=16)
    own = client.responses.create(model=small, **ask)
    raw = client.responses.with_raw_response.create(model="keep", **ask)
    routed = raw.parse()
    assert raw.headers[HEADER] == small and routed.usage.model_extra["routed_to"] == small
    assert routed.output_text == own.output_text
