"""What a caller asks of the fit, and how the fit reports back: two frozen dataclasses that travel
from the command line (or `localinfer.load`) down to `fit.auto` and `fit.request` unchanged.

A misspelt field is a TypeError where it is written, not a silent None where it is read.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

Notify = Callable[[str], None]
# A progress display for one quantization, handed in by the command line (nothing on a pipe).
QuantizeBar = Callable[[], ContextManager[Callable[[int, int, str], None] | None]]


def _silent(_: str) -> None:
    pass


@dataclass(frozen=True)
class FitOptions:
    """The model's variant, context, KV cache and placement as asked (`run`'s options)."""

    quant: str = "auto"             # --quant: auto = the most precise variant that fits
    ctx: int = 0                    # --ctx: 0 = sized to the prompt (run) or the default
    kv_type: str | None = None      # --kv-type: None = f16, q8_0 when that is what fits
    memory: str | None = None       # --memory: the budget as written ("6GB"); None = detected
    gpu_layers: int | None = None   # --gpu-layers: None = as many as the GPU's memory holds
    cpu_moe: int | None = None      # --cpu-moe: layers whose experts stay in RAM; None = fit.moe
    offline: bool = False           # --offline: never download
    rope_scaling: str = ""          # serve --rope-scaling: yarn or linear stretches the trained
                                    # context to --ctx; "" never goes past it
    # May quantize a variant into the store when none on disk fits (an operator's command; a
    # server's request only with serve --pull): False refuses instead, writing nothing.
    quantize_to_fit: bool = True
    mmproj: str = ""                # --mmproj (or one found beside the model): images and audio


@dataclass(frozen=True)
class Reporter:
    """Where the fit's notes and progress go: silent unless a caller hands in its own."""

    notify: Notify = _silent
    progress: bool = False                   # a Hub pull may draw its own bar
    quantize_bar: QuantizeBar = nullcontext  # a quantization made to fit
    download_bar: Callable | None = None     # a pull from the pip mirror (fetch.DownloadBar)


# --gpu-layers: llama.cpp's own limit on a model's layers is 512 (LLAMA_MAX_LAYERS); more means all.
MAX_GPU_LAYERS = 1 << 16


def gpu_layers_count(value: str | int | None) -> int | None:
    """A --gpu-layers value as a count (None for auto), refused before llama.cpp sees it."""
    from localinfer.errors import UsageError
    text = "auto" if value is None else str(value).strip().lower()
    if text == "auto":
        return None
    if not text.isascii() or not text.isdigit() or int(text) > MAX_GPU_LAYERS:
        raise UsageError(f"--gpu-layers must be auto, 0 (CPU only) or a number of layers up to "
                         f"{MAX_GPU_LAYERS}, not {value}")
    return int(text)
