"""POST /v1/completions: one choice per prompt (server/logprob_fields.py: a string, token ids, or
a list of either), each prepared as server/requests.py prepares a completion and run through the
model's worker together, so that they are decoded in one batch.

`logprobs` N gives OpenAI's legacy object per choice (server/logprob_shapes.py's `legacy`):
the chosen tokens' log-probabilities with the top N each. `echo` puts the prompt's text (its
tokens' text, as the offsets count it) before the answer and, with logprobs, the prompt's own
log-probabilities before the answer's (the first token's null): what lm-evaluation-harness
scores a multiple-choice answer with. Those come from a forward pass over the prompt with every
position's logits (engine/echo.py), which runs between two steps of the batch scheduler
(server/worker.py's `between`): the scheduler's prefill keeps only each piece's last logits.
`max_tokens` 0 generates nothing: with echo, the prompt alone is scored.

Streamed, each choice's text comes as it is decoded, with the log-probabilities of the tokens
it carries; an echoed prompt first. Usage comes in a last chunk of its own, with no choices,
when `stream_options.include_usage` asks for it, as OpenAI sends it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse

from localinfer.engine.echo import prompt_logprobs
from localinfer.engine.logprobs import TokenLogprob, token_logprob
from localinfer.server import access, hosting, jobs, logprob_fields, logprob_shapes as shapes
from localinfer.server import reuse, routers
from localinfer.server.choices import Jobs, check_n
from localinfer.server.errors import BadRequest, error
from localinfer.server.requests import Prepared, parse, prepare, read_body, usage_asked, \
    with_priority_header
from localinfer.server.worker import Between

_FINISH = {"stop": "stop", "length": "length", "context": "length"}


@dataclass
class Choice:
    """One prompt's answer: its job (run unless max_tokens is 0), and what echo adds."""

    prepared: Prepared
    echo: bool
    prompt_text: str = ""                   # the echoed prompt
    scored: list = field(default_factory=list)      # the prompt's log-probabilities (echo)
    ending: _Ending | None = None           # the end of generation's own figure (logprobs)
    repeat: bool = False            # another of a prompt's `n` choices: its prompt counted once

    @property
    def job(self):
        return self.prepared.job

    @property
    def runs(self) -> bool:
        return self.job.limits.max_tokens != 0

    @property
    def logprobs(self) -> int | None:
        return self.job.limits.logprobs


async def complete(served, request: Request):
    try:
        raw = await read_body(request, seconds=served.body_seconds)
        body = with_priority_header(await asyncio.to_thread(parse, raw), request.headers)
    except BadRequest as e:
        return e.response()

    async def attempt(seen, gate):      # on the model named, or the one a router chose
        try:
            choices = await hosting.prepared(seen, _choices, body, seen)
        except BadRequest as e:
            return e.response()
        reply = _Reply(seen.names[0], choices, seen.session, served.log, usage_asked(body))
        return await _run(seen, request, choices, reply, gate)
    return await routers.answer(served, request, body, attempt, lambda e: e.response())


def _choices(body: dict, seen) -> list[Choice]:
    echo = logprob_fields.echo(body)
    usage_asked(body)               # checked before any work
    out = []
    for prompt in logprob_fields.prompts(body):
        prepared = prepare({**body, "prompt": prompt}, seen.session, seen.names,
                           seen.request_ctx, chat=False, defaults=seen.defaults)
        check_n(prepared, seen.worker.batch.n_seq - 1)
        for i, one in enumerate((prepared, *prepared.others)):     # `n` choices of each prompt
            choice = Choice(one, echo, repeat=i > 0)
            if choice.logprobs is not None and choice.runs:
                choice.ending = _Ending(one.job, seen.session)
                one.decides = None      # the end's own figure is not in the answer store
            if echo:
                choice.prompt_text = shapes.decoded(seen.session, prepared.job.prompt)
            out.append(choice)
    return out


class _Ending:
    """The job's sampler, which also scores the end-of-generation token when it picks one: the
    Emitter keeps no figure for it, and OpenAI's legacy object lists it (lm-evaluation-harness
    drops the last entry as the generated token's, so without it a prompt's last token would
    be dropped instead)."""

    def __init__(self, job, session) -> None:
        self.sampler, self.session, self.top = job.sampler, session, job.limits.logprobs
        self.scored: TokenLogprob | None = None
        job.sampler = self

    def __call__(self, logits, history) -> int:
        token = self.sampler(logits, history)
        if self.session.is_eog(token):
            self.scored = token_logprob(logits, token, self.top)
        return token

    def of(self, job) -> list[TokenLogprob]:
        """[its figure] when the job ended there (not at a stop string, a limit or an error)."""
        stats = job.stats
        ended = stats.finish_reason == "stop" and not stats.stop_string and not job.error
        return [self.scored] if ended and self.scored is not None else []


