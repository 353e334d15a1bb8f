"""`localinfer cache ls|stats|clear`: look at and empty the persistent prompt cache."""

from __future__ import annotations

import json
import time

import typer

from localinfer import settings
from localinfer.cli import console
from localinfer.units import counted, human_size

# prompt_cache (and its numpy) is imported by each command: this module is loaded for every
# `localinfer` invocation, because the main app registers it as a sub-command.

app = typer.Typer(help="The prompt cache: KV states of earlier prompts, reused automatically.\n\n"
                  "\b\nlocalinfer cache stats\nlocalinfer cache ls --json\nlocalinfer cache clear",
                  no_args_is_help=True)


@app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Entries, most recently used first."""
    from localinfer.cache import prompt_cache
    heads = prompt_cache.entries(settings.load().prompt_cache_dir)
    if as_json:
        rows = [{"model": h.label, "tokens": len(h.tokens), "bytes": h.size,
                 "last_used": h.last_used, "path": str(h.path)} for h in heads]
        typer.echo(json.dumps(rows, indent=2))
        return
    if not heads:
        console.note("the prompt cache is empty")
        return
    console.print_table(["MODEL", "TOKENS", "SIZE", "LAST USED", "ENTRY"],
                        [[h.label, str(len(h.tokens)), human_size(h.size), _ago(h.last_used),
                          h.path.stem[:12]] for h in heads])


@app.command()
def stats(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Entries, bytes used and the cap."""
    from localinfer.cache import prompt_cache
    conf = settings.load()
    use = prompt_cache.usage(conf.prompt_cache_dir)
    cap = conf.prompt_cache_bytes
    cap = prompt_cache.DEFAULT_CAP_BYTES if cap is None else cap
    record = {"entries": use.entries, "bytes": use.bytes, "tokens": use.tokens, "cap_bytes": cap,
              "path": str(conf.prompt_cache_dir)}
    if as_json:
        typer.echo(json.dumps(record))
        return
    typer.echo(f"{counted(use.entries, 'entry', 'entries')} · {counted(use.tokens, 'token')} · {human_size(use.bytes)} "
               f"of {human_size(cap)} · {conf.prompt_cache_dir}")


@app.command()
def clear() -> None:
    """Delete every entry."""
    from localinfer.cache import prompt_cache
    gone = prompt_cache.clear(settings.load().prompt_cache_dir)
    console.note(f"removed {counted(gone.entries, 'entry', 'entries')} ({human_size(gone.bytes)})")


def _ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"
