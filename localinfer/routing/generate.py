"""A router's request on loaded models: `run`'s and `load()`'s path (prepare, through a Pool that
loads each model when the request first reaches it) and a plain function for measurements
(answer). Both give the chosen model's own answer: the last model of a cascade decodes with the
caller's settings alone, an earlier one with its chosen tokens scored as well (scores are read
from the raw logits after the sampler chose, so they change no token)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from localinfer.engine.decode import Limits, Stats
from localinfer.fit.options import FitOptions, Reporter
from localinfer.routing import cascade
from localinfer.routing.policy import Cascade, Facts, Router
from localinfer.units import human_size

if TYPE_CHECKING:
    from localinfer.engine.load import LoadedModel
    from localinfer.engine.prompt import PromptText
    from localinfer.engine.sampling import SamplingParams
    from localinfer.fit.request import Request
    from localinfer.pipeline.generate import Ask


def scoring(limits: Limits, policy: Cascade) -> Limits:
    """`limits` with the chosen tokens scored as the policy's measure needs (and as asked)."""
    asked = limits.logprobs
    return replace(limits, logprobs=policy.top if asked is None else max(asked, policy.top))


@dataclass
class RoutedStats(Stats):
    """The answering model's figures, with the route (`as_dict` carries it to --json): ttft_s is
    the time to the first text shown, from the start of the first model's prefill."""

    routed: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return super().as_dict() | self.routed

    @classmethod
    def of(cls, stats: Stats, routed: dict, ttft_s: float) -> RoutedStats:
        base = {f: getattr(stats, f) for f in Stats.__dataclass_fields__}
        return cls(**(base | {"ttft_s": ttft_s}), routed=routed)


class Pool:
    """The router's models, loaded when the request first reaches each (pulled, fitted to the
    memory budget as `run` fits one) and kept while they fit the budget together; when the next
    one does not fit beside them, they are freed first, and `report` says so once. With
    `keep_cells` (a chat: each request extends the last) a model's next request keeps the KV
    cells its last one left that it shares, as `chat MODEL` does, rather than restoring them
    from the prompt cache (which keeps only prompts of whole 64-token grains)."""

    def __init__(self, fit: FitOptions, report: Reporter = Reporter(), *, backend: str = "auto",
                 threads: int = 0, engine_log: bool = False, keep_cells: bool = False) -> None:
        self.fit, self.report, self.backend = fit, report, backend
        self.threads, self.engine_log = threads, engine_log
        self.loaded: dict[str, LoadedModel] = {}
        self._said = False
        self.keep_cells = keep_cells
        self._cells: dict[str, object] = {}     # model -> the KVCache of its last request

    def prepare(self, model: str, request: Request, ask: Ask):
        """(the model loaded, its generation of the request), as `run` prepares them."""
        from localinfer.pipeline import generate as pipeline
        from localinfer.pipeline import load
        named = load.name(model, replace(self.fit, quant="auto"), self.report)
        self._make_room(model, named, request)
        loaded, made = pipeline.prepare(named, request, self.fit, ask, self.report,
                                        backend=self.backend, threads=self.threads,
                                        engine_log=self.engine_log, loaded=self.loaded.get(model))
        self.loaded[model] = loaded
        cache = getattr(made, "cache", None)
        if self.keep_cells and cache is not None:
            if model in self._cells:
                cache.follow(self._cells[model])    # a session loaded again: ignored there
            self._cells[model] = cache
        return loaded, made

    def _make_room(self, model: str, named, request: Request) -> None:
        from localinfer.pipeline import load
        from localinfer.routing import memory
        others = {m: l for m, l in self.loaded.items() if m != model}
        if not others:
            return
        fitted = load.fit_model(named, self.fit, self.report, threads=self.threads,
                                request=request)
        path = fitted.ref.path or load.refs.locate(
            fitted.ref, load.refs.model_store(), offline=self.fit.offline,
            progress=self.report.progress, notify=self.report.notify)
        room = memory.together([(l.path, l.options) for l in others.values()], path,
                               fitted.options, self.fit.memory)
        if room.fits:
            return
        if not self._said:
            self.report.notify(
                f"router: its models do not fit the memory budget together ({human_size(room.need)}"
                f" needed, {human_size(room.budget)} in the budget); loading one at a time")
            self._said = True
        for name in others:
            self.free(name)

    def free(self, model: str) -> None:
        self._cells.pop(model, None)
        loaded = self.loaded.pop(model, None)
        if loaded is not None:
            loaded.session.close()

    def close(self) -> None:
        for model in list(self.loaded):
            self.free(model)


