"""`n` choices of one OpenAI chat completion: each choice is the reply server/api.py gives one
job (its message, tool calls, thinking trace, log-probabilities), numbered by `index`, under one
id; the usage counts the prompt once and every choice's tokens. Streamed, each choice's chunks
go as they come, interleaved, with the usage in a last chunk of its own when asked.

The jobs run together through the batch scheduler, which reads their shared prompt once
(engine/scheduler.py); a request may ask for as many choices as the server has slots.
"""

from __future__ import annotations

import asyncio
import json

from localinfer.server import reuse
from localinfer.server.errors import BadRequest

_DONE = object()        # a choice's stream has ended


def check_n(prepared, slots: int) -> None:
    """At most `slots` choices: more would wait for one another's slots."""
    if 1 + len(prepared.others) > slots:
        raise BadRequest(f"'n' may be at most {slots} here (the server's --parallel slots)", "n")


class Jobs:
    """The choices' jobs, cancelled together (server/jobs.py cancels `reply.job`)."""

    def __init__(self, jobs: list) -> None:
        self.jobs = jobs

    @property
    def cancelled(self) -> bool:
        return all(job.cancelled for job in self.jobs)

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        for job in self.jobs:
            job.cancelled = value


class ChatChoices:
    """The reply of a chat completion with n choices, from one reply per choice."""

    keep_alive = ": keep-alive\n\n"     # an SSE comment, which clients skip

    def __init__(self, replies: list, include_usage: bool) -> None:
        self.replies, self.include_usage = replies, include_usage
        for reply in replies:           # one id for all; the usage once, here
            reply.id, reply.created, reply.include_usage = replies[0].id, replies[0].created, False
        self.job = Jobs([reply.job for reply in replies])

    def failure(self):
        return next((f for f in (r.failure() for r in self.replies) if f is not None), None)

    def usage(self) -> dict:
        prompt = self.replies[0].job.stats.prompt_tokens
        done = sum(r.job.stats.generated_tokens for r in self.replies)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                **reuse.usage(*self.job.jobs)}

    def whole(self) -> dict:
        bodies = [reply.whole() for reply in self.replies]
        return {**bodies[0], "choices": [{**body["choices"][0], "index": i}
                                         for i, body in enumerate(bodies)],
                "usage": self.usage()}

    async def frames(self, events: asyncio.Queue):
        async for data in self.stream(events):
            yield f"data: {data}\n\n"

    async def stream(self, events: asyncio.Queue):
        """Each choice's reply streams from a queue of its own; (choice, text) events go to it,
        and its chunks come out numbered, as they are made."""
        queues = [asyncio.Queue() for _ in self.replies]
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(i, q, out)) for i, q in enumerate(queues)]
        tasks.append(asyncio.ensure_future(_dispatch(events, queues)))
        try:
            left = len(self.replies)
            while left:
                data = await out.get()
                if data is _DONE:
                    left -= 1
                    continue
                yield data
                if '"error"' in data and "error" in json.loads(data):    # the stream ends
                    self.job.cancelled = True
                    return
            if self.include_usage:
                yield json.dumps({**self.replies[0]._envelope({"delta": {}}), "choices": [],
                                  "usage": self.usage()})
            yield "[DONE]"
        finally:
            for task in tasks:
                task.cancel()

    async def _pump(self, i: int, queue: asyncio.Queue, out: asyncio.Queue) -> None:
        try:
            async for data in self.replies[i].stream(queue):
                if data == "[DONE]":
                    continue
                body = json.loads(data)
                for choice in body.get("choices", ()):
                    choice["index"] = i
                out.put_nowait(json.dumps(body))
        finally:
            out.put_nowait(_DONE)


async def _dispatch(events: asyncio.Queue, queues: list[asyncio.Queue]) -> None:
    """(choice, text) to that choice's queue; anything else (the server stopping) to all."""
    while True:
        item = await events.get()
        if isinstance(item, tuple):
            queues[item[0]].put_nowait(item[1])
        else:
            for queue in queues:
                queue.put_nowait(item)
