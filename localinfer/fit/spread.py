"""A model spread over this machine and RPC workers: how many layers each holds, as pure functions.

llama.cpp puts the first layers on the CPU and the last `n_gpu_layers` (the output layer counted)
on its devices: the workers first, in the order they were given, then the local GPU; it splits
those layers between the devices by the free memory each reports (llama_model_base::load_tensors).
So `n_gpu_layers` is the one value a fit chooses, and `llama_shares` says what llama.cpp will make
of it. The fit chooses it so that the layers sit where the memory is: in proportion to what each
side offers, the CPU included, within what each can hold; a local GPU, being faster than any
network hop, takes all it can first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localinfer.backends.llama.devices import llama_shares
from localinfer.units import human_size


@dataclass(frozen=True)
class Device:
    name: str          # "worker 10.0.0.2:50052", "the GPU"
    free: int          # what it reports: llama.cpp's split weighs by this
    budget: int        # what the fit lets it hold (free less headroom)
    compute: int       # the compute buffer it reserves once it holds a layer


@dataclass(frozen=True)
class Spread:
    offloaded: int                 # n_gpu_layers
    shares: tuple[int, ...]        # layers on each device, in llama.cpp's order
    held: tuple[int, ...]          # bytes each device holds for them
    overfull: str = ""             # the first device that cannot hold its share, in words


def spread(n: int, devices: Sequence[Device], per_layer: float) -> Spread:
    """What each device holds with `n` layers offloaded, and the first that cannot."""
    shares = llama_shares(n, [d.free for d in devices])
    held = [int(s * per_layer) + (d.compute if s else 0) for d, s in zip(devices, shares)]
    overfull = ""
    for device, share, size in zip(devices, shares, held):
        if size > device.budget:
            overfull = (f"{device.name} can hold {human_size(device.budget)} but its share, "
                        f"{share} of {n} offloaded layers, needs {human_size(size)}")
            break
    return Spread(n, tuple(shares), tuple(held), overfull)


def choose(total: int, devices: Sequence[Device], per_layer: float, *,
           cpu_fixed: int, ram: int, gpu_first: bool) -> Spread:
    """The offloaded count for an automatic fit: every device holding its share, the CPU the
    rest (`cpu_fixed` bytes besides its layers, `ram` its budget), and as near as that allows to
    an even spread by memory (all it can hold first when `gpu_first`). When none fits, the spread
    that leaves the least in RAM, to say how much more it needs."""
    def cpu_fits(n: int) -> bool:
        return cpu_fixed + (total - n) * per_layer <= ram
    fitting = [s for s in (spread(n, devices, per_layer) for n in range(total + 1))
               if not s.overfull]
    if not fitting:
        return spread(0, devices, per_layer)
    if gpu_first:
        target = total
    else:
        offered = sum(d.budget for d in devices)
        target = round(total * offered / max(1, offered + max(ram - cpu_fixed, 0)))
    feasible = [s for s in fitting if cpu_fits(s.offloaded)]
    pool = feasible or [max(fitting, key=lambda s: s.offloaded)]
    return min(pool, key=lambda s: (abs(s.offloaded - target), -s.offloaded))


def describe(spread_: Spread, devices: Sequence[Device], total: int) -> str:
    """Where the layers go, in words: "16 of 31 layers on the CPU, 15 on worker 10.0.0.2:50052
    (120 MB of 4.0 GB)"."""
    parts = [f"{total - spread_.offloaded} of {total} layers on the CPU"]
    for device, share, held in zip(devices, spread_.shares, spread_.held):
        parts.append(f"{share} on {device.name} ({human_size(held)} of "
                     f"{human_size(device.budget)})")
    return ", ".join(parts)
