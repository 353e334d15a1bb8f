"""`run ROUTER`: a router's request streamed as `run` streams a model's (cli.shell.emit), the route
said by -v and carried by --json (routed_to, confidence, threshold, route); `map ROUTER` line by
line; `chat ROUTER` turn by turn, each turn a routed request with the whole conversation."""

from __future__ import annotations

import sys
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


class _Answering:
    """The model answering so far, for shell.emit (which reads the model it is given after the
    answer ends: by then the route is decided)."""

    def __init__(self, made) -> None:
        self._made = made

    def __getattr__(self, name: str):
        return getattr(self._made.loaded, name)


def run(router: Router, request: Request, fit: FitOptions, ask: Ask, report: Reporter, *,
        backend: str, threads: int, engine_log: bool, as_json: bool, verbose: bool,
        show_trace: bool, max_tokens: int, priority: str | None = None) -> None:
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
        made = routing.prepare(router, request, ask, pool, priority=priority)
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


def chat(router: Router, *, system: str | None, ask: Ask, fit: FitOptions, report: Reporter,
         backend: str, threads: int, engine_log: bool, verbose: bool, show_trace: bool) -> None:
    """`chat ROUTER`: each turn routed as a request of its own (as `run` routes one) with the
    whole conversation so far, rendered by the answering model's own chat template. The router
    decides per turn; each model keeps the KV cells of the turns it has seen (as `chat MODEL`
    keeps them), so they are not evaluated again while it stays loaded, and its prompt cache
    restores long ones when it was loaded again."""
    from dataclasses import replace

    from localinfer import routing
    from localinfer.cli import chat as chat_repl
    from localinfer.cli import chat_input
    pool = routing.Pool(replace(fit, quant="auto"), report, backend=backend, threads=threads,
                        engine_log=engine_log, keep_cells=True)
    history = chat_repl._setup_readline()
    talk = _Talk(router, pool, ask, system, verbose, show_trace)
    console.note(f"router {router.name} ready ({', '.join(router.models)}) · /help lists the "
                 "commands; /bye or Ctrl-D leaves")
    try:        # no prompts mixed into piped output
        chat_input.converse(console.interactive(sys.stdin), talk.command, talk.take, talk)
    finally:
        pool.close()
        chat_repl._save_history(history)


class _Talk:
    """A routed chat's conversation, and how each turn is asked."""

    def __init__(self, router: Router, pool, ask: Ask, system: str | None, verbose: bool,
                 show_trace: bool) -> None:
        self.router, self.pool, self.ask, self.system = router, pool, ask, system
        self.verbose, self.show_trace = verbose, show_trace
        self.messages: list[dict[str, str]] = []

    def command(self, line: str) -> bool:
        """A /command; False when it ends the chat. Media go to one model: not through a
        router."""
        from localinfer.cli.chat import obey
        command, *rest = line.split(None, 1)
        if command in ("/image", "/audio"):
            console.error(f"{command} does not go through router {self.router.name}; chat "
                          "with one of its models to send images or audio")
            return True
        return obey(self, command, rest[0] if rest else "")

    def take(self, text: str) -> None:
        """Answer `text`; the exchange joins the conversation as far as it went."""
        from localinfer.cli import chat_input
        from localinfer.cli.thinking import Output
        from localinfer.engine.prompt import PromptText
        from localinfer.fit.request import Request
        from localinfer.routing import prepare
        self.messages.append({"role": "user", "content": text})
        prompt = PromptText(text, 0, self.system, False, self.ask.think.think,
                            messages=tuple(self.messages))
        try:
            with chat_input.keys_held(sys.stdin):   # keys typed during the reply stay out of it
                made = prepare(self.router, Request(prompt, self.ask.limits.max_tokens),
                               self.ask, self.pool)
                out = Output(made.style, show_trace=self.show_trace)
                try:
                    for piece in made:
                        out.feed(piece)
                except KeyboardInterrupt:           # Ctrl-C ends the reply, not the chat
                    made.stats.finish_reason = "interrupted"
                out.flush()
        except LocalinferError as e:     # too long for the context, a refused option: this turn
            self.messages.pop()
            console.error(str(e) + ("; /clear starts a new conversation"
                                    if "context" in str(e) else ""))
            return
        reply = self._close(made, out)
        if made.stats.finish_reason == "interrupted" and not reply:
            self.messages.pop()         # nothing came: no empty answer in the conversation
            return
        self.messages.append({"role": "assistant", "content": reply})

    def _close(self, made, out) -> str:
        """After a reply: the newline, what cut it, the prompt cache written, -v's lines."""
        from localinfer.cache import prompt_cache
        from localinfer.cli.chat import _cut_marker
        from localinfer.engine.structured import incomplete
        from localinfer.thinking.setup import no_answer
        reply, finish, limits = out.answer.strip(), made.stats.finish_reason, self.ask.limits
        n_ctx = made.loaded.session.n_ctx
        sys.stdout.write("\n")
        sys.stdout.flush()
        unanswered = no_answer(out.still_thinking(), finish, limits.max_tokens, n_ctx)
        cut = _cut_marker(finish, limits, n_ctx)
        problem = incomplete(self.ask.output, reply, finish) if self.ask.output else None
        for line in (unanswered, problem):
            if line:
                console.error(line)
        if cut and not unanswered:
            console.note(cut)
        prompt_cache.persist(made.cache, notify=console.note if self.verbose else None)
        if self.verbose and made.outcome.routed_to is not None:
            console.note(made.describe())
            console.notes(shell.format_stats(made.stats, made.loaded))
        return reply
