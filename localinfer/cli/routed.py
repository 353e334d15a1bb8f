"""`run ROUTER`: a router's request streamed as `run` streams a model's (cli.shell.emit), the route
said by -v and carried by --json (routed_to, confidence, threshold, route)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localinfer.cli import console, shell
from localinfer.errors import LocalinferError, UsageError

if TYPE_CHECKING:
    from localinfer.fit.options import FitOptions, Reporter
    from localinfer.fit.request import Request
    from localinfer.pipeline.generate import Ask
    from localinfer.routing import Router


def router_for(model: str, *, quant: str = "auto", reuse_answers: bool = False) -> Router | None:
    """The router `model` names (its whole config checked: one line, exit 2, before anything
    loads), or None for a model. Options that cannot apply to a router are refused here."""
    from localinfer import routing
    router = routing.lookup(model)
    if router is None:
        return None
    if quant.lower() != "auto":
        raise UsageError(f"--quant does not apply to router {router.name}: its models name "
                         "their variants in config.toml")
    if reuse_answers:
        raise UsageError(f"--reuse-answers does not work through router {router.name} yet; "
                         "name one of its models to reuse answers")
    return router


def refuse_chat(model: str) -> None:
    """A chat keeps one model's context from turn to turn; a router decides per request."""
    from localinfer import routing
    router = routing.lookup(model)
    if router is not None:
        raise UsageError(f"{router.name} is a router, and a chat through a router is not "
                         f"supported yet (a chat keeps one model's context); chat with one of "
                         f"its models ({', '.join(router.models)}), or pass a PROMPT to run")


class _Answering:
    """The model answering so far, for shell.emit (which reads the model it is given after the
    answer ends: by then the route is decided)."""

    def __init__(self, made) -> None:
        self._made = made

    def __getattr__(self, name: str):
        return getattr(self._made.loaded, name)


def run(router: Router, request: Request, fit: FitOptions, ask: Ask, report: Reporter, *,
        backend: str, threads: int, engine_log: bool, as_json: bool, verbose: bool,
        show_trace: bool, max_tokens: int) -> None:
    """`run`'s path for a router: its models loaded as the request reaches them, the answer of
    the one that answers streamed, the rest of `run`'s checks on that model."""
    from dataclasses import replace

    from localinfer import routing
    from localinfer.cache import prompt_cache
    from localinfer.pipeline import generate as pipeline
    from localinfer.thinking.setup import no_answer
    pool = routing.Pool(replace(fit, quant="auto"), report, backend=backend, threads=threads,
                        engine_log=engine_log)
    try:
        made = routing.prepare(router, request, ask, pool)
        out = shell.emit(made, _Answering(made), as_json=as_json, verbose=verbose,
                         show_trace=show_trace)
        if verbose:
            console.note(made.describe())
        prompt_cache.persist(made.cache, notify=console.note if verbose else None)
        loaded, stats = made.loaded, made.stats
        unanswered = no_answer(out.still_thinking(), stats.finish_reason, max_tokens,
                               loaded.session.n_ctx)
        if unanswered:
            raise LocalinferError(unanswered)
        problem = pipeline.incomplete_answer(ask, out.answer, made, loaded)
        if problem:
            raise LocalinferError(problem)
        if stats.finish_reason == "context":
            console.note(f"the reply stopped at the end of the context "
                         f"({loaded.session.n_ctx:,} tokens); -n N sizes the context for a "
                         "longer one (or --ctx N)")
    finally:
        pool.close()


class _Done:
    """One map line answered through the router, as map's printer reads a scheduler job."""

    def __init__(self, index: int, text: str = "", stats=None, error: str | None = None,
                 routed: dict | None = None) -> None:
        from localinfer.engine.decode import Stats
        self.index, self.text, self.error = index, text, error
        self.stats, self.routed = stats or Stats(), routed or {}


def map_lines(router: Router, feed, printer, *, template: str, params, limits, system: str | None,
              raw: bool, think, output, fit: FitOptions, report: Reporter, backend: str,
              threads: int, engine_log: bool, use_cache: bool, verbose: bool) -> None:
    """`map ROUTER`: each line routed as `run` routes a prompt, one line at a time (a router's
    decision is per request; the batch scheduler decodes one model), answers printed in order
    by map's `printer`; a line that fails fails alone."""
    from dataclasses import replace

    from localinfer import routing
    from localinfer.engine.decode import Limits
    from localinfer.engine.prompt import PromptText
    from localinfer.fit.request import Request
    from localinfer.pipeline import generate as pipeline
    from localinfer.thinking.split import ANSWER, splitter
    from localinfer.cli.map_remote import PLACEHOLDER
    pool = routing.Pool(replace(fit, quant="auto"), report, backend=backend,
                        threads=threads, engine_log=engine_log)
    index, kept = 0, {}
    try:
        while (line := feed.take(block=True)) is not None:
            printer.read(index, line)
            seeded = params if params.seed in (None, -1) else replace(params, seed=params.seed + index)
            ask = pipeline.Ask(seeded, Limits(limits.max_tokens, limits.stop, logprobs=limits.logprobs),
                               draft="none", output=output, use_cache=use_cache, think=think)
            prompt = PromptText(template.replace(PLACEHOLDER, line), 0, system, raw, think.think)
            try:
                made = routing.prepare(router, Request(prompt, limits.max_tokens), ask, pool)
                cut = splitter(made.style) if made.style is not None else None
                text = "".join(made)
                parts = (cut.feed(text) + cut.flush()) if cut else []
                if cut:
                    printer.trace(index, "".join(p.text for p in parts if p.kind != ANSWER))
                    text = "".join(p.text for p in parts if p.kind == ANSWER)
                if limits.logprobs is not None:
                    from localinfer.engine.logprobs import records
                    printer.logprobs[index] = records(made.logprobs, made.loaded.session.piece)
                done = _Done(index, text, made.stats, routed=made.outcome.fields())
                kept[made.outcome.routed_to] = kept.get(made.outcome.routed_to, 0) + 1
            except LocalinferError as e:
                done = _Done(index, error=str(e))
            printer.finished(done)
            index += 1
    finally:
        pool.close()
    if verbose:
        console.note(f"router {router.name}: " + ", ".join(
            f"{n} line{'s' if n != 1 else ''} answered by {model}" for model, n in kept.items()))
