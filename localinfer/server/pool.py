"""Several models in one server, inside one memory budget: loaded on demand, unloaded when idle.

A request `acquire`s a model by name and holds a `Lease` on it until its answer is done; a leased
model is never unloaded. A model not loaded yet is fitted (`plan`, which gives its memory need)
and loaded (`load`) in a thread of its own, one load per model at a time; everyone who asks for it
meanwhile waits for that load. Before a load, the least recently used idle models are unloaded
until the new one's need fits the budget beside those that stay; while even that is not enough
(the others are in use), the load waits for room, in the order the loads were asked for. The
waiting is bounded: past `queue_limit` waiters an acquire is refused at once (`Busy`). A model
that cannot fit even alone is refused with the --memory it would need (`TooLarge`).

Keep-alive, as Ollama means it: an idle model is unloaded `keep_alive` seconds after its last
lease ends (0: as soon as it ends; math.inf: never; negative, not a number or past Go's longest
duration, about 292 years: never, pool_state.bounded). The latest acquire's keep-alive is the
model's. `expire()` unloads what is due; the pool's reaper thread calls it when something falls
due, and no value it is given ends that thread.

Everything is guarded by one lock, and waiting is either a thread's (`acquire`) or a coroutine's
(`acquire_async`, for the server's event loop): each is woken by `_notify` on any change and looks
again. Loads and unloads run outside the lock, so `ps` and other models' requests never wait on them.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from typing import Callable, Generic, TypeVar

from localinfer.errors import LocalinferError, ModelLoadError
from localinfer.server.pool_state import (FAILED, LOADING, READY, ROOM, Busy, Entry, Need, Plan,
                                          Status, TooLarge, bounded, expires_in, held, memory_arg,
                                          processor, victims, why_unloaded)
from localinfer.units import human_size

M = TypeVar("M")
DEFAULT_KEEP_ALIVE = 300.0      # Ollama's: five minutes
# The reaper looks again at least this often: a long timed wait is where a huge value would
# overflow, and nothing is lost by waking early (it waits again).
REAP_WAKE_SECONDS = 3600.0


class Lease(Generic[M]):
    """A loaded model, pinned until `release` (idempotent; also on leaving a `with` block)."""

    def __init__(self, pool: Pool, entry: Entry) -> None:
        self._pool, self._entry, self._held = pool, entry, True
        self.name: str = entry.name
        self.plan: Plan = entry.plan

    @property
    def model(self) -> M:
        # Read through the entry, which lets go of the model once it is unloaded: a lease kept
        # after its release does not keep the model's Python side (a 262k-token vocabulary) alive.
        return self._entry.model

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pool._release(self._entry)

    def __enter__(self) -> Lease[M]:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Pool(Generic[M]):
    """Models by name inside `budget` (less `overhead`, what the process holds once whatever it
    loads: the runtime). `plan(name)` fits a model (may raise: the acquire gets the error);
    `load(name, plan)` loads it; `unload(model)` frees it (default: `model.close()`). `log` hears
    one line per load and unload, `fault` (default: `log`) one per failure. With `reaper`, a
    thread unloads models as they expire;
    without, only `expire()` does (tests drive it with their own `clock`)."""

    def __init__(self, budget: Need, plan: Callable[[str], Plan], load: Callable[[str, Plan], M],
                 *, unload: Callable[[M], None] = lambda model: model.close(),
                 overhead: Need = Need(0), keep_alive: float = DEFAULT_KEEP_ALIVE,
                 queue_limit: int = 64, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda line: None,
                 fault: Callable[[str], None] | None = None, reaper: bool = True) -> None:
        self.budget, self.overhead, self.room = budget, overhead, budget - overhead
        self.keep_alive, self.queue_limit = bounded(keep_alive), queue_limit
        self._plan, self._load, self._unload = plan, load, unload
        self._clock, self._log, self._fault = clock, log, fault or log
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._models: dict[str, Entry] = {}        # planning, waiting for room, loading, loaded
        self._room_queue: list[Entry] = []         # loads waiting for room, first asked first
        self._freeing = Need(0)                     # held by models being unloaded right now
        self._waiting = 0                           # acquires not yet answered
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="localinfer-pool-reaper",
                                        daemon=True) if reaper else None
        if self._reaper:
            self._reaper.start()

    # -- acquiring ---------------------------------------------------------------------------------
    def acquire(self, name: str, keep_alive: float | None = None) -> Lease[M]:
        """The model, loaded if need be (this thread waits); raises the load's error, `Busy` or
        `TooLarge`. `keep_alive`: seconds it stays loaded once idle (units.parse_duration's:
        math.inf for ever); None: the pool's default."""
        with self._lock:
            lease, entry, new = self._enter(name, keep_alive)
        if lease is not None:
            return lease
        if new:
            self._start_load(entry)
        with self._lock:
            try:
                while not self._settled(entry):
                    self._changed.wait()
                return self._take(entry, keep_alive)
            finally:
                self._leave(entry)

    async def acquire_async(self, name: str, keep_alive: float | None = None) -> Lease[M]:
        """`acquire` for a coroutine: it waits without holding a thread. Cancelled while its model
        loads, it leaves the queue; the load goes on, and the model stays loaded as idle."""
        wake = asyncio.Event()
        with self._lock:
            lease, entry, new = self._enter(name, keep_alive)
            if lease is not None:
                return lease
            listener = (asyncio.get_running_loop(), wake)
            self._listeners.add(listener)
        try:
            if new:
                self._start_load(entry)
            while True:
                with self._lock:
                    if self._settled(entry):
                        return self._take(entry, keep_alive)
                    wake.clear()        # under the lock: a change after this look sets it again
                await wake.wait()
        finally:
            with self._lock:
                self._listeners.discard(listener)
                self._leave(entry)

    def _enter(self, name: str, keep_alive) -> tuple[Lease | None, Entry | None, bool]:
        """(a lease at once, or the entry to wait for and whether this acquire starts its load)."""
        if self._closed:
            raise LocalinferError("the server is shutting down")
        entry = self._models.get(name)
        if entry is not None and entry.state == READY:
            return self._pin(entry, keep_alive), None, False
        if self._waiting >= self.queue_limit:
            raise Busy(f"too many requests are waiting for models ({self.queue_limit}); "
                       "try again shortly")
        new = entry is None
        if new:
            entry = self._models[name] = Entry(name, self.keep_alive)
        entry.waiters += 1
        self._waiting += 1
        return None, entry, new

    def _settled(self, entry: Entry) -> bool:
        return entry.state in (READY, FAILED)

    def _take(self, entry: Entry, keep_alive) -> Lease[M]:
        if entry.state == FAILED:
            raise _again(entry.error)
        return self._pin(entry, keep_alive)

    def _leave(self, entry: Entry) -> None:
        entry.waiters -= 1
        self._waiting -= 1
        self._notify()      # a load nobody waits for any more may be abandoned

    def _pin(self, entry: Entry, keep_alive) -> Lease[M]:
        entry.users += 1
        entry.keep_alive = self.keep_alive if keep_alive is None else bounded(keep_alive)
        entry.expires_at, entry.stopped = None, False
        entry.last_used = self._clock()
        return Lease(self, entry)

    def _release(self, entry: Entry) -> None:
        with self._lock:
            entry.users -= 1
            entry.last_used = now = self._clock()
            if entry.users == 0:
                entry.expires_at = now + entry.keep_alive
            self._notify()

    # -- loading -----------------------------------------------------------------------------------
    def _start_load(self, entry: Entry) -> None:
        # In a thread of its own: the load goes on if the acquire that started it is cancelled.
        threading.Thread(target=self._bring_in, args=(entry,), name="localinfer-pool-load",
                         daemon=True).start()

    def _bring_in(self, entry: Entry) -> None:
        """Fit, wait for room, unload what must go, load; any failure fails this entry alone."""
        started = time.perf_counter()
        try:
            plan = self._plan(entry.name)
            with self._lock:
                entry.plan = plan
                self._check_alone(entry)
                entry.state = ROOM
                self._room_queue.append(entry)
                victims = self._wait_for_room(entry)
            self._close(victims, "to make room for " + entry.name)
            model = self._load(entry.name, plan)
        except _Abandoned:
            return
        except BaseException as e:     # noqa: BLE001 - whatever the engine raised, one line
            self._fail(entry, e)
            return
        self._loaded(entry, model, time.perf_counter() - started)

    def _check_alone(self, entry: Entry) -> None:
        self.check_fits(entry.name, entry.plan.need)

    def check_fits(self, name: str, need: Need) -> None:
        """TooLarge unless `need` fits the budget with no other model loaded."""
        if need.within(self.room):
            return
        if need.ram > self.room.ram:
            raise TooLarge(f"{name} needs --memory {memory_arg(need.ram + self.overhead.ram)}"
                           f"; the budget is {human_size(self.budget.ram)}")
        raise TooLarge(f"{name} needs {human_size(need.vram)} of GPU memory; "
                       f"{human_size(self.room.vram)} is free for models")

    def _wait_for_room(self, entry: Entry) -> list[Entry]:
        """Under the lock, until `entry` is first in line and fits once the least recently used
        idle models go: those models, taken out of the pool (their memory counted as being
        freed until they are closed)."""
        while True:
            if self._closed:
                raise LocalinferError("the server is shutting down")
            if entry.waiters == 0:
                self._room_queue.remove(entry)
                del self._models[entry.name]
                self._notify()
                raise _Abandoned
            first = self._room_queue[0] is entry
            going = victims(self._models.values(), self._freeing, entry.plan.need,
                            self.room) if first else None
            if going is not None:
                self._room_queue.pop(0)
                for victim in going:
                    del self._models[victim.name]
                    self._freeing += victim.plan.need
                entry.state = LOADING
                self._notify()          # the next load in line may look for room now
                return going
            self._changed.wait()

    def _loaded(self, entry: Entry, model: M, seconds: float) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                entry.model, entry.state = model, READY
                entry.last_used = now = self._clock()
                if entry.waiters == 0:      # everyone who asked has gone: idle from now
                    entry.expires_at = now + entry.keep_alive
                self._notify()
        if closed:          # stopped while it loaded: its requests get the stop, not the model
            self._fail(entry, LocalinferError("the server is shutting down"))
            self._unload(model)
            return
        self._log(f"loaded {entry.name} ({human_size(entry.plan.need.total)}, {seconds:.1f} s)")

    def _fail(self, entry: Entry, error: BaseException) -> None:
        if not isinstance(error, LocalinferError):
            error = ModelLoadError(f"could not load {entry.name}: {error}")
        with self._lock:
            entry.state, entry.error = FAILED, error
            if entry in self._room_queue:
                self._room_queue.remove(entry)
            if self._models.get(entry.name) is entry:
                del self._models[entry.name]
            self._notify()
        self._fault(str(error) if entry.name in str(error) else f"{entry.name}: {error}")

    # -- unloading ---------------------------------------------------------------------------------
    def _close(self, entries: list[Entry], why: str | None = None) -> None:
        """Unload models already taken out of the pool; their memory is free once each is
        closed. `why` goes in the log (None: each entry's own reason, why_unloaded)."""
        for entry in entries:
            try:
                self._unload(entry.model)
                self._log(f"unloaded {entry.name} ({why or why_unloaded(entry)})")
            except Exception as e:      # noqa: BLE001 - counted as freed: the model is gone
                self._fault(f"unloading {entry.name} failed: {e}")
            with self._lock:
                entry.model = None
                self._freeing -= entry.plan.need
                self._notify()

    def expire(self) -> list[str]:
        """Unload every idle model whose keep-alive has run out; their names."""
        with self._lock:
            now = self._clock()
            due = [e for e in self._models.values()
                   if e.idle and e.expires_at is not None and e.expires_at <= now]
            for entry in due:
                del self._models[entry.name]
                self._freeing += entry.plan.need
        self._close(due)
        return [e.name for e in due]

    def stop(self, name: str) -> bool:
        """Unload a model as soon as no request holds it (`localinfer stop`); False if it is not
        loaded."""
        with self._lock:
            entry = self._models.get(name)
            if entry is None or entry.state != READY:
                return False
            entry.keep_alive, entry.stopped = 0.0, True
            if entry.users == 0:
                entry.expires_at = self._clock()
            self._notify()
        if self._reaper is None:
            self.expire()
        return True

    def _reap(self) -> None:
        """The reaper thread: sleeps until the next expiry (or any change), then expires. It
        outlives any failure of one round: a pool whose reaper died would never unload again."""
        while True:
            try:
                if not self._reap_once():
                    return
            except Exception as e:      # noqa: BLE001 - said once a round, and the thread goes on
                self._fault(f"the pool's reaper: {type(e).__name__}: {e}")
                time.sleep(1.0)

    def _reap_once(self) -> bool:
        """One wait and, when something is due, one expiry; False once the pool is closed."""
        with self._lock:
            if self._closed:
                return False
            due = [e.expires_at for e in self._models.values()
                   if e.idle and e.expires_at is not None and e.expires_at < math.inf]
            wait = min(due) - self._clock() if due else REAP_WAKE_SECONDS
            if wait > 0:
                self._changed.wait(timeout=min(wait, REAP_WAKE_SECONDS))
                return True
        self.expire()
        return True

    def close(self) -> None:
        """Stop: unload every loaded model (the server has stopped answering); later acquires
        are refused, and a load under way is unloaded when it ends."""
        with self._lock:
            self._closed = True
            ready = [e for e in self._models.values() if e.state == READY]
            for entry in ready:
                del self._models[entry.name]
                self._freeing += entry.plan.need
            self._notify()
        self._close(ready, "the server is stopping")
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)

    # -- looking -----------------------------------------------------------------------------------
    def peek(self, name: str) -> M | None:
        """The model loaded under `name` now, without a lease (None: not loaded)."""
        with self._lock:
            entry = self._models.get(name)
            return entry.model if entry is not None and entry.state == READY else None

    def status(self) -> list[Status]:
        """The models loaded or loading, most recently used first (`ps`, /api/ps, /metrics).
        One whose keep-alive has run out is left out: the reaper is unloading it, and a client
        that asked for the unload (keep_alive 0, `stop`) must not see it listed after."""
        with self._lock:
            now = self._clock()
            shown = [e for e in self._models.values() if e.state in (LOADING, READY)
                     and not (e.idle and e.expires_at is not None and e.expires_at <= now)]
            return [Status(e.name, "ready" if e.state == READY else "loading", e.plan.need,
                           e.plan.n_ctx, e.users, expires_in(e, now),
                           e.plan.processor or processor(e.plan.need))
                    for e in sorted(shown, key=lambda e: -e.last_used)]

    def held(self) -> Need:
        """Memory held by loaded and loading models, and by those being unloaded."""
        with self._lock:
            return held(self._models.values(), self._freeing)

    @property
    def waiting(self) -> int:
        """Acquires waiting for a model to load (the queue depth)."""
        return self._waiting

    def _notify(self) -> None:
        """Under the lock: every waiting thread and coroutine looks again."""
        self._changed.notify_all()
        for loop, wake in self._listeners:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:        # that loop has closed: nobody is left to wake
                pass


class _Abandoned(Exception):
    """Every request for a model waiting for room has gone: its load is not worth the room."""


def _again(error: BaseException) -> BaseException:
    """Each waiter raises its own copy of a load's error (one traceback each), the message the
    same."""
    try:
        return copy.copy(error)
    except Exception:       # noqa: BLE001 - an exception that cannot be copied: the original
        return error