async def _run(seen, request: Request, choices: list[Choice], reply: _Reply, gate=None):
    """The prompts scored (echo with logprobs), then the jobs through the worker; the reply
    streamed or whole. The model's lease goes back once the answer ends. `gate`: a router's
    (server/routers.py); None when it passed the request on."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    if gate is not None and (why := gate.refusal(len(choices))) is not None:
        seen.release()
        return error(why, 400)
    try:
        refused = await _started(seen, loop, events, choices, gate)
    finally:
        seen.arrived()                  # the worker no longer holds a step for it
    if refused is not None:
        reply.job.cancelled = True      # those submitted already
        seen.release()
        return refused
    if gate is not None and not await jobs.held(gate, request, choices[0].job, seen.release):
        return None                     # passed on: its job cancelled, nothing of it sent
    if (entry := access.record(request.scope)) is not None:     # serve -v's line: the first
        entry.model, entry.job = seen.names[0], choices[0].job
    seen.under_way.add(events)
    marked = reuse.headers(reply.job.jobs)      # every answer from the answer store
    if choices[0].prepared.stream:
        return jobs._EventStream(reply, events, seen.under_way, seen.release, marked)
    try:
        if not await _answered(request, events, reply):
            return error(jobs.SHUTTING_DOWN, 503, code="server_shutting_down")
    finally:
        seen.under_way.discard(events)
        seen.release()
    return reply.failure() or JSONResponse(reply.whole(), headers=marked)


async def _started(seen, loop, events: asyncio.Queue, choices: list[Choice], gate=None
                   ) -> JSONResponse | None:
    """The prompts scored and the jobs submitted; the error reply when that cannot be."""
    try:
        if seen.worker.error is not None:
            return error(f"the model failed: {seen.worker.error}", 500)
        failed = await _score(seen, choices)
        if failed is not None:
            return failed
        stored = await asyncio.to_thread(reuse.slots, seen, [
            c.prepared if c.runs and gate is None else None for c in choices])
        for i, choice in enumerate(choices):
            if choice.runs and not _submit(seen, loop, events, i, choice, stored[i], gate):
                return error("too many requests are waiting; try again shortly", 429,
                             headers={"Retry-After": "1"})
    except BaseException:
        seen.release()
        raise
    return None


async def _score(seen, choices: list[Choice]) -> JSONResponse | None:
    """Each echoed prompt's own log-probabilities, in the worker's thread between two steps."""
    # a prompt's `n` choices share its figures: scored once
    asked = [c for c in choices if c.echo and c.logprobs is not None and not c.repeat]
    futures = []
    for choice in asked:
        future: Future = Future()
        tokens = list(choice.job.prompt)
        work = partial(_prompt_work, tokens=tokens, top=choice.logprobs)
        if not seen.worker.between(Between(len(tokens), work, future)):
            return error("too many requests are waiting; try again shortly", 429,
                         headers={"Retry-After": "1"})
        futures.append(future)
    for choice, future in zip(asked, futures):
        try:
            choice.scored = await asyncio.wrap_future(future)
        except Exception as e:          # the engine's failure, as a job's would be
            seen.log(f"a request failed: {e}")
            return error(f"the model failed: {e}", 500)
    for before, choice in zip(choices, choices[1:]):
        if choice.repeat:
            choice.scored = before.scored
    return None


def _prompt_work(batch, seq: int, *, tokens: list[int], top: int):
    return prompt_logprobs(batch, seq, tokens, top)


def _submit(seen, loop, events: asyncio.Queue, i: int, choice: Choice, slot, gate) -> bool:
    """The choice's job to the worker, or its answer from the answer store (`slot`)."""
    job, submitted, model = choice.job, time.perf_counter(), seen.names[0]
    if jobs.replay(seen, model, job, slot, lambda item: events.put_nowait((i, item))):
        return True
    job.on_text = lambda text: jobs._hand_over(loop, events, (i, text))

    def done(finished) -> None:     # in the scheduler's thread: counted before the reply
        seen.metrics.generation(model, finished, time.perf_counter() - submitted)
        jobs._hand_over(loop, events, (i, None))
    job.on_text, done = jobs.recorded(seen, model, job, slot, job.on_text, done)
    if gate is not None:
        job.on_text, done = gate.wrap(job, job.on_text, done)
    return seen.worker.submit(job, done)


