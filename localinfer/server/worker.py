"""The scheduler in a thread of its own, fed by a bounded queue of jobs from the HTTP handlers.

A request that fails ends alone (the scheduler records its error and goes on); `error` is set only
when the scheduler itself stops, i.e. the model can no longer run at all.

An interactive request announces itself (`expect`) as soon as its model is leased: while its prompt
is being prepared, a step that would decode batch jobs alone waits for it (HOLD_SECONDS at most).
On a machine whose cores the decode keeps busy, the handler's template and tokenizer work would
otherwise share them with batch steps, and its first token come later by that much.

Work that is not a generation (`between`: a prompt's own log-probabilities, engine/echo.py) runs
in the scheduler's thread between two steps, in the sequence the scheduler keeps for a shared
prefix, which a server never gives it (so no request's cells are in it). It runs whole there,
not a piece per step: its cells are outside the scheduler's accounting of the pool, so they must
be free again before the next step, or that step could find no cell for a request it admitted.
It waits for the cells it needs: free slots' kept cells (a cache) are dropped for it, and while
requests fill the rest it waits for a step that leaves room.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from localinfer.backends import BatchSession
from localinfer.engine.scheduler import Job, Occupancy, Scheduler

_STOP = object()
HOLD_SECONDS = 0.25     # the longest a batch step waits for an expected interactive request
_POLL_SECONDS = 0.005   # how often a waiting step looks again (the request may have failed)


@dataclass(frozen=True)
class Between:
    """Work on the batch between two steps: `work(batch, seq)` in a sequence of its own with
    `cells` free for it; its result (or exception) goes to `future`."""

    cells: int
    work: Callable[[BatchSession, int], object]
    future: Future


@dataclass(frozen=True)
class Load:
    """One model's requests and cells now (/metrics)."""

    waiting: int            # submitted, not yet given a sequence
    running: int            # being decoded
    cells_used: int         # KV cells holding tokens
    cells: int              # KV cells of the context


