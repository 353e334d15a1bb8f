"""Third-party clients of issue 44 against a live `serve` (SmolLM2): litellm's `n=2` (two
choices, different under sampling, the same again under the seed), and streamed tool-call
arguments read as instructor's `create_partial` reads them (more than one partial object).

instructor itself cannot be installed beside this project's openai (instructor 1.17 pins
jiter < 0.15, this project's openai 3.60 needs jiter >= 0.16): its test runs where it is
installed (in a virtual environment of its own, instructor 1.17 with openai 3.3, against serve on
SmolLM2 it yielded 15 partial objects, 5 of them different, the last {city: Paris, unit: Unit}).
The partial objects are also checked here as instructor makes them (pydantic's partial JSON
parse of the arguments so far, each validated by a model whose fields may be missing)."""

from __future__ import annotations

import signal

import pytest
from helpers import SMOLLM, start_server

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct:Q4_1"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: str
    unit: str


class PartialWeather(pydantic.BaseModel):      # instructor's Partial[Weather]
    city: str | None = None
    unit: str | None = None


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = start_server(SMOLLM, "--ctx", "1024", "--parallel", "2")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


def _arguments_so_far(server: str) -> list[str]:
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "Weather", "description": Weather.__doc__,
                                             "parameters": Weather.model_json_schema()}}
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], stream=True, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "Weather"}})
    joined, out = "", []
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls if chunk.choices else None) or []:
            joined += call.function.arguments or ""
            out.append(joined)
    return out


def test_streamed_arguments_make_more_than_one_partial_object(server):
    from pydantic_core import from_json
    seen = []
    for so_far in _arguments_so_far(server):
        if not so_far:
            continue
        partial = PartialWeather.model_validate(from_json(so_far, allow_partial="trailing-strings"))
        if not seen or partial != seen[-1]:
            seen.append(partial)
    assert len(seen) > 1, seen
    assert Weather.model_validate(seen[-1].model_dump()).city


def test_instructor_create_partial_yields_more_than_one_object(server):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=server + "/v1", api_key="x",
                                                  max_retries=0), mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model=MODEL, messages=ASK, response_model=Weather, temperature=0, max_tokens=60))
    assert len(partials) > 1 and partials[-1].city


def test_litellm_n_2_gives_two_seeded_choices(server):
    litellm = pytest.importorskip("litellm")
    asked = dict(model="openai/" + MODEL, api_base=server + "/v1", api_key="x",
                 messages=[{"role": "user", "content": "Name an animal."}], n=2, seed=9,
                 temperature=1.0, max_tokens=12)
    first = litellm.completion(**asked)
    texts = [c.message.content for c in first.choices]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert [c.message.content for c in litellm.completion(**asked).choices] == texts
