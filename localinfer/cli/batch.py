"""`map`: one prompt per line of stdin, answered together by the continuous-batching scheduler."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from localinfer.cli import console, shell
from localinfer.cli.options import (ctx_option, fit_model, memory_option, offline_option,
                                    quant_option, threads_option)
from localinfer.errors import EXIT_RUNTIME, UsageError

PLACEHOLDER = "{}"


def register(app: typer.Typer) -> None:
    app.command("map")(map_lines)


def map_lines(
    model: str = typer.Argument(..., help="Catalogue name or alias[:QUANT], or a path to a .gguf file."),
    template: str = typer.Argument(..., help="The prompt for each line; {} is the line."),
    parallel: int = typer.Option(4, "--parallel", "-P", min=1, max=63,
                                 help="Prompts decoded together."),
    as_jsonl: bool = typer.Option(False, "--jsonl", help="One JSON object per line: input, "
                                  "answer, finish reason (or error)."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message for chat models."),
    raw: bool = typer.Option(False, "--raw", help="Send each prompt as is, without the chat template."),
    temp: float = typer.Option(0.8, "--temp", min=0.0, help="Temperature; 0 is greedy."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the first line's sampler "
                                       "(the next lines count up from it)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens an answer takes."),
    stop: list[str] = typer.Option([], "--stop", help="Stop at this string (repeatable)."),
    ctx: int = ctx_option(2048, 64, "Context of each prompt and its answer."),
    threads: int = threads_option(),
    offline: bool = offline_option("Never download; fail if not on disk."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Do not restore prompts from the "
                                  "prompt cache."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="Each answer is one "
                                              "JSON document valid against this schema (a file "
                                              "or inline JSON)."),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="Each answer follows this "
                                          "GBNF grammar file."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
) -> None:
    """Answer one prompt per line of stdin; the answers on stdout, one per line, in input order."""
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams
    from localinfer.engine.structured import from_options
    if PLACEHOLDER not in template:
        raise UsageError(f"the template has no {PLACEHOLDER} for the line")
    params = SamplingParams(temperature=temp, seed=seed)     # refused before anything loads
    output = from_options(json_schema, grammar)
    lines = _input_lines()
    _, batch = open_batch(model, parallel=parallel, ctx=ctx, quant=quant, memory_=memory_,
                          threads=threads, offline=offline)
    try:
        failed = _answer(batch, lines, template, params, Limits(max_tokens, tuple(stop)),
                         system=system, raw=raw, jsonl=as_jsonl, use_cache=not no_cache,
                         gbnf=output.gbnf if output else None)
    finally:
        batch.close()
    if failed:
        console.warn(f"{failed} of {len(lines)} lines failed")
        raise typer.Exit(EXIT_RUNTIME)


def _input_lines() -> list[str]:
    text = shell.read_stdin()
    if text is None:
        raise UsageError("map reads its lines from stdin: pipe them in (`... | localinfer map "
                         "MODEL \"...{}...\"`)")
    return text.splitlines()


def open_batch(model: str, *, parallel: int, ctx: int, quant: str, memory_: str | None,
               threads: int, offline: bool):
    """(the model reference, a SequenceBatch of `parallel` requests of `ctx` tokens each, plus the
    shared prefix's sequence), fitted to the memory budget as `run` fits: map's and serve's."""
    from localinfer.backends.llama_batched import SequenceBatch
    from localinfer.models import refs
    ref, options, _ = fit_model(model, quant=quant, ctx=ctx * parallel, kv_type=None,
                                memory_budget=memory_, threads=threads, verbose=False,
                                offline=offline)
    path = refs.locate(ref, refs.model_store(), offline=offline, progress=console.interactive(),
                       notify=console.note)
    return ref, SequenceBatch(path, options, parallel + 1)


def _answer(batch, lines, template, params, limits, *, system, raw, jsonl, use_cache,
            gbnf) -> int:
    """Run every line through the scheduler, printing answers in input order; the failures."""
    from localinfer.cache import prompt_cache
    from localinfer.engine.scheduler import Scheduler
    jobs = _jobs(batch.session, lines, template, params, limits, system=system, raw=raw,
                 gbnf=gbnf)
    printer = _InOrder(lines, jsonl)
    prefix = _shared_prefix([j.prompt for j in jobs])
    with console.progress_bar("answering") as progress:
        def done(job) -> None:
            printer.finished(job)
            job.sampler = None          # its grammar, if any, is freed with it
            if progress:
                progress(printer.count, len(jobs), "")
        store = prompt_cache.open_for(batch.session, enabled=use_cache)
        Scheduler(batch, prefix=prefix, store=store).run(jobs, done)
    return printer.failed


def _jobs(session, lines, template, params, limits, *, system, raw, gbnf):
    from dataclasses import replace

    from localinfer.engine.prompt import PromptText, prompt_tokens
    from localinfer.engine.sampling import make_sampler
    from localinfer.engine.scheduler import Job
    jobs = []
    for i, line in enumerate(lines):
        seeded = params if params.seed in (None, -1) else replace(params, seed=params.seed + i)
        text = template.replace(PLACEHOLDER, line)
        sampler = _constrained(seeded, session, gbnf) if gbnf else make_sampler(seeded)
        jobs.append(Job(prompt_tokens(session, PromptText(text, 0, system, raw)), sampler,
                        limits, index=i))
    return jobs


def _constrained(params, session, gbnf: str):
    """A constrained sampler whose grammar is made when its line's answer starts (and dropped
    when it ends): a grammar's parse state for every line of a long input at once is memory."""
    from localinfer.engine.constrain import ConstrainedSampler
    made = []

    def sample(logits, history) -> int:
        if not made:
            made.append(ConstrainedSampler(params, session.grammar(gbnf)))
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
    """Prints each answer once every line before it is printed: input order, as they finish."""

    def __init__(self, lines: list[str], jsonl: bool) -> None:
        self.lines, self.jsonl = lines, jsonl
        self.ready: dict[int, object] = {}
        self.next = self.count = self.failed = 0

    def finished(self, job) -> None:
        self.ready[job.index] = job
        self.count += 1
        self.failed += job.error is not None
        while self.next in self.ready:
            self._print(self.ready.pop(self.next))
            self.next += 1
        sys.stdout.flush()

    def _print(self, job) -> None:
        line = self.lines[job.index]
        if self.jsonl:
            record = {"input": line}
            record |= {"error": job.error} if job.error else \
                {"answer": job.text, "finish_reason": job.stats.finish_reason}
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
            return
        if job.error:
            console.warn(f"line {job.index + 1}: {job.error}")
            sys.stdout.write("\n")          # its place kept: line N of the output is line N's
            return
        sys.stdout.write(job.text.strip().replace("\\", "\\\\").replace("\n", "\\n") + "\n")
