"""`serve`: the model behind an OpenAI-compatible HTTP API, requests batched continuously.

Speculative decoding (`run --draft`) is not offered: the scheduler decodes many sequences in one
batch and verifies no drafts (engine/scheduler.py says why), so a --draft here would be a promise
the server does not keep.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import typer

from localinfer.cli import console
from localinfer.cli.options import (CONTEXT, SERVER, backend_option, cpu_moe_option, ctx_option,
                                    engine_log, fit_options,
                                    gpu_layers_option, kv_type_option, memory_option,
                                    min_p_option, offline_option, quant_option,
                                    no_think_option, repeat_penalty_option, reporter,
                                    seed_option, system_option, temp_option,
                                    think_budget_option, think_option, think_settings,
                                    threads_option, top_k_option, top_p_option, verbose_option)
from localinfer.errors import UsageError

if TYPE_CHECKING:
    from localinfer.fit.options import FitOptions
    from localinfer.server.requests import Defaults
    from localinfer.thinking.style import Think

DEFAULT_MODEL = "smollm2"
KEY_ENV = "LOCALINFER_API_KEY"


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    model: str = typer.Argument(DEFAULT_MODEL, metavar="MODEL", help="Catalogue name or "
                                "alias[:QUANT], hf:OWNER/REPO[:QUANT], or a .gguf path."),
    system: Optional[str] = system_option("System message for chat requests that have none."),
    host: str = typer.Option("127.0.0.1", "--host", metavar="HOST", rich_help_panel=SERVER,
                             help="Address to listen on; any other than loopback needs --api-key."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, metavar="PORT",
                             rich_help_panel=SERVER, help="Port to listen on (1-65535)."),
    parallel: int = typer.Option(4, "--parallel", "-P", min=1, max=63, metavar="N",
                                 rich_help_panel=SERVER, help="Requests decoded together (1-63)."),
    queue: int = typer.Option(64, "--queue", min=0, metavar="N", rich_help_panel=SERVER,
                              help="Requests that may wait for a free slot; beyond them, 429."),
    api_key: Optional[str] = typer.Option(None, "--api-key", metavar="KEY", rich_help_panel=SERVER,
                                          help=f"Bearer token every endpoint but /health "
                                          f"requires (or {KEY_ENV})."),
    cors: Optional[str] = typer.Option(None, "--cors", metavar="ORIGIN", rich_help_panel=SERVER,
                                       help="Origin allowed by CORS headers."),
    allowed_hosts: list[str] = typer.Option([], "--allowed-hosts", metavar="NAMES",
                                            rich_help_panel=SERVER, help="Host names answered "
                                            "besides the loopback names and --host "
                                            "(comma-separated or repeated; * for any)."),
    request_timeout: float = typer.Option(30.0, "--request-timeout", min=0.1, max=3600,
                                          metavar="SECONDS", rich_help_panel=SERVER,
                                          help="Seconds a client has to send a request's "
                                          "headers, and again its body (0.1-3600)."),
    temp: float = temp_option(),
    top_k: int = top_k_option(),
    top_p: float = top_p_option(),
    min_p: float = min_p_option(),
    repeat_penalty: float = repeat_penalty_option(),
    seed: Optional[int] = seed_option("Seed of every request that sets none (the same request "
                                      "then gets the same answer); -1 or none: a new draw each "
                                      "request."),
    think: Optional[str] = think_option(),
    no_think: bool = no_think_option(),
    think_budget: Optional[int] = think_budget_option(),
    ctx: int = ctx_option(0, 0, "Context the requests share, one of them may use it all; 0 = "
                          "the model's trained context, as far as the memory budget allows."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
    kv_type: Optional[str] = kv_type_option(),
    no_cache: bool = typer.Option(False, "--no-cache", rich_help_panel=CONTEXT,
                                  help="Do not restore prompts from the prompt cache."),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    cpu_moe: str = cpu_moe_option(),
    offline: bool = offline_option(),
    verbose: int = verbose_option("-v: one line per request on stderr (method, path, status, "
                                  "model, tokens, seconds); -vv: the engine's log too."),
) -> None:
    """Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models,
    /v1/embeddings), Anthropic's /v1/messages and Ollama's API (/api/chat, /api/generate,
    /api/tags, /api/show, /api/ps, /api/embed).

    The sampling, --system and thinking options are the defaults of requests that set none.

    A thinking model's trace comes back as reasoning_content (and reasoning), apart from content.

    \b
    Examples:
      localinfer serve smollm2 --parallel 4 -v
      localinfer serve qwen2.5-1.5b --host 0.0.0.0 --api-key "$KEY" --temp 0.2
      (then any OpenAI client, base_url http://127.0.0.1:8080/v1)
      localinfer serve smollm2 --port 11434    (Ollama's port, for its clients)
    """
    from localinfer.server import guard
    key = api_key or os.environ.get(KEY_ENV) or None
    if not guard.is_loopback(host) and not key:
        raise UsageError(f"listening on {host} needs --api-key (or {KEY_ENV}): anyone who can "
                         "reach it could use the model")
    # refused before loading
    defaults = _defaults(temp, top_k, top_p, min_p, repeat_penalty, seed, system,
                         think_settings(think, no_think, think_budget))
    from localinfer.server import listen
    sock = listen.bind(host, port)      # a port in use is one line now, not after the load
    try:
        _serve(sock, model, host=host, port=port, parallel=parallel, queue=queue, key=key,
               cors=cors, hosts=guard.allowed_hosts(host, allowed_hosts),
               request_timeout=request_timeout, verbose=verbose,
               defaults=defaults,
               fit=fit_options(quant=quant, ctx=ctx, kv_type=kv_type, memory=memory_,
                               gpu_layers=gpu_layers, offline=offline, cpu_moe=cpu_moe),
               load=dict(threads=threads, engine_log=engine_log(verbose), backend=backend),
               use_cache=not no_cache)
    finally:
        sock.close()


def _serve(sock, model: str, *, host: str, port: int, parallel: int, queue: int, key, cors,
           hosts, request_timeout: float, defaults: Defaults, verbose: int, fit: FitOptions,
           load: dict, use_cache: bool) -> None:
    """Load the model, then answer requests on `sock` until a stop is asked for."""
    from localinfer.cache import prompt_cache
    from localinfer.pipeline import load as pipeline
    from localinfer.engine.prompt import uses_chat_template
    from localinfer.server import guard, listen
    from localinfer.server.api import Served, make_app
    from localinfer.server.embedder import Embeddings, pinned
    from localinfer.server.loading import need_of
    from localinfer.server.worker import Worker
    report = reporter()
    named = pipeline.name(model, fit, report)
    fitted = pipeline.fit_batch(named, fit, report, parallel=parallel, shared=True, **load)
    ref, batch = fitted.ref, fitted.load()
    # opened on the first embeddings request, as `localinfer embed` opens it (--ctx 0: its default)
    embeddings = Embeddings(pinned(named, ref), replace(fit, ctx=0), log=console.error, **load)
    try:
        if defaults.system is not None and not uses_chat_template(batch.session, False):
            console.warn("this model has no chat template; --system is ignored")
        worker = Worker(batch, parallel + queue,
                        prompt_cache.open_for(batch.session, enabled=use_cache), batch.n_ctx)
        names = tuple(dict.fromkeys([ref.display, model, *(_aliases(ref))]))
        served = Served(worker, batch.session, names, batch.n_ctx, key, hosts, port,
                        console.error, request_timeout, defaults,
                        request_log=console.note if verbose else None, embeddings=embeddings,
                        need=need_of(fitted)[0], model_path=_model_path(ref))
        console.note(f"serving {names[0]} on http://{_url_host(host)}:{port}/v1 ({parallel} at "
                     f"a time, {batch.n_ctx:,} tokens of context between them)")
        try:
            listen.run(make_app(served, cors), sock, protocol=guard.protocol(request_timeout),
                       on_exit=served.close)
        finally:
            worker.stop()
            embeddings.close()
    finally:
        batch.close()


def _defaults(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
              seed: int | None, system: str | None, think: Think) -> Defaults:
    """What requests that do not say get: sampling, system message, thinking."""
    from localinfer.engine.sampling import SamplingParams
    from localinfer.server.requests import Defaults
    return Defaults(SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                   repeat_penalty=repeat_penalty, seed=seed), system, think)


def _model_path(ref):
    """The file loaded (on disk by now: nothing is pulled), for Ollama's /api/tags and /api/show."""
    from localinfer.models import refs
    return refs.locate(ref, refs.model_store(), offline=True, progress=False, notify=console.note)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _aliases(ref) -> list[str]:
    spec = getattr(ref, "spec", None)
    return [spec.name, *getattr(spec, "aliases", ())] if spec else []
