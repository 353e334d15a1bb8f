"""What the model pool (server/pool.py) counts and shows: memory needs, a fit's plan, one model's
entry and its `ps` line, and the pure rules over them: which idle models to unload to make room,
when an idle model expires, how a need is shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from localinfer.errors import LocalinferError
from localinfer.units import MAX_DURATION_SECONDS

# An entry's life: fitted, waiting for room, loading, loaded; or failed (its waiters get the error).
PLANNING, ROOM, LOADING, READY, FAILED = "planning", "room", "loading", "ready", "failed"


class Busy(LocalinferError):
    """More requests wait for models than the queue allows."""


class TooLarge(LocalinferError):
    """The model's need exceeds the whole budget."""


@dataclass(frozen=True)
class Need:
    """Memory a model holds while loaded: bytes of RAM and of (discrete) GPU memory."""

    ram: int
    vram: int = 0

    def __add__(self, other: Need) -> Need:
        return Need(self.ram + other.ram, self.vram + other.vram)

    def __sub__(self, other: Need) -> Need:
        return Need(self.ram - other.ram, self.vram - other.vram)

    def within(self, room: Need) -> bool:
        return self.ram <= room.ram and self.vram <= room.vram

    @property
    def total(self) -> int:
        return self.ram + self.vram


@dataclass(frozen=True)
class Plan:
    """What a fit decided for one model: its need, its context, and what `load` needs to load it
    as fitted (`detail`, opaque to the pool)."""

    need: Need
    n_ctx: int = 0
    detail: object = None
    processor: str = ""         # where it runs, when the need alone cannot say (unified memory)


@dataclass(frozen=True)
class Status:
    """One model in the pool, as `ps` shows it."""

    name: str
    state: str                  # "loading" or "ready"
    need: Need
    n_ctx: int
    users: int                  # leases held now
    expires_in: float | None    # seconds until it is unloaded if left idle; None: never
    processor: str              # "100% CPU", "100% GPU", "30%/70% CPU/GPU", as `ollama ps` says


def processor(need: Need) -> str:
    """Where a need runs, by its shares of RAM and GPU memory."""
    if not need.vram:
        return "100% CPU"
    gpu = round(100 * need.vram / need.total)
    return "100% GPU" if gpu == 100 else f"{100 - gpu}%/{gpu}% CPU/GPU"


@dataclass(eq=False)
class Entry:
    """One model in the pool, from the first request for it until it is unloaded."""

    name: str
    keep_alive: float           # seconds idle before it is unloaded; math.inf: never
    state: str = PLANNING
    plan: Plan | None = None
    model: object = None
    error: BaseException | None = None
    users: int = 0              # leases held
    waiters: int = 0            # acquires waiting for this entry to load
    last_used: float = 0.0
    expires_at: float | None = None     # when it is unloaded if left idle; None while in use
    stopped: bool = False               # an unload was asked for (Pool.stop), not a keep-alive

    @property
    def idle(self) -> bool:
        return self.state == READY and self.users == 0 and self.waiters == 0


def bounded(seconds: float) -> float:
    """A keep-alive the pool and its timers can count with: negative, not a number, or past the
    longest duration (units.MAX_DURATION_SECONDS) is for ever (math.inf), as parse_duration
    reads them; a Python caller may hand the pool any of these."""
    try:
        seconds = float(seconds)
    except (OverflowError, TypeError, ValueError):
        return math.inf
    return seconds if 0 <= seconds < MAX_DURATION_SECONDS else math.inf


def why_unloaded(entry: Entry) -> str:
    """What the log says of an idle model unloaded by `expire`."""
    if entry.stopped:
        return "asked to: localinfer stop, or keep_alive 0 with no prompt"
    if entry.keep_alive == 0:
        return "its request said keep_alive 0"
    return f"idle for its keep-alive, {entry.keep_alive:g} s"


def expires_in(entry: Entry, now: float) -> float | None:
    """Seconds until an entry is unloaded if left idle (None: never)."""
    if entry.keep_alive == math.inf:
        return None
    if entry.expires_at is None:        # in use (or loading): at least its keep-alive from now
        return entry.keep_alive
    return max(0.0, entry.expires_at - now)


def memory_arg(n: int) -> str:
    """`n` bytes as a --memory value, rounded up so that passing it back is enough: '812MB',
    '1.3GB'."""
    if n < 1000 ** 3:
        return f"{-(-n // 1000 ** 2)}MB"
    return f"{-(-n // 10 ** 8) / 10:.1f}GB"


def held(entries, freeing: Need) -> Need:
    """Memory held by the loaded and loading models among `entries`, and `freeing` (models
    being unloaded)."""
    return freeing + sum((e.plan.need for e in entries if e.state in (LOADING, READY)), Need(0))


def victims(entries, freeing: Need, need: Need, room: Need) -> list[Entry] | None:
    """The least recently used idle models to unload for `need` to fit `room` ([] when it fits
    as it is); None when even unloading every idle model would not make room."""
    entries = list(entries)
    taken = held(entries, freeing)
    chosen = []
    for candidate in sorted((e for e in entries if e.idle), key=lambda e: e.last_used):
        if (taken + need).within(room):
            break
        chosen.append(candidate)
        taken -= candidate.plan.need
    return chosen if (taken + need).within(room) else None
