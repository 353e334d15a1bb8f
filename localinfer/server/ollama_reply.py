"""The Ollama shapes of one answer (/api/chat and /api/generate), for server/jobs.py.

Streamed (Ollama's default), one JSON object a line (application/x-ndjson): each piece of text as
`message.content` (chat) or `response` (generate), a thinking model's trace as `message.thinking`
or `thinking`, a reply's tool calls in one object of their own (`message.tool_calls`, each
`{"function": {"name", "arguments": {...}}}`, arguments an object as Ollama gives them), then the
last object with `done: true`, `done_reason` (stop or length) and the figures Ollama reports,
durations in nanoseconds. Not streamed: that last object with the whole message in it. A failure
after the stream has begun is one `{"error": ...}` line, as Ollama sends it. With `logprobs`,
each object has `logprobs`: the entries (token, logprob, bytes, top_logprobs) of the tokens
whose text it carries, as Ollama's api.Logprob; the whole answer's object all of them.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Callable

from starlette.responses import JSONResponse

from localinfer.server import jobs, logprob_shapes, reasoning, reuse, tools
from localinfer.server.errors import ollama_error
from localinfer.server.requests import Prepared

MEDIA_TYPE = "application/x-ndjson"
_DONE_REASON = {"length": "length", "context": "length"}


def created_at() -> str:
    """Now, in RFC 3339 with nanoseconds and Z, as Ollama writes `created_at`."""
    now = time.time_ns()
    stamp = datetime.fromtimestamp(now // 10**9, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{now % 10**9:09d}Z"


def loaded(model: str, chat: bool) -> dict:
    """The reply to a request with no prompt (or no messages): Ollama loads the model and says
    so. Here it is loaded already, for as long as the server runs."""
    body = {"model": model, "created_at": created_at(), "done": True, "done_reason": "load"}
    return {**body, "message": {"role": "assistant", "content": ""}} if chat \
        else {**body, "response": ""}


def ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI-shaped calls (server/tools.py) as Ollama gives them: arguments an object."""
    return [{"function": {"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"])}} for c in calls]


class Reply:
    """One answer in Ollama's shapes: NDJSON objects while it streams, or the whole object."""

    media_type = MEDIA_TYPE         # of the stream (server/jobs.py)

    def __init__(self, model: str, chat: bool, prepared: Prepared,
                 log: Callable[[str], None], started_ns: int, session=None) -> None:
        self.model, self.chat, self.job, self.log = model, chat, prepared.job, log
        self.session, self.logprobs = session, prepared.job.limits.logprobs is not None
        self.follow, self.scored = logprob_shapes.Following(session, self.job), []
        self.style, self.tools, self.constrained = prepared.style, prepared.tools, \
            prepared.constrained
        self.started_ns = started_ns        # when the request arrived: total_duration's start

    def failure(self) -> JSONResponse | None:
        """A grammar at a dead end is the request's own fault (400); anything else the
        engine's (500, and one line in the log)."""
        if self.job.error is None:
            return None
        if self.constrained is not None and self.constrained.failed is not None:
            field = "tools" if self.tools is not None else "format"
            return ollama_error(f"{field}: {self.constrained.failed}", 400)
        self.log(f"a request failed: {self.job.error}")
        return ollama_error(self.job.error, 500)

    def _piece(self, content: str = "", thinking: str = "", calls: list | None = None) -> dict:
        """One object of the stream (done false), or the start of the last one."""
        body: dict = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = ollama_calls(calls)
            body["message"] = message
        else:
            body["response"] = content
            if thinking:
                body["thinking"] = thinking
        if self.logprobs:       # the entries of the tokens this object carries
            body["logprobs"] = logprob_shapes.entries(self.session, self.scored)
            self.scored = []
        return {**body, "done": False}

    def _done(self, body: dict) -> dict:
        """`body` as the last object: done, why, and the figures (durations in nanoseconds)."""
        stats = self.job.stats
        return {**body, "done": True,
                "done_reason": _DONE_REASON.get(stats.finish_reason, "stop"),
                "total_duration": time.perf_counter_ns() - self.started_ns,
                "load_duration": 0,             # loaded once, when the server started
                "prompt_eval_count": stats.prompt_tokens,
                "prompt_eval_duration": int(stats.prefill_s * 1e9),
                "eval_count": stats.generated_tokens,
                "eval_duration": int(stats.decode_s * 1e9), **jobs.closed_early(self.job),
                **reuse.usage(self.job)}

    def whole(self) -> dict:
        self.scored = logprob_shapes.shown(self.session, self.job) if self.logprobs else []
        said = reasoning.message(self.style, self.job.text)
        content, calls = tools.split(self.tools, said["content"], self.job.text)
        return self._done(self._piece(content or "", said.get("reasoning_content", ""), calls))

    async def frames(self, events: asyncio.Queue):
        """Each object of the stream, one JSON line each."""
        async for body in self._objects(events):
            yield json.dumps(body) + "\n"

    async def _objects(self, events: asyncio.Queue):
        deltas = reasoning.Deltas(self.style)
        held = tools.Stream(self.tools)
        sent = 0
        while (text := await events.get()) is not None:
            if text is jobs.CLOSING:        # cut short, and said so
                self.job.cancelled = True
                yield {"error": jobs.SHUTTING_DOWN}
                return
            if self.logprobs:
                sent += len(text)
                self.scored += self.follow.upto(sent)
            held.see(text)      # a format whose calls show only in the raw output (harmony)
            for delta in deltas.feed(text):
                if (body := self._delta(delta, held)) is not None:
                    yield body
        failed = self.failure()
        if failed is not None:
            yield json.loads(failed.body)
            return
        for delta in deltas.flush():
            if (body := self._delta(delta, held)) is not None:
                yield body
        if self.logprobs:
            self.scored += self.follow.rest()
        rest, calls = held.finish()
        if rest:
            yield self._piece(rest)
        if calls:
            yield self._piece(calls=calls)
        yield self._done(self._piece())

    def _delta(self, delta: dict, held: tools.Stream) -> dict | None:
        """The object for one delta of the splitter: trace, or the answer text the tool-call
        filter lets through now (None: nothing to send yet)."""
        if delta.get("reasoning_content"):
            return self._piece(thinking=delta["reasoning_content"])
        shown = held.feed(delta.get("content", ""))
        return self._piece(shown) if shown else None
