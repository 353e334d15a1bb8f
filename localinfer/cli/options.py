"""Options several commands share, the ranges their values must keep, and the step from a model
option to a loaded model (fitted to memory for `run` and `chat`, as named for the others).

The ranges are llama.cpp's: past them it aborts the process (100,000 threads: std::bad_alloc),
overruns its fixed-size tables (more than GGML_MAX_N_THREADS threads), truncates (n_ctx is 32 bits
in its C structs) or crawls: ggml's threads spin-wait for one another at every step, so threads
beyond the CPUs make each step far slower (measured on 2 CPUs: 16 threads took 22 s and 64 threads
57 s for what 2 do in under a second; 512 did not finish in 200 s).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import typer

from localinfer.backends import BACKEND_CHOICES, LoadOptions
from localinfer.cli import console
from localinfer.errors import UsageError
from localinfer.models import refs

if TYPE_CHECKING:
    from localinfer.backends import Session
    from localinfer.engine.load import LoadedModel
    from localinfer.fit.request import Request, Sized

GGML_MAX_N_THREADS = 512      # ggml.h: the size of the thread pool's tables
# Tokens of context (and of one `eval` chunk, which is also its batch). The longest context any
# model is trained for is 10M tokens (Llama 4 Scout); memory bounds it further at run time.
MAX_CTX = 1 << 24
# --gpu-layers: llama.cpp's own limit on a model's layers is 512 (LLAMA_MAX_LAYERS); more means all.
MAX_GPU_LAYERS = 1 << 16


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def max_threads() -> int:
    return min(usable_cpus(), GGML_MAX_N_THREADS)


# -- the options ----------------------------------------------------------------------------------
# The panels `--help` groups options into, the same names on every command.
SAMPLING = "Sampling"
CONTEXT = "Context and memory"
SPECULATION = "Speculation"
OUTPUT = "Output"
BACKEND = "Backend"
SERVER = "Server"


def verbose_option(help_text: str = "-v: timings and stats on stderr; -vv: the engine's log too."):
    """-v counts: 1 is our stats block, 2 (or --debug) adds llama.cpp's own log."""
    return typer.Option(0, "--verbose", "-v", count=True, help=help_text, rich_help_panel=OUTPUT,
                        show_default=False, metavar="")


def engine_log(verbose: int) -> bool:
    """Whether the engine's own log goes to stderr: -vv, or --debug."""
    from localinfer.cli import app
    return verbose >= 2 or app.debugging()


def backend_option():
    return typer.Option("auto", "--backend", metavar="NAME", rich_help_panel=BACKEND,
                        help=f"Inference backend: {'|'.join(BACKEND_CHOICES)}.")


def quant_option():
    return typer.Option("auto", "--quant", "-q", metavar="QUANT", rich_help_panel=CONTEXT,
                        help="Variant to run; auto = the most precise one that fits the memory "
                        "budget (quantized here if none does).")


def memory_option():
    return typer.Option(None, "--memory", metavar="SIZE", rich_help_panel=CONTEXT,
                        help="Memory budget, e.g. 6GB (default: available RAM minus headroom).")


def kv_type_option():
    return typer.Option(None, "--kv-type", metavar="TYPE", rich_help_panel=CONTEXT,
                        help="KV cache: f16, q8_0 or q4_0 (default f16; q8_0 when that is what "
                        "fits).")


def threads_option():
    return typer.Option(0, "--threads", "-t", callback=check_threads, metavar="N",
                        rich_help_panel=BACKEND, help="CPU threads; 0 = one per physical core "
                        "this process may use.")


# -- sampling: one definition each, the same defaults on every command that samples ---------------
def temp_option():
    return typer.Option(0.8, "--temp", min=0.0, metavar="FLOAT", rich_help_panel=SAMPLING,
                        help="Temperature; 0 is greedy and deterministic.")


def top_k_option():
    return typer.Option(40, "--top-k", min=0, metavar="K", rich_help_panel=SAMPLING,
                        help="Keep the k most likely tokens; 0 = off.")


def top_p_option():
    return typer.Option(0.95, "--top-p", min=0.0, max=1.0, metavar="P", rich_help_panel=SAMPLING,
                        help="Nucleus: keep the most likely tokens up to this mass (0-1).")


