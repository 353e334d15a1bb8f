"""The cells a free slot keeps after its request, for the next request that starts the same way.

A finished request's cells stay in its sequence until the slot is taken again, as llama-server's
slots keep theirs: a conversation's next turn, or any prompt with the same system prompt, goes on
from them. They are only a cache: when the pool needs room they are dropped from their end, oldest
slot first, so a long conversation loses its last tokens before the whole of it.

A request paused to give its room back (engine/scheduler.py) leaves its cells here as well, marked
as its own: it continues from all of them, since they are what it computed itself. Anyone else
continues only from a point that keeps its logits a cold run's (engine/batching.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from localinfer.engine import batching


@dataclass
class Held:
    """What one slot's cells hold, from position 0."""

    tokens: list[int]
    from_prefix: int                # of them, the prefix sequence's own cells (shared, not ours)
    exact: batching.Exact           # how far they are what a cold evaluation computes
    owner: object | None = None     # the paused job they belong to

    @property
    def own(self) -> int:
        """Cells of the pool that are this slot's alone."""
        return len(self.tokens) - self.from_prefix


class Kept:
    """Free slots' cells, oldest first, on a BatchSession."""

    def __init__(self, batch) -> None:
        self.batch = batch
        self._held: dict[int, Held] = {}

    def put(self, seq: int, held: Held) -> None:
        self._held.pop(seq, None)
        self._held[seq] = held          # the newest last: dropped last

    def pop(self, seq: int) -> Held | None:
        return self._held.pop(seq, None)

    def get(self, seq: int) -> Held | None:
        return self._held.get(seq)

    def forget(self, seq: int) -> None:
        if self._held.pop(seq, None) is not None:
            self.batch.forget(seq)

    def clear(self) -> None:
        self._held.clear()

    def tokens(self) -> list[list[int]]:
        """What each slot's cells hold."""
        return [h.tokens for h in self._held.values()]

    def cells(self, keep: int | None = None) -> int:
        """Cells they hold, all but `keep`'s."""
        return sum(h.own for s, h in self._held.items() if s != keep)

    def owned_by(self, job) -> int | None:
        return next((s for s, h in self._held.items() if h.owner is job), None)

    def disown(self, job) -> None:
        """A paused job is over: its cells are a cache like any other's."""
        for held in self._held.values():
            if held.owner is job:
                held.owner = None

    def drop(self, cells: int, keep: int | None = None) -> int:
        """Free up to `cells` cells, from the end of the oldest slots' cells (all but `keep`'s);
        returns how many were freed."""
        freed = 0
        for seq in [s for s in self._held if s != keep]:
            if freed >= cells:
                break
            held = self._held[seq]
            cut = min(cells - freed, held.own)
            freed += cut
            n_keep = len(held.tokens) - cut
            if n_keep <= held.from_prefix:
                self.forget(seq)
                continue
            self.batch.trim(seq, n_keep)
            held.tokens = held.tokens[:n_keep]
            held.exact = replace(held.exact, end=min(held.exact.end, n_keep))
        return freed

    def reusable(self, seq: int, tokens: Sequence[int], n_prompt: int, *, base: int, window: int,
                 owner=None) -> int:
        """How many of `seq`'s cells a request may continue from: its own all they share (at
        least one token left to evaluate), another's only up to batching.reuse_point."""
        held = self._held.get(seq)
        if held is None:
            return 0
        common = common_prefix(tokens, held.tokens, len(tokens) - 1)
        if owner is not None and held.owner is owner:
            return common
        return min(common, batching.reuse_point(n_prompt, common, held.exact, window, base=base))


def common_prefix(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """Length of the shared start of a and b, at most `most`."""
    n = 0
    for x, y in zip(a, b):
        if x != y or n >= most:
            break
        n += 1
    return n
