"""`localinfer frontier --router NAME`: what routing buys, measured on labelled prompts.

One run answers every prompt with the router's cheapest model alone, its most precise model
alone, and the cascade at several thresholds, each greedy with the same token budget, taking
them in turn prompt by prompt (a machine's load then moves every configuration alike). Each is a
point: quality, mean time per request, mean time to first token, and the share of requests the
cascade sent up.

Quality is against an oracle, the precise model's own greedy answer (docs/routing.md says why):
  agreement        the share of answers equal to the oracle's (surrounding whitespace aside);
  token agreement  the tokens an answer shares with the oracle's before the two first differ,
                   over the longer one's length (prompt_set.prefix_agreement), averaged: it
                   tells a near miss from an answer that goes elsewhere from its first token;
  reference        where a prompt has a reference answer, the share that contain it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from localinfer.errors import UsageError
from localinfer.measure.prompt_set import (MAX_PROMPT_CHARS, Prompt, matches_reference,
                                           prefix_agreement, same_answer)


@dataclass(frozen=True)
class Outcome:
    """One request's answer and what it cost, as a client sees it."""

    text: str
    tokens: tuple[int, ...]        # the answering model's tokens
    seconds: float                 # from the request's start to the end of its answer
    ttft_s: float                  # from the request's start to the first text shown
    routed_up: bool = False        # the cascade sent it to a more precise model
    confidence: float | None = None


# One configuration: a prompt in, its outcome out (the models loaded and kept by the caller).
Runner = Callable[[str], Outcome]


@dataclass(frozen=True)
class Config:
    label: str                     # "small", "large", "cascade"
    model: str                     # what answers: a model's name, or the router's
    run: Runner
    threshold: float | None = None


@dataclass
class RoutePoint:
    label: str
    model: str
    threshold: float | None
    prompts: int
    agreement: float
    token_agreement: float | None      # None: the models' vocabularies differ
    reference_accuracy: float | None
    references: int
    mean_s: float
    ttft_s: float
    routed_up: float               # the share answered by a model past the cheapest
    answer_tokens: float           # mean tokens an answer (what the time per request pays for)
    by_kind: dict[str, float] = field(default_factory=dict)   # agreement per prompt kind
    frontier: bool = False


def measure(prompts: Sequence[Prompt], configs: Sequence[Config], *, oracle: str = "large",
            compare_tokens: bool = True,
            progress: Callable[[int, int], None] | None = None) -> list[RoutePoint]:
    """Answer every prompt with every configuration, then score each against the answers of the
    configuration labelled `oracle` (`compare_tokens`: the models share one vocabulary, so
    their tokens compare). Each configuration answers the first prompt once before, untimed:
    a model's first request pays for buffers the others do not."""
    labels = [c.label for c in configs]
    if oracle not in labels:
        raise ValueError(f"no configuration labelled {oracle!r} to be the oracle")
    for config in configs:
        config.run(prompts[0].prompt)
    outcomes: list[list[Outcome]] = [[] for _ in configs]
    for i, prompt in enumerate(prompts):
        for config, into in zip(configs, outcomes):
            into.append(config.run(prompt.prompt))
        if progress:
            progress(i + 1, len(prompts))
    truth = outcomes[labels.index(oracle)]
    points = [score(c, prompts, got, truth, compare_tokens) for c, got in zip(configs, outcomes)]
    mark_frontier(points)
    return points


