"""Whether a router's next model fits the memory budget beside the models it has open, by the same
estimate the fit places one model with (fit/memory.py): if not, the open ones are freed first
and the router runs its models one at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from localinfer.backends import LoadOptions
from localinfer.fit import auto, memory


@dataclass(frozen=True)
class Together:
    fits: bool
    need: int               # bytes the open models and the next one take together
    budget: int             # bytes the budget offers (RAM and a GPU's memory)


def estimate(path: Path, options: LoadOptions | None) -> int:
    """What one model file takes loaded with `options` (the fit's estimate)."""
    n_ctx = options.n_ctx if options and options.n_ctx else 4096
    kv_type = (options.kv_type if options else None) or "f16"
    facts = memory.facts_from_file(path)
    return memory.estimate(facts, memory.Request(n_ctx=n_ctx, kv_type=kv_type)).required


def together(open_models: Sequence[tuple[Path, LoadOptions | None]], path: Path,
             options: LoadOptions | None, memory_budget: str | None) -> Together:
    """Whether the model at `path` fits beside `open_models` ((file, options) each)."""
    _, budget = auto.machine_and_budget(memory_budget)
    need = sum(estimate(p, o) for p, o in open_models) + estimate(path, options)
    room = budget.ram + budget.vram
    return Together(need <= room, need, room)