class Worker:
    """Runs every submitted job on the model; `submit` refuses a job when `capacity` (the slots
    and the waiting room) are all taken by jobs not yet done. `request_ctx`: the positions one
    request may fill (the whole pool, by default)."""

    def __init__(self, batch: BatchSession, capacity: int, store=None,
                 request_ctx: int | None = None) -> None:
        self.batch, self.capacity, self.store = batch, capacity, store     # store: prompt cache
        self.request_ctx = request_ctx or batch.n_ctx
        self._queue: queue.Queue = queue.Queue()
        self._callbacks: dict[int, tuple[Job, Callable[[Job], None]]] = {}
        self._stopping = False
        self._expected = 0          # interactive requests leased, not yet submitted
        self._expected_until = 0.0  # the newest one's hold ends then (monotonic seconds)
        self._between: deque[Between] = deque()     # the scheduler thread's own
        self._tasks = 0             # Between work submitted and not done
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._scheduler: Scheduler | None = None
        self._thread = threading.Thread(target=self._run, name="localinfer-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job, on_done: Callable[[Job], None]) -> bool:
        """Queue a job (on_done(job) is called from the scheduler's thread); False when full."""
        with self._lock:
            # A cancelled job (its client gone) no longer takes room: the scheduler frees it
            # before its next step, and this one waits behind it for that step at most.
            if self._busy() >= self.capacity:
                return False
            self._callbacks[id(job)] = job, on_done
        self._queue.put(job)
        return True

    def between(self, task: Between) -> bool:
        """Queue work to run between two steps (see the module's notes); False when full."""
        with self._lock:
            if self._busy() >= self.capacity or self.error is not None:
                return False
            self._tasks += 1
        self._queue.put(task)
        return True

    def _busy(self) -> int:
        return sum(not j.cancelled for j, _ in self._callbacks.values()) + self._tasks

    def expect(self) -> Callable[[], None]:
        """An interactive request is being prepared for this model; call what this returns once
        it is submitted or has failed (later calls do nothing)."""
        with self._lock:
            self._expected += 1
            self._expected_until = time.monotonic() + HOLD_SECONDS
        said = []

        def arrived() -> None:
            if not said:
                said.append(True)
                with self._lock:
                    self._expected -= 1
        return arrived

    def load(self) -> Load:
        """What it holds now, from any thread: the jobs not done that have no sequence wait."""
        held = self._scheduler.occupancy if self._scheduler else Occupancy()
        with self._lock:
            outstanding = len(self._callbacks)
        return Load(max(outstanding - held.running, 0), held.running, held.cells_used,
                    self.batch.n_ctx)

    def stop(self) -> None:
        """No more jobs: those running finish (or are cancelled by their handlers), then it ends."""
        self._queue.put(_STOP)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        try:
            self._scheduler = Scheduler(self.batch, store=self.store,
                                        request_ctx=self.request_ctx)
            self._scheduler.run([], self._done, self._arrivals)
        except BaseException as e:        # the engine cannot go on: later requests get a 500
            self.error, self._scheduler = e, None       # nothing runs on it any more
            with self._lock:
                pending, self._callbacks = list(self._callbacks.values()), {}
            for job, on_done in pending:
                job.error = f"the model failed: {e}"
                on_done(job)
        self._drop_between()

    def _drop_between(self) -> None:
        """Work that can no longer run (the worker stopped or failed) ends with an error."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Between):
                self._between.append(item)
        while self._between:
            self._finish_between(self._between.popleft(), RuntimeError(
                f"the model failed: {self.error}" if self.error else "the model was unloaded"))

    def _done(self, job: Job) -> None:
        with self._lock:
            _, on_done = self._callbacks.pop(id(job))
        on_done(job)

    def _arrivals(self, idle: bool) -> list[Job] | None:
        """What came in since the last step; blocks while there is nothing to do."""
        if self._stopping:
            return None
        came, block = [], idle and not self._between
        while True:
            wait = None if block or came else self._hold()
            try:
                item = self._queue.get(block=block or wait is not None, timeout=wait)
            except queue.Empty:
                if wait is not None:
                    continue            # still expected: look again
                break
            if item is _STOP:
                self._stopping = True
                return came or None
            if isinstance(item, Between):
                self._between.append(item)
            else:
                came.append(item)
            block = False
        self._run_between()
        return came

    def _run_between(self) -> None:
        """The work waiting that has room now, in the order it came, in the sequence the
        scheduler keeps for a prefix (a server passes none)."""
        scheduler = self._scheduler
        while self._between and not scheduler.prefix:
            task = self._between[0]
            free = self.batch.n_ctx - scheduler.occupancy.cells_used
            if free < task.cells:   # free slots' cells are a cache: dropped as admission would
                free += scheduler._kept.drop(task.cells - free)
            if free < task.cells:
                return              # requests hold the rest: a later step leaves room
            self._between.popleft()
            try:
                result = task.work(self.batch, scheduler.parallel)
            except Exception as e:      # its own failure: the scheduler's requests go on
                self._finish_between(task, e)
            else:
                self._finish_between(task, None, result)

    def _finish_between(self, task: Between, error: BaseException | None,
                        result: object = None) -> None:
        with self._lock:
            self._tasks -= 1
        if error is not None:
            task.future.set_exception(error)
        else:
            task.future.set_result(result)

    def _hold(self) -> float | None:
        """How long to wait for an expected interactive request before the next step (None: not
        at all): only while no interactive job runs, whose tokens a wait would delay, and for
        HOLD_SECONDS after the newest was leased at most."""
        held = self._scheduler.occupancy if self._scheduler else Occupancy()
        left = self._expected_until - time.monotonic()
        if self._expected <= 0 or held.interactive or left <= 0:
            return None
        return min(left, _POLL_SECONDS)
