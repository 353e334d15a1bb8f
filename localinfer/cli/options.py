"""Options several commands share, the ranges their values must keep, and the step from them to
the library's options (pipeline/ does the rest: fit, load, generate).

The ranges are llama.cpp's: past them it aborts the process (100,000 threads: std::bad_alloc),
overruns its fixed-size tables (more than GGML_MAX_N_THREADS threads), truncates (n_ctx is 32 bits
in its C structs) or crawls: ggml's threads spin-wait for one another at every step, so threads
beyond the CPUs make each step far slower (measured on 2 CPUs: 16 threads took 22 s and 64 threads
57 s for what 2 do in under a second; 512 did not finish in 200 s).
"""

from __future__ import annotations

import typer

from localinfer import machine, settings
from localinfer.backends import BACKEND_CHOICES
from localinfer.cli import console
from localinfer.errors import UsageError
from localinfer.fit.options import FitOptions, Reporter, gpu_layers_count

GGML_MAX_N_THREADS = 512      # ggml.h: the size of the thread pool's tables
# Tokens of context (and of one `eval` chunk, which is also its batch). The longest context any
# model is trained for is 10M tokens (Llama 4 Scout); memory bounds it further at run time.
MAX_CTX = 1 << 24


def max_threads() -> int:
    """The most `--threads` may ask for: the CPUs this process may run on (see above)."""
    return min(machine.usable_cpus(), GGML_MAX_N_THREADS)


# -- the options ----------------------------------------------------------------------------------
# The panels `--help` groups options into, the same names on every command.
SAMPLING = "Sampling"
CONTEXT = "Context and memory"
SPECULATION = "Speculation"
OUTPUT = "Output"
BACKEND = "Backend"
SERVER = "Server"
THINKING = "Thinking"


def verbose_option(help_text: str = "-v: timings and stats on stderr; -vv: the engine's log too."):
    """-v counts: 1 is our stats block, 2 (or --debug) adds llama.cpp's own log."""
    return typer.Option(0, "--verbose", "-v", count=True, help=help_text, rich_help_panel=OUTPUT,
                        show_default=False, metavar="")


def engine_log(verbose: int) -> bool:
    """Whether the engine's own log goes to stderr: -vv, or --debug."""
    return verbose >= 2 or console.debugging()


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


def frequency_penalty_option():
    return typer.Option(0.0, "--frequency-penalty", min=-2.0, max=2.0, metavar="FLOAT",
                        rich_help_panel=SAMPLING, show_default=False,
                        help="Subtract per repeat, -2 to 2; 0 = off.")


def presence_penalty_option():
    return typer.Option(0.0, "--presence-penalty", min=-2.0, max=2.0, metavar="FLOAT",
                        rich_help_panel=SAMPLING, show_default=False,
                        help="Subtract once if seen, -2 to 2.")


def logit_bias_option():
    return typer.Option([], "--logit-bias", metavar="ID=BIAS", rich_help_panel=SAMPLING,
                        show_default=False, help="Add BIAS to token ID (repeatable).")


def penalties(frequency: float, presence: float, biases: list[str]) -> dict:
    """The penalty options as SamplingParams' fields (which check their ranges)."""
    pairs = {}
    for said in biases:
        token, _, bias = said.partition("=")
        try:
            pairs[int(token)] = float(bias)
        except ValueError:
            raise UsageError(f"--logit-bias '{said[:40]}' must be ID=BIAS, a token id and a "
                             "number, e.g. 42=-100") from None
    return {"frequency_penalty": frequency, "presence_penalty": presence,
            "logit_bias": tuple(pairs.items())}


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


def think_option():
    # A value or none: `--think` alone is `--think on` (cli.app.optional_think_value).
    return typer.Option(None, "--think", show_default=False, metavar="LEVEL",
                        rich_help_panel=THINKING,
                        help="Thinking models: on, off, or gpt-oss's low|medium|high.")


def no_think_option():
    return typer.Option(False, "--no-think", rich_help_panel=THINKING, show_default=False,
                        help="--think off.")


def think_budget_option():
    return typer.Option(None, "--think-budget", min=0, max=MAX_CTX, metavar="TOKENS",
                        rich_help_panel=THINKING, show_default=False,
                        help="End the trace after this many tokens so that an answer follows.")


def show_thinking_option():
    return typer.Option(None, "--show-thinking/--hide-thinking", rich_help_panel=THINKING,
                        show_default=False,
                        help="The trace on stderr (default: on a terminal, not in a pipe).")


def think_settings(think: str | None, no_think: bool, budget: int | None):
    """--think, --no-think and --think-budget as the library's Think."""
    from localinfer.thinking.style import Think, check_think
    if no_think and think not in (None, "off"):
        raise UsageError(f"--no-think and --think {think} say opposite things; give one")
    return Think("off" if no_think else check_think(think), budget)


