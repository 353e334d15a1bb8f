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
from localinfer.cli.options import (rpc_option, CONTEXT, SERVER, backend_option, cpu_moe_option, ctx_option,
                                    engine_log, fit_options,
                                    gpu_layers_option, kv_type_option, memory_option,
                                    min_p_option, offline_option, quant_option,
                                    no_think_option, repeat_penalty_option, reporter,
                                    frequency_penalty_option, presence_penalty_option,
                                    logit_bias_option, penalties, seed_option, system_option,
                                    temp_option,
                                    think_budget_option, think_option, think_settings,
                                    threads_option, top_k_option, top_p_option, verbose_option)
from localinfer.cli.answers import reuse_answers_option
from localinfer.errors import UsageError

if TYPE_CHECKING:
    from localinfer.fit.options import FitOptions
    from localinfer.server.requests import Defaults
    from localinfer.thinking.style import Think

KEY_ENV = "LOCALINFER_API_KEY"


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    models: Optional[list[str]] = typer.Argument(
        None, metavar="[MODEL]...", show_default=False,
        help="Models loaded at start and kept loaded (catalogue name or alias[:QUANT], "
             "hf:OWNER/REPO[:QUANT], or a .gguf path); any other model on disk is loaded when "
             "a request names it."),
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
    frequency_penalty: float = frequency_penalty_option(),
    presence_penalty: float = presence_penalty_option(),
    logit_bias: list[str] = logit_bias_option(),
    seed: Optional[int] = seed_option("Seed of every request that sets none (the same request "
                                      "then gets the same answer); -1 or none: a new draw each "
                                      "request."),
    think: Optional[str] = think_option(),
    no_think: bool = no_think_option(),
    think_budget: Optional[int] = think_budget_option(),
    reuse_answers: bool = reuse_answers_option(),
    ctx: int = ctx_option(0, 0, "Context the requests share, one of them may use it all; 0 = "
                          "the model's trained context, as far as the memory budget allows."),
    rope_scaling: Optional[str] = typer.Option(
        None, "--rope-scaling", metavar="yarn|linear", rich_help_panel=CONTEXT,
        help="Stretch the model's trained context to a longer --ctx (its answers degrade past "
             "the trained length); without it such a --ctx is refused."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
    kv_type: Optional[str] = kv_type_option(),
    no_cache: bool = typer.Option(False, "--no-cache", rich_help_panel=CONTEXT,
                                  help="Do not restore prompts from the prompt cache."),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    rpc: Optional[str] = rpc_option(),
    cpu_moe: str = cpu_moe_option(),
    offline: bool = offline_option(),
    keep_alive: str = typer.Option("5m", "--keep-alive", metavar="DURATION",
                                   rich_help_panel=SERVER, help="How long a model stays loaded "
                                   "after its last request (5m, 1h30m, 0: unload at once, -1: "
                                   "never); a request's keep_alive overrides it."),
    pull: bool = typer.Option(False, "--pull", rich_help_panel=SERVER,
                              help="Let a request for a catalogue model not on disk pull it "
                              "(it waits for the download)."),
    allow_remote_media: bool = typer.Option(
        False, "--allow-remote-media", rich_help_panel=SERVER,
        help="Fetch the http(s) image URLs requests name (20 MB, 10 s each); without it only "
             "data: URLs and base64 are read."),
    verbose: int = verbose_option("-v: one line per request on stderr (method, path, status, "
                                  "model, tokens, seconds); -vv: the engine's log too."),
) -> None:
    """Serve models over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models,
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
      localinfer serve --keep-alive 10m         (any model on disk, loaded when asked for)
    """
    from localinfer.server import guard
    key = api_key or os.environ.get(KEY_ENV) or None
    if not guard.is_loopback(host) and not key:
        raise UsageError(f"listening on {host} needs --api-key (or {KEY_ENV}): anyone who can "
                         "reach it could use the model")
    # refused before loading
    if rope_scaling is not None:
        from localinfer.fit.auto import check_rope_scaling
        check_rope_scaling(rope_scaling)
        if backend in ("mlx", "onnx"):      # only llama.cpp stretches RoPE positions
            raise UsageError(f"--rope-scaling needs --backend llama.cpp: the {backend} backend "
                             "does not apply RoPE scaling")
        if not ctx:
            raise UsageError("--rope-scaling needs --ctx: the context to stretch the trained "
                             "one to")
    if pull and offline:
        raise UsageError("--pull and --offline say opposite things; give one")
    defaults = _defaults(temp, top_k, top_p, min_p, repeat_penalty, seed, system,
                         think_settings(think, no_think, think_budget),
                         penalties(frequency_penalty, presence_penalty, logit_bias))
    defaults = replace(defaults, remote_media=allow_remote_media)
    defaults = replace(defaults, normalise=reuse_answers)
    from localinfer import routing
    routers = routing.routers()         # config.toml's, checked before anything loads
    from localinfer.units import parse_duration
    idle = parse_duration(keep_alive, "--keep-alive")
    from localinfer.server import listen
    sock = listen.bind(host, port)      # a port in use is one line now, not after the load
    try:
        _serve(sock, models or [], idle=idle, pull=pull, host=host, port=port,
               parallel=parallel, queue=queue, key=key, cors=cors, hosts=guard.allowed_hosts(host, allowed_hosts),
               request_timeout=request_timeout, verbose=verbose,
               defaults=defaults, reuse_answers=reuse_answers, routers=routers,
               fit=replace(fit_options(quant=quant, ctx=ctx, kv_type=kv_type, memory=memory_,
                                       gpu_layers=gpu_layers, offline=offline, cpu_moe=cpu_moe),
                           rope_scaling=rope_scaling or ""),
               load=dict(threads=threads, engine_log=engine_log(verbose), backend=backend),
               use_cache=not no_cache)
    finally:
        sock.close()


