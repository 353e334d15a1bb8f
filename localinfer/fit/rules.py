"""Does a model fit this machine, and how: memory budgets and placement as pure functions.

Nothing here reads the machine or a file: `Machine` and `ModelFacts` describe them, so the rules
are tested on described machines (an 8 GB M1, a 24 GB PC with a 6 GB GPU, ...). `detect_machine`
in this module is the one place that reads the real one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localinfer.fit import memory, moe, spread
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
    # A GPU that shares the CPU's memory (Metal, integrated GPUs): the most it may use, as the
    # engine reports it (Metal's recommended working set); None: no such GPU in the engine.
    metal_working_set: int | None = None
    vram_free: int = 0                      # discrete GPUs: free memory the engine reports, summed
    repacks: bool = True                    # x86 with AVX2: llama.cpp repacks some weights
    # RPC workers' devices (--rpc), in llama.cpp's order: (name, free memory they report).
    workers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Budget:
    ram: int            # bytes the CPU side may use
    vram: int           # bytes a discrete GPU may hold (0: none)
    source: str         # how the budget was found, for messages
    workers: tuple[int, ...] = ()   # bytes each RPC worker device may hold


def budget(machine: Machine, override: int | None = None) -> Budget:
    """What a model may use: an explicit override (of the RAM; a discrete GPU keeps its own),
    else what the machine offers minus headroom."""
    vram = int(machine.vram_free * (1 - VRAM_HEADROOM))
    # A worker keeps headroom as a GPU does: its own runtime and scratch live beside the layers.
    workers = tuple(int(free * (1 - VRAM_HEADROOM)) for _, free in machine.workers)
    if override is not None:
        return Budget(override, vram, "--memory / LOCALINFER_MEMORY_BUDGET", workers)
    if machine.metal_working_set:
        # Unified memory, counted once: the GPU's working-set limit bounds everything the model
        # allocates, and the GPU's memory is the RAM, never added to it.
        return Budget(min(machine.metal_working_set, machine.ram_available), 0,
                      "Metal recommended working set" if machine.apple_silicon
                      else "the integrated GPU's share of RAM", workers)
    ram = int(machine.ram_available * (1 - RAM_HEADROOM))
    return Budget(ram, vram, "available RAM minus headroom" + (" + free VRAM" if vram else ""),
                  workers)


@dataclass(frozen=True)
class Placement:
    fits: bool
    n_ctx: int
    kv_type: str
    gpu_layers: int               # layers on the GPU, the output layer counted (0: CPU only)
    needed: int                   # bytes on the CPU side
    notes: tuple[str, ...] = ()   # changes made to fit, for stderr
    on_gpu: int = 0               # bytes on a discrete GPU (weights, KV cells, compute buffer)
    layers: int = 0               # every layer llama.cpp places: n_layer + 1 (the output layer)
    cpu_moe: int = 0              # layers whose expert tensors stay in host memory (fit.moe)
    spread: str = ""              # with RPC workers: where the layers go, in words
    overfull: str = ""            # with RPC workers: the device that cannot hold its share


def place(facts: memory.ModelFacts, machine: Machine, budget_: Budget, *, n_ctx: int,
          kv_type: str | None = None, logits_rows: int = memory.RUN_LOGITS_ROWS,
          gpu_layers: int | None = None, min_ctx: int = MIN_CTX,
          cpu_moe: int | None = None) -> Placement:
    """Fit one model: the requested context and KV type, else q8_0 KV, else a shorter context,
    never shorter than `min_ctx` (what the prompt needs, when it is known).

    `gpu_layers` (--gpu-layers) fixes how many layers go to the GPU; None: as many as it holds.
    `cpu_moe` (--cpu-moe) fixes how many layers keep their experts in host memory; None: as few
    as make the rest fit the GPU (fit.moe).
    """
    moe.check_asked(facts.expert_bytes, cpu_moe, facts.architecture)
    kv_choices = (kv_type,) if kv_type else KV_FALLBACKS
    ctx = n_ctx
    while True:
        for kv in kv_choices:
            request = memory.Request(ctx, kv_type=kv, logits_rows=logits_rows, repack=machine.repacks)
            placement = _split(facts, request, machine, budget_, gpu_layers, cpu_moe)
            if placement.fits:
                spread_ = (f"placed over the workers: {placement.spread}",) \
                    if placement.spread else ()
                return replace(placement, notes=(*_notes(n_ctx, ctx, kv_type, kv), *spread_))
        if ctx <= min_ctx or ctx // 2 < MIN_CTX:
            return placement      # the smallest try: says how much it needs
        ctx = max(ctx // 2, min_ctx)


def _split(facts: memory.ModelFacts, request: memory.Request, machine: Machine, budget_: Budget,
           gpu_layers: int | None, cpu_moe: int | None = None) -> Placement:
    """Where the layers go. A GPU that shares the RAM takes them all: one pool holds the model. A
    discrete GPU takes as many as its free memory holds (all when they fit, as llama.cpp would),
    the rest stay in RAM; a mixture of experts keeps experts in RAM first (`_experts_split`).
    Without a GPU the engine can use, everything is on the CPU."""
    est = memory.estimate(facts, request)
    ctx, kv, total = request.n_ctx, request.kv_type, facts.n_layer + 1
    unified = machine.metal_working_set is not None
    if machine.workers:
        return _over_workers(facts, request, est, machine, budget_, gpu_layers)
    # Asked for, the override is passed on wherever the experts are (on a CPU it changes nothing).
    asked = moe.asked_split(facts.expert_bytes, cpu_moe).cpu_moe if cpu_moe else 0
    if not unified and (budget_.vram <= 0 or facts.n_layer == 0):
        return Placement(est.required <= budget_.ram, ctx, kv, 0, est.required, layers=total,
                         cpu_moe=asked)
    # An offloaded layer takes its weights and KV cells to the GPU (and is not repacked on the
    # CPU); the layer-count rule is llama.cpp's, the output layer being the last of n_layer + 1.
    per_layer = (facts.file_size + est.kv_cache) / total
    compute = gpu_compute(facts, request)
    if not unified and (cpu_moe is not None or gpu_layers is None):
        experts = _experts_split(facts, request, est, compute, budget_, gpu_layers, cpu_moe)
        if experts is not None:
            return experts
    if gpu_layers is not None:
        layers = min(gpu_layers, total)
    elif unified:
        layers = total
    else:
        layers = max(0, min(total, int((budget_.vram - compute) // per_layer)))
    on_gpu = int(layers * per_layer) + (compute if layers else 0)
    on_cpu = est.required if unified else est.required - int(layers * per_layer)
    return Placement(on_cpu <= budget_.ram, ctx, kv, layers, on_cpu, on_gpu=on_gpu, layers=total,
                     cpu_moe=asked)


def _over_workers(facts: memory.ModelFacts, request: memory.Request, est: memory.Estimate,
                  machine: Machine, budget_: Budget, gpu_layers: int | None) -> Placement:
    """The layers over the RPC workers and this machine (fit.spread): the workers and a local
    GPU hold the shares llama.cpp splits by free memory, the CPU (or unified memory) the rest."""
    total = facts.n_layer + 1
    per_layer = (facts.file_size + est.kv_cache) / total
    compute = gpu_compute(facts, request)
    unified = machine.metal_working_set is not None
    # A worker's compute buffer holds no logits: the output layer stays here (overrides.py).
    on_worker = memory._activations(facts, request)
    devices = [spread.Device(f"worker {name}", free, held, on_worker)
               for (name, free), held in zip(machine.workers, budget_.workers)]
    if unified:      # llama.cpp offloads every layer; the Metal GPU's share is held in the RAM
        devices.append(spread.Device("this Mac's GPU", machine.metal_working_set, budget_.ram,
                                     compute))
    elif machine.vram_free:
        devices.append(spread.Device("the GPU", machine.vram_free, budget_.vram, compute))
    # With workers the output layer stays here (backends/llama/overrides.py), as a layer's worth;
    # its share on the last device is counted there too: the fit errs on the safe side.
    cpu_fixed = est.required - int(total * per_layer) + (0 if unified else int(per_layer))
    if unified or gpu_layers is not None:
        chosen = spread.spread(total if unified else min(gpu_layers, total), devices, per_layer)
    else:
        chosen = spread.choose(total, devices, per_layer, cpu_fixed=cpu_fixed,
                               ram=budget_.ram, gpu_first=bool(machine.vram_free))
    n_workers = len(machine.workers)
    remote_layers = sum(chosen.shares[:n_workers])
    if unified:
        on_cpu, on_gpu = est.required - int(remote_layers * per_layer), 0
    else:
        on_cpu = cpu_fixed + int((total - chosen.offloaded) * per_layer)
        on_gpu = sum(chosen.held[n_workers:])
    return Placement(not chosen.overfull and on_cpu <= budget_.ram, request.n_ctx,
                     request.kv_type, chosen.offloaded, on_cpu, on_gpu=on_gpu, layers=total,
                     spread=spread.describe(chosen, devices, total), overfull=chosen.overfull)


def footprint(facts: memory.ModelFacts, request: memory.Request, machine: Machine, *,
              gpu_layers: int, cpu_moe: int) -> Placement:
    """Where a model loaded as fitted holds its memory: `needed` bytes in RAM, `on_gpu` bytes on
    a discrete GPU, with `gpu_layers` on the GPU (-1: all) and `cpu_moe` layers' experts in RAM
    (LoadOptions' fields, as the fit chose them)."""
    layers = facts.n_layer + 1 if gpu_layers < 0 else gpu_layers
    return _split(facts, request, machine, budget(machine), layers, cpu_moe or None)


def _experts_split(facts: memory.ModelFacts, request: memory.Request, est: memory.Estimate,
                   compute: int, budget_: Budget, gpu_layers: int | None,
                   cpu_moe: int | None) -> Placement | None:
    """Every layer on the GPU but the experts of the first ones, kept in RAM: as few as make the
    rest fit the GPU (or --cpu-moe's count). None when the model has no experts, or when even
    its attention and shared weights do not fit the GPU: whole layers stay on the CPU then."""
    on_gpu_all = facts.file_size + est.kv_cache
    if cpu_moe is not None:
        split = moe.asked_split(facts.expert_bytes, cpu_moe)
    else:
        split = moe.experts_to_host(facts.expert_bytes, on_gpu_all + compute, budget_.vram)
    if split is None or (split.cpu_moe == 0 and cpu_moe is None):
        return None        # no experts, or all fits: the layer rule below says the same
    total = facts.n_layer + 1
    layers = total if gpu_layers is None else min(gpu_layers, total)
    # Weights and KV cells of the layers on the GPU, less the experts kept in RAM.
    on_gpu = max(0, int(on_gpu_all * layers / total) - split.moved) + (compute if layers else 0)
    on_cpu = est.required - int(on_gpu_all * layers / total) + split.moved
    return Placement(on_cpu <= budget_.ram, request.n_ctx, request.kv_type, layers, on_cpu,
                     on_gpu=on_gpu, layers=total, cpu_moe=split.cpu_moe)


def gpu_compute(facts: memory.ModelFacts, request: memory.Request) -> int:
    """The compute buffer a GPU reserves once it holds layers: one micro-batch of activations and
    every logits row a decode call may return. Unlike the CPU's, whose untouched pages cost
    nothing, device memory is taken whole when it is reserved."""
    return memory._activations(facts, request) + memory.N_OUTPUTS_MAX * facts.n_vocab * 4


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
                   kv_type: str | None = None, gpu_layers: int | None = None,
                   min_ctx: int = MIN_CTX,
                   cpu_moe: int | None = None) -> tuple[Candidate, Placement] | None:
    """The most precise variant that fits (on-disk ones win a tie in precision); None if none does."""
    from localinfer.quant.quantize import PRECISION_ORDER
    rank = {q: i for i, q in enumerate(PRECISION_ORDER)}
    ordered = sorted(candidates, key=lambda c: (rank.get(c.quant, 99), not c.on_disk))
    for candidate in ordered:
        placement = place(candidate.facts, machine, budget_, n_ctx=n_ctx, kv_type=kv_type,
                          gpu_layers=gpu_layers, min_ctx=min_ctx, cpu_moe=cpu_moe)
        if placement.fits:
            return candidate, placement
    return None


