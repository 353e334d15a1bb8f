"""`serve`: the model behind an OpenAI-compatible HTTP API, requests batched continuously.

Speculative decoding (`run --draft`) is not offered: the scheduler decodes many sequences in one
batch and verifies no drafts (engine/scheduler.py says why), so a --draft here would be a promise
the server does not keep.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import typer

from localinfer.cli import console
from localinfer.cli.options import (BACKEND, CONTEXT, OUTPUT, SAMPLING, SERVER, ctx_option,
                                    engine_log, gpu_layers_option, kv_type_option, memory_option,
                                    offline_option, quant_option, threads_option, verbose_option)
from localinfer.errors import UsageError

if TYPE_CHECKING:
    from localinfer.engine.sampling import SamplingParams

DEFAULT_MODEL = "smollm2"
KEY_ENV = "LOCALINFER_API_KEY"


def register(app: typer.Typer) -> None:
    app.command()(serve)


def _in(panel: str, option, metavar: str | None = None):
    """A shared option (cli/options.py) shown in `panel` of --help, under `metavar` ("" for a
    flag that takes no value). Its range, if any, is checked by hand: Typer prints min and max
    as `N [0<=x<=16777216]` in --help."""
    option.rich_help_panel = panel
    if metavar is not None:
        option.metavar = metavar
    if option.min is not None or option.max is not None:
        low, high, name = option.min, option.max, option.param_decls[0]
        option.min = option.max = None
        option.callback = lambda value: _within(value, name, low, high)
    return option


def serve(
    model: str = typer.Argument(DEFAULT_MODEL, metavar="MODEL", help="Catalogue name or "
                                "alias[:QUANT], hf:OWNER/REPO[:QUANT], or a .gguf path."),
    system: Optional[str] = typer.Option(None, "--system", "-s", metavar="TEXT",
                                         help="System message for chat requests that have none."),
    host: str = typer.Option("127.0.0.1", "--host", metavar="HOST", rich_help_panel=SERVER,
                             help="Address to listen on; any other than loopback needs --api-key."),
    port: int = typer.Option(8080, "--port", metavar="PORT", callback=lambda v: _within(
        v, "--port", 1, 65535), rich_help_panel=SERVER, help="Port to listen on."),
    parallel: int = typer.Option(4, "--parallel", "-P", metavar="N", rich_help_panel=SERVER,
                                 callback=lambda v: _within(v, "--parallel", 1, 63),
                                 help="Requests decoded together (1 to 63)."),
    queue: int = typer.Option(64, "--queue", metavar="N", rich_help_panel=SERVER,
                              callback=lambda v: _within(v, "--queue", 0, None),
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
    request_timeout: float = typer.Option(30.0, "--request-timeout", metavar="SECONDS",
                                          rich_help_panel=SERVER, callback=lambda v: _within(
                                              v, "--request-timeout", 0.1, 3600),
                                          help="Seconds a client has to send a request's "
                                          "headers, and again its body (0.1 to 3600)."),
    temp: float = typer.Option(0.8, "--temp", metavar="FLOAT", rich_help_panel=SAMPLING,
                               help="Temperature; 0 is greedy. Like every sampling option, the "
                               "default for requests that do not set it."),
    top_k: int = typer.Option(40, "--top-k", metavar="N", rich_help_panel=SAMPLING,
                              help="Keep the k most likely tokens; 0 = off."),
    top_p: float = typer.Option(0.95, "--top-p", metavar="FLOAT", rich_help_panel=SAMPLING,
                                help="Nucleus mass, above 0 up to 1 (1 = off)."),
    min_p: float = typer.Option(0.05, "--min-p", metavar="FLOAT", rich_help_panel=SAMPLING,
                                help="Drop tokens below this fraction of the top probability."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", metavar="FLOAT",
                                         rich_help_panel=SAMPLING,
                                         help="Penalty for recently seen tokens; 1 = off."),
    seed: Optional[int] = typer.Option(None, "--seed", metavar="N", rich_help_panel=SAMPLING,
                                       help="Seed of every request that sets none (the same "
                                       "request then gets the same answer); -1 or none given: "
                                       "a new draw each request."),
    ctx: int = _in(CONTEXT, ctx_option(0, 0, "Context the requests share, one of them may use "
                                       "it all; 0 = the model's trained context, as far as the "
                                       "memory budget allows."), "N"),
    memory_: Optional[str] = _in(CONTEXT, memory_option(), "SIZE"),
    kv_type: Optional[str] = _in(CONTEXT, kv_type_option(), "TYPE"),
    no_cache: bool = typer.Option(False, "--no-cache", rich_help_panel=CONTEXT,
                                  help="Do not restore prompts from the prompt cache."),
    quant: str = _in(BACKEND, quant_option(), "QUANT"),
    threads: int = _in(BACKEND, threads_option(), "N"),
    gpu_layers: str = _in(BACKEND, gpu_layers_option(), "N"),
    offline: bool = _in(BACKEND, offline_option("Never download; fail if not on disk.")),
    verbose: int = _in(OUTPUT, verbose_option("-v: one line per request on stderr (method, path, "
                                              "status, model, tokens, seconds); -vv: the "
                                              "engine's log too."), ""),
) -> None:
    """Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models).

    \b
    Examples:
      localinfer serve smollm2 --parallel 4 -v
      localinfer serve qwen2.5-1.5b --host 0.0.0.0 --api-key "$KEY" --temp 0.2
      (then any OpenAI client, base_url http://127.0.0.1:8080/v1)
    """
    from localinfer.server import guard
    key = api_key or os.environ.get(KEY_ENV) or None
    if not guard.is_loopback(host) and not key:
        raise UsageError(f"listening on {host} needs --api-key (or {KEY_ENV}): anyone who can "
                         "reach it could use the model")
    params = _defaults(temp, top_k, top_p, min_p, repeat_penalty, seed)    # refused before loading
    from localinfer.server import listen
    sock = listen.bind(host, port)      # a port in use is one line now, not after the load
    try:
        _serve(sock, model, host=host, port=port, parallel=parallel, queue=queue, key=key,
               cors=cors, hosts=guard.allowed_hosts(host, allowed_hosts),
               request_timeout=request_timeout, params=params, system=system, verbose=verbose,
               load=dict(ctx=ctx, quant=quant, memory_=memory_, threads=threads, offline=offline,
                         kv_type=kv_type, gpu_layers=gpu_layers, verbose=engine_log(verbose)),
               use_cache=not no_cache)
    finally:
        sock.close()


def _serve(sock, model: str, *, host: str, port: int, parallel: int, queue: int, key, cors,
           hosts, request_timeout: float, params: SamplingParams, system: str | None,
           verbose: int, load: dict, use_cache: bool) -> None:
    """Load the model, then answer requests on `sock` until a stop is asked for."""
    from localinfer.cache import prompt_cache
    from localinfer.cli.batch import open_batch
    from localinfer.engine.prompt import uses_chat_template
    from localinfer.server import guard, listen
    from localinfer.server.api import Served, make_app
    from localinfer.server.requests import Defaults
    from localinfer.server.worker import Worker
    ref, batch = open_batch(model, parallel=parallel, shared=True, **load)
    try:
        if system is not None and not uses_chat_template(batch.session, False):
            console.warn("this model has no chat template; --system is ignored")
        worker = Worker(batch, parallel + queue,
                        prompt_cache.open_for(batch.session, enabled=use_cache), batch.n_ctx)
        names = tuple(dict.fromkeys([ref.display, model, *(_aliases(ref))]))
        served = Served(worker, batch.session, names, batch.n_ctx, key, hosts, port,
                        console.error, request_timeout, Defaults(params, system),
                        request_log=console.note if verbose else None)
        console.note(f"serving {names[0]} on http://{_url_host(host)}:{port}/v1 ({parallel} at "
                     f"a time, {batch.n_ctx:,} tokens of context between them)")
        try:
            listen.run(make_app(served, cors), sock, protocol=guard.protocol(request_timeout),
                       on_exit=served.close)
        finally:
            worker.stop()
    finally:
        batch.close()


def _defaults(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
              seed: int | None) -> SamplingParams:
    from localinfer.engine.sampling import SamplingParams
    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed)


def _within(value, name: str, low, high):
    """A range checked by hand: Typer's min/max would print `<integer range> [1<=x<=65535]`
    for a metavar in --help."""
    if (low is not None and value < low) or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"{low} or more"
        raise typer.BadParameter(f"must be {bound}, not {value}", param_hint=name)
    return value


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _aliases(ref) -> list[str]:
    spec = getattr(ref, "spec", None)
    return [spec.name, *getattr(spec, "aliases", ())] if spec else []
