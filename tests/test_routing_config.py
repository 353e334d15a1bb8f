"""Routers as config.toml declares them (issue 45 section 1), with no model loaded: each problem
is one stderr line naming the file and the router, exit 2, before anything loads; `show` and
`info` describe a router; the cascade's decision and the rules' choice on their own.

The decoding through a router on real models is tests/test_routing.py's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import error_line, home_with, run_cli

from localinfer.engine.logprobs import TokenLogprob
from localinfer.routing import Cascade, Facts, Outcome, Rule, Rules, stream

GOOD = '[routers.fast]\nmodels = ["smollm2:Q4_1", "smollm2:Q8_0"]\n'


def refused(tmp_path: Path, config: str, *words: str, args=("run", "fast", "Hi")) -> str:
    """The one line `args` gets from a home whose config.toml is `config` (no model in it: a
    load would fail otherwise, not with this line)."""
    home = tmp_path / "home"
    result = run_cli(*args, home=home if home.exists() else home_with(tmp_path, config))
    assert result.returncode == 2, (result.returncode, result.stderr)
    line = error_line(result)
    for word in ("config.toml", *words):
        assert word in line, (word, line)
    return line


@pytest.mark.parametrize("config, words", [
    ('[routers.fast]\nmodels = ["smollm2:Q4_1", "no-such-model"]\n', ["[routers.fast]",
                                                                      "no-such-model"]),
    ('[routers.fast]\nmodels = ["smollm2", "./missing.gguf"]\n', ["[routers.fast]", "missing"]),
    (GOOD + 'policy = "fastest"\n', ["[routers.fast]", "unknown policy", "fastest"]),
    (GOOD + 'threshold = "high"\n', ["[routers.fast]", "threshold"]),
    (GOOD + "threshold = nan\n", ["[routers.fast]", "threshold"]),
    (GOOD + "threshold = 2\n", ["[routers.fast]", "at most 0"]),
    (GOOD + "tokens = 0\n", ["[routers.fast]", "tokens"]),
    (GOOD + "tokens = 100000\n", ["[routers.fast]", "tokens"]),
    (GOOD + 'measure = "median"\n', ["[routers.fast]", "measure"]),
    (GOOD + "temperature = 0\n", ["[routers.fast]", "unknown key", "temperature"]),
    ('[routers.fast]\nmodels = ["smollm2"]\n', ["[routers.fast]", "models lists 1"]),
    ('[routers.fast]\nmodels = "smollm2"\n', ["[routers.fast]", "models must be a list"]),
    ('[routers.fast]\nmodels = ["fast", "smollm2"]\n', ["[routers.fast]", "fast -> fast"]),
    ('[routers.a]\npolicy = "rule"\nmodels = ["b"]\n[routers.b]\npolicy = "rule"\n'
     'models = ["smollm2", "fast"]\n' + GOOD.replace("smollm2:Q4_1", "a"),
     ["reaches itself", "a -> b -> fast -> a"]),
    ('[routers.fast]\npolicy = "rule"\nmodels = ["smollm2"]\n[[routers.fast.rules]]\n'
     'model = "gemma-3-270m"\n', ["rule 1", "not one of the router's models"]),
    ('[routers.fast]\npolicy = "rule"\nmodels = ["smollm2"]\n[[routers.fast.rules]]\n'
     'model = "smollm2"\nschema = "yes"\n', ["rule 1", "schema must be true or false"]),
    ('[routers.fast]\npolicy = "rule"\nmodels = ["smollm2"]\n[[routers.fast.rules]]\n'
     'model = "smollm2"\nmin-prompt-tokens = -4\n', ["rule 1", "min-prompt-tokens"]),
    ("[routers]\nfast = 3\n", ["[routers.fast]", "must be a table"]),
    ("routers = 3\n", ["routers must be a table"]),
])
def test_a_bad_router_is_one_line_exit_2_before_anything_loads(tmp_path, config, words):
    refused(tmp_path, config, *words)


def test_every_command_taking_a_model_checks_the_routers(tmp_path):
    """map, show, info and the Python API refuse the same file in the same line (before reading
    stdin's lines or loading); a plain model's run too: the file is wrong as a whole."""
    config = GOOD.replace('"smollm2:Q8_0"', '"no-such-model"')
    line = refused(tmp_path, config, "no-such-model")
    for args in (("map", "fast", "{}"), ("show", "fast"), ("info", "fast"),
                 ("run", "smollm2", "Hi")):
        assert refused(tmp_path, config, args=args) == line
    import localinfer
    from localinfer.user_config import ConfigError
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALINFER_HOME", str(tmp_path / "home"))
        with pytest.raises(ConfigError, match="no-such-model"):
            localinfer.load("fast")


def test_a_router_cannot_hide_a_catalogue_model(tmp_path):
    refused(tmp_path, GOOD.replace("routers.fast", "routers.smollm2"), "smollm2",
            "catalogue", args=("run", "gemma-3-270m", "Hi"))


def test_show_and_info_describe_a_router(tmp_path):
    home = home_with(tmp_path, GOOD + "threshold = -0.8\ntokens = 12\nmeasure = \"min\"\n"
                     '[routers.by-need]\npolicy = "rule"\nmodels = ["smollm2", "fast"]\n'
                     'default = "fast"\n[[routers.by-need.rules]]\nschema = true\n'
                     'model = "smollm2"\n')
    facts = json.loads(run_cli("info", "fast", "--json", home=home).stdout)
    assert facts | {"declared_in": ""} == {
        "router": "fast", "declared_in": "", "policy": "cascade",
        "models": ["smollm2:Q4_1", "smollm2:Q8_0"], "decides_after_tokens": 12,
        "confidence": "min", "threshold": -0.8}
    shown = run_cli("show", "by-need", home=home)
    assert shown.returncode == 0, shown.stderr
    assert "schema = true -> smollm2" in shown.stdout and "otherwise" in shown.stdout
    refused_line = error_line(run_cli("show", "fast", "--template", home=home))
    assert "router" in refused_line and "smollm2:Q4_1" in refused_line
    chat = run_cli("chat", "fast", "--raw", home=home)      # a routed chat renders templates
    assert chat.returncode == 2 and "--raw does not apply to router fast" in error_line(chat)


# -- the decisions ---------------------------------------------------------------------------
def scored(*logprobs: float, runner_up: float = -9.0) -> list[TokenLogprob]:
    return [TokenLogprob(1, lp, ((1, lp), (2, runner_up))) for lp in logprobs]


def test_the_confidence_measures_and_the_decision():
    tokens = scored(-0.1, -0.3, -2.0, -5.0)
    assert Cascade(tokens=3).confidence(tokens) == pytest.approx(-0.8)     # the first 3 only
    assert Cascade(tokens=3, measure="min").confidence(tokens) == -2.0
    assert Cascade(tokens=1, measure="margin").confidence(tokens) == pytest.approx(8.9)
    policy = Cascade(threshold=-0.8)
    assert policy.decide(-0.8) and not policy.decide(-0.81) and not policy.decide(math.nan)
    assert Cascade(threshold=-math.inf).decide(math.nan)            # always keeps
    assert not Cascade(threshold=math.inf).decide(0.0)              # never keeps


def test_rules_in_order_then_the_default():
    rules = Rules((Rule("big", min_prompt_tokens=100), Rule("big", schema=True),
                   Rule("mid", priority="high")), default="small")
    assert rules.choose(Facts(prompt_tokens=99)) == ("small", None)
    assert rules.choose(Facts(prompt_tokens=100)) == ("big", 0)
    assert rules.choose(Facts(prompt_tokens=5, schema=True)) == ("big", 1)
    assert rules.choose(Facts(prompt_tokens=5, priority="high")) == ("mid", 2)


class Attempt:
    """A decoder that yields one piece per token, each scored `logprob`, and logs what the
    consumer has been shown when each piece is produced."""

    def __init__(self, name: str, logprob: float, n: int, log: list) -> None:
        self.name, self.logprob, self.n, self.log = name, logprob, n, log
        self.logprobs: list[TokenLogprob] = []

    def __iter__(self):
        for i in range(self.n):
            self.logprobs.append(TokenLogprob(i, self.logprob))
            self.log.append(("made", self.name, i))
            yield f"{self.name}{i} "


@pytest.mark.parametrize("small_logprob, answer", [(-0.1, "small"), (-3.0, "big")])
def test_the_stream_holds_the_first_tokens_until_the_decision(small_logprob, answer):
    log: list = []
    outcome = Outcome(-1.0)
    attempts = [lambda: Attempt("small", small_logprob, 10, log),
                lambda: Attempt("big", -0.5, 6, log)]
    shown = []
    for piece in stream(Cascade(threshold=-1.0, tokens=4), ["small", "big"], attempts, outcome):
        log.append(("shown", piece))
        shown.append(piece)
    assert all(p.startswith(answer) for p in shown) and len(shown) == (10 if answer == "small"
                                                                         else 6)
    # Nothing of the small model is shown before its fourth token decided it.
    first_shown = next(i for i, e in enumerate(log) if e[0] == "shown")
    assert ("made", "small", 3) in log[:first_shown]
    if answer == "big":
        assert [e for e in log if e[0] == "made" and e[1] == "small"][-1] == ("made", "small", 3)
    assert outcome.routed_to == answer and outcome.confidence == pytest.approx(small_logprob)
    assert [s.accepted for s in outcome.steps] == ([True] if answer == "small" else [False, True])


def test_a_hostile_web_of_routers_is_checked_in_bounded_time(tmp_path):
    """Routers each naming the next eight (a web with about 2^N paths): checked by a walk that
    visits each router once; the same web closed into a cycle is refused; too many routers are
    refused by count."""
    import time
    from localinfer.routing import config
    from localinfer.user_config import ConfigError, parse

    def web(n: int, closed: bool) -> bytes:
        text = ""
        for i in range(n):
            members = [f'"r{j % n}"' for j in range(i + 1, i + 9) if closed or j < n]
            listed = ", ".join(members or ['"smollm2"'])
            text += f'[routers.r{i}]\npolicy = "rule"\nmodels = [{listed}]\n'
        return text.encode()
    start = time.perf_counter()
    assert len(config.checked(parse(web(200, closed=False), tmp_path / "config.toml"))) == 200
    with pytest.raises(ConfigError, match="reaches itself"):
        config.checked(parse(web(200, closed=True), tmp_path / "config.toml"))
    assert time.perf_counter() - start < 5
    many = "".join(f'[routers.r{i}]\nmodels = ["smollm2", "smollm2:Q8_0"]\n' for i in range(300))
    with pytest.raises(ConfigError, match="300 routers; a file declares at most 256"):
        config.checked(parse(many.encode(), tmp_path / "config.toml"))