async def _answered(request: Request, events: asyncio.Queue, reply: _Reply) -> bool:
    """Until every job is done (True) or the server stops (False); a client that leaves
    cancels them all."""
    left = len(reply.job.jobs)
    watch = asyncio.create_task(jobs._until_gone(request, reply.job))
    try:
        while left:
            item = await events.get()
            if item is jobs.CLOSING:
                reply.job.cancelled = True
                return False
            left -= item[1] is None
        return True
    except asyncio.CancelledError:
        reply.job.cancelled = True
        raise
    finally:
        watch.cancel()


class _Reply:
    """The choices in OpenAI's text_completion shapes."""

    keep_alive = ": keep-alive\n\n"

    def __init__(self, model: str, choices: list[Choice], session, log, usage: bool) -> None:
        self.model, self.choices, self.session, self.log = model, choices, session, log
        self.usage_asked = usage
        self.job = Jobs([c.job for c in choices if c.runs])
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def failure(self) -> JSONResponse | None:
        for choice in self.choices:
            problem = choice.job.error if choice.runs else None
            if problem is None:
                continue
            constrained = choice.prepared.constrained
            if constrained is not None and constrained.failed is not None:
                return error(f"response_format: {constrained.failed}", 400,
                             param="response_format", code="grammar_dead_end")
            self.log(f"a request failed: {problem}")
            return error(problem, 500)
        return None

    def _usage(self) -> dict:
        prompt = sum(len(c.job.prompt) for c in self.choices if not c.repeat)
        done = sum(c.job.stats.generated_tokens for c in self.choices if c.runs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                **reuse.usage(*self.job.jobs)}

    def _body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def whole(self) -> dict:
        return self._body([self._whole(i, c) for i, c in enumerate(self.choices)],
                          usage=self._usage())

    def _whole(self, i: int, choice: Choice) -> dict:
        job, text = choice.job, choice.prompt_text
        tokens, scored = (list(job.prompt), list(choice.scored)) if choice.echo else ([], [])
        finish = "length"
        if choice.runs:
            shown = shapes.shown(self.session, job) + (choice.ending.of(job) if choice.ending
                                                       else [])
            tokens += [s.token for s in shown]
            scored += shown
            text += job.text
            finish = _FINISH.get(job.stats.finish_reason, "stop")
        logprobs = None if choice.logprobs is None else shapes.legacy(self.session, tokens,
                                                                      scored)
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                **(jobs.closed_early(job) if choice.runs else {})}

    # -- the stream --------------------------------------------------------------------------
    def frames(self, events: asyncio.Queue):
        return self._framed(events)

    async def _framed(self, events: asyncio.Queue):
        async for data in self._stream(events):
            yield f"data: {data}\n\n"

    def _chunk(self, i: int, text: str, finish: str | None, logprobs: dict | None,
               **extra) -> str:
        return json.dumps(self._body([{"index": i, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish, **extra}]))

    async def _stream(self, events: asyncio.Queue):
        follows = {}
        for i, choice in enumerate(self.choices):
            legacy = _LegacyStream(self.session, choice) if choice.logprobs is not None else None
            follows[i] = (shapes.Following(self.session, choice.job), legacy, [0])
            if choice.echo:
                yield self._chunk(i, choice.prompt_text, None if choice.runs else "length",
                                  legacy and legacy.echoed())
        left = len(self.job.jobs)
        while left:
            item = await events.get()
            if item is jobs.CLOSING:
                self.job.cancelled = True
                yield error(jobs.SHUTTING_DOWN, 503, code="server_shutting_down").body.decode()
                return
            i, text = item
            follow, legacy, sent = follows[i]
            if text is not None:
                sent[0] += len(text)
                scored = follow.upto(sent[0])
                yield self._chunk(i, text, None, legacy and legacy.piece(scored))
                continue
            left -= 1
            failed = self.failure()
            if failed is not None:
                yield failed.body.decode()
                return
            choice = self.choices[i]
            job, ending = choice.job, choice.ending
            last = follow.rest() + (ending.of(job) if ending else [])
            yield self._chunk(i, "", _FINISH.get(job.stats.finish_reason, "stop"),
                              legacy and legacy.piece(last), **jobs.closed_early(job))
        if self.usage_asked:
            yield json.dumps(self._body([], usage=self._usage()))
        yield "[DONE]"


class _LegacyStream:
    """One choice's legacy logprobs, a chunk at a time, offsets counted over its whole text."""

    def __init__(self, session, choice: Choice) -> None:
        self.session, self.choice = session, choice
        self.offset = len(choice.prompt_text)

    def echoed(self) -> dict:
        return shapes.legacy(self.session, self.choice.job.prompt, self.choice.scored)

    def piece(self, scored: list) -> dict:
        tokens = [s.token for s in scored]
        body = shapes.legacy(self.session, tokens, scored, self.offset)
        self.offset += len(shapes.decoded(self.session, tokens))
        return body
