"""One prepared job through the worker, for every API the server speaks (server/api.py's OpenAI
endpoints, server/anthropic.py's Messages): its queueing (a full queue is a 429), its text handed
from the scheduler's thread to the request's handler, a client that leaves cancelling it, streamed
or not (a non-streamed handler watches the connection while it waits, since Starlette does not
cancel it), and a stop asked for (Served.close) ending its reply at once and whole: a 503, or the
stream's own error event. The reply object gives the API's shapes: `frames(events)` (the framed
server-sent events), `whole()`, `failure()` and `job`; `closed_early(job)` gives every API the
same extra fields for an answer the budget closed early.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from localinfer.engine.scheduler import Job
from localinfer.server import access, reuse
from localinfer.server.errors import error
from localinfer.server.requests import Prepared

CLOSING = object()          # in a request's events: the server is stopping
SHUTTING_DOWN = "the server is shutting down; the answer was cut short"
# Server-sent events straight to the client: no proxy buffering, no cached copy.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A stream with nothing to send for this long (a long prompt read, text held back while it may
# be a call) sends the API's keep-alive: agents cancel a stream that falls silent.
KEEP_ALIVE_SECONDS = 5.0


def closed_early(job: Job) -> dict:
    """`closed_early` and `closed_tokens` where the tokens left narrowed a constrained answer
    (a schema's, a tool call's) to the shortest valid close (engine/closing.py); {} otherwise.
    Extra fields, as llama-server adds its own: the finish reason alone cannot say it, since an
    answer closed early may still end with the model's own end of generation ("stop")."""
    stats = job.stats
    return {"closed_early": True, "closed_tokens": stats.closed_tokens} \
        if stats.closed_at >= 0 and not job.error else {}


async def run(served, request: Request, prepared: Prepared, reply, fail=error, gate=None):
    """A prepared job through the worker: the reply's events as they come (`reply.frames`), or
    `reply.whole()` once done; `fail` gives the error replies (OpenAI's or Anthropic's shape).
    With `n` choices (prepared.others) every job goes, and each event is (choice, text).
    `gate`: a router's (server/routers.py), which may hold the answer back until its model's
    confidence decides; None when it passed the request on (nothing of it was sent)."""
    release = served.release            # the model's lease: given back when the answer ends
    if served.worker.error is not None:
        release()
        return fail(f"the model failed: {served.worker.error}", 500)
    if gate is not None and (why := gate.refusal(1 + len(prepared.others))) is not None:
        release()
        return fail(why, 400)
    job = reply.job                     # every choice's job, as one to cancel
    every = [prepared.job, *(other.job for other in prepared.others)]
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    submitted, model = time.perf_counter(), served.names[0]
    stored = await looked_up(served, [prepared, *prepared.others]) if gate is None \
        else [None] * len(every)        # a routed request is not answered from the store
    refused = False
    for i, one in enumerate(every):
        tag = (lambda item: item) if len(every) == 1 else (lambda item, i=i: (i, item))
        if replay(served, model, one, stored[i], lambda item, t=tag: events.put_nowait(t(item))):
            continue
        one.on_text = lambda text, tag=tag: _hand_over(loop, events, tag(text))

        def done(finished: Job, tag=tag) -> None:   # in the scheduler's thread: counted first
            served.metrics.generation(model, finished, time.perf_counter() - submitted)
            _hand_over(loop, events, tag(None))
        one.on_text, done = recorded(served, model, one, stored[i], one.on_text, done)
        if gate is not None:
            one.on_text, done = gate.wrap(one, one.on_text, done)
        refused = refused or not served.worker.submit(one, done)
    served.arrived()                    # the worker no longer holds a step for it
    if refused:
        job.cancelled = True            # the choices submitted already
        release()
        return fail("too many requests are waiting; try again shortly", 429,
                    headers={"Retry-After": "1"})
    if gate is not None and not await held(gate, request, job, release):
        return None                     # passed on: its job cancelled, nothing of it sent
    if (entry := access.record(request.scope)) is not None:
        entry.model, entry.job = model, prepared.job
    served.under_way.add(events)
    marked = reuse.headers(every)           # every answer from the answer store
    if prepared.stream:
        return _EventStream(reply, events, served.under_way, release, marked)
    try:
        if not await _answered(request, events, job, len(every)):
            return fail(SHUTTING_DOWN, 503, code="server_shutting_down")
    finally:
        served.under_way.discard(events)
        release()
    return reply.failure() or JSONResponse(reply.whole(), headers=marked)


