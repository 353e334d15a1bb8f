"""The command line. Only this module knows about the terminal, stdin and exit codes."""

from __future__ import annotations

import io
import json
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from localinfer import settings
from localinfer.backends import BACKEND_CHOICES, LoadOptions
from localinfer.cli import console, limits, shell
from localinfer.errors import (EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, LocalinferError,
                               UsageError)
from localinfer.models import refs

# Modules a command needs are imported inside it: `quantize` or `list` should not pay for the
# decode loop, the prompt cache and their numpy at start-up.
if TYPE_CHECKING:
    from localinfer.cache import prompt_cache
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams

# typer >= 0.22 parses with its own copy of click (typer._click): its exceptions are not click's,
# and it no longer imports click at all (so neither do we: a hundredth of a second).
try:
    from typer._click.exceptions import NoArgsIsHelpError, UsageError as _ClickUsageError
    _CLICK_EXIT: tuple[type[BaseException], ...] = (typer.Exit,)
    _CLICK_ABORT: tuple[type[BaseException], ...] = (typer.Abort,)
except ImportError:
    import click
    from click.exceptions import NoArgsIsHelpError, UsageError as _ClickUsageError
    _CLICK_EXIT = (click.exceptions.Exit, typer.Exit)
    _CLICK_ABORT = (click.exceptions.Abort, typer.Abort)

app = typer.Typer(
    help="Run language models locally, as fast as the hardware allows.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_debug = False


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    """Run language models locally, as fast as the hardware allows."""


# -- shared options -------------------------------------------------------------------------------
def _backend_option():
    return typer.Option("auto", "--backend", help=f"Inference backend: {'|'.join(BACKEND_CHOICES)}.")


def _fit(model: str, *, quant: str, ctx: int, kv_type: str | None, memory_budget: str | None,
         threads: int, verbose: bool, offline: bool) -> tuple[str, LoadOptions]:
    """The variant, context and KV type that fit the memory budget (pulled or quantized if need
    be; notes on stderr)."""
    from localinfer.fit import auto
    chosen = auto.resolve(model, quant=quant, n_ctx=ctx, kv_type=kv_type,
                             memory_budget=memory_budget, offline=offline, notify=console.note,
                             progress=console.interactive())
    for note in chosen.notes:
        console.note(note)
    return chosen.model, LoadOptions(n_ctx=chosen.n_ctx, n_threads=threads, verbose=verbose,
                                     kv_type=chosen.kv_type)


def _quant_option():
    return typer.Option("auto", "--quant", "-q", help="Variant to run; auto = the most precise one "
                        "that fits the memory budget (quantized here if none does).")


def _memory_option():
    return typer.Option(None, "--memory", help="Memory budget, e.g. 6GB (default: available RAM "
                        "minus headroom).")


def _kv_type_option():
    return typer.Option(None, "--kv-type", help="KV cache: f16, q8_0 or q4_0 (default f16; q8_0 "
                        "when that is what fits).")


def _threads_option(help_text: str = "CPU threads; 0 = physical cores."):
    return typer.Option(0, "--threads", "-t", callback=_check_threads, help=help_text)


def _check_threads(value: int) -> int:
    # Past the CPUs ggml's spinning threads crawl, past 512 llama.cpp overruns or aborts (limits).
    top = limits.max_threads()
    if not 0 <= value <= top:
        raise typer.BadParameter(f"must be 0 (automatic) to {top} (the CPUs this "
                                 f"machine has), not {value}")
    return value


def _ctx_option(default: int, minimum: int, help_text: str):
    return typer.Option(default, "--ctx", "-c", min=minimum, max=limits.MAX_CTX, help=help_text)


def _check_backend(backend: str) -> None:
    if backend not in BACKEND_CHOICES:   # before a pull, not after downloading the model
        raise UsageError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKEND_CHOICES)}")


def _open(model: str, *, backend: str, offline: bool, options: LoadOptions) -> refs.LoadedModel:
    _check_backend(backend)
    conf, cat, store = refs.context()
    ref = refs.parse_ref(model, cat)
    path = refs.locate(ref, store, offline=offline, progress=console.interactive(),
                         notify=console.note)
    return refs.load(ref, path, backend=backend, options=options)


