"""`embed`: one embedding per line of stdin, one JSON line each on stdout, in input order."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Optional

import typer

from localinfer.cli import console, shell
from localinfer.cli.options import (rpc_option, CONTEXT, backend_option, check_backend, ctx_option,
                                    engine_log, fit_options, gpu_layers_option, memory_option,
                                    model_argument, offline_option, quant_option, reporter,
                                    threads_option, verbose_option)
from localinfer.errors import UsageError
from localinfer.units import counted

DEFAULT_CTX, DEFAULT_BATCH, MAX_BATCH = 512, 32, 256   # pipeline/embed.py's, without importing it


def register(app: typer.Typer) -> None:
    app.command("embed")(embed_lines)


def embed_lines(
    model: str = model_argument(),
    batch: int = typer.Option(DEFAULT_BATCH, "--batch", "-b", min=1, max=MAX_BATCH, metavar="N",
                              rich_help_panel=CONTEXT, help="Lines embedded together."),
    ctx: int = ctx_option(DEFAULT_CTX, 8, f"The longest line, in tokens; 0 = {DEFAULT_CTX}."),
    truncate: bool = typer.Option(False, "--truncate", rich_help_panel=CONTEXT,
                                  help="Cut a line longer than --ctx to it (default: refuse "
                                  "it)."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
    verbose: int = verbose_option("-v: lines, tokens and lines/s on stderr; -vv: the engine's "
                                  "log too."),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    rpc: Optional[str] = rpc_option(),
    offline: bool = offline_option(),
) -> None:
    """Embed each line of stdin: one JSON object per line on stdout, in input order,
    {"index": N, "embedding": [...]} (N counts lines from 0; the vector has unit length).

    \b
    cat sentences.txt | localinfer embed smollm2 > vectors.jsonl
    """
    from localinfer.pipeline import embed, load
    check_backend(backend)
    reads = shell.stdin_lines()
    if reads is None:
        raise UsageError("embed reads its lines from stdin: pipe them in (`... | localinfer "
                         "embed MODEL`)")
    first = next(reads, [])       # a first line that is not text is refused before the model loads
    if not first:
        return
    fit, report = fit_options(quant=quant, ctx=ctx, memory=memory_, gpu_layers=gpu_layers,
                              offline=offline), reporter()
    embedder = embed.open_embedder(load.name(model, fit, report), fit, report, batch=batch,
                                   threads=threads, engine_log=engine_log(verbose),
                                   backend=backend)
    started, done, tokens = time.perf_counter(), 0, 0
    try:
        for lines in _groups(first, reads, 4 * batch):
            inputs, error = [], None
            for line in lines:
                try:
                    inputs.append(embed.input_tokens(embedder, line, truncate=truncate,
                                                     label=f"line {done + len(inputs) + 1}"))
                except UsageError as e:      # the lines before it are written first
                    error = e
                    break
            _write(done, embed.vectors_of(embedder, inputs) if inputs else [])
            done, tokens = done + len(inputs), tokens + sum(map(len, inputs))
            if error:
                raise error
    finally:
        embedder.close()
        if verbose:
            seconds = time.perf_counter() - started
            console.note(f"{counted(done, 'line')}, {counted(tokens, 'token')} in {seconds:.2f} s"
                         f" ({done / seconds if seconds else 0:.1f} lines/s); "
                         f"{embedder.dimensions} dimensions, {embedder.pooling} pooling")


def _groups(first: list[str], reads: Iterator[list[str]], size: int) -> Iterator[list[str]]:
    """The lines as they come, in groups of at most `size`: what one read brought is embedded
    without waiting for the next, and a bad line is raised after the lines before it."""
    pending = list(first)
    while True:
        while len(pending) >= size:
            yield pending[:size]
            del pending[:size]
        try:
            more = next(reads, None)
        except UsageError:
            if pending:
                yield pending
            raise
        if more is None:
            if pending:
                yield pending
            return
        pending += more


def _write(start: int, vectors) -> None:
    out = sys.stdout
    for i, vector in enumerate(vectors.tolist() if len(vectors) else []):
        out.write(json.dumps({"index": start + i, "embedding": vector}) + "\n")
    out.flush()
