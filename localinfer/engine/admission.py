"""Who runs while the pool of cells is shared: the scheduler's admission (engine/scheduler.py).

Each request is promised its prompt and max_tokens (one token without max_tokens), within its
room, but no more than its share of the pool (n_ctx / parallel; its prompt and one token when the
prompt alone is more): a request within its promise is never paused or cut short, and admission
starts one only when the pool has its promise free. Beyond its promise a request grows into cells
nobody else needs, and gives back what it holds beyond its share when they are needed: a waiting
request that asks no more than its share pauses, the most recently admitted first, those holding
more than theirs, and so does a step that finds no cell for every growing request. A paused
request keeps its text and sampler; its cells stay as a free slot's (engine/slots.py: dropped from
their end as room is needed) and it goes back to the head of the queue, to continue from the
cells it still has once its room is free (what it lost is evaluated again as a prompt). When a
request has nobody to take room from, it ends with finish_reason "context" (the end of its
context, as in `run`).

So a small request behind a large one starts as soon as it has a slot, and one that asks more
than its share waits for its room without holding up the small ones behind it.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from localinfer.engine.slots import Held, common_prefix

# The scheduler's Job (engine/scheduler.py). Not imported, even for type checking: the scheduler
# imports this module, and the layout test keeps the two from importing each other.
Job = Any


class Admission:
    """The admission half of Scheduler: it holds `batch`, `parallel`, `share`, `prefix`,
    `store`, `_kept` and `_paused`, and `_refused`, `_room`, `_slot_for`, `_start`, `_finish`,
    `_end_early` and `_publish`."""

    def _admit(self, waiting: deque, running: dict, free: list[int],
               on_done: Callable[[Job], None]) -> None:
        """Start waiting jobs, in order, while a slot is free and the pool has their room; a job
        that asks more than its share lets those behind it that ask no more go first while it
        waits. Batch jobs leave one slot to interactive ones (when there are two or more), so
        that an interactive request never waits for a batch one to end."""
        i, large_waits = 0, False
        while free and i < len(waiting):
            job = waiting[i]
            if job.batch and not job.cancelled and \
                    sum(r.job.batch for r in running.values()) >= max(1, self.parallel - 1):
                i += 1          # (behind the interactive ones, but for a paused one)
                continue
            if job.cancelled or self._refused(job):
                del waiting[i]
                self._paused.pop(id(job), None)
                self._kept.disown(job)
                job.stats.finish_reason = "cancelled" if job.cancelled else ""
                on_done(job)
                continue
            modest = self._promise(job) <= self.share
            if large_waits and not modest:
                i += 1
                continue
            seq = self._slot_for(job, free)
            need = self._promise(job) - self._shared(job)
            # With nothing running it always starts: _refused made sure it fits an empty pool.
            if self._room_for(need, running, keep=seq) or not running or \
                    (modest and self._take_room(need, running, free, waiting, keep=seq)):
                del waiting[next(n for n, j in enumerate(waiting) if j is job)]
                free.remove(seq)
                running[seq] = self._start(job, seq)
                self._publish(running)
                i, large_waits = 0, False
                continue
            if modest:
                return          # it waits: a request that ends gives its cells back
            large_waits, i = True, i + 1

    def _promise(self, job: Job) -> int:
        """The positions admission promises a job: its prompt and max_tokens (else one token),
        within its room and no more than its share (or its prompt and a token, if more); a paused
        job, at least the positions it had."""
        most = job.limits.max_tokens
        want = min(len(job.prompt) + (most if most > 0 else 1), self._room(job.prompt))
        return max(min(want, max(self.share, len(job.prompt) + 1)),
                   len(job.prompt) + len(job.tokens))

    def _lends(self, r) -> bool:
        """Whether it holds more than its share: cells it gives back when another needs them."""
        return r.pos + len(r.pending) > max(self.share, len(r.job.prompt) + 1)

    def _shared(self, job: Job) -> int:
        # Its cells: the prefix's are shared, unless the prompt cache restores its own.
        return 0 if self.store else common_prefix(job.prompt, self.prefix, len(job.prompt) - 1)

    def _free_cells(self, running: dict, keep: int | None = None) -> int:
        held = len(self.prefix) + sum(r.claim() for r in running.values())
        return self.batch.n_ctx - held - self._kept.cells(keep)

    def _room_for(self, cells: int, running: dict, keep: int | None = None) -> bool:
        """Whether the pool has `cells` free, once free slots' kept cells (all but `keep`'s) are
        dropped as need be, from the end of the oldest slots' (only when that is enough)."""
        short = cells - self._free_cells(running, keep)
        if 0 < short <= self._kept.cells(keep):
            self._kept.drop(short, keep)
        return self._free_cells(running, keep) >= cells

    def _take_room(self, need: int, running: dict, free: list[int], waiting: deque,
                   keep: int) -> bool:
        """Pause requests holding more than their share, the most recently admitted first, until
        the pool has `need` cells; nobody is paused when all of them would not make it."""
        lenders = [s for s, r in running.items() if self._lends(r)]
        if not lenders or need > self._free_cells(running, keep) + self._kept.cells(keep) \
                + sum(running[s].claim() for s in lenders):
            return False
        for seq in reversed(lenders):
            self._pause(running, free, seq, waiting)
            if self._room_for(need, running, keep):
                return True
        return False

    def _out_of_room(self, running: dict) -> int | None:
        """The request to pause (or end) before the next step because the pool has no cell for
        every growing request's next token: of those holding more than their share, else of
        those growing past what they were promised, the most recently admitted."""
        growing = [s for s, r in running.items() if not r.pending and r.pos >= r.reserved]
        if not growing or self._room_for(len(growing), running):
            return None
        return ([s for s, r in running.items() if self._lends(r)] or growing)[-1]

    def _give_back(self, running: dict, free: list[int], seq: int, waiting: deque,
                   on_done: Callable[[Job], None]) -> None:
        """Paused, to continue when the others leave it room; ended at its context when alone."""
        if len(running) > 1:
            self._pause(running, free, seq, waiting)
        else:
            self._end_early(running[seq])
            self._finish(running, free, seq, "context", on_done)

    def _pause(self, running: dict, free: list[int], seq: int, waiting: deque) -> None:
        """A request gives its room back: its cells stay as its slot's (dropped from their end as
        room is needed) and it waits at the head of the queue, its text and sampler as they are."""
        r = running.pop(seq)
        held = (r.job.prompt + r.job.tokens)[:r.pos]
        self._kept.put(seq, Held(held, r.from_prefix, r.exact, owner=r.job))
        free.append(seq)
        self._paused[id(r.job)] = r.emit
        waiting.appendleft(r.job)
        self._publish(running)
