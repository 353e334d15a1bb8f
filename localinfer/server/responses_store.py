"""The responses `serve` keeps for the Responses API's `previous_response_id` and its
GET and DELETE /v1/responses/{id}: in memory only, never on disk, bounded in count, in the bytes
they hold and in age. The oldest goes first when a bound is reached; one past its age is gone as
if deleted. A request with `store: false` leaves nothing here.

Each entry holds the conversation up to and including that response, as the chat messages
server/requests.py takes (a later request's `input` is added after them), and the response
object as it was sent. A chain of responses shares its earlier messages (the same dicts), but
each entry is charged for the whole conversation it keeps alive: the bound on bytes holds
however the chain is cut by evictions.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_COUNT = 1000              # responses kept
MAX_BYTES = 64 << 20          # their conversations and response objects, as JSON
MAX_AGE_S = 24 * 3600.0       # from when each was stored


@dataclass(frozen=True)
class Stored:
    messages: tuple[dict, ...]      # the conversation through this response's own output
    response: dict                  # the response object, as GET returns it
    size: int
    at: float                       # time.monotonic() when stored


class Store:
    """What is kept, by response id; safe to use from the event loop and worker threads."""

    def __init__(self, *, count: int = MAX_COUNT, size: int = MAX_BYTES,
                 age_s: float = MAX_AGE_S, clock=time.monotonic) -> None:
        self.count, self.size, self.age_s, self.clock = count, size, age_s, clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        """Keep a finished response and the conversation through it (too large to keep: not
        kept, so a later request naming it gets the 404 an expired one gets)."""
        size = len(json.dumps(messages)) + len(json.dumps(response))
        if size > self.size:
            return
        entry = Stored(tuple(messages), response, size, self.clock())
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = entry
            self._bytes += size
            while len(self._entries) > self.count or self._bytes > self.size:
                self._drop(next(iter(self._entries)))

    def get(self, ident: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._entries.get(ident)

    def delete(self, ident: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(ident)

    def _expire(self) -> None:
        """Entries are in the order stored, so the expired ones are at the front."""
        oldest = self.clock() - self.age_s
        while self._entries and next(iter(self._entries.values())).at < oldest:
            self._drop(next(iter(self._entries)))

    def _drop(self, ident: str) -> bool:
        entry = self._entries.pop(ident, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