def misread_think(args: list[str], message: str) -> str | None:
    """The line for click's "unexpected extra argument" when a word after a bare `--think` was
    meant as its value (`--think maybe`): `--think` alone is `--think on` (cli.app), so the word
    became an argument, one too many. `args`: the command line as typed."""
    from localinfer.thinking.style import THINK_VALUES
    if "unexpected extra argument" not in message:
        return None
    args = args[:args.index("--")] if "--" in args else args
    words = [after for arg, after in zip(args, args[1:])
             if arg == "--think" and after not in THINK_VALUES and not after.startswith("-")]
    if not words:
        return None
    shown = words[0] if len(words[0]) <= 40 else words[0][:37] + "..."
    return (f"--think must be one of {', '.join(THINK_VALUES)} (got {shown!r}); --think alone "
            "means --think on")


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


def rpc_option():
    return typer.Option(None, "--rpc", metavar="HOST:PORT,...", callback=check_rpc,
                        rich_help_panel=BACKEND, help="Also compute on these `localinfer "
                        "worker`s (or LOCALINFER_RPC): layers spread by memory.")


def check_rpc(value: str | None) -> str | None:
    """--rpc, else LOCALINFER_RPC, checked and recorded; the workers are connected when a model
    is first fitted or loaded (backends/llama/rpc.py)."""
    from localinfer.backends.llama import rpc
    if value is not None:
        try:
            rpc.request(rpc.parse_endpoints(value))
        except UsageError as e:
            raise typer.BadParameter(str(e).removeprefix("--rpc: ")) from None
    elif settings.load().rpc:
        rpc.request(rpc.parse_endpoints(settings.load().rpc, "LOCALINFER_RPC"))
    return value


def cpu_moe_option():
    return typer.Option("auto", "--cpu-moe", callback=check_cpu_moe, metavar="N",
                        rich_help_panel=BACKEND, help="Mixture-of-experts models on a GPU: keep "
                        "the experts of the first N layers in RAM, everything else on the GPU "
                        "(auto: as few as make the rest fit its free memory; 0: none).")


def check_cpu_moe(value: str) -> str:
    parse_cpu_moe(value)
    return value


def parse_cpu_moe(value: str) -> int | None:
    """--cpu-moe as a number of layers (None for auto); anything else is refused here."""
    from localinfer.fit.moe import cpu_moe_count
    try:
        return cpu_moe_count(value)
    except UsageError as e:
        raise typer.BadParameter(str(e).removeprefix("--cpu-moe ")) from None


def check_gpu_layers(value: str) -> str:
    parse_gpu_layers(value)
    return value


def parse_gpu_layers(value: str) -> int | None:
    """--gpu-layers as a count (None for auto); anything else is refused before llama.cpp sees it."""
    try:
        return gpu_layers_count(value)
    except UsageError as e:
        raise typer.BadParameter(str(e).removeprefix("--gpu-layers ")) from None


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


def logprobs_option(needs: str = "--json"):
    return typer.Option(None, "--logprobs", metavar="N", rich_help_panel=OUTPUT,
                        show_default=False,
                        help=f"Raw log-probabilities in {needs}, N alternatives each (0-20).")


def check_logprobs(n: int | None, as_json: bool, needs: str = "--json") -> int | None:
    """--logprobs in range and with the output that carries it, refused before anything loads."""
    from localinfer.engine.logprobs import MAX_TOP
    if n is None:
        return None
    if not 0 <= n <= MAX_TOP:
        raise UsageError(f"--logprobs must be from 0 to {MAX_TOP}, not {n}")
    if not as_json:
        raise UsageError(f"--logprobs needs {needs}: the log-probabilities are printed in its "
                         "JSON")
    return n


def check_backend(backend: str) -> None:
    """--backend checked before anything is pulled (pipeline.load's rule, imported on use: the
    pipeline's imports would cost every `localinfer --help` 30 ms)."""
    from localinfer.pipeline.load import check_backend as check
    check(backend)


# -- from the options to the library's --------------------------------------------------------
def reporter() -> Reporter:
    """The fit's and the pull's notes and bars on stderr (bars on a terminal only)."""
    return Reporter(notify=console.note, progress=console.interactive(),
                    quantize_bar=lambda: console.progress_bar("quantizing"),
                    download_bar=console.download_bar)


def fit_options(*, quant: str = "auto", ctx: int = 0, kv_type: str | None = None,
                memory: str | None = None, gpu_layers: str = "auto",
                offline: bool = False, cpu_moe: str = "auto") -> FitOptions:
    """The fit's options from the command line's (--gpu-layers and --cpu-moe as written)."""
    from localinfer.fit.moe import cpu_moe_count
    return FitOptions(quant=quant, ctx=ctx, kv_type=kv_type, memory=memory,
                      gpu_layers=gpu_layers_count(gpu_layers), offline=offline,
                      cpu_moe=cpu_moe_count(cpu_moe))
