"""`map`'s input: stdin's lines, read in a thread of their own."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator

_END = object()        # the reading thread is done


class Feed:
    """stdin's lines, read in a thread of their own so that a producer that pauses never stalls
    the answers under way; what one read of stdin brought waits here, two reads at most. A bad
    line (not text, too long) ends the input there: `error` holds why, raised once the lines
    before it are answered."""

    def __init__(self, reads: Iterator[list[str]], ahead: int) -> None:
        self.ahead = ahead              # lines read but not printed yet, at most (map's window)
        self.error: Exception | None = None
        self.exhausted = False
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._lines: deque[str] = deque()
        threading.Thread(target=self._read, args=(reads,), daemon=True,
                         name="map-stdin").start()

    def _read(self, reads: Iterator[list[str]]) -> None:
        try:
            for lines in reads:
                self._queue.put(lines)
        except Exception as e:      # noqa: BLE001 - handed to the main thread, raised there
            self._queue.put(e)
        self._queue.put(_END)

    def peek(self) -> str | None:
        """The first line, waiting for it (None: there is none); a bad first line is raised."""
        if not self._lines and not self.exhausted:
            first = self.take(block=True)
            if first is not None:
                self._lines.appendleft(first)
        if self.error and not self._lines:
            raise self.error
        return self._lines[0] if self._lines else None

    def take(self, *, block: bool) -> str | None:
        """The next line; None when none is there yet (block: until one is) or ever will be."""
        while not self._lines and not self.exhausted:
            try:
                item = self._queue.get(block=block)
            except queue.Empty:
                return None
            if isinstance(item, list):
                self._lines.extend(item)
                continue
            self.exhausted = True
            if isinstance(item, Exception):
                self.error = item
        return self._lines.popleft() if self._lines else None