# -- run ------------------------------------------------------------------------------------------
@app.command()
def run(
    model: str = typer.Argument(..., help="Catalogue name or alias[:QUANT], or a path to a .gguf file."),
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' reads it from stdin alone. "
                                           "Piped stdin is put before it."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message for chat models."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    temp: float = typer.Option(0.8, "--temp", min=0.0, help="Temperature; 0 is greedy and deterministic."),
    top_k: int = typer.Option(40, "--top-k", min=0, help="Keep the k most likely tokens; 0 = off."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Nucleus mass."),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0,
                                help="Drop tokens below this fraction of the top probability."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0,
                                         help="Penalty for recently seen tokens; 1 = off."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling; -1 (or "
                                       "none given) draws a new one each run."),
    max_tokens: int = typer.Option(-1, "--max-tokens", "-n", min=-1,
                                   help="Stop after this many tokens; -1 = until the model ends."),
    stop: list[str] = typer.Option([], "--stop", help="Stop at this string (repeatable)."),
    ctx: int = _ctx_option(0, 0, "Context length; 0 = model's, up to 4096."),
    threads: int = _threads_option(),
    backend: str = _backend_option(),
    offline: bool = typer.Option(False, "--offline", help="Never download; fail if not on disk."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Timings and engine logs on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the prompt cache."),
    draft: str = typer.Option("auto", "--draft", help="Speculative decoding: a draft MODEL, auto "
                              "(catalogue draft if on disk, else lookup), lookup, self, none."),
    draft_max: int = typer.Option(8, "--draft-max", min=0, help="Most tokens drafted per round "
                                  "(adaptive below it); 0 = no speculation."),
    quant: str = _quant_option(),
    memory_: Optional[str] = _memory_option(),
    kv_type: Optional[str] = _kv_type_option(),
) -> None:
    """Generate a completion and stream it to stdout."""
    from localinfer.cache import prompt_cache
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams, make_sampler
    if max_tokens == 0:
        raise UsageError("--max-tokens must be -1 (no limit) or at least 1")
    _check_backend(backend)
    model, options = _fit(model, quant=quant, ctx=ctx, kv_type=kv_type, memory_budget=memory_,
                          threads=threads, verbose=verbose, offline=offline)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed)
    sampler = make_sampler(params)
    if prompt is None and console.interactive(sys.stdin):
        from localinfer.cli import chat as chat_mod
        loaded = _open(model, backend=backend, offline=offline,
                       options=options)
        chat_mod.repl(loaded, sampler, system=system, limits=Limits(max_tokens, tuple(stop)))
        return
    text = shell.combine_input(shell.read_stdin(), prompt)
    loaded = _open(model, backend=backend, offline=offline, options=options)
    session = loaded.session
    if refs.uses_chat_template(session, raw):
        tokens = refs.chat_tokens(session, shell.messages(text, system))
    else:
        if system and not raw:
            console.warn("this model has no chat template; --system is ignored")
        tokens = refs.raw_tokens(session, text)
    generation = _generation(loaded, tokens, params, Limits(max_tokens, tuple(stop)), draft=draft,
                             draft_max=draft_max, offline=offline,
                             options=options,
                             store=prompt_cache.open_for(session, enabled=not no_cache))
    generation.stats.load_s = loaded.load_s
    shell.emit(generation, loaded, as_json=as_json, verbose=verbose)
    prompt_cache.persist(generation.cache, notify=console.note if verbose else None)


def _generation(loaded: refs.LoadedModel, tokens: list[int], params: SamplingParams,
                limits: Limits, *, draft: str, draft_max: int, offline: bool, options: LoadOptions,
                store: prompt_cache.PromptCache | None = None):
    """Plain decoding, or speculative decoding with the drafter --draft names."""
    from localinfer.engine.decode import KVCache
    from localinfer.speculate import choose
    drafter = None if draft_max == 0 else choose.open_drafter(
        draft, loaded, options=options, offline=offline, notify=console.note)
    return choose.generation(loaded, KVCache(loaded.session, store), tokens, params, limits, drafter,
                               max_draft=draft_max)


# -- chat -----------------------------------------------------------------------------------------
@app.command()
def chat(
    model: str = typer.Argument(..., help="Catalogue name or alias[:QUANT], or a .gguf path."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message."),
    temp: float = typer.Option(0.8, "--temp", min=0.0, help="Temperature; 0 is greedy."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed; -1 (or none given) "
                                       "draws a new one each run."),
    max_tokens: int = typer.Option(-1, "--max-tokens", "-n", min=-1, help="Per reply; -1 = no limit."),
    ctx: int = _ctx_option(0, 0, "Context length; 0 = model's, up to 4096."),
    threads: int = _threads_option(),
    backend: str = _backend_option(),
    offline: bool = typer.Option(False, "--offline", help="Never download."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Timings after each reply."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the prompt cache."),
    quant: str = _quant_option(),
    memory_: Optional[str] = _memory_option(),
    kv_type: Optional[str] = _kv_type_option(),
) -> None:
    """Multi-turn chat in the terminal (/exit, /clear, /system TEXT)."""
    from localinfer.cli import chat as chat_mod
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams, make_sampler
    if max_tokens == 0:
        raise UsageError("--max-tokens must be -1 (no limit) or at least 1")
    sampler = make_sampler(SamplingParams(temperature=temp, seed=seed))
    _check_backend(backend)
    model, options = _fit(model, quant=quant, ctx=ctx, kv_type=kv_type, memory_budget=memory_,
                          threads=threads, verbose=verbose, offline=offline)
    loaded = _open(model, backend=backend, offline=offline, options=options)
    chat_mod.repl(loaded, sampler, system=system, limits=Limits(max_tokens), verbose=verbose,
                  use_cache=not no_cache)


# -- model management -----------------------------------------------------------------------------
@app.command()
def pull(model: str = typer.Argument(..., help="Catalogue name or alias[:QUANT].")) -> None:
    """Download a model into the store (tries each source in order)."""
    from localinfer.models import fetch
    _, cat, store = refs.context()
    ref = refs.parse_ref(model, cat)
    if ref.spec is None:
        raise UsageError("pull takes a catalogue name, not a file path")
    path = fetch.ensure(ref.spec, ref.spec.variant(ref.quant), store,
                        progress=console.interactive(), notify=console.note)
    console.note(f"{ref.display} is at {path}")


@app.command("list")
def list_models(
    catalogue_: bool = typer.Option(False, "--catalogue", help="All models that can be pulled."),
) -> None:
    """Models on disk (or the whole catalogue with --catalogue)."""
    _, cat, store = refs.context()
    if catalogue_:
        rows = [[spec.name, ", ".join(spec.variants), spec.parameters, spec.kind,
                 ", ".join(spec.aliases)] for spec in cat.models.values()]
        console.print_table(["NAME", "QUANTS", "PARAMS", "KIND", "ALIASES"], rows)
        return
    rows = [[m.name, m.quant, console.human_size(m.size), str(m.path)] for m in store.installed()]
    if not rows:
        console.note("no models on disk yet; `localinfer pull NAME` or `localinfer list --catalogue`")
        return
    console.print_table(["NAME", "QUANT", "SIZE", "PATH"], rows)


@app.command()
def rm(model: str = typer.Argument(..., help="NAME (every quant) or NAME:QUANT.")) -> None:
    """Delete a model from the store."""
    from localinfer.models import store_sweep
    _, cat, store = refs.context()
    name, _, quant = model.partition(":")
    spec = cat.get(name)
    stored_name = spec.name if spec else name
    store_sweep.sweep(store)        # temporary files that killed writers left go too
    removed = store.remove(stored_name, quant.upper() or None)
    if not removed:
        raise UsageError(f"{model} is not on disk (`localinfer list` shows what is)")
    for path in removed:
        console.note(f"removed {path}")


@app.command()
def info(
    model: str = typer.Argument(..., help="Catalogue name[:QUANT] or a .gguf path."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Facts about a model: architecture, size, layers, heads, vocabulary, tensor types."""
    from localinfer.cli import info as info_mod
    _, cat, store = refs.context()
    facts = info_mod.describe(refs.parse_ref(model, cat), store)
    info_mod.show(facts, as_json=as_json)


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """This machine's CPU, memory and accelerators, and the backend `run` would choose."""
    from localinfer.fit import machine as devices_mod
    devices_mod.show(devices_mod.detect(), as_json=as_json)


@app.command()
def bench(
    model: str = typer.Argument(..., help="Catalogue name[:QUANT] or a .gguf path."),
    n_prompt: int = typer.Option(512, "--prompt-tokens", "-p", min=1, max=limits.MAX_CTX // 2,
                                 help="Prefill length."),
    n_gen: int = typer.Option(128, "--gen-tokens", "-n", min=2, max=limits.MAX_CTX // 2,
                              help="Tokens to decode."),
    repetitions: int = typer.Option(5, "--repetitions", "-r", min=1, help="Runs per test."),
    threads: int = _threads_option(),
    backend: str = _backend_option(),
    offline: bool = typer.Option(False, "--offline", help="Never download."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    draft: str = typer.Option("none", "--draft", help="Also measure speculative decoding with this "
                              "drafter (MODEL|auto|lookup|self) against plain, side by side."),
) -> None:
    """Measure prefill and decode speed and time to first token."""
    from localinfer.measure import bench as bench_mod
    options = LoadOptions(n_ctx=n_prompt + n_gen + 16, n_threads=threads)
    loaded = _open(model, backend=backend, offline=offline, options=options)
    if draft != "none":
        _bench_speculation(loaded, draft, n_gen=n_gen, repetitions=repetitions, options=options,
                           offline=offline, as_json=as_json)
        return
    result = bench_mod.measure(loaded, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions,
                               progress=console.note if console.interactive() else None)
    bench_mod.show(result, as_json=as_json)


def _bench_speculation(loaded: refs.LoadedModel, draft: str, *, n_gen: int, repetitions: int,
                       options: LoadOptions, offline: bool, as_json: bool) -> None:
    from localinfer.measure import speculation
    from localinfer.speculate import choose
    drafter = choose.open_drafter(draft, loaded, options=options, offline=offline,
                                    notify=console.note)
    result = speculation.measure(loaded, drafter, n_gen=n_gen, repetitions=repetitions,
                                progress=console.note if console.interactive() else None)
    speculation.show(result, as_json=as_json)


# -- quantization ---------------------------------------------------------------------------------
@app.command("quantize")
def quantize_cmd(
    model: str = typer.Argument(..., help="Catalogue name[:QUANT] or a .gguf path to quantize from."),
    qtype: str = typer.Option(..., "--type", help="Target type: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, "
                              "IQ4_XS, Q3_K_M, Q2_K, IQ2_XXS, F16, BF16, F32, ..."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Write here instead of the model store."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix (IQ1/IQ2 need one)."),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="Quantize an already quantized model (loses quality)."),
    threads: int = _threads_option("Threads; 0 = all hardware threads."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the exact size and memory; write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
    offline: bool = typer.Option(False, "--offline", help="Never download the source."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: print JSON."),
) -> None:
    """Quantize a model with llama.cpp's quantizer; the result lands in the store as NAME:TYPE."""
    from localinfer.quant import jobs as qc
    job = qc.prepare(model, qtype, output, offline=offline)
    matrix = qc.load_imatrix(imatrix)
    if dry_run:
        qc.dry_run(job, matrix, ctx_sizes=(2048, 4096), as_json=as_json)
        return
    qc.run(job, matrix, threads=threads, allow_requantize=allow_requantize, force=force)


# -- prompt cache ---------------------------------------------------------------------------------
def _register_cache_app() -> None:
    from localinfer.cli.cache import app as cache_app
    app.add_typer(cache_app, name="cache")


_register_cache_app()


# -- quality ---------------------------------------------------------------------------------------
@app.command("eval")
def eval_cmd(
    model: str = typer.Argument(..., help="Catalogue name[:QUANT] or a .gguf path to measure."),
    reference: Optional[str] = typer.Option(None, "--reference", "-r", help="A higher-precision "
                                            "variant of the same model: adds mean KL and top-1 agreement."),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text to score (default: chapters "
                                        "I-III of Alice's Adventures in Wonderland)."),
    ctx: int = _ctx_option(512, 16, "Chunk length, as llama-perplexity -c."),
    chunks: int = typer.Option(0, "--chunks", min=0, help="Score at most this many chunks; 0 = all."),
    threads: int = _threads_option(),
    backend: str = _backend_option(),
    offline: bool = typer.Option(False, "--offline", help="Never download."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Perplexity over a text; with --reference, mean KL divergence and top-1 agreement too."""
    from localinfer.measure import quality
    words = quality.read_text(text)
    options = LoadOptions(n_ctx=ctx, n_threads=threads, n_batch=ctx)
    loaded = _open(model, backend=backend, offline=offline, options=options)
    ref = _open(reference, backend=backend, offline=offline, options=options) if reference else None
    tokens = quality.tokens_for(loaded.session, words)
    if ref is not None and quality.tokens_for(ref.session, words) != tokens:
        raise UsageError("the reference model tokenizes the text differently; "
                         "it must be a variant of the same model")
    show = console.interactive()
    result = quality.evaluate(
        loaded.session, tokens, n_ctx=ctx, reference=ref.session if ref else None,
        max_chunks=chunks or None,
        progress=(lambda i, n, ppl: console.note(f"[{i}/{n}] perplexity so far {ppl:.4f}")) if show else None)
    record = {"model": loaded.ref.display, "reference": ref.ref.display if ref else None,
              "text": str(text) if text else "default (Alice, ch. I-III)", **result.as_dict()}
    if as_json:
        sys.stdout.write(json.dumps(record) + "\n")
        return
    rows = [["model", record["model"]], ["text", record["text"]],
            ["tokens scored", f"{result.tokens_scored} in {result.chunks} chunks of {ctx}"],
            ["perplexity", f"{result.perplexity:.4f}"]]
    if ref is not None:
        rows += [["reference", record["reference"]], ["mean KL", f"{result.mean_kl:.5f} nats/token"],
                 ["top-1 agreement", f"{result.top1_agreement:.2%}"]]
    rows.append(["time", f"{result.seconds:.1f} s"])
    console.print_table(["EVAL", "VALUE"], rows)


@app.command("frontier")
def frontier_cmd(
    model: str = typer.Argument(..., help="Catalogue name[:QUANT] or a .gguf path."),
    types: list[str] = typer.Option([], "--types", help="Types to compare (repeatable; default: "
                                    "Q8_0 Q6_K Q5_K_M Q4_K_M Q4_0 Q3_K_M Q2_K)."),
    ctx: int = _ctx_option(512, 16, "Chunk length for the quality measures."),
    chunks: int = typer.Option(4, "--chunks", min=1, help="Chunks of the default text to score."),
    threads: int = _threads_option(),
    offline: bool = typer.Option(False, "--offline", help="Never download."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw quality against speed and "
                                        "size into this PNG file."),
) -> None:
    """Quantize to several types and measure size, memory, speed and quality; mark the frontier."""
    from localinfer import settings
    from localinfer.measure import frontier
    from localinfer.quant import jobs, quantize
    chosen = [quantize.parse_type(t) for t in types for t in t.split(",")] or \
        list(frontier.DEFAULT_TYPES)
    job = jobs.prepare(model, chosen[0], None, offline=offline)
    workdir = settings.load().cache_dir / "frontier" / job.name
    reference, points = frontier.measure(job.source, chosen, workdir, n_ctx=ctx, chunks=chunks,
                                         threads=threads, note=console.note)
    if plot is not None:
        frontier.plot(points, plot, f"{job.name}: quality vs speed and size")
    if as_json:
        sys.stdout.write(frontier.to_json(reference, points) + "\n")
        return
    console.print_table(frontier.HEADERS, frontier.as_rows(points))
    console.note(f"* on the efficient frontier; quality against {reference.name}")


# -- entry point ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every failure ends as one line on stderr and a documented exit code."""
    global _debug
    args = list(sys.argv[1:] if argv is None else argv)
    _debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    shell.guard_standard_streams()
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")
    try:
        _debug = _debug or settings.load().debug
        shell.check_arguments(args)
        code = _invoke(args)
    except NoArgsIsHelpError as e:   # bare `localinfer` or `localinfer run`: the help, not an error
        e.show()
        sys.exit(EXIT_USAGE)
    except _ClickUsageError as e:
        _fail(e.format_message(), EXIT_USAGE, e)
    except (KeyboardInterrupt, *_CLICK_ABORT):
        _flush_quietly()
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        shell.quiet_broken_pipe()
        sys.exit(0)
    except LocalinferError as e:
        _fail(str(e), e.exit_code, e)
    except OSError as e:             # the disk or the file system, not a bug: say which file
        _fail(_os_error_line(e), EXIT_RUNTIME, e)
    except MemoryError as e:
        _fail("out of memory; try a smaller model, --ctx or --memory", EXIT_RUNTIME, e)
    except Exception as e:  # a bug: still one line, the traceback with --debug
        _fail(f"internal error: {type(e).__name__}: {e} (run with --debug for details)",
              EXIT_RUNTIME, e)
    sys.exit(code if isinstance(code, int) else 0)


def _invoke(args: list[str]) -> object:
    """Parse the arguments and run the command. Not through click's main(): that turns a closed
    pipe into a silent exit 1 before any handler here could call it the normal end it is."""
    command = typer.main.get_command(app)
    try:
        with command.make_context("localinfer", args) as ctx:
            return command.invoke(ctx)
    except _CLICK_EXIT as e:
        return e.exit_code


def _fail(message: str, code: int, exc: BaseException) -> None:
    if _debug:
        traceback.print_exception(exc, file=sys.stderr)
    console.error(message.splitlines()[0] if message else type(exc).__name__)
    sys.exit(code)


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except (OSError, LocalinferError):   # a closed pipe or stdout: nothing more to say
        pass


def _os_error_line(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or type(e).__name__}{where}"