class RoutedGeneration:
    """A routed request as a Generation looks to whoever streams it (cli.shell.emit, the Python
    API): iterate for text; `loaded`, `stats`, `cache`, `tokens`, `logprobs` are the answering
    model's (the first model's until the decision), `outcome` says how it went."""

    def __init__(self, router: Router, models: Sequence[str], first, later: Sequence[Callable],
                 limits: Limits, *, policy: Cascade | None,
                 passed_on: Callable[[LoadedModel, object], None] | None = None) -> None:
        self.router, self.models, self.limits, self.policy = router, list(models), limits, policy
        self._later, self._passed_on = list(later), passed_on
        self.loaded, self._made = first
        self.style = self._made.style
        self.stats = self._made.stats
        self.outcome = cascade.Outcome(policy.threshold if policy else None)

    @property
    def cache(self):
        return self._made.cache

    @property
    def tokens(self) -> list[int]:
        return self._made.tokens

    @property
    def logprobs(self) -> list:
        asked = self.limits.logprobs
        if asked is None:
            return []
        return [replace(lp, top=lp.top[:asked]) for lp in self._made.logprobs]

    def _start(self, pair):
        self.loaded, self._made = pair
        self.stats = self._made.stats
        return self._made

    def _kept(self, _: int, made) -> None:
        if self.limits.logprobs is None:    # scored for the decision alone: no more
            made.limits.logprobs = None

    def _gone(self, i: int, made) -> None:
        if self._passed_on is not None:
            self._passed_on(self.loaded, made)

    def __iter__(self) -> Iterator[str]:
        first = (self.loaded, self._made)
        starts = [lambda: self._start(first)] + [
            (lambda later=later: self._start(later())) for later in self._later]
        policy = self.policy or Cascade(threshold=float("-inf"))
        yield from cascade.stream(policy, self.models, starts, self.outcome,
                                  passed_on=self._gone, kept=self._kept)
        self.stats = RoutedStats.of(self._made.stats, {"router": self.router.name,
                                                      **self.outcome.fields()},
                                    self.outcome.ttft_s)

    def describe(self) -> str:
        return self.outcome.describe(self.router.name, self.policy)


def prepare(router: Router, request: Request, ask: Ask, pool: Pool, *,
            priority: str | None = None, lookup: Callable[[str], Router | None] | None = None
            ) -> RoutedGeneration:
    """The routed request, its first model loaded and prefilled lazily as run's is: a rule
    router's choice (through the routers it names), or a cascade's first model, the next ones
    loaded only if the request goes up."""
    from localinfer.cache import prompt_cache
    if lookup is None:
        from localinfer.routing.config import lookup
    rule = None
    while not isinstance(router.policy, Cascade):
        chosen, index = router.policy.choose(facts(router, request, ask, pool, priority))
        rule = f"rule {index + 1}" if index is not None else "default"
        inner = lookup(chosen)
        if inner is None:
            made = RoutedGeneration(router, [chosen], pool.prepare(chosen, request, ask), [],
                                    ask.limits, policy=None)
            made.outcome.rule = rule
            return made
        router = inner
    policy = router.policy
    scored = replace(ask, limits=scoring(ask.limits, policy))
    last = len(router.models) - 1

    def later(i: int):
        return lambda: pool.prepare(router.models[i], request, ask if i == last else scored)

    def passed_on(loaded: LoadedModel, made) -> None:
        prompt_cache.persist(made.cache)
    made = RoutedGeneration(router, router.models, pool.prepare(router.models[0], request, scored),
                            [later(i) for i in range(1, len(router.models))], ask.limits,
                            policy=policy, passed_on=passed_on)
    made.outcome.rule = rule
    return made


