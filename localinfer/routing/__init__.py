"""Routers: one name for several models (issue 45 section 1), declared in config.toml as
`[routers.NAME]` (routing/config.py has the format) and used wherever a model name goes.

Two policies. A **cascade** (`policy = "cascade"`, models cheapest first) lets the cheapest model
answer and holds its first `tokens` tokens back; their confidence, measured from the model's own
log-probabilities, decides: at or above `threshold` the answer stands and is shown, below it the
request goes to the next model, and nothing of the first answer is ever shown. A **rule** router
(`policy = "rule"`) picks a model by what the request holds (prompt length in tokens, a schema,
tools, thinking, an explicit priority).

The interface other parts build on (serve, frontier):

    from localinfer import routing

    router = routing.load_router("fast")     # checked config; ConfigError (exit 2) or UsageError
    routing.lookup(name)                     # the Router, or None: `name` is a model
    routing.routers()                        # {name: Router}: every router (for model lists)
    router.models                            # ("smollm2:Q4_1", "smollm2:Q8_0"), cheapest first
    router.kind                              # "cascade" | "rule"
    router.policy.tokens, .threshold, .measure   # a cascade's decision (routing.policy.Cascade)
    router.policy.confidence(token_logprobs) # the measure over the first `tokens` TokenLogprobs
    router.decide(confidence)                # True: the answer stands

    # One request on models already loaded (pipeline.load / helpers), one per router.models entry:
    got = routing.answer(router, [small, large], "What is 2+2?", max_tokens=64)
    got.text, got.routed_to, got.index, got.confidence, got.threshold, got.ttft_s, got.total_s
    got.steps     # each model tried: .model .confidence .accepted .tokens .seconds

    # Any decoder (serve's scheduler jobs): attempts that yield text and keep a growing
    # `logprobs` list of the chosen tokens' TokenLogprob (Limits.logprobs = routing.scoring(...)):
    outcome = routing.Outcome(router.policy.threshold)
    for text in routing.stream(router.policy, router.models, [start_small, start_large], outcome):
        send(text)                           # never text that is later withdrawn
    outcome.fields()   # {"routed_to", "confidence", "threshold", "route": [...]} for JSON
    outcome.describe(router.name, router.policy)   # the -v line
    # A rule router: router.policy.choose(routing.Facts(prompt_tokens=..., schema=..., tools=...,
    # thinking=..., priority=...)) -> (model or router name, rule index or None for the default).

    # run's and load()'s path: a Pool loads each model when the request reaches it (one at a
    # time when they do not fit the memory budget together) and prepare() gives a Generation-like
    # RoutedGeneration (iterate it; .loaded, .stats (as_dict carries the route), .outcome).
    pool = routing.Pool(fit_options, reporter)     # keep_cells=True: chat turns (cli/routed)
    made = routing.prepare(router, fit_request, ask, pool)
    # A conversation: PromptText(..., messages=(...)) renders it through each model's template.

A confidence of nan (no token scored: an empty answer) never keeps the answer unless the
threshold is -inf. Deciding costs one log-softmax per decided token (engine/logprobs.py); the
answer that stands is then decoded without scores unless the caller asked for them.
"""

from __future__ import annotations

from localinfer.routing.cascade import Attempt, Outcome, Step, stream
from localinfer.routing.config import load_router, lookup, routers
from localinfer.routing.generate import Answer, Pool, RoutedGeneration, answer, prepare, scoring
from localinfer.routing.policy import Cascade, Facts, Router, Rule, Rules

__all__ = ["Answer", "Attempt", "Cascade", "Facts", "Outcome", "Pool", "RoutedGeneration",
           "Router", "Rule", "Rules", "Step", "answer", "load_router", "lookup", "prepare",
           "routers", "scoring", "stream"]