def min_p_option():
    return typer.Option(0.05, "--min-p", min=0.0, max=1.0, metavar="P", rich_help_panel=SAMPLING,
                        help="Drop tokens below this fraction of the top probability (0-1).")


def repeat_penalty_option():
    return typer.Option(1.0, "--repeat-penalty", min=0.0, metavar="FLOAT",
                        rich_help_panel=SAMPLING, help="Penalty for recently seen tokens; 1 = off.")


def seed_option(help_text: str = "Random seed; -1 (or none) draws a new one each run."):
    return typer.Option(None, "--seed", metavar="N", rich_help_panel=SAMPLING, help=help_text)


def max_tokens_option(default: int = -1, help_text: str = "Stop after this many tokens; -1 = "
                      "until the model ends."):
    return typer.Option(default, "--max-tokens", "-n", min=-1, metavar="N",
                        rich_help_panel=SAMPLING, help=help_text)


def stop_option():
    return typer.Option([], "--stop", metavar="TEXT", rich_help_panel=SAMPLING,
                        help="Stop at this string (repeatable).")


def system_option(help_text: str = "System message for chat models."):
    return typer.Option(None, "--system", "-s", metavar="TEXT", help=help_text)


def raw_option(help_text: str = "Send the prompt as is, without the chat template."):
    return typer.Option(False, "--raw", help=help_text)


def no_cache_option():
    return typer.Option(False, "--no-cache", rich_help_panel=CONTEXT,
                        help="Neither use nor fill the prompt cache.")


def json_schema_option(help_text: str = "Answer with one JSON document valid against this JSON "
                       "schema (a file, or inline JSON); decoding is constrained token by token."):
    return typer.Option(None, "--json-schema", metavar="SCHEMA", rich_help_panel=OUTPUT,
                        help=help_text)


def grammar_option(help_text: str = "Constrain the answer to this GBNF grammar file "
                   "(llama.cpp's grammar format)."):
    return typer.Option(None, "--grammar", metavar="FILE", rich_help_panel=OUTPUT, help=help_text)


def draft_option(default: str = "auto", help_text: str = "Speculative decoding: a draft MODEL, "
                 "auto (catalogue draft if on disk, else lookup), lookup, self, none."):
    return typer.Option(default, "--draft", metavar="DRAFTER", rich_help_panel=SPECULATION,
                        help=help_text)


def draft_max_option():
    return typer.Option(8, "--draft-max", min=0, metavar="N", rich_help_panel=SPECULATION,
                        help="Most tokens drafted per round (adaptive below it); 0 = none.")


def model_argument(help_text: str = "Catalogue name or alias[:QUANT], hf:OWNER/REPO[:QUANT], "
                   "hf:OWNER/REPO/FILE.gguf, or a path to a .gguf file."):
    return typer.Argument(..., metavar="MODEL", show_default=False, help=help_text)


def check_threads(value: int) -> int:
    top = max_threads()
    if not 0 <= value <= top:
        raise typer.BadParameter(f"must be 0 (automatic) to {top} (the CPUs this "
                                 f"machine has), not {value}")
    return value


def gpu_layers_option():
    return typer.Option("auto", "--gpu-layers", callback=check_gpu_layers, metavar="N",
                        rich_help_panel=BACKEND, help="Layers on the GPU: auto (as many as its free memory holds), N "
                        "(more than the model has = all), or 0 (CPU only).")


def check_gpu_layers(value: str) -> str:
    parse_gpu_layers(value)
    return value


def parse_gpu_layers(value: str) -> int | None:
    """--gpu-layers as a count (None for auto); anything else is refused before llama.cpp sees it."""
    text = value.strip().lower()
    if text == "auto":
        return None
    if not text.isascii() or not text.isdigit() or int(text) > MAX_GPU_LAYERS:
        raise typer.BadParameter(f"must be auto, 0 (CPU only) or a number of layers up to "
                                 f"{MAX_GPU_LAYERS}, not {value}")
    return int(text)


