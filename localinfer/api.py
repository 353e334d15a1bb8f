"""The Python API: `localinfer.load(model)` gives a `Model` whose `generate`, `stream` and `chat`
take the command line's options and return what `localinfer run` prints for them.

    import localinfer
    with localinfer.load("smollm2") as model:
        print(model.generate("Why is the sky blue?", temperature=0, max_tokens=60))
        for piece in model.stream("Tell me a story."):
            print(piece, end="", flush=True)
        print(model.chat([{"role": "user", "content": "Hi"}]), model.stats)

The same pipeline as `run` (pipeline/): the name resolved once, the variant and context fitted to
the memory budget (pulled or quantized if need be), the context sized to each prompt (the model is
loaded again only when a prompt needs another context or cache type), the prompt cache, drafting.
Errors raise the project's exceptions (localinfer.errors) with `run`'s one-line messages; nothing
prints or exits. Notes (what was pulled, quantized, shortened) go to `notify`, if given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from localinfer.engine.decode import Limits, Stats
from localinfer.engine.load import LoadedModel
from localinfer.engine.logprobs import check_top, records
from localinfer.engine.prompt import PromptText
from localinfer.engine.sampling import SamplingParams
from localinfer.errors import LocalinferError, UsageError
from localinfer.fit.moe import cpu_moe_count
from localinfer.fit.options import FitOptions, Reporter, gpu_layers_count
from localinfer.models import refs
from localinfer.pipeline import generate as pipeline
from localinfer.pipeline import load as loading
from localinfer.thinking.split import ANSWER, Part, splitter
from localinfer.thinking.style import Think, check_think


@dataclass(frozen=True)
class _Setup:
    """What `load` was given, kept for every later fit."""

    named: refs.Named | None        # None for a router
    fit: FitOptions
    report: Reporter
    backend: str
    threads: int
    router: object = None           # routing.Router: `model` named a router of config.toml


def load(model: str, *, quant: str = "auto", ctx: int = 0, backend: str = "auto",
         memory: str | None = None, kv_type: str | None = None, gpu_layers: str | int = "auto",
         threads: int = 0, offline: bool = False, cpu_moe: str | int = "auto",
         rpc: str | None = None, notify: Callable[[str], None] | None = None,
         mmproj: str | None = None) -> Model:
    """Resolve, pull, fit and load a model as `localinfer run MODEL` would (same options, same
    refusals, as exceptions). `ctx` 0 sizes the context to each prompt; `memory` is a budget such
    as "6GB"; `cpu_moe` keeps a mixture of experts' experts of that many layers in RAM (auto:
    as the GPU needs); `rpc` names `localinfer worker`s as --rpc does ("host:50052,..."): once
    connected they stay in this process's llama.cpp, and later loads use them too; `notify`
    hears the notes `run` writes to stderr; `mmproj` names the projector that images and audio
    go through (default: mmproj*.gguf beside a model file), loaded with the first call that
    sends media."""
    if threads < 0:
        raise UsageError(f"threads must be 0 (automatic) or more, not {threads}")
    if ctx < 0:
        raise UsageError(f"ctx must be 0 (automatic) or more, not {ctx}")
    loading.check_backend(backend)
    if rpc:
        from localinfer.backends.llama import rpc as workers
        workers.request(workers.parse_endpoints(rpc, "rpc"))
    fit = FitOptions(quant=quant, ctx=ctx, kv_type=kv_type, memory=memory,
                     gpu_layers=gpu_layers_count(gpu_layers), offline=offline,
                     cpu_moe=cpu_moe_count(cpu_moe))
    report = Reporter(notify=notify) if notify else Reporter()
    from localinfer import routing
    router = routing.lookup(model)      # a router's config is checked before anything loads
    if router is not None:
        if quant.lower() != "auto":
            raise UsageError(f"quant does not apply to router {router.name}: its models name "
                             "their variants")
        # Its models load when a request first reaches each (routing.Pool).
        return Model(_Setup(None, fit, report, backend, threads, router))
    named = loading.name(model, fit, report)
    made = Model(_Setup(named, fit, report, backend, threads))
    made._mmproj = mmproj
    made._open()
    return made


class Model:
    """A model loaded by `load`; a context manager (leaving it frees the model)."""

    def __init__(self, setup: _Setup) -> None:
        self._setup = setup
        self._loaded: LoadedModel | None = None
        self._closed = False
        self.stats: Stats | None = None     # the figures of the last call: tokens, speeds, why
        self.reasoning: str | None = None   # the last call's trace (None: the model writes none)
        # The last call's tokens with their log-probabilities, as `run --json --logprobs N`
        # prints them (None: not asked for)
        self.logprobs: list[dict] | None = None
        self._embedder = None               # the model in embedding mode, opened by embed()
        self._mmproj: str | None = None     # load's mmproj (see _media)
        self._pool = None                   # a router's models (routing.Pool), as loaded
        # Through a router: how the last call went (routed_to, confidence, threshold, route);
        # `stats.as_dict()` carries it too. None for a model.
        self.route: dict | None = None

    @property
    def name(self) -> str:
        """The variant loaded, as `run -v` names it (e.g. smollm2-135m-instruct:Q4_1)."""
        if self._setup.router is not None:
            return self._setup.router.name
        return self._loaded.ref.display if self._loaded else self._setup.named.ref.display

    @property
    def backend(self) -> str:
        return self._loaded.backend if self._loaded else self._setup.backend

    def generate(self, prompt: str, **options) -> str:
        """The answer `localinfer run MODEL PROMPT` prints for these options (without the newline
        `run` adds to end the line). Options as `run`'s long options: max_tokens, temperature,
        top_k, top_p, min_p, repeat_penalty, frequency_penalty, presence_penalty, logit_bias
        ({token id: bias}), seed, stop, system, raw, draft, draft_max,
        json_schema (a dict or a JSON string), grammar (GBNF text), cache, think (True, False,
        or "low"/"medium"/"high"), think_budget, logprobs (0 to 20: `logprobs` after the call
        holds each token's, and the N likeliest tokens'), reuse_answers (a deterministic
        request answered from the answer store: `stats.as_dict()["reused"]`),
        reuse_similarity (a cosine from 0 to 1: also the stored answer of a prompt that means
        the same, by reuse_embedder's embeddings, default this model's; no default: none was
        measured safe, docs/answer-reuse.md; `stats.as_dict()["similarity"]`), priority (a
        rule router's `priority` rules; `route` after the call says which model answered). A thinking
        model's trace is not in it: it is `reasoning` after the call."""
        return "".join(self.stream(prompt, **options))

    def stream(self, prompt: str, **options) -> Iterator[str]:
        """The answer as it is decoded, piece by piece (see `generate`)."""
        return (text for kind, text in self.stream_parts(prompt, **options) if kind == ANSWER)

    def stream_parts(self, prompt: str, **options) -> Iterator[Part]:
        """(kind, text) pieces as they are decoded: kind "reasoning" for a thinking model's
        trace, "answer" for the answer."""
        self._check_open()
        priority = options.pop("priority", None)        # a rule router's `priority` rules
        ask, system, raw = _ask(options)
        request = _request(PromptText(prompt, 0, system, raw, ask.think.think,
                                      self._media(options)), ask)
        if self._setup.router is not None:
            yield from self._routed(request, ask, priority)
            return
        self._loaded, made = pipeline.prepare(
            self._setup.named, request, self._setup.fit, ask, self._setup.report,
            backend=self._setup.backend, threads=self._setup.threads, loaded=self._loaded)
        yield from self._run(made, ask)

    def chat(self, messages: list[dict], **options) -> str:
        """The assistant's reply to a conversation of {"role", "content"} messages, through the
        model's chat template (`system` adds a system message in front). Through a router each
        call is routed as a request of its own with the whole conversation, rendered by the
        answering model's template (`priority` as generate's; `route` says who answered)."""
        self._check_open()
        priority = options.pop("priority", None)
        ask, system, raw = _ask(options)
        if options.get("images") or options.get("audio"):
            raise UsageError("chat() takes no images or audio yet: use generate(prompt, images=...)")
        if raw:
            raise UsageError("chat takes messages for the chat template; use generate(raw=True)")
        if self._setup.router is not None:
            last = str(messages[-1].get("content", "")) if messages else ""
            request = _request(PromptText(last, 0, system, False, ask.think.think,
                                          messages=tuple(messages)), ask)
            return "".join(text for kind, text in self._routed(request, ask, priority)
                           if kind == ANSWER)
        conversation = ([{"role": "system", "content": system}] if system else []) + messages
        return "".join(text for kind, text in self._chat(conversation, ask) if kind == ANSWER)

    def embed(self, texts: str | list[str], *, truncate: bool = False) -> list[list[float]]:
        """One L2-normalised vector per text (a single string: a list of one), as `localinfer
        embed` writes them: the model's own pooling (mean for a generative model), deterministic.
        A text longer than the context (load's `ctx`, 0 = 512 tokens) is refused, or cut to it
        with `truncate`. The first call loads the model a second time, in embedding mode."""
        from localinfer.pipeline import embed
        self._check_open()
        if self._setup.router is not None:
            raise UsageError(f"{self.name} is a router; embed with one of its models")
        if self._embedder is None:
            setup = self._setup
            self._embedder = embed.open_embedder(setup.named, setup.fit, setup.report,
                                                 threads=setup.threads, backend=setup.backend)
        return embed.embed(self._embedder, texts, truncate=truncate)

    def close(self) -> None:
        self._closed = True
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self._loaded is not None:
            self._loaded.session.close()
            self._loaded = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this model was closed; localinfer.load() it again")

    def _open(self) -> None:
        """The model fitted as a fixed-context command (`chat`) fits it. A model that a long
        prompt loaded again with another context or KV type is loaded back, so that a reply does
        not depend on the calls before it."""
        setup = self._setup
        fitted = loading.fit_model(setup.named, setup.fit, setup.report, threads=setup.threads)
        self._loaded = loading.reuse_or_load(self._loaded, fitted, backend=setup.backend,
                                             offline=setup.fit.offline, report=setup.report)

    def _routed(self, request, ask: pipeline.Ask, priority: str | None) -> Iterator[Part]:
        """A request through the router: its answering model's answer, as `run ROUTER` gives."""
        from localinfer import routing
        if ask.reuse:
            raise UsageError(f"reuse_answers does not work through router {self.name} yet")
        setup = self._setup
        if self._pool is None:
            self._pool = routing.Pool(setup.fit, setup.report, backend=setup.backend,
                                      threads=setup.threads)
        made = routing.prepare(setup.router, request, ask, self._pool, priority=priority)
        self.route = None
        yield from self._run(made, ask)
        self.route = made.outcome.fields()

    def _chat(self, conversation: list[dict], ask: pipeline.Ask) -> Iterator[str]:
        from localinfer.cache import prompt_cache
        from localinfer.engine.prompt import chat_tokens
        from localinfer.pipeline import reuse
        from localinfer.thinking import setup
        self._open()
        loaded = self._loaded
        session, think = loaded.session, ask.think.think
        tokens = chat_tokens(session, conversation, setup.template_vars(session.chat_template, think))
        tokens += setup.empty_trace_tokens(session, tokens, think)

        def build(draft_max: int):
            return pipeline.generation(loaded, tokens, ask.params, ask.limits, draft=ask.draft,
                                       draft_max=draft_max, offline=self._setup.fit.offline,
                                       options=loaded.options, output=ask.output,
                                       report=self._setup.report,
                                       store=prompt_cache.open_for(loaded.session,
                                                                   enabled=ask.use_cache),
                                       think=ask.think)
        yield from self._run(reuse.reusing(session, tokens, ask, build, raw=False,
                                           notify=self._setup.report.notify), ask)

    def _media(self, options: dict) -> tuple:
        """`images` and `audio` (paths, bytes or localinfer.media.Media), checked before anything
        decodes them; the first call with media loads the projector with the model, for good."""
        from dataclasses import replace

        from localinfer import media
        from localinfer.engine.media import find_projector
        given = []
        for kind in ("images", "audio"):
            items = options.get(kind) or ()
            if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
                raise UsageError(f"{kind} must be a list (of paths, bytes or Media)")
            expect = "image" if kind == "images" else "audio"
            media.count_ok(len(given) + len(items), "the request")
            for k, m in enumerate(items):
                if isinstance(m, media.Media):
                    given.append(m)
                elif isinstance(m, (bytes, bytearray)):
                    given.append(media.check(bytes(m), f"{kind}[{k}]", expect))
                elif isinstance(m, (str, Path)):      # not an int: os.stat would take a descriptor
                    given.append(media.read_path(m, expect))
                else:
                    raise UsageError(f"{kind}[{k}] must be a path, bytes or a Media")
        if given and not self._setup.fit.mmproj:
            ref = self._setup.named.ref if self._setup.named else None
            if ref is None:
                raise UsageError("images and audio do not go through a router yet")
            path = find_projector(str(ref.path or ref.display), self._mmproj, tuple(given))
            self._setup = replace(self._setup, fit=replace(self._setup.fit, mmproj=path))
        return tuple(given)

    def _run(self, made, ask: pipeline.Ask) -> Iterator[Part]:
        from localinfer.cache import prompt_cache
        from localinfer.thinking.setup import no_answer
        cut = splitter(made.style) if made.style is not None else None
        answer, trace = [], []
        for piece in made:
            for part in cut.feed(piece) if cut else [Part(ANSWER, piece)]:
                (answer if part.kind == ANSWER else trace).append(part.text)
                yield part
        for part in cut.flush() if cut else []:
            (answer if part.kind == ANSWER else trace).append(part.text)
            yield part
        loaded = getattr(made, "loaded", None) or self._loaded     # a router's: the one that answered
        self.stats, self.reasoning = made.stats, "".join(trace) if cut else None
        self.logprobs = None if ask.limits.logprobs is None else \
            records(made.logprobs, loaded.session.piece)
        prompt_cache.persist(made.cache)
        finish = made.stats.finish_reason
        unanswered = no_answer(cut is not None and cut.in_trace, finish, ask.limits.max_tokens,
                               loaded.session.n_ctx)
        if unanswered:
            raise LocalinferError(unanswered)
        problem = pipeline.incomplete_answer(ask, "".join(answer), made, loaded)
        if problem:
            raise LocalinferError(problem)


_OPTIONS = {"max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed",
            "frequency_penalty", "presence_penalty", "logit_bias",
            "stop", "system", "raw", "draft", "draft_max", "json_schema", "grammar", "cache",
            "think", "think_budget", "logprobs", "reuse_answers", "images", "audio",
            "reuse_similarity", "reuse_embedder"}


def _ask(options: dict) -> tuple[pipeline.Ask, str | None, bool]:
    """The options of one call, checked as the command line checks them."""
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(_OPTIONS))}")
    max_tokens = options.get("max_tokens", -1)
    if max_tokens == 0 or max_tokens < -1:
        raise UsageError("max_tokens must be -1 (no limit) or at least 1")
    stop = options.get("stop", ())
    params = SamplingParams(temperature=options.get("temperature", 0.8),
                            top_k=options.get("top_k", 40), top_p=options.get("top_p", 0.95),
                            min_p=options.get("min_p", 0.05),
                            repeat_penalty=options.get("repeat_penalty", 1.0),
                            seed=options.get("seed"),
                            frequency_penalty=options.get("frequency_penalty", 0.0),
                            presence_penalty=options.get("presence_penalty", 0.0),
                            logit_bias=tuple((int(token), float(bias)) for token, bias
                                             in (options.get("logit_bias") or {}).items()))
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    from localinfer.pipeline.similar import asked
    similar = asked(options.get("reuse_similarity"), options.get("reuse_embedder"),
                    option="reuse_embedder")
    limits = Limits(max_tokens, stops, logprobs=check_top(options.get("logprobs")))
    ask = pipeline.Ask(params, limits, draft=options.get("draft", "auto"),
                       draft_max=options.get("draft_max", 8),
                       output=_output(options.get("json_schema"), options.get("grammar")),
                       use_cache=options.get("cache", True), think=_think(options),
                       reuse=bool(options.get("reuse_answers", False)) or similar is not None,
                       similar=similar)
    return ask, options.get("system"), bool(options.get("raw", False))


def _think(options: dict) -> Think:
    """`think` (True/False or a --think value) and `think_budget`, checked as the CLI checks them."""
    think = options.get("think")
    think = {True: "on", False: "off"}.get(think, think) if isinstance(think, bool) else think
    budget = options.get("think_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 0):
        raise UsageError(f"think_budget must be a whole number of tokens, 0 or more, not {budget!r}")
    return Think(check_think(think), budget)


def _request(prompt: PromptText, ask: pipeline.Ask):
    from localinfer.fit.request import Request
    return Request(prompt, ask.limits.max_tokens)


def _output(json_schema: dict | str | None, grammar: str | None):
    """A schema (a dict; or a string: inline JSON or a file, as --json-schema) or GBNF text,
    checked as the command line checks them."""
    from localinfer.engine import structured
    if json_schema is not None and grammar is not None:
        raise UsageError("json_schema and grammar cannot be used together")
    if isinstance(json_schema, dict):
        return structured.from_schema(json_schema, "json_schema")
    if json_schema is not None:
        return structured.from_options(json_schema, None)
    if grammar is not None:
        return structured.from_grammar(grammar, "grammar")
    return None
