"""`map`: one prompt per line of stdin, answered together by the continuous-batching scheduler."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from localinfer.cli import console, map_remote, shell
from localinfer.cli.answers import reuse_answers_option
from localinfer.cli.map_feed import Feed as _Feed
from localinfer.cli.options import (rpc_option, BACKEND, CONTEXT, OUTPUT, backend_option,
                                    cpu_moe_option, ctx_option, engine_log, fit_options,
                                    gpu_layers_option, grammar_option, json_schema_option,
                                    check_logprobs, logprobs_option,
                                    kv_type_option, max_tokens_option, memory_option, min_p_option,
                                    model_argument, no_think_option, offline_option, quant_option,
                                    raw_option, repeat_penalty_option, reporter, seed_option,
                                    frequency_penalty_option, presence_penalty_option,
                                    logit_bias_option, penalties,
                                    show_thinking_option, stop_option, system_option, temp_option,
                                    think_budget_option, think_option, think_settings,
                                    threads_option, top_k_option, top_p_option, verbose_option)
from localinfer.errors import EXIT_RUNTIME, LocalinferError, UsageError
from localinfer.units import counted

PLACEHOLDER = map_remote.PLACEHOLDER


def register(app: typer.Typer) -> None:
    app.command("map")(map_lines)


def map_lines(
    command: typer.Context,
    model: str = model_argument(),
    template: str = typer.Argument(..., metavar="TEMPLATE", show_default=False,
                                   help="The prompt for each line; {} is the line."),
    parallel: int = typer.Option(4, "--parallel", "-P", min=1, max=63, metavar="N",
                                 rich_help_panel=CONTEXT, help="Prompts decoded together."),
    system: Optional[str] = system_option(),
    raw: bool = raw_option("Send each prompt as is, without the chat template."),
    temp: float = temp_option(),
    top_k: int = top_k_option(),
    top_p: float = top_p_option(),
    min_p: float = min_p_option(),
    repeat_penalty: float = repeat_penalty_option(),
    frequency_penalty: float = frequency_penalty_option(),
    presence_penalty: float = presence_penalty_option(),
    logit_bias: list[str] = logit_bias_option(),
    seed: Optional[int] = seed_option("Seed of the first line's sampler (the next lines count up "
                                      "from it); -1 (or none) draws a new one each run."),
    max_tokens: int = max_tokens_option(256, "Most tokens an answer takes."),
    stop: list[str] = stop_option(),
    ctx: int = ctx_option(2048, 64, "Context of each prompt and its answer; 0 = 2048."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
    kv_type: Optional[str] = kv_type_option(),
    no_cache: bool = typer.Option(False, "--no-cache", rich_help_panel=CONTEXT,
                                  help="Do not restore prompts from the prompt cache."),
    reuse_answers: bool = reuse_answers_option(),
    as_jsonl: bool = typer.Option(False, "--jsonl", rich_help_panel=OUTPUT,
                                  help="One JSON object per line: input, answer, finish reason "
                                  "(or error); closed_early where -n cut a --json-schema "
                                  "answer short and its document was closed to fit."),
    logprobs: Optional[int] = logprobs_option("--jsonl"),
    json_schema: Optional[str] = json_schema_option("Each answer is one JSON document valid "
                                                    "against this schema (a file or inline "
                                                    "JSON)."),
    grammar: Optional[str] = grammar_option("Each answer follows this GBNF grammar file."),
    think: Optional[str] = think_option(),
    no_think: bool = no_think_option(),
    think_budget: Optional[int] = think_budget_option(),
    show_thinking: Optional[bool] = show_thinking_option(),
    verbose: int = verbose_option("-v: how many lines were decoded; -vv: the engine's log."),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    rpc: Optional[str] = rpc_option(),
    cpu_moe: str = cpu_moe_option(),
    offline: bool = offline_option(),
    server: Optional[str] = typer.Option(None, "--server", metavar="URL", rich_help_panel=BACKEND,
                                         help="Send the lines to a running `localinfer serve` "
                                         "at URL as batch requests (its interactive ones go "
                                         "first) instead of loading MODEL here."),
) -> None:
    """Answer one prompt per line of stdin; the answers on stdout, one per line, in input order
    (a thinking model's trace: never stdout).

    \b
    seq 1 20 | localinfer map smollm2 "Is {} a prime number? Answer yes or no." --temp 0
    cat titles.txt | localinfer map smollm2 "Translate to French: {}" --jsonl
    cat titles.txt | localinfer map smollm2 "Summarise: {}" --server http://127.0.0.1:8080
    """
    from localinfer.cli.thinking import show_by_default
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams
    from localinfer.engine.structured import from_options
    if PLACEHOLDER not in template:
        raise UsageError(f"the template has no {PLACEHOLDER} for the line")
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed,   # checked before loading
                            **penalties(frequency_penalty, presence_penalty, logit_bias))
    output = from_options(json_schema, grammar)
    thinking = think_settings(think, no_think, think_budget)
    if check_logprobs(logprobs, as_jsonl, "--jsonl") is not None and server:
        raise UsageError("--logprobs is not sent to a server: drop --server to run the model here")
    if reuse_answers and server:
        raise UsageError("--reuse-answers is not sent to a server: drop --server to run the "
                         "model here")
    remote = map_remote.remote(command, server, model, template, params, max_tokens, stop,
                               system=system, raw=raw, json_schema=json_schema, think=thinking)
    feed = _input_lines(ahead=2 * parallel)
    feed.peek()                 # a first line that is not text is refused before the model loads
    show_trace = show_by_default(show_thinking) and not as_jsonl
    if remote is not None:
        printer = _InOrder(as_jsonl, show_trace)
        map_remote.answer_lines(remote, feed, parallel, printer)
        _ended(printer, feed, max_tokens)
        return
    from localinfer.pipeline import load
    from localinfer.thinking.setup import check_asked, style_of
    fit, report = fit_options(quant=quant, ctx=ctx, kv_type=kv_type, memory=memory_,
                              gpu_layers=gpu_layers, offline=offline, cpu_moe=cpu_moe), reporter()
    from localinfer.cli import routed
    router = routed.router_for(model, quant=quant, reuse_answers=reuse_answers)
    if router is not None:      # one line at a time through the router (docs/routing.md)
        printer = _InOrder(as_jsonl, show_trace)
        routed.map_lines(router, feed, printer, template=template, params=params,
                         limits=Limits(max_tokens, tuple(stop), logprobs=logprobs), system=system,
                         raw=raw, think=thinking, output=output, fit=fit, report=report,
                         backend=backend, threads=threads, engine_log=engine_log(verbose),
                         use_cache=not no_cache, verbose=verbose > 0)
        return _ended(printer, feed, max_tokens)
    ref, batch = load.open_batch(load.name(model, fit, report), fit, report, parallel=parallel,
                                 threads=threads, engine_log=engine_log(verbose), backend=backend)
    try:
        check_asked(style_of(batch.session, [], raw), thinking, ref.display, raw)
        printer = _answer(batch, feed, _Lines(template, params, Limits(max_tokens, tuple(stop),
                                                                        logprobs=logprobs),
                                              system=system, raw=raw, think=thinking,
                                              gbnf=output.gbnf if output else None),
                          jsonl=as_jsonl, use_cache=not no_cache, show_trace=show_trace,
                          reuse=reuse_answers, verbose=verbose > 0)
    finally:
        batch.close()
    _ended(printer, feed, max_tokens)


def _ended(printer: _InOrder, feed: _Feed, max_tokens: int) -> None:
    """What the run says once every line is printed, and how it exits."""
    if printer.closed:
        limit = f"-n {max_tokens}" if max_tokens > 0 else "the bound of an answer without -n"
        console.note(f"{printer.closed} of {counted(printer.count, 'answer')} closed their document "
                     f"early to fit {limit} (or the context); a larger -n or --ctx gives it room")
    if printer.failed:
        console.warn(f"{printer.failed} of {counted(printer.count, 'line')} failed")
    if feed.error:              # the lines before it are answered; the rest is not read
        raise feed.error
    if printer.failed:
        raise typer.Exit(EXIT_RUNTIME)


def _input_lines(ahead: int) -> _Feed:
    lines = shell.stdin_lines()
    if lines is None:
        raise UsageError("map reads its lines from stdin: pipe them in (`... | localinfer map "
                         "MODEL \"...{}...\"`)")
    return _Feed(lines, ahead)


def _answer(batch, feed: _Feed, lines: _Lines, *, jsonl: bool, use_cache: bool,
            show_trace: bool = False, reuse: bool = False, verbose: bool = False) -> _InOrder:
    """Run the lines through the scheduler as they come, printing answers in input order.

    A line becomes a job (tokenized, with its sampler) only when the scheduler has a free
    sequence for it, and at most `feed.ahead` lines are read but not printed yet: memory holds
    that window, not the input. A line whose deterministic request repeats an earlier one is
    answered with its answer, not decoded again (pipeline/reuse.py; `reuse`: the store too)."""
    from localinfer.cache import prompt_cache
    from localinfer.engine.logprobs import records
    from localinfer.engine.scheduler import Scheduler
    from localinfer.pipeline.reuse import MapReuse
    printer = _InOrder(jsonl, show_trace)
    first = feed.peek()
    if first is None:
        return printer
    session, parallel = batch.session, batch.n_seq - 1
    seq_ctx = batch.n_ctx // parallel           # each line's context, as the scheduler shares it
    created = 0

    def arrivals(idle: bool):
        nonlocal created
        jobs = []
        # created - count: in the scheduler; created - next: read and not printed yet
        while created - printer.count < parallel and created - printer.next < feed.ahead:
            line = feed.take(block=idle and not jobs)
            if line is None:
                break
            job = lines.job(session, line, created)
            printer.read(created, line)
            created += 1
            if job.error:
                done(job)
            else:
                jobs.append(job)
        return None if not jobs and feed.exhausted else jobs

    with console.progress_bar("answering") as progress:
        def done(job) -> None:
            job.sampler, job.prompt = None, []      # its grammar, if any, is freed with it
            if job.limits.logprobs is not None:     # rendered now: the printer has no session
                printer.logprobs[job.index] = records(job.logprobs, session.piece)
            printer.trace(job.index, lines.split(job, seq_ctx))
            printer.finished(job)
            if progress:
                progress(printer.count, created, "")
        store = prompt_cache.open_for(session, enabled=use_cache)
        prefix = lines.prefix(session, first)
        shared = MapReuse(session, lines, seq_ctx, stored=reuse, notify=console.note)
        Scheduler(batch, prefix=prefix, store=store).run([], *shared.wrap(done, arrivals))
    if verbose:
        console.note(shared.describe())
    return printer


class _Lines:
    """How map turns a line into its job: the template, sampling, limits and grammar; and, for a
    thinking model, its trace told apart from its answer once it is done."""

    def __init__(self, template: str, params, limits, *, system: str | None, raw: bool,
                 gbnf: str | None, think=None) -> None:
        from localinfer.thinking.style import Think
        self.template, self.params, self.limits = template, params, limits
        self.system, self.raw, self.gbnf = system, raw, gbnf
        self.think = think or Think()
        self.styles: dict[int, object] = {}    # a thinking model's lines under way: their Style

    def job(self, session, line: str, index: int):
        from dataclasses import replace

        from localinfer.engine.sampling import make_sampler
        from localinfer.engine.scheduler import Job
        from localinfer.engine.structured import OutputFormat, answer_limit
        params = self.params
        if params.seed not in (None, -1):
            params = replace(params, seed=params.seed + index)
        try:
            prompt = self.tokens(session, line)
        except LocalinferError as e:    # e.g. the chat template refuses this line: it alone fails
            return Job([], make_sampler(params), self.limits, index=index, error=str(e))
        from localinfer.thinking import setup
        style = setup.style_of(session, prompt, self.raw)
        if style is None:           # no trace: as before thinking models
            sampler = _constrained(params, lambda: session.grammar(self.gbnf)) if self.gbnf \
                else make_sampler(params)
            limits = replace(self.limits, max_tokens=answer_limit(    # as run's: bounded
                OutputFormat(self.gbnf, False) if self.gbnf else None, self.limits.max_tokens))
            return Job(prompt, sampler, limits, index=index)
        self.styles[index] = style
        shown = setup.shown_markers(session, style)
        limits = replace(self.limits, shown=shown) if shown else self.limits
        if self.gbnf or self.think.budget is not None:
            # The gate frees the trace, ends it at the budget and keeps the answer to the grammar.
            sampler = _constrained(params, lambda: setup.gate_for(
                session, style, self.think, session.grammar(self.gbnf) if self.gbnf else None))
        else:
            sampler = make_sampler(params)
        return Job(prompt, sampler, limits, index=index)

    def split(self, job, seq_ctx: int) -> str | None:
        """A finished job of a thinking model: its text made the answer alone, and an answer
        that never started (-n, the context or the model's end inside the trace) made the
        line's error. Returns the trace (None: the model writes none)."""
        style = self.styles.pop(job.index, None)
        if style is None:
            return None
        from localinfer.thinking.setup import no_answer
        from localinfer.thinking.split import ANSWER, REASONING, splitter
        cut = splitter(style)
        parts = cut.feed(job.text) + cut.flush()
        job.text = "".join(p.text for p in parts if p.kind == ANSWER)
        finish = job.stats.finish_reason
        if job.error is None:
            job.error = no_answer(cut.in_trace, finish, self.limits.max_tokens, seq_ctx)
        return "".join(p.text for p in parts if p.kind == REASONING)

    def tokens(self, session, line: str) -> list[int]:
        from localinfer.engine.prompt import PromptText, prompt_tokens
        text = self.template.replace(PLACEHOLDER, line)
        return prompt_tokens(session, PromptText(text, 0, self.system, self.raw,
                                                 think=self.think.think))

    def prefix(self, session, first_line: str) -> list[int]:
        """The tokens every line's prompt starts with, known before the lines are: where the
        template's prompt parts for two unlike lines, or sooner where the first line's does
        (a line may tokenize into what the template has before `{}`). A prompt that parts from
        it sooner still shares the cells up to where it parts, no more.

        A chat template that fails for the probes fails the run here, in one line, before any
        line is answered; one that fails for the first line alone fails that line, later."""
        prompts = [self.tokens(session, probe) for probe in _PROBES]
        try:
            prompts.append(self.tokens(session, first_line))
        except LocalinferError:
            pass
        return _shared_prefix(prompts)


# Two lines unlike in their first character's class: where their prompts part is where the line
# begins, whatever a tokenizer merges at the boundary.
_PROBES = ("A", "7")


def _constrained(params, grammar):
    """A constrained sampler whose grammar (`grammar()` makes it) is made when its line's answer
    starts (and dropped when it ends): a grammar's parse state for every line of a long input at
    once is memory."""
    from localinfer.engine.constrain import ConstrainedSampler
    made = []

    def sample(logits, history) -> int:
        if not made:
            made.append(ConstrainedSampler(params, grammar()))
        return made[0](logits, history)
    return sample


def _shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The tokens every prompt starts with: evaluated once, shared by all."""
    if not prompts:
        return []
    first, n = prompts[0], len(prompts[0])
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p)) if a != b), min(n, len(p)))
    return first[:n]


class _InOrder:
    """Prints each answer once every line before it is printed: input order, as they finish.
    Holds only the lines read but not printed yet (the finished ones waiting for an earlier one)."""

    def __init__(self, jsonl: bool, show_trace: bool = False) -> None:
        self.jsonl, self.show_trace = jsonl, show_trace
        self.inputs: dict[int, str] = {}            # the lines --jsonl echoes, until printed
        self.ready: dict[int, object] = {}
        self.traces: dict[int, str] = {}            # a thinking model's traces, until printed
        self.logprobs: dict[int, list[dict]] = {}   # --logprobs' records, until printed
        self.next = self.count = self.failed = 0    # printed, finished, failed
        self.closed = 0             # answers the budget closed early (engine/closing.py)

    def read(self, index: int, line: str) -> None:
        if self.jsonl:
            self.inputs[index] = line

    def trace(self, index: int, trace: str | None) -> None:
        """A thinking model's trace of a line about to finish (None: the model writes none)."""
        if trace is not None:
            self.traces[index] = trace

    def finished(self, job) -> None:
        self.ready[job.index] = job
        self.count += 1
        self.failed += job.error is not None
        self.closed += job.error is None and job.stats.closed_at >= 0
        while self.next in self.ready:
            self._print(self.ready.pop(self.next))
            self.next += 1
        sys.stdout.flush()

    def _print(self, job) -> None:
        trace = self.traces.pop(job.index, None)
        logprobs = self.logprobs.pop(job.index, None)
        if self.jsonl:
            record = {"input": self.inputs.pop(job.index)}
            record |= {"error": job.error} if job.error else \
                {"answer": job.text, "finish_reason": job.stats.finish_reason}
            if not job.error and job.stats.closed_at >= 0:     # as run --json says it
                record |= {"closed_early": True, "closed_tokens": job.stats.closed_tokens}
            if trace is not None:           # a thinking model's: beside the answer, as run --json
                record["reasoning"] = trace
            if not job.error and logprobs is not None:      # every token's, as run --json
                record["logprobs"] = logprobs
            if getattr(job, "reused", False):      # an earlier line's answer (pipeline/reuse.py)
                record["reused"] = True
            if not job.error:                      # through a router: which model answered
                record |= getattr(job, "routed", {})
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
            return
        if trace and self.show_trace:
            _show_trace(job.index, trace)
        if job.error:
            console.warn(f"line {job.index + 1}: {job.error}")
            sys.stdout.write("\n")          # its place kept: line N of the output is line N's
            return
        sys.stdout.write(job.text.strip().replace("\\", "\\\\").replace("\n", "\\n") + "\n")


def _show_trace(index: int, trace: str) -> None:
    """A line's trace on stderr (--show-thinking), headed by its line, before its answer prints;
    dimmed on a terminal."""
    import os
    dim = console.interactive(sys.stderr) and not os.environ.get("NO_COLOR")
    body = f"\x1b[2m{trace}\x1b[0m" if dim else trace
    sys.stderr.write(f"line {index + 1}, thinking:\n{body}\n\n")
    sys.stderr.flush()
