"""Routers on real models (issue 45 section 1): SmolLM2 as pulled (Q4_1, the cheap model) and a
Q8_0 that `quantize` makes of it (the precise one), whose greedy answers to PROMPT differ.

Through a router a greedy answer is the answering model's own, byte for byte, whichever way the
cascade decides (a threshold that always keeps the small model's answer, one that never does); a
stream shows nothing of an answer passed on; --json and map --jsonl carry the route; rules route
by what the request holds; load() goes through a router; models that do not fit the memory budget
together load one at a time. Config errors (no model loaded) are test_routing_config.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import home_with, run_cli

from localinfer.quant import quantize

PROMPT = "What is the capital of France?"
GREEDY = ("--temp", "0", "-n", "24", "--draft", "none", "--offline")
GRAMMAR = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def models(smollm_path: Path, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("routing")
    q8 = work / "smollm-Q8_0.gguf"
    quantize.quantize_file(smollm_path, q8, "Q8_0", allow_requantize=True)
    return {"small": smollm_path, "large": q8, "work": work}


@pytest.fixture(scope="module")
def home(models) -> Path:
    small, large = models["small"], models["large"]
    pair = f'models = ["{small}", "{large}"]\ntokens = 8\n'
    return home_with(models["work"], f"""
[routers.stay]
{pair}threshold = -inf
[routers.up]
{pair}threshold = inf
[routers.pick]
policy = "rule"
models = ["{small}", "{large}", "up"]
[[routers.pick.rules]]
schema = true
model = "{large}"
[[routers.pick.rules]]
min-prompt-tokens = 60
model = "{large}"
[[routers.pick.rules]]
priority = "high"
model = "up"
""", models=True)


@pytest.fixture(scope="module")
def own(models, home) -> dict[str, str]:
    """Each model's own greedy answer to PROMPT, as `run FILE` prints it."""
    answers = {}
    for name in ("small", "large"):
        result = run_cli("run", str(models[name]), PROMPT, *GREEDY, home=home)
        assert result.returncode == 0, result.stderr
        answers[name] = result.stdout
    assert answers["small"] != answers["large"]     # else a route could not be told by its answer
    return answers


def test_a_kept_answer_is_the_small_models_own_with_the_route_in_json(models, home, own):
    result = run_cli("run", "stay", PROMPT, *GREEDY, "--json", home=home)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["text"] + "\n" == own["small"]
    assert record["routed_to"] == str(models["small"]) and record["threshold"] == "-inf"
    assert record["confidence"] < 0 and record["route"] == [
        {"model": str(models["small"]), "confidence": record["confidence"], "accepted": True}]
    assert "logprobs" not in record         # scored for the decision, not asked for


def test_a_passed_on_answer_is_the_large_models_own_and_nothing_of_the_small_one_shows(
        models, home, own):
    """stdout is the stream: the small model's first tokens, decoded and scored, never reach it."""
    result = run_cli("run", "up", PROMPT, *GREEDY, "-v", home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout == own["large"]
    assert f"router up: answered by {models['large']} ({models['small']} at -" in result.stderr
    assert "passed on" in result.stderr and "threshold inf" in result.stderr


def test_map_routes_each_line_and_says_so_in_jsonl(models, home, own):
    result = run_cli("map", "up", "{}", "--jsonl", "--temp", "0", "-n", "24", "--offline",
                     home=home, input=PROMPT + "\n")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["answer"] + "\n" == own["large"]
    assert record["routed_to"] == str(models["large"]) and record["threshold"] == "inf"
    assert [step["accepted"] for step in record["route"]] == [False, True]


def test_models_that_do_not_fit_together_load_one_at_a_time(models, home, own):
    """Each SmolLM2 fits 400 MB alone (the fit's estimate at run's context: 283 and 329 MB),
    not both."""
    result = run_cli("run", "up", PROMPT, *GREEDY, "--memory", "400MB", home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout == own["large"]
    assert "do not fit the memory budget together" in result.stderr
    assert "loading one at a time" in result.stderr


def test_rules_route_by_what_the_request_holds_through_load(models, home, monkeypatch):
    import localinfer
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    small, large = str(models["small"]), str(models["large"])
    with localinfer.load("pick") as model:
        assert model.name == "pick"
        # draft="none" throughout: the routes are under test, and a lookup draft would first
        # probe how each model batches in this fresh home (test_exactness_key.py's subject).
        model.generate("Hi.", temperature=0, max_tokens=4, draft="none")
        assert model.route == {"routed_to": small, "rule": "default"}
        assert model.generate("Is water wet?", grammar=GRAMMAR, temperature=0,
                              draft="none") in ("yes", "no")
        assert model.route == {"routed_to": large, "rule": "rule 1"}
        model.generate("Summarise: " + "the sea is wide and deep. " * 10, temperature=0,
                       max_tokens=4, draft="none")
        assert model.route == {"routed_to": large, "rule": "rule 2"}
        got = model.generate(PROMPT, temperature=0, max_tokens=24, draft="none",
                             priority="high")           # to the cascade `up`
        assert model.route["routed_to"] == large and model.stats.as_dict()["router"] == "up"
    with localinfer.load(large) as plain:
        assert got == plain.generate(PROMPT, temperature=0, max_tokens=24, draft="none")


CHAT = "What is the capital of France?\nAnd of Spain?\n"
CHAT_GREEDY = ("--temp", "0", "-n", "16", "--offline")


def test_a_routed_chat_answers_each_turn_as_the_answering_models_own_chat(models, home,
                                                                          monkeypatch):
    """Each turn goes through the cascade with the whole conversation; every turn of `up` is
    the large model's, byte for byte as `chat LARGE` gives it, and nothing of the small model's
    held first tokens shows. The second turn keeps the KV cells of the first."""
    large = str(models["large"])
    own = run_cli("chat", large, *CHAT_GREEDY, "-v", home=home, input=CHAT + "/help\n")
    routed = run_cli("chat", "up", *CHAT_GREEDY, "-v", home=home, input=CHAT + "/help\n")
    for said in (own.stderr, routed.stderr):    # -v's figures and /help: a line each
        assert "\nprompt: " in said and "\n  /clear " in said and "\\n" not in said, said
    assert own.returncode == 0 and routed.returncode == 0, own.stderr + routed.stderr
    assert len(own.stdout.splitlines()) >= 2 and routed.stdout == own.stdout
    assert routed.stderr.count(f"router up: answered by {large}") == 2
    assert "cached" in routed.stderr.split(f"router up: answered by {large}")[2]
    first, second = own.stdout.splitlines()[:2]
    import localinfer          # Model.chat through the router: the same second turn
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    with localinfer.load("up") as model:
        got = model.chat([{"role": "user", "content": CHAT.splitlines()[0]},
                          {"role": "assistant", "content": first},
                          {"role": "user", "content": CHAT.splitlines()[1]}],
                         temperature=0, max_tokens=16, draft="none")
        assert got == second and model.route["routed_to"] == large


def test_run_priority_feeds_a_rule_routers_priority_rules(models, home, own):
    result = run_cli("run", "pick", PROMPT, *GREEDY, "--priority", "high", "-v", home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout == own["large"]        # rule 3 sends it to the cascade `up`
    assert f"router up: answered by {models['large']}" in result.stderr
    plain = run_cli("run", str(models["small"]), "Hi", "-n", "1", "--offline", "--draft", "none",
                    "--priority", "high", "-v", home=home)
    assert plain.returncode == 0, plain.stderr
    assert "--priority high: ignored" in plain.stderr