def _serve(sock, models: list[str], *, idle: float, pull: bool, host: str, port: int,
           parallel: int, queue: int, key, cors, hosts, request_timeout: float,
           defaults: Defaults, verbose: int, fit: FitOptions, load: dict,
           use_cache: bool, reuse_answers: bool = False, routers: dict | None = None) -> None:
    """Load the command line's models, then answer requests on `sock` until a stop is asked
    for, loading any other model a request names."""
    from localinfer.server import guard, listen
    from localinfer.server.api import Served, make_app
    from localinfer.server.hosting import Models
    from localinfer.server.loading import Loader, pooled
    from localinfer.server.pool import Pool
    pooled_fit, budget, overhead = pooled(fit)
    # A model is fitted more than once (planned, then loaded): each of its notes is said once.
    loader = Loader(pooled_fit, parallel, queue, use_cache=use_cache,
                    report=replace(reporter(), notify=_once(console.note)),
                    log=console.error, **load)
    for model in models:            # pulled now (unless --offline), as `serve MODEL` always did
        loader.plan(model)
    # A request's model is never downloaded without --pull (Models.key checks it is on disk),
    # nor quantized into the store to fit: only an operator's leave (--pull) writes the store.
    loader = replace(loader, fit=replace(pooled_fit, offline=fit.offline or not pull,
                                         quantize_to_fit=pull))
    # Requests waiting for a model to load would have taken its slots or its queue.
    # Loads and unloads are -v's lines, as requests are; a failure is always one line.
    # A model that fails to load at start is the command's error, said once as it exits.
    starting = True
    pool = Pool(budget, loader.plan, loader.load, overhead=overhead, keep_alive=idle,
                queue_limit=parallel + queue, log=console.note if verbose else lambda line: None,
                fault=lambda line: starting or console.error(line))
    try:
        hosted = Models(loader, pool, pull=pull, log=console.error)
        loaded = [hosted.preload(model) for model in models]
        starting = False
        for model in loaded:
            if defaults.system is not None and not _uses_template(model.session):
                console.warn(f"{model.names[0]} has no chat template; --system is ignored")
        served = Served(hosted, key, hosts, port, console.error, request_timeout, defaults,
                        request_log=console.note if verbose else None,
                        reuse_answers=reuse_answers, routers=routers or {})
        what = ", ".join(f"{m.names[0]} ({m.n_ctx:,} tokens of context)" for m in loaded) or \
            "the models on disk"
        console.note(f"serving {what} on http://{_url_host(host)}:{port}/v1 ({parallel} at a "
                     f"time per model)")
        for router in (routers or {}).values():
            console.note(_router_line(router, routers, loader, pool))
        listen.run(make_app(served, cors), sock, protocol=guard.protocol(request_timeout),
                   on_exit=served.close)
    finally:
        pool.close()


def _router_line(router, routers: dict, loader, pool) -> str:
    """What serve says of a router at start: its models, and whether they fit the memory budget
    together (if not, the pool loads them one at a time: it unloads an idle model for the next)."""
    from localinfer.errors import LocalinferError
    from localinfer.server.pool_state import Need
    from localinfer.units import human_size
    line = f"router {router.name} ({router.kind}): {', '.join(router.models)}"
    try:
        needs = [loader.describing().plan(member).need for member in router.models
                 if member.lower() not in routers]
    except LocalinferError as e:        # said again, as a request's error, when one reaches it
        return f"{line}; {e}"
    together = sum(needs, Need(0))
    if not together.within(pool.room):
        line += (f"; they do not fit the memory budget together (they need "
                 f"{human_size(together.total)}, it leaves {human_size(pool.room.total)}): "
                 "loaded one at a time")
    return line


def _once(say):
    said: set[str] = set()

    def say_once(line: str) -> None:
        if line not in said:
            said.add(line)
            say(line)
    return say_once


def _uses_template(session) -> bool:
    from localinfer.engine.prompt import uses_chat_template
    return uses_chat_template(session, False)


def _defaults(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
              seed: int | None, system: str | None, think: Think, penalised: dict) -> Defaults:
    """What requests that do not say get: sampling, system message, thinking."""
    from localinfer.engine.sampling import SamplingParams
    from localinfer.server.requests import Defaults
    return Defaults(SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                   repeat_penalty=repeat_penalty, seed=seed, **penalised),
                    system, think)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
