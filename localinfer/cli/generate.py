"""`run` and `chat`: the request path from the command line to streamed text."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Optional

import typer

from localinfer.cli import console, media_args, shell
from localinfer.cli.answers import (reuse_answers_option, reuse_embedder_option,
                                    reuse_similarity_option, similar)
from localinfer.cli.options import (rpc_option, CONTEXT, backend_option, check_backend, cpu_moe_option,
                                    ctx_option,
                                    draft_max_option, draft_option, engine_log, fit_options,
                                    check_logprobs, logprobs_option,
                                    gpu_layers_option, grammar_option, json_option,
                                    json_schema_option, kv_type_option, max_tokens_option,
                                    memory_option, min_p_option, model_argument, no_cache_option,
                                    offline_option, parse_gpu_layers, quant_option, raw_option,
                                    no_think_option, repeat_penalty_option, reporter,
                                    frequency_penalty_option, presence_penalty_option,
                                    logit_bias_option, penalties, seed_option, show_thinking_option, stop_option,
                                    system_option, temp_option, think_budget_option, think_option,
                                    think_settings, threads_option, top_k_option, top_p_option,
                                    verbose_option)
from localinfer.errors import LocalinferError, UsageError

# The decode loop, the prompt cache and their numpy are imported inside the commands (through
# pipeline/): `list` or `quantize` should not pay for them at start-up.

CTX_HELP = ("Context length; 0 = sized to the prompt and the reply's room (at least 4096, at "
            "most the model's trained context).")
CHAT_CTX_HELP = ("Context length; 0 = 4096, grown as the conversation needs (up to the model's "
                 "trained context) before old turns are dropped.")


def register(app: typer.Typer) -> None:
    app.command()(run)
    app.command()(chat)


def run(
    command: typer.Context,
    model: str = model_argument(),
    prompt: Optional[str] = typer.Argument(None, metavar="[PROMPT]", show_default=False,
                                           help="The prompt; '-' reads it from stdin alone. "
                                           "Piped stdin is put before it. None on a terminal: "
                                           "a chat."),
    system: Optional[str] = system_option(),
    raw: bool = raw_option(),
    temp: float = temp_option(),
    top_k: int = top_k_option(),
    top_p: float = top_p_option(),
    min_p: float = min_p_option(),
    repeat_penalty: float = repeat_penalty_option(),
    frequency_penalty: float = frequency_penalty_option(),
    presence_penalty: float = presence_penalty_option(),
    logit_bias: list[str] = logit_bias_option(),
    seed: Optional[int] = seed_option(),
    max_tokens: int = max_tokens_option(),
    stop: list[str] = stop_option(),
    ctx: int = ctx_option(0, 0, CTX_HELP),
    truncate: bool = typer.Option(False, "--truncate", rich_help_panel=CONTEXT,
                                  help="Fit a long prompt: drop the start of the piped input, "
                                  "not the question (stderr says how much)."),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
    kv_type: Optional[str] = kv_type_option(),
    no_cache: bool = no_cache_option(),
    reuse_answers: bool = reuse_answers_option(),
    reuse_similarity: Optional[float] = reuse_similarity_option(),
    reuse_embedder: Optional[str] = reuse_embedder_option(),
    priority: Optional[str] = typer.Option(None, "--priority", metavar="NAME",
                                           rich_help_panel=CONTEXT, show_default=False,
                                           help="A rule router's priority (docs/routing.md)."),
    draft: str = draft_option(),
    draft_max: int = draft_max_option(),
    as_json: bool = json_option("Print one JSON object (text and stats) instead of streaming."),
    logprobs: Optional[int] = logprobs_option(),
    json_schema: Optional[str] = json_schema_option(),
    grammar: Optional[str] = grammar_option(),
    think: Optional[str] = think_option(),
    no_think: bool = no_think_option(),
    think_budget: Optional[int] = think_budget_option(),
    show_thinking: Optional[bool] = show_thinking_option(),
    verbose: int = verbose_option(),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    rpc: Optional[str] = rpc_option(),
    cpu_moe: str = cpu_moe_option(),
    offline: bool = offline_option(),
    image: list[str] = media_args.image_option(),
    audio: list[str] = media_args.audio_option(),
    mmproj: Optional[str] = media_args.mmproj_option(),
) -> None:
    """Generate a completion and stream it to stdout (a thinking model's trace: never stdout).

    \b
    localinfer run smollm2 "Why is the sky blue?"
    git diff | localinfer run qwen2.5-1.5b "Write a commit message." -n 60
    localinfer run smollm2 "Describe a person in JSON." --json-schema person.json
    """
    from dataclasses import replace

    from localinfer.cache import prompt_cache
    from localinfer.cli.thinking import show_by_default
    from localinfer.thinking.setup import no_answer
    from localinfer.engine.decode import Limits
    from localinfer.engine.prompt import uses_chat_template
    from localinfer.engine.sampling import SamplingParams
    from localinfer.engine.structured import from_options
    from localinfer.fit.request import Request
    from localinfer.pipeline import generate as pipeline, load
    if prompt is None and console.interactive(sys.stdin):    # `run MODEL` on a terminal: chat
        return open_chat(ChatOptions.of(command))
    _check_max_tokens(max_tokens)
    check_logprobs(logprobs, as_json)
    check_backend(backend)
    output = from_options(json_schema, grammar)     # checked before any model is pulled or loaded
    thinking = think_settings(think, no_think, think_budget)
    fit = fit_options(quant=quant, ctx=ctx, kv_type=kv_type, memory=memory_,
                      gpu_layers=gpu_layers, offline=offline, cpu_moe=cpu_moe)
    from localinfer.engine.media import find_projector
    media = media_args.read(image, audio)       # checked, the projector found, before any load
    fit = replace(fit, mmproj=find_projector(model, mmproj, media))
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed,
                            **penalties(frequency_penalty, presence_penalty, logit_bias))
    report = reporter()
    matching = similar(reuse_similarity, reuse_embedder)
    reuse_answers = reuse_answers or matching is not None      # a threshold turns reuse on
    from localinfer.cli import routed
    router = routed.router_for(model, quant=quant, reuse_answers=reuse_answers)
    named = load.name(model, fit, report) if router is None else None
    # The prompt is read before the fit: the context is sized to it.
    piped = None if media_args.uses_stdin(image, audio) else shell.read_stdin()
    request = Request(replace(shell.prompt_text(piped, prompt, system=system, raw=raw),
                              think=thinking.think, media=media), max_tokens, truncate)
    ask = pipeline.Ask(params, Limits(max_tokens, tuple(stop), logprobs=logprobs), draft=draft,
                       draft_max=draft_max,
                       output=output, use_cache=not no_cache, think=thinking, reuse=reuse_answers,
                       similar=matching)
    if priority is not None and verbose and (router is None or router.kind != "rule"):
        console.note(f"--priority {priority}: ignored, {model} is not a rule router")
    if router is not None:      # one name for several models (docs/routing.md)
        return routed.run(router, request, fit, ask, report, backend=backend, threads=threads,
                          engine_log=engine_log(verbose), as_json=as_json, verbose=verbose > 0,
                          show_trace=show_by_default(show_thinking), max_tokens=max_tokens,
                          priority=priority)
    loaded, generation = pipeline.prepare(named, request, fit, ask, report, backend=backend,
                                          threads=threads, engine_log=engine_log(verbose),
                                          probe_note=True)
    session = loaded.session
    if system and not raw and not uses_chat_template(session, raw):
        console.warn("this model has no chat template; --system is ignored")
    out = shell.emit(generation, loaded, as_json=as_json, verbose=verbose > 0,
                     show_trace=show_by_default(show_thinking))
    prompt_cache.persist(generation.cache, notify=console.note if verbose else None)
    finish = generation.stats.finish_reason
    unanswered = no_answer(out.still_thinking(), finish, max_tokens, session.n_ctx)
    if unanswered:
        raise LocalinferError(unanswered)
    problem = pipeline.incomplete_answer(ask, out.answer, generation, loaded)
    if problem:
        raise LocalinferError(problem)
    if generation.stats.finish_reason == "context":
        console.note(f"the reply stopped at the end of the context ({session.n_ctx:,} tokens); "
                     "-n N sizes the context for a longer one (or --ctx N)")
    if generation.stats.closed_at >= 0:
        console.note(shell.closed_early(generation.stats, generation.limits.max_tokens,
                                        session.n_ctx, unasked=max_tokens < 0))


def chat(
    command: typer.Context,
    model: str = model_argument(),
    system: Optional[str] = system_option(),
    raw: bool = raw_option("Send each message as is, without the chat template."),
    temp: float = temp_option(),
    top_k: int = top_k_option(),
    top_p: float = top_p_option(),
    min_p: float = min_p_option(),
    repeat_penalty: float = repeat_penalty_option(),
    frequency_penalty: float = frequency_penalty_option(),
    presence_penalty: float = presence_penalty_option(),
    logit_bias: list[str] = logit_bias_option(),
    seed: Optional[int] = seed_option(),
    max_tokens: int = max_tokens_option(help_text="Most tokens per reply; -1 = no limit."),
    stop: list[str] = stop_option(),
    ctx: int = ctx_option(0, 0, CHAT_CTX_HELP),
    quant: str = quant_option(),
    memory_: Optional[str] = memory_option(),
    kv_type: Optional[str] = kv_type_option(),
    no_cache: bool = no_cache_option(),
    json_schema: Optional[str] = json_schema_option(),
    grammar: Optional[str] = grammar_option(),
    think: Optional[str] = think_option(),
    no_think: bool = no_think_option(),
    think_budget: Optional[int] = think_budget_option(),
    show_thinking: Optional[bool] = show_thinking_option(),
    verbose: int = verbose_option("-v: timings after each reply; -vv: the engine's log too."),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    rpc: Optional[str] = rpc_option(),
    cpu_moe: str = cpu_moe_option(),
    offline: bool = offline_option(),
    mmproj: Optional[str] = media_args.mmproj_option(),
) -> None:
    """Multi-turn chat in the terminal (/help lists its commands).

    \b
    localinfer chat smollm2
    localinfer chat smollm2 --system "Answer in one sentence." --temp 0.3
    """
    open_chat(ChatOptions.of(command))


@dataclass(frozen=True)
class ChatOptions:
    """`chat`'s options, as parsed and checked: the chat command and `run MODEL` on a terminal
    both take them from their command's parsed values by name (`of`), so an option added to
    `chat` reaches the chat from either, and never as Typer's placeholder for a default."""

    model: str
    system: str | None
    raw: bool
    temp: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: list[str]
    seed: int | None
    max_tokens: int
    stop: list[str]
    ctx: int
    quant: str
    memory_: str | None
    kv_type: str | None
    no_cache: bool
    json_schema: str | None
    grammar: str | None
    think: str | None
    no_think: bool
    think_budget: int | None
    show_thinking: bool | None
    verbose: int
    backend: str
    threads: int
    gpu_layers: str
    rpc: str | None         # the workers: connected by the option's own check, when parsed
    cpu_moe: str
    offline: bool
    mmproj: str | None      # /image and /audio go through it (default: one beside the model)

    @classmethod
    def of(cls, command: typer.Context) -> ChatOptions:
        """The options from a parsed command (`chat`, or `run`, which has them all). Those of
        `run` a chat has no use for are refused when the command line gives them."""
        _refuse_run_only(command)
        return cls(**{f.name: command.params[f.name] for f in fields(cls)})


# `run`'s options a chat does not take: given with no prompt on a terminal, they would be lost.
RUN_ONLY = ("truncate", "draft", "draft_max", "as_json", "logprobs", "reuse_answers", "priority",
            "reuse_similarity", "reuse_embedder", "image", "audio")    # chat: /image, /audio


def _refuse_run_only(command: typer.Context) -> None:
    given = [p.opts[0] for p in command.command.params if p.name in RUN_ONLY and
             getattr(command.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]
    if given:
        raise UsageError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} a PROMPT: "
                         "with none, on a terminal, run opens a chat, which has no "
                         f"{'such option' if len(given) == 1 else 'such options'}")


