"""Does a model fit this machine, and how: memory budgets and placement as pure functions.

Nothing here reads the machine or a file: `Machine` and `ModelFacts` describe them, so the rules
are tested on described machines (an 8 GB M1, a 24 GB PC with a 6 GB GPU, ...). `detect_machine`
in this module is the one place that reads the real one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localinfer.fit import memory
from localinfer.units import human_size

GB = 1000 ** 3
# Left free on a CPU machine for the OS and other programs, as a share of the RAM available now.
RAM_HEADROOM = 0.10
# llama.cpp keeps a little VRAM for the CUDA context and scratch; layers go to the GPU within this.
VRAM_HEADROOM = 0.10
KV_FALLBACKS = ("f16", "q8_0")     # what the fit may try, in order, to make a request fit
MIN_CTX = 512


@dataclass(frozen=True)
class Machine:
    ram_total: int
    ram_available: int
    apple_silicon: bool = False
    metal_working_set: int | None = None   # Metal's recommendedMaxWorkingSetSize
    vram_free: int = 0                      # CUDA: free memory of the GPU used for offload
    repacks: bool = True                    # x86 with AVX2: llama.cpp repacks some weights


@dataclass(frozen=True)
class Budget:
    ram: int            # bytes the CPU side may use
    vram: int           # bytes a discrete GPU may hold (0: none)
    source: str         # how the budget was found, for messages


def budget(machine: Machine, override: int | None = None) -> Budget:
    """What a model may use: an explicit override, else what the machine offers minus headroom."""
    if override is not None:
        return Budget(override, 0, "--memory / LOCALINFER_MEMORY_BUDGET")
    if machine.apple_silicon and machine.metal_working_set:
        # Unified memory: Metal's working-set limit bounds everything the model allocates.
        return Budget(min(machine.metal_working_set, machine.ram_available), 0,
                      "Metal recommended working set")
    ram = int(machine.ram_available * (1 - RAM_HEADROOM))
    vram = int(machine.vram_free * (1 - VRAM_HEADROOM))
    return Budget(ram, vram, "available RAM minus headroom" + (" + free VRAM" if vram else ""))


@dataclass(frozen=True)
class Placement:
    fits: bool
    n_ctx: int
    kv_type: str
    gpu_layers: int               # layers offloaded to the GPU (0: CPU only)
    needed: int                   # bytes on the CPU side
    notes: tuple[str, ...] = ()   # changes made to fit, for stderr


def place(facts: memory.ModelFacts, machine: Machine, budget_: Budget, *, n_ctx: int,
          kv_type: str | None = None, logits_rows: int = 1) -> Placement:
    """Fit one model: the requested context and KV type, else q8_0 KV, else a shorter context."""
    kv_choices = (kv_type,) if kv_type else KV_FALLBACKS
    ctx = n_ctx
    while True:
        for kv in kv_choices:
            request = memory.Request(ctx, kv_type=kv, logits_rows=logits_rows, repack=machine.repacks)
            placement = _split(facts, memory.estimate(facts, request), budget_, ctx, kv)
            if placement.fits:
                return replace(placement, notes=_notes(n_ctx, ctx, kv_type, kv))
        if ctx // 2 < MIN_CTX:
            return placement      # the smallest try: says how much it needs
        ctx //= 2


def _split(facts: memory.ModelFacts, est: memory.Estimate, budget_: Budget, ctx: int,
           kv: str) -> Placement:
    """Everything on the CPU when it fits; else as many layers as the GPU holds, the rest in RAM."""
    if est.required <= budget_.ram:
        return Placement(True, ctx, kv, 0, est.required)
    if budget_.vram <= 0 or facts.n_layer == 0:
        return Placement(False, ctx, kv, 0, est.required)
    # Offloaded layers take their weights and KV cells to the GPU (and are not repacked on the CPU).
    per_layer = (facts.file_size + est.kv_cache) / facts.n_layer
    layers = min(facts.n_layer, int(budget_.vram // per_layer))
    on_cpu = est.required - int(layers * per_layer)
    return Placement(on_cpu <= budget_.ram, ctx, kv, layers, on_cpu)


def _notes(asked_ctx: int, ctx: int, asked_kv: str | None, kv: str) -> tuple[str, ...]:
    notes = []
    if kv != "f16" and asked_kv is None:
        notes.append(f"using a {kv} KV cache to fit the memory budget")
    if ctx != asked_ctx:
        notes.append(f"context shortened from {asked_ctx} to {ctx} tokens to fit the memory budget")
    return tuple(notes)


@dataclass(frozen=True)
class Candidate:
    quant: str
    facts: memory.ModelFacts
    on_disk: bool


def choose_variant(candidates: list[Candidate], machine: Machine, budget_: Budget, *, n_ctx: int,
                   kv_type: str | None = None) -> tuple[Candidate, Placement] | None:
    """The most precise variant that fits (on-disk ones win a tie in precision); None if none does."""
    from localinfer.quant.quantize import PRECISION_ORDER
    rank = {q: i for i, q in enumerate(PRECISION_ORDER)}
    ordered = sorted(candidates, key=lambda c: (rank.get(c.quant, 99), not c.on_disk))
    for candidate in ordered:
        placement = place(candidate.facts, machine, budget_, n_ctx=n_ctx, kv_type=kv_type)
        if placement.fits:
            return candidate, placement
    return None


def does_not_fit(name: str, facts: memory.ModelFacts, machine: Machine, budget_: Budget, *,
                 kv_type: str | None, smaller_quant: str | None) -> str:
    """The one line a user reads when nothing fits: needed, available, and what would make it fit.

    `facts` is the smallest variant that was tried. The need is the least `place` can ask for (the
    shortest context, the smallest KV type it may choose), so the budget named is enough; the
    q4_0 hint is given only when `place` confirms it. `smaller_quant` says how to get a smaller
    variant, where one might exist.
    """
    least = place(facts, machine, budget_, n_ctx=MIN_CTX, kv_type=kv_type)
    hints = []
    if kv_type != "q4_0" and place(facts, machine, budget_, n_ctx=MIN_CTX, kv_type="q4_0").fits:
        hints.append(f"--kv-type q4_0 --ctx {MIN_CTX}")
    if smaller_quant:
        hints.append(f"a smaller quant ({smaller_quant})")
    hints.append(f"a budget of {_size_arg(least.needed)} or more (--memory)")
    return (f"{name} needs at least {human_size(least.needed)} (context {MIN_CTX}, {least.kv_type} "
            f"KV cache) but {human_size(budget_.ram)} is available ({budget_.source}); "
            f"it would fit with {' or '.join(hints)}")


def _size_arg(n: int) -> str:
    """`n` bytes as a --memory value, rounded up so that passing it back is enough."""
    return f"{-(-n // 100_000) / 10:.1f}MB"


def detect_machine() -> Machine:
    """This machine, as `place` sees it (CPU memory; GPU offload is not in this build)."""
    import psutil

    from localinfer.fit import machine
    mem = psutil.virtual_memory()
    apple = machine.is_apple_silicon()
    # Without Metal bindings we cannot ask for recommendedMaxWorkingSetSize; macOS sets it near
    # two thirds of unified memory on machines up to 36 GB and three quarters above.
    working_set = int(mem.total * (0.67 if mem.total <= 36 * 1024 ** 3 else 0.75)) if apple else None
    return Machine(ram_total=mem.total, ram_available=mem.available, apple_silicon=apple,
                   metal_working_set=working_set, repacks=memory.cpu_repacks())