async def held(gate, request: Request, job, release) -> bool:
    """Whether the router's gate lets the answer out; the lease goes back when it does not (or
    the wait is given up)."""
    try:
        kept = await gate.decided(request, job)
    except BaseException:
        job.cancelled = True
        release()
        raise
    if not kept:
        release()
    return kept


async def looked_up(served, prepared: list) -> list:
    """Each job's place in the answer store (server/reuse.py), read in a thread; the lease goes
    back if that fails."""
    try:
        return await asyncio.to_thread(reuse.slots, served, prepared)
    except BaseException:
        served.release()
        raise


def replay(served, model: str, job: Job, slot, hand: Callable) -> bool:
    """Whether `job` was answered from the store: its pieces, then its end, handed to the reply
    (on the event loop), and counted."""
    if slot is None or slot.answer is None:
        return False
    for piece in reuse.replayed(job, slot.answer):
        hand(piece)
    hand(None)
    served.metrics.reused_answer(model)
    return True


def recorded(served, model: str, job: Job, slot, on_text, on_done):
    """(on_text, on_done) that store the answer once whole when `slot` says where; as given
    when it does not."""
    if slot is None:
        return on_text, on_done
    return reuse.recording(job, slot, on_text, on_done,
                           lambda: served.metrics.stored_answer(model))


class _EventStream(StreamingResponse):
    """The answer as server-sent events. However the response ends (the answer whole, the client
    gone, even before the first event, or the server stopping) its job ends with it."""

    def __init__(self, reply, events: asyncio.Queue, under_way: set, release,
                 headers: dict[str, str] | None = None) -> None:
        # server-sent events, or the reply's own framing (Ollama's NDJSON)
        super().__init__(kept_alive(reply.frames(events), getattr(reply, "keep_alive", None)),
                         media_type=getattr(reply, "media_type", "text/event-stream"),
                         headers={**SSE_HEADERS, **(headers or {})})
        self.job, self.events, self.under_way = reply.job, events, under_way
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.under_way.discard(self.events)
            self.job.cancelled = True       # done already, or nobody is left to read it
            self.release()


async def kept_alive(frames, beat: str | Callable[[], str] | None,
                     seconds: float | None = None):
    """`frames`, with `beat` (the reply's `keep_alive` frame: Anthropic's ping, an SSE comment,
    or a function that makes each, for the Responses API's numbered `keepalive` events)
    whenever none came for `seconds`; a framing with none (NDJSON) goes as it is."""
    if beat is None:
        async for frame in frames:
            yield frame
        return
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(frames))
            done, _ = await asyncio.wait({pending}, timeout=seconds or KEEP_ALIVE_SECONDS)
            if not done:
                yield beat() if callable(beat) else beat
                continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                pending = None
                return
            pending = None
            yield frame
    finally:
        if pending is not None:         # the client left: the frames' task goes with it
            pending.cancel()
        else:
            await frames.aclose()


async def _answered(request: Request, events: asyncio.Queue, job: Job, jobs: int = 1) -> bool:
    """Until the scheduler is done with the job (True), or the server stops (False: the job is
    cancelled); a client that leaves meanwhile cancels it (its sequence is freed before the next
    step, and then the scheduler says it is done). `jobs`: the choices' jobs to wait for."""
    watch = asyncio.create_task(_until_gone(request, job))
    try:
        while jobs:
            item = await events.get()
            if item is CLOSING:
                job.cancelled = True
                return False
            jobs -= item is None or isinstance(item, tuple) and item[1] is None
        return True
    except asyncio.CancelledError:        # uvicorn gave up waiting for it
        job.cancelled = True
        raise
    finally:
        watch.cancel()


async def _until_gone(request: Request, job: Job) -> None:
    # The body is read: the next message the server hands over is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True


def _hand_over(loop, events: asyncio.Queue, item: str | None) -> None:
    """From the scheduler's thread to the request's handler (None: the answer is complete)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, item)
    except RuntimeError:        # the server's loop has closed (shutting down): nobody is waiting
        pass
