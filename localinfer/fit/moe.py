"""Mixtures of experts on a discrete GPU: which layers keep their expert tensors in host memory.

A MoE model's expert tensors (`blk.N.ffn_{gate,up,down}_exps`) are most of its bytes, yet each
token reads only the few experts its router picks. So when the whole model does not fit the GPU,
keeping the experts of some layers in host memory, with attention, norms, router and shared
weights of every layer on the GPU, decodes much faster than leaving whole layers on the CPU.
This is llama.cpp's `--n-cpu-moe N`: the experts of layers 0..N-1 go to the CPU's buffer type
through `llama_model_params.tensor_buft_overrides`, every other tensor to the GPU.

Pure functions of a model's facts and a GPU budget, so decisions are tested on described machines;
`backends/llama/overrides.py` turns the count into llama.cpp's patterns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from localinfer.errors import UsageError

# The tensors llama.cpp's --n-cpu-moe pattern takes (backends/llama/overrides.py): the expert
# weights and their biases (gpt-oss) alike.
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate)_exps\b")
# --cpu-moe: more than llama.cpp's LLAMA_MAX_LAYERS means all, as --gpu-layers does.
MAX_CPU_MOE = 1 << 16


def expert_bytes(tensors, n_layer: int) -> tuple[int, ...]:
    """Bytes of expert tensors in each layer (all zero for a dense model)."""
    per_layer = [0] * n_layer
    for t in tensors:
        found = _EXPERT_TENSOR.match(t.name)
        if found and int(found.group(1)) < n_layer:
            per_layer[int(found.group(1))] += t.n_bytes
    return tuple(per_layer)


def cpu_moe_count(value: str | int | None) -> int | None:
    """A --cpu-moe value as a number of layers (None for auto), refused before llama.cpp sees it."""
    text = "auto" if value is None else str(value).strip().lower()
    if text == "auto":
        return None
    if not text.isascii() or not text.isdigit() or int(text) > MAX_CPU_MOE:
        raise UsageError(f"--cpu-moe must be auto, 0 (every expert on the GPU) or a number of "
                         f"layers whose experts stay in host memory, not {value!r}")
    return int(text)


def check_asked(experts: tuple[int, ...], asked: int | None, architecture: str) -> None:
    """--cpu-moe on a model without experts is a mistake worth one clear line."""
    if asked and not any(experts):
        raise UsageError(f"--cpu-moe applies to mixture-of-experts models; this one "
                         f"({architecture}) has no expert tensors: leave it out")


@dataclass(frozen=True)
class ExpertSplit:
    cpu_moe: int          # layers (the first ones) whose experts stay in host memory
    moved: int            # their expert bytes, kept off the GPU


def experts_to_host(experts: tuple[int, ...], whole: int, vram: int) -> ExpertSplit | None:
    """The fewest layers whose experts must stay in host memory for the rest of the model to fit
    the GPU: `whole` is what the GPU would hold with every layer on it (weights, KV cache, compute
    buffer). None when there are no experts, or when even with all of them in host memory the
    rest does not fit (then whole layers stay on the CPU instead)."""
    if not any(experts):
        return None
    if whole <= vram:
        return ExpertSplit(0, 0)
    moved = 0
    for n, size in enumerate(experts, start=1):
        moved += size
        if whole - moved <= vram:
            return ExpertSplit(n, moved)
    return None


def asked_split(experts: tuple[int, ...], asked: int) -> ExpertSplit:
    """--cpu-moe N: the experts of the first N layers (all of them when N is more)."""
    n = min(asked, len(experts))
    return ExpertSplit(n, sum(experts[:n]))


def describe(cpu_moe: int, n_layer: int) -> str:
    """`experts of 12 of 48 layers in host memory`, for -v, info and devices."""
    return f"experts of {cpu_moe} of {n_layer} layers in host memory"