def ctx_option(default: int, minimum: int, help_text: str):
    """--ctx: 0 is automatic on every command (what that means is the command's: `default` where
    it is not 0), so `ctx = 0` in config.toml's [defaults] suits them all; else at least
    `minimum`."""
    def check(value: int) -> int:
        if value == 0:
            return default
        if value < minimum:
            raise typer.BadParameter(f"must be 0 (automatic) or at least {minimum}, not {value}")
        return value
    return typer.Option(default, "--ctx", "-c", min=0, max=MAX_CTX, metavar="TOKENS",
                        callback=check, rich_help_panel=CONTEXT, help=help_text)


def offline_option(help_text: str = "Never download; fail if the model is not on disk."):
    return typer.Option(False, "--offline", rich_help_panel=BACKEND, help=help_text)


def json_option(help_text: str = "Print JSON."):
    return typer.Option(False, "--json", rich_help_panel=OUTPUT, help=help_text)


def check_backend(backend: str) -> None:
    if backend not in BACKEND_CHOICES:   # before a pull, not after downloading the model
        raise UsageError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKEND_CHOICES)}")


# -- from the model option to a loaded model ------------------------------------------------------
def fit_model(model: str, *, quant: str, ctx: int, kv_type: str | None, memory_budget: str | None,
              threads: int, verbose: bool, offline: bool, gpu_layers: str = "auto",
              request: Request | None = None, vocab: Session | None = None
              ) -> tuple[refs.ModelRef, LoadOptions, Sized | None]:
    """The variant, context, KV type and GPU layers that fit the memory budget (pulled or
    quantized if need be; notes on stderr). With `run`'s `request` the context is sized to its
    prompt (fit.request; `vocab`, a loaded model, counts it), and the sizing comes back with the
    prompt as it is to be sent (--truncate may cut it)."""
    from localinfer.fit import auto, request as sizing
    fit = dict(quant=quant, kv_type=kv_type, memory_budget=memory_budget, offline=offline,
               notify=console.note, progress=console.interactive(),
               quantize_bar=lambda: console.progress_bar("quantizing"),
               download_bar=console.download_bar,
               gpu_layers=_gpu_layers(gpu_layers))
    if request is None:
        chosen, sized = auto.resolve(model, n_ctx=ctx, **fit), None
    else:
        sized = sizing.resolve(request, model, ctx=ctx, vocab=vocab, **fit)
        chosen = sized.resolved
    for note in (*chosen.notes, *(sized.notes if sized else ())):
        console.note(note)
    from localinfer.engine.prompt import is_long
    return chosen.ref, LoadOptions(n_ctx=chosen.n_ctx, n_threads=threads, verbose=verbose,
                                   kv_type=chosen.kv_type, gpu_layers=chosen.gpu_layers,
                                   long_prompt=sized is not None and is_long(sized.prompt)), sized


def open_model(model: str, *, backend: str, offline: bool, options: LoadOptions,
               gpu_layers: str | None = None) -> LoadedModel:
    """Load the model a name or path names, pulling it first if need be; `gpu_layers` (a
    --gpu-layers value) places its layers as `run` would, None keeps `options`'."""
    check_backend(backend)
    _, cat, _ = refs.context()
    return open_ref(refs.parse_ref(model, cat, offline=offline, notify=console.note),
                    backend=backend, offline=offline, options=options, gpu_layers=gpu_layers)


def open_ref(ref: refs.ModelRef, *, backend: str, offline: bool, options: LoadOptions,
             gpu_layers: str | None = None) -> LoadedModel:
    from dataclasses import replace

    from localinfer.engine.load import load_model
    path = refs.locate(ref, refs.model_store(), offline=offline, progress=console.interactive(),
                       notify=console.note, download_bar=console.download_bar)
    if gpu_layers is not None:
        from localinfer.fit import auto
        placed = auto.place_file(path, n_ctx=options.n_ctx, kv_type=options.kv_type,
                                 gpu_layers=_gpu_layers(gpu_layers))
        options = replace(options, gpu_layers=placed.gpu_layers)
    return load_model(ref, path, backend=backend, options=options)


def _gpu_layers(value: str) -> int | None:
    try:
        return parse_gpu_layers(value)
    except typer.BadParameter as e:     # a caller that skipped the option's check
        raise UsageError(f"--gpu-layers {e}") from None