def open_chat(o: ChatOptions) -> None:
    """Load the model as `chat` fits it and run the conversation."""
    from localinfer.cli import chat as chat_repl
    from localinfer.cli.thinking import show_by_default
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams
    from localinfer.engine.structured import from_options
    from localinfer.pipeline import load
    from localinfer.thinking.setup import check_asked, style_of
    from localinfer.cli import routed
    router = routed.router_for(o.model, quant=o.quant)
    _check_max_tokens(o.max_tokens)
    params = SamplingParams(temperature=o.temp, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p,
                            repeat_penalty=o.repeat_penalty, seed=o.seed,
                            **penalties(o.frequency_penalty, o.presence_penalty, o.logit_bias))
    check_backend(o.backend)
    output = from_options(o.json_schema, o.grammar)
    thinking = think_settings(o.think, o.no_think, o.think_budget)
    fit, report = fit_options(quant=o.quant, ctx=o.ctx, kv_type=o.kv_type, memory=o.memory_,
                              gpu_layers=o.gpu_layers, offline=o.offline,
                              cpu_moe=o.cpu_moe), reporter()
    if router is not None:      # each turn routed with the conversation (docs/routing.md)
        if o.raw or o.mmproj:
            raise UsageError(f"{'--raw' if o.raw else '--mmproj'} does not apply to router "
                             f"{router.name}: chat with one of its models for it")
        from localinfer.pipeline.generate import Ask
        return routed.chat(router, system=o.system, ask=Ask(
            params, Limits(o.max_tokens, tuple(o.stop)), draft="none", output=output,
            use_cache=not o.no_cache, think=thinking), fit=fit, report=report, backend=o.backend,
            threads=o.threads, engine_log=engine_log(o.verbose), verbose=o.verbose > 0,
            show_trace=show_by_default(o.show_thinking))
    from dataclasses import replace

    from localinfer.engine.media import chat_projector
    fit = replace(fit, mmproj=chat_projector(o.model, o.mmproj))
    fitted = load.fit_model(load.name(o.model, fit, report), fit, report, threads=o.threads,
                            engine_log=engine_log(o.verbose))
    options = fitted.options
    loaded = load.open_ref(fitted.ref, options, backend=o.backend, offline=o.offline,
                           report=report)
    check_asked(style_of(loaded.session, [], o.raw), thinking, loaded.ref.display, o.raw)
    chat_repl.repl(loaded, params, system=o.system, limits=Limits(o.max_tokens, tuple(o.stop)),
                   verbose=o.verbose > 0, use_cache=not o.no_cache, output=output, raw=o.raw,
                   think=thinking, show_trace=show_by_default(o.show_thinking),
                   grow=chat_repl.growing(ctx=o.ctx, kv_type=o.kv_type, memory_budget=o.memory_,
                                          gpu_layers=parse_gpu_layers(o.gpu_layers),
                                          cpu_moe=fit.cpu_moe, options=options))


def _check_max_tokens(max_tokens: int) -> None:
    if max_tokens == 0:
        raise UsageError("--max-tokens must be -1 (no limit) or at least 1")
