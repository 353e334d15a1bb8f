"""`localinfer cache ls|stats|clear`: look at the persistent prompt cache and the answer store, and
measure and empty every cache the tool writes (cache/kinds.py)."""

from __future__ import annotations

import json

import typer

from localinfer import settings
from localinfer.cli import console
from localinfer.errors import UsageError
from localinfer.units import ago, counted, human_size

# prompt_cache (and its numpy) is imported by each command: this module is loaded for every
# `localinfer` invocation, because the main app registers it as a sub-command.

app = typer.Typer(help="The caches: the prompt cache (KV states of earlier prompts, reused "
                  "automatically), the answer store (--reuse-answers), the batching check's verdicts, frontier's files, MLX and ONNX "
                  "conversions.\n\n\b\nlocalinfer cache stats\nlocalinfer cache ls --json\n"
                  "localinfer cache clear", no_args_is_help=True)


@app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Entries of the prompt cache (tokens: the prompt's) and of the answer store (tokens: the
    answer's), most recently used first."""
    from localinfer.cache import answers, prompt_cache
    heads = sorted([("prompts", h) for h in prompt_cache.entries(settings.load().prompt_cache_dir)]
                   + [("answers", h) for h in answers.entries()],
                   key=lambda kind_head: kind_head[1].last_used, reverse=True)
    if as_json:
        rows = [{"cache": kind, "model": h.label, "tokens": len(h.tokens), "bytes": h.size,
                 "last_used": h.last_used, "path": str(h.path)} for kind, h in heads]
        typer.echo(json.dumps(rows, indent=2))
        return
    if not heads:
        console.note("the prompt cache and the answer store are empty")
        return
    console.print_table(["CACHE", "MODEL", "TOKENS", "SIZE", "LAST USED", "ENTRY"],
                        [[kind, h.label, str(len(h.tokens)), human_size(h.size), ago(h.last_used),
                          h.path.stem[:12]] for kind, h in heads])


@app.command()
def stats(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The prompt cache's entries, bytes and cap, then every other cache's files and bytes."""
    from localinfer.cache import kinds, prompt_cache
    conf = settings.load()
    use = prompt_cache.usage(conf.prompt_cache_dir)
    cap = conf.prompt_cache_bytes
    cap = prompt_cache.DEFAULT_CAP_BYTES if cap is None else cap
    others = [kinds.usage(kind) for kind in kinds.kinds(conf) if kind.name != kinds.PROMPTS]
    total = use.bytes + sum(u.bytes for u in others)
    record = {"entries": use.entries, "bytes": use.bytes, "tokens": use.tokens, "cap_bytes": cap,
              "path": str(conf.prompt_cache_dir), "total_bytes": total,
              "caches": [{"name": u.kind.name, "what": u.kind.what, "files": u.files,
                          "bytes": u.bytes, "paths": [str(p) for p in u.kind.paths]}
                         for u in others]}
    if as_json:
        typer.echo(json.dumps(record))
        return
    typer.echo(f"{counted(use.entries, 'entry', 'entries')} · {counted(use.tokens, 'token')} · {human_size(use.bytes)} "
               f"of {human_size(cap)} · {conf.prompt_cache_dir}")
    for u in others:
        where = str(u.kind.paths[0]) if len(u.kind.paths) == 1 else str(conf.cache_dir)
        unit = ("entry", "entries") if u.kind.name in kinds.ENTRIES else ("file",)
        typer.echo(f"{u.kind.name}: {counted(u.files, *unit)} · {human_size(u.bytes)} · "
                   f"{u.kind.what} · {where}")
    typer.echo(f"in all: {human_size(total)} (`localinfer cache clear` empties every cache)")


@app.command()
def clear(names: list[str] = typer.Argument(None, metavar="[CACHE]...", show_default=False,
                                            help="prompts, answers, batching, frontier, "
                                            "projectors, mlx, onnx, other "
                                            "(default: all).")) -> None:
    """Empty every cache the tool writes, or the ones named."""
    from localinfer.cache import kinds
    every = kinds.kinds(settings.load())
    known = [kind.name for kind in every]
    unknown = [name for name in names or () if name not in known]
    if unknown:
        raise UsageError(f"no cache named {console.clean(unknown[0])!r}; the caches are "
                         f"{', '.join(known)}")
    gone = [kinds.clear(kind) for kind in every if not names or kind.name in names]
    for u in gone:
        if u.files:
            unit = ("entry", "entries") if u.kind.name in kinds.ENTRIES else ("file", "files")
            console.note(f"{u.kind.name}: removed {counted(u.files, *unit)} "
                         f"({human_size(u.bytes)})")
    if not any(u.files for u in gone):
        console.note("nothing to remove: the caches were empty")