def score(config: Config, prompts: Sequence[Prompt], got: Sequence[Outcome],
          truth: Sequence[Outcome], compare_tokens: bool = True) -> RoutePoint:
    n = len(prompts)
    agree = [same_answer(g.text, t.text) for g, t in zip(got, truth)]
    tokens = [1.0 if same else prefix_agreement(g.tokens, t.tokens)
              for same, g, t in zip(agree, got, truth)] if compare_tokens else None
    referenced = [(p, g) for p, g in zip(prompts, got) if p.reference is not None]
    right = sum(matches_reference(g.text, p.reference) for p, g in referenced)
    kinds = sorted({p.kind for p in prompts})
    by_kind = {k: _share([a for p, a in zip(prompts, agree) if p.kind == k]) for k in kinds}
    return RoutePoint(config.label, config.model, config.threshold, n, _share(agree),
                      sum(tokens) / n if tokens is not None else None, right / len(referenced) if referenced else None,
                      len(referenced), _mean([g.seconds for g in got]),
                      _mean([g.ttft_s for g in got]), _share([g.routed_up for g in got]),
                      _mean([len(g.tokens) for g in got]), by_kind)


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def mark_frontier(points: list[RoutePoint]) -> None:
    """Set `frontier` on every point no other beats on agreement and on time per request."""
    for p in points:
        p.frontier = not any(
            q is not p and q.agreement >= p.agreement and q.mean_s <= p.mean_s
            and (q.agreement > p.agreement or q.mean_s < p.mean_s) for q in points)


# -- the router's configurations ------------------------------------------------------------------
# Thresholds swept when none are given, by the router's confidence measure: for the mean, the
# range SmolLM2's confidences fell in (docs/routing.md), around the default; for min and margin,
# a spread over each measure's scale, not yet measured.
DEFAULT_THRESHOLDS = {"mean": (-0.5, -0.6, -0.7, -0.8), "min": (-1.0, -2.0, -3.0, -5.0),
                      "margin": (1.0, 2.0, 3.0, 5.0)}


def cascade_router(name: str):
    """The cascade `name` names in config.toml; any other router, or none, refused in one line
    before anything loads."""
    from localinfer import routing
    router = routing.load_router(name)
    if router.kind != "cascade":
        raise UsageError(f"router {router.name} is a rule router; frontier --router measures a "
                         "cascade (a rule router's choice has no threshold to sweep)")
    return router


def open_models(router, *, n_ctx: int, threads: int = 0, backend: str = "auto",
                offline: bool = False, report=None) -> list:
    """The router's models, loaded in its order, all at once: each configuration then runs on
    warm models and no load time counts."""
    from localinfer.backends import LoadOptions
    from localinfer.fit.options import Reporter
    from localinfer.pipeline.load import open_model
    options = LoadOptions(n_ctx=n_ctx, n_threads=threads)
    return [open_model(m, options, backend=backend, offline=offline,
                       report=report or Reporter(), place=True) for m in router.models]


def router_configs(router, loaded: Sequence, thresholds: Sequence[float], *,
                   max_tokens: int) -> list[Config]:
    """Always the cheapest model, always the most precise, and the cascade at each threshold:
    every one through the router's own `routing.answer`, so all are timed alike."""
    alone = [replace(router, models=(router.models[i],)) for i in (0, -1)]
    configs = [Config("small", router.models[0], _runner(alone[0], [loaded[0]], max_tokens)),
               Config("large", router.models[-1],
                      _runner(alone[1], [loaded[-1]], max_tokens, up=True))]
    for t in thresholds:
        at = replace(router, policy=replace(router.policy, threshold=t))
        configs.append(Config("cascade", router.name, _runner(at, loaded, max_tokens), t))
    return configs


def same_vocabulary(loaded: Sequence) -> bool:
    """Whether the models tokenize alike (then their answers' tokens compare one to one)."""
    probe = "Routing: 1,234 apples; naïve café, 東京."
    first = loaded[0].session
    return all(m.session.n_vocab == first.n_vocab and m.session.tokenize(probe, special=False)
               == first.tokenize(probe, special=False) for m in loaded[1:])


def _runner(router, loaded: Sequence, max_tokens: int, *, up: bool = False) -> Runner:
    """`up`: the model alone is the precise one, and counts as every request sent up."""
    from localinfer import routing

    def run(prompt: str) -> Outcome:
        got = routing.answer(router, loaded, prompt, max_tokens=max_tokens)
        return Outcome(got.text, got.tokens, got.total_s, got.ttft_s,
                       routed_up=up or got.index > 0, confidence=got.confidence)
    return run