def facts(router: Router, request: Request, ask: Ask, pool: Pool,
          priority: str | None = None) -> Facts:
    """What a rule router looks at in the request; the prompt counted (by the vocabulary of the
    router's first model) only when a rule asks for its length."""
    think = ask.think.think
    n = _count(router.models[0], request, pool) if router.policy.counts_tokens else None
    return Facts(prompt_tokens=n, schema=ask.output is not None, tools=False,
                 thinking=think is not None and think != "off", priority=priority)


def _count(model: str, request: Request, pool: Pool) -> int:
    from localinfer.engine.prompt import prompt_tokens
    from localinfer.pipeline import load
    from localinfer.routing.config import lookup
    while (inner := lookup(model)) is not None:     # a rule router names a router first
        model = inner.models[0]
    if model in pool.loaded:
        return len(prompt_tokens(pool.loaded[model].session, request.prompt))
    from localinfer.backends.llama.vocab import LlamaVocab
    fit = replace(pool.fit, quant="auto")
    ref = load.fit_model(load.name(model, fit, pool.report), fit, pool.report).ref
    path = ref.path or load.refs.locate(ref, load.refs.model_store(), offline=fit.offline,
                                        progress=pool.report.progress, notify=pool.report.notify)
    vocab = LlamaVocab(path)
    try:
        return len(prompt_tokens(vocab, request.prompt))
    finally:
        vocab.close()


@dataclass(frozen=True)
class Answer:
    """One request through a cascade on loaded models (see `answer`)."""

    text: str
    routed_to: str               # the answering model, as the router names it
    index: int                   # its place in the cascade (0: the cheapest)
    confidence: float | None     # the last measured (see cascade.Outcome.confidence)
    threshold: float
    ttft_s: float                # request start to the first text shown
    total_s: float               # request start to the answer's end
    steps: tuple[cascade.Step, ...]
    tokens: tuple[int, ...]      # the answering model's tokens


def answer(router: Router, models: Sequence[LoadedModel], prompt: PromptText | str, *,
           params: SamplingParams | None = None, max_tokens: int = 256,
           stop: Sequence[str] = (), draft: str = "none", cache: bool = False) -> Answer:
    """`prompt` (a PromptText, or text sent through each model's chat template) through the
    cascade `router` on `models`, loaded already, one per router.models entry in that order.
    Greedy unless `params` say otherwise; no drafting and no prompt cache unless asked (so
    timings compare). The text is the chosen model's own answer, byte for byte."""
    from localinfer.cache import prompt_cache
    from localinfer.engine.prompt import PromptText, prompt_tokens
    from localinfer.engine.sampling import SamplingParams
    from localinfer.pipeline.generate import generation
    policy = router.policy
    if not isinstance(policy, Cascade) or len(models) != len(router.models):
        raise ValueError("answer() takes a cascade and one loaded model per router.models entry")
    prompt = PromptText(prompt) if isinstance(prompt, str) else prompt
    params = params or SamplingParams(temperature=0.0)
    asked = Limits(max_tokens, tuple(stop))
    scored = scoring(asked, policy)
    made: list = []

    def start(i: int):
        def begin():
            loaded = models[i]
            gen = generation(loaded, prompt_tokens(loaded.session, prompt), params,
                             asked if i == len(models) - 1 else scored, draft=draft,
                             options=loaded.options,
                             store=prompt_cache.open_for(loaded.session, enabled=cache))
            made.append(gen)
            return gen
        return begin
    outcome = cascade.Outcome(policy.threshold)
    text = "".join(cascade.stream(policy, router.models, [start(i) for i in range(len(models))],
                                  outcome, kept=lambda _, gen: _unscore(gen, asked)))
    return Answer(text, outcome.routed_to, outcome.index, outcome.confidence, policy.threshold,
                  outcome.ttft_s, outcome.total_s, tuple(outcome.steps), tuple(made[-1].tokens))


def _unscore(made, asked: Limits) -> None:
    if asked.logprobs is None:
        made.limits.logprobs = None

