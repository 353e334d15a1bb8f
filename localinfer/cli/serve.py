"""`serve`: the model behind an OpenAI-compatible HTTP API, requests batched continuously."""

from __future__ import annotations

import os
import signal
from typing import Optional

import typer

from localinfer.cli import console
from localinfer.cli.options import (ctx_option, memory_option, offline_option, quant_option,
                                    threads_option)
from localinfer.errors import UsageError

DEFAULT_MODEL = "smollm2"
KEY_ENV = "LOCALINFER_API_KEY"


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalogue name or alias[:QUANT], or a .gguf path."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; any other than "
                             "loopback needs --api-key."),
    port: int = typer.Option(8080, "--port", min=1, max=65535),
    parallel: int = typer.Option(4, "--parallel", "-P", min=1, max=63,
                                 help="Requests decoded together."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=f"Bearer token every endpoint "
                                          f"but /health requires (or {KEY_ENV})."),
    cors: Optional[str] = typer.Option(None, "--cors", help="Origin allowed by CORS headers."),
    allowed_hosts: list[str] = typer.Option([], "--allowed-hosts", help="Host names answered "
                                            "besides the loopback names and --host "
                                            "(comma-separated or repeated; * for any)."),
    request_timeout: float = typer.Option(30.0, "--request-timeout", min=0.1, max=3600,
                                          help="Seconds a client has to send a request's "
                                          "headers, and again its body."),
    queue: int = typer.Option(64, "--queue", min=0, help="Requests that may wait for a free "
                              "slot; beyond them, 429."),
    ctx: int = ctx_option(0, 0, "Context the requests share, one of them may use it all; 0 = "
                          "the model's trained context, as far as the memory budget allows."),
    threads: int = threads_option(),
    offline: bool = offline_option("Never download; fail if not on disk."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Do not restore prompts from the "
                                  "prompt cache."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
) -> None:
    """Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models)."""
    from localinfer.server import guard
    key = api_key or os.environ.get(KEY_ENV) or None
    if not guard.is_loopback(host) and not key:
        raise UsageError(f"listening on {host} needs --api-key (or {KEY_ENV}): anyone who can "
                         "reach it could use the model")
    import uvicorn

    from localinfer.cache import prompt_cache
    from localinfer.cli.batch import open_batch
    from localinfer.server.api import Served, make_app
    from localinfer.server.worker import Worker
    hosts = guard.allowed_hosts(host, allowed_hosts)
    ref, batch = open_batch(model, parallel=parallel, ctx=ctx, quant=quant, memory_=memory_,
                            threads=threads, offline=offline, shared=True)
    worker = Worker(batch, parallel + queue,
                    prompt_cache.open_for(batch.session, enabled=not no_cache), batch.n_ctx)
    names = tuple(dict.fromkeys([ref.display, model, *(_aliases(ref))]))
    served = Served(worker, batch.session, names, batch.n_ctx, key, hosts, port, console.error,
                    request_timeout)
    console.note(f"serving {names[0]} on http://{host}:{port}/v1 ({parallel} at a time, "
                 f"{batch.n_ctx:,} tokens of context between them)")
    # uvicorn stops on SIGINT/SIGTERM gracefully (no new connections, streams given 10 s), then
    # raises the signal again for the handler it found; a stop asked for is a normal end: exit 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(make_app(served, cors), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=10, http=guard.protocol(request_timeout))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        worker.stop()
        batch.close()


def _aliases(ref) -> list[str]:
    spec = getattr(ref, "spec", None)
    return [spec.name, *getattr(spec, "aliases", ())] if spec else []
