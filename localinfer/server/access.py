"""One log line per request (`serve -v`): method, path, status, model, tokens and seconds (and
`closed_early=N` where a constrained answer's last N tokens were narrowed to close it in time, and
`priority=batch` for a batch request); and, logged or not, the request counted by path and status
for /metrics.

The line is written when the response is over (a stream's too), so it can say what the request
cost. Handlers fill in what only they know (the model answered, the job) through the record this
middleware puts in the request's scope; a request refused before a handler saw it (a bad Host
name, a missing key, an unknown path) is logged with its status alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

_KEY = "localinfer.access"
MAX_PATH = 200          # characters of a path the log shows: a line, not a page


@dataclass
class Record:
    model: str | None = None
    job: object | None = None           # engine.scheduler.Job, once the request became one


def record(scope) -> Record | None:
    """The request's record, where requests are logged."""
    return scope.get(_KEY)


def logged(app, log: Callable[[str], None] | None,
           count: Callable[[str, int], None] | None = None):
    """`app`, with one `log` line per HTTP request once its response is over (none: no log), and
    `count(path, status)` then (/metrics' requests by endpoint and status)."""
    async def logging_app(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        started, status, entry = time.perf_counter(), [0], Record()
        scope[_KEY] = entry

        async def watched(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await app(scope, receive, watched)
        finally:
            if count is not None:
                count(scope["path"], status[0])
            if log is not None:
                log(line(scope, status[0], entry, time.perf_counter() - started))
    return logging_app


def line(scope, status: int, entry: Record, seconds: float) -> str:
    # raw_path: still percent-encoded, so a path cannot put a line break or an escape code in
    # the log; the request line's bytes are checked by h11 already.
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    path = path if len(path) <= MAX_PATH else path[:MAX_PATH] + "…"
    parts = [scope["method"], path, str(status or "-")]
    if entry.model:
        parts.append(f"model={entry.model}")
    job = entry.job
    if job is not None:
        stats = job.stats
        finish = "error" if job.error else (stats.finish_reason or "cancelled")
        parts += [f"prompt={stats.prompt_tokens}", f"generated={stats.generated_tokens}",
                  f"finish={finish}"]
        if stats.closed_at >= 0 and not job.error:     # its last N tokens closed the document
            parts.append(f"closed_early={stats.closed_tokens}")
        if job.batch:
            parts.append("priority=batch")
    parts.append(f"{seconds:.2f}s")
    return " ".join(parts)