def parse_thresholds(values: Sequence[str], measure: str) -> list[float]:
    """--thresholds: numbers (comma-separated or repeated; -inf keeps every answer, inf none),
    else DEFAULT_THRESHOLDS for the router's measure."""
    found = [v.strip() for value in values for v in value.split(",") if v.strip()]
    if not found:
        return list(DEFAULT_THRESHOLDS[measure])
    try:
        numbers = [float(v) for v in found]
    except ValueError:
        raise UsageError(f"--thresholds takes numbers (-inf and inf too), not {', '.join(found)}")
    if any(math.isnan(n) for n in numbers) or len(numbers) > MAX_THRESHOLDS:
        raise UsageError(f"--thresholds takes 1 to {MAX_THRESHOLDS} numbers, none nan")
    return numbers


MAX_THRESHOLDS = 12
# Context room for the chat template and a prompt of up to MAX_PROMPT_CHARS (a token holds a
# character at least, but a few for some scripts' bytes); the answer's tokens come on top.
PROMPT_ROOM = 2 * MAX_PROMPT_CHARS


def context_for(max_tokens: int) -> int:
    return PROMPT_ROOM + max_tokens


# -- output ---------------------------------------------------------------------------------------
HEADERS = ["CONFIG", "THRESHOLD", "AGREE", "TOKEN AGREE", "REFERENCE", "MEAN s", "TTFT s",
           "UP", "ANSWER TOKENS"]


def as_rows(points: Sequence[RoutePoint]) -> list[list[str]]:
    return [[f"{p.label} ({_short(p.model)})" + (" *" if p.frontier else ""),
             "-" if p.threshold is None else f"{p.threshold:g}", f"{p.agreement:.1%}",
             "-" if p.token_agreement is None else f"{p.token_agreement:.1%}",
             "-" if p.reference_accuracy is None else f"{p.reference_accuracy:.1%}",
             f"{p.mean_s:.3f}", f"{p.ttft_s:.3f}", f"{p.routed_up:.0%}",
             f"{p.answer_tokens:.1f}"] for p in points]


def _short(model: str) -> str:
    """A model named by its file: the file's name (the table stays readable)."""
    return Path(model).name if model.endswith(".gguf") else model


def to_json(router: str, max_tokens: int, points: Sequence[RoutePoint]) -> str:
    """The points as JSON; JSON has no infinity, so a threshold of inf or -inf is that string, as
    `run --json` gives a router's."""
    rows = [asdict(p) | {"threshold": _finite_or_text(p.threshold)} for p in points]
    return json.dumps({"router": router, "max_tokens": max_tokens,
                       "oracle": next((p.model for p in points if p.label == "large"), None),
                       "points": rows}, indent=2, allow_nan=False)


def _finite_or_text(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else str(value)


def plot(points: Sequence[RoutePoint], path: Path, title: str) -> None:
    """Agreement with the oracle against time per request and against time to first token."""
    from localinfer.measure.frontier import figure, save
    fig, axes = figure(2)
    for ax, key, label in ((axes[0], "mean_s", "mean time per request (s)"),
                           (axes[1], "ttft_s", "mean time to first token (s)")):
        for p in points:
            x = getattr(p, key)
            ax.scatter([x], [p.agreement], color="tab:red" if p.label == "cascade" else "tab:blue")
            name = p.label if p.threshold is None else f"{p.threshold:g}"
            ax.annotate(name, (x, p.agreement), textcoords="offset points", xytext=(4, 4))
        cascade = sorted((getattr(p, key), p.agreement) for p in points if p.label == "cascade")
        ax.plot([c[0] for c in cascade], [c[1] for c in cascade], color="tab:red",
                label="cascade (thresholds)")
        ax.set_xlabel(label)
        ax.set_ylabel("answers equal to the large model's")
        ax.legend()
    save(fig, path, title)
