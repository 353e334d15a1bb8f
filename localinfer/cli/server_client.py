"""`ps` and `stop`: what a running `localinfer serve` has loaded, and unloading one model.

They speak the server's Ollama endpoints, as `ollama ps` and `ollama stop` do: GET /api/ps, and
POST /api/generate with no prompt and keep_alive 0 (the model is unloaded once the requests that
hold it are done). Any server that speaks that API answers them, an Ollama too.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

import typer

from localinfer.cli import console, http_client
from localinfer.errors import LocalinferError, UsageError
from localinfer.units import human_size

# A server busy loading a model still answers /api/ps and a stop at once; a list of the models
# loaded is a few hundred bytes a model.
LIMITS = http_client.Limits(wait_s=30.0, reply_s=30.0, max_bytes=4 << 20)
MAX_COUNT = 1 << 62         # a size or a context length no machine has: the reply is not /api/ps


def register(app: typer.Typer) -> None:
    app.command()(ps)
    app.command()(stop)


def _url_option():
    return typer.Option(None, "--url", metavar="URL", help="The server's address (default: "
                        "http://127.0.0.1:PORT).")


def _port_option():
    return typer.Option(8080, "--port", min=1, max=65535, metavar="PORT",
                        help="The port of a server on this machine (1-65535).")


def ps(url: Optional[str] = _url_option(), port: int = _port_option()) -> None:
    """The models a running server holds: name, memory, where they run, context, until when.

    \b
    localinfer ps
    localinfer ps --url http://gpu-box:8080
    """
    models = _loaded(_base(url, port))
    rows = [[m["name"], human_size(m.get("size") or 0), _processor(m),
             f"{m['context_length']:,}" if m.get("context_length") is not None else "",
             _until(m.get("expires_at"))] for m in models]
    if not rows:
        console.note("no models loaded")
        return
    console.print_table(["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"], rows)


def stop(model: str = typer.Argument(..., metavar="MODEL", show_default=False,
                                     help="The model, by any name a request may use."),
         url: Optional[str] = _url_option(), port: int = _port_option()) -> None:
    """Unload a model from a running server (once the requests using it are done).

    \b
    localinfer stop smollm2-135m-instruct:Q4_1
    """
    base = _base(url, port)
    loaded = [m["name"] for m in _loaded(base)]
    listed = model in loaded or f"{model}:latest" in loaded
    answer = _call(base, "/api/generate", {"model": model, "keep_alive": 0})
    # Another name of a loaded model (an alias, the name without its quant): a localinfer server
    # resolves it as a request's and says whether it unloaded something; an Ollama says nothing.
    if not listed and answer.get("unloaded") is not True:
        shown = ", ".join(console.clean(name) for name in loaded)     # the server's own names
        raise UsageError(f"{console.clean(model)} is not loaded on {base}; loaded: "
                         f"{shown or 'none'}")


def _base(url: str | None, port: int) -> str:
    return server_url(url or f"http://127.0.0.1:{port}", "--url")


def server_url(url: str, option: str) -> str:
    """A server's address as an option gives it (no trailing slash), refused in one line unless
    it is http:// or https:// with a host (`map --server` takes it the same way)."""
    from urllib.parse import urlsplit
    base = url.rstrip("/")
    try:
        host = urlsplit(base).hostname
    except ValueError:          # a malformed port or IPv6 bracket
        host = None
    if not base.startswith(("http://", "https://")) or not host or len(base) > 2000:
        raise UsageError(f"{option} must be an http:// or https:// address with a host, not "
                         f"{url[:100]!r}")
    return base


def _call(base: str, path: str, body: dict | None = None) -> dict:
    """One request to the server; its JSON object. Any failure is one LocalinferError line."""
    reply = http_client.exchange(base, path, body, limits=LIMITS)
    if not 200 <= reply.status < 300:
        raise LocalinferError(f"{base}{path}: {reply.status} {reply.error()[0]}")
    try:
        answer = reply.json()
    except ValueError:
        raise LocalinferError(f"{base}{path} did not answer with JSON: is it a localinfer or "
                              "Ollama server?") from None
    if not isinstance(answer, dict):
        raise LocalinferError(f"{base}{path} answered with something else than a JSON object: "
                              "is it a localinfer or Ollama server?")
    return answer


def _loaded(base: str) -> list[dict]:
    """/api/ps's models, each checked to hold what ps shows of it as Ollama's API has it."""
    models = _call(base, "/api/ps").get("models")
    if not isinstance(models, list) or not all(map(_is_model, models)):
        raise LocalinferError(f"{base}/api/ps answered with something else than a list of "
                              "models: is it a localinfer or Ollama server?")
    return models


def _is_model(model: object) -> bool:
    def count(key: str) -> bool:
        value = model.get(key)
        return value is None or (type(value) is int and 0 <= value < MAX_COUNT)
    return (isinstance(model, dict) and isinstance(model.get("name"), str)
            and all(map(count, ("size", "size_vram", "context_length")))
            and isinstance(model.get("expires_at") or "", str))


def _processor(model: dict) -> str:
    """As `ollama ps` says it: 100% CPU, 100% GPU, or the split."""
    from localinfer.server.pool_state import Need, processor
    size, vram = model.get("size") or 0, model.get("size_vram") or 0
    return processor(Need(max(size - vram, 0), vram)) if size else "100% CPU"


def _until(expires_at: object) -> str:
    if not isinstance(expires_at, str):
        return ""
    try:
        when = datetime.strptime(expires_at[:19], "%Y-%m-%dT%H:%M:%S").replace(
            tzinfo=timezone.utc)
    except ValueError:
        return expires_at[:40]
    seconds = (when - datetime.now(timezone.utc)).total_seconds()
    if seconds > 100 * 365 * 86400:
        return "Forever"
    if seconds <= 0:
        return "now"
    return f"{_span(seconds)} from now"


def _span(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} hour{'s' if hours > 1 else ''}" + (f" {minutes} min" if minutes else "")
    return f"{minutes} minute{'s' if minutes != 1 else ''}" if minutes else f"{secs} seconds"