def does_not_fit(name: str, facts: memory.ModelFacts, machine: Machine, budget_: Budget, *,
                 kv_type: str | None, smaller_quant: str | None,
                 gpu_layers: int | None = None, cpu_moe: int | None = None) -> str:
    """The one line a user reads when nothing fits: needed, available, and what would make it fit.

    `facts` is the smallest variant that was tried. The need is the least `place` can ask for (the
    shortest context, the smallest KV type it may choose), so the budget named is enough; the
    q4_0 hint is given only when `place` confirms it. `smaller_quant` says how to get a smaller
    variant, where one might exist. With a discrete GPU the need is what stays in RAM once the
    GPU holds what it can.
    """
    least = place(facts, machine, budget_, n_ctx=MIN_CTX, kv_type=kv_type, gpu_layers=gpu_layers,
                  cpu_moe=cpu_moe)
    if least.overfull:
        return f"{name} does not fit as asked: {least.overfull}; try a smaller --gpu-layers"
    hints = []
    if kv_type != "q4_0" and place(facts, machine, budget_, n_ctx=MIN_CTX, kv_type="q4_0",
                                   gpu_layers=gpu_layers, cpu_moe=cpu_moe).fits:
        hints.append(f"--kv-type q4_0 --ctx {MIN_CTX}")
    if smaller_quant:
        hints.append(f"a smaller quant ({smaller_quant})")
    hints.append(f"a budget of {_size_arg(least.needed)} or more (--memory)")
    split = f" in RAM with {least.gpu_layers} of {least.layers} layers on the GPU" \
        if least.on_gpu and machine.metal_working_set is None else ""
    if machine.workers:
        split = f" in RAM with {least.gpu_layers} of {least.layers} layers on the workers"
    if split and least.cpu_moe:
        split += f" ({moe.describe(least.cpu_moe, facts.n_layer)})"
    return (f"{name} needs at least {human_size(least.needed)}{split} (context {MIN_CTX}, "
            f"{least.kv_type} KV cache) but {human_size(budget_.ram)} is available "
            f"({budget_.source}); "
            f"it would fit with {' or '.join(hints)}")


def _size_arg(n: int) -> str:
    """`n` bytes as a --memory value, rounded up so that passing it back is enough."""
    return f"{-(-n // 100_000) / 10:.1f}MB"


def detect_machine() -> Machine:
    """This machine, as `place` sees it: RAM from the operating system, GPUs from the engine's
    device registry (their free memory as the driver reports it now)."""
    from localinfer import machine
    from localinfer.backends.llama import devices as llama_devices
    from localinfer.fit import gpu
    ram_total, ram_available = machine.ram()
    apple = machine.is_apple_silicon()
    found = llama_devices.devices()
    vram, shared = gpu.memory_of(found, apple_silicon=apple)
    workers = tuple((d.description, d.memory_free) for d in found if d.backend == "RPC")
    return Machine(ram_total=ram_total, ram_available=ram_available, apple_silicon=apple,
                   metal_working_set=shared, vram_free=vram, repacks=memory.cpu_repacks(),
                   workers=workers)
