"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions, /health.

Every request is checked before it reaches the model (server/requests.py): a bad one is a 400 in
OpenAI's error shape, an unknown model a 404, a full queue a 429 with Retry-After; what every
request passes first (Host names, the API key, a reply for any exception) is server/guard.py.
A request's own failure ends that request alone: a grammar that allows no token of the vocabulary
is a 400 (the schema asked for what this model cannot spell), an engine failure a 500; the next
request is served as the first was. A client that disconnects cancels its job, streamed or not:
a non-streamed handler watches the connection while it waits, since Starlette does not cancel it.
A stop asked for (Served.close, from server/listen.py) cancels every job under way and ends its
reply at once and whole: a 503, or a stream's error event, so that the client knows the answer is
cut and uvicorn finds every response complete. Any other path is a 404, another method a 405, both
in OpenAI's error shape (Anthropic's under /v1/messages). The job's running is server/jobs.py's,
shared with Anthropic's Messages API (server/anthropic.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.server import access, anthropic, choices, embeddings, guard, hosting, ollama
from localinfer.server import reasoning, reuse, routers
from localinfer.server import completions as completing, logprob_shapes, responses, \
    tool_stream, tools
from localinfer.server import served_metrics, tokenizer
from localinfer.server.errors import BadRequest, error, error_for
from localinfer.server.jobs import CLOSING as _CLOSING, SHUTTING_DOWN as _SHUTTING_DOWN, \
    closed_early, run
from localinfer.server.requests import BODY_SECONDS, Defaults, Prepared, parse, prepare, \
    read_body, with_priority_header

_FINISH = {"stop": "stop", "length": "length", "context": "length"}


@dataclass
class Served:
    models: object            # server.hosting.Models: what the server serves, by name
    api_key: str | None = None
    hosts: frozenset[str] | None = None     # Host names answered (guard.allowed_hosts); None: any
    port: int = 0
    log: Callable[[str], None] = print      # one line per server fault
    body_seconds: float = BODY_SECONDS
    defaults: Defaults = field(default_factory=Defaults)    # for what a request leaves out
    request_log: Callable[[str], None] | None = None        # one line per request (serve -v)
    metrics: served_metrics.ServedMetrics = field(default_factory=served_metrics.ServedMetrics)
    reuse_answers: bool = False             # --reuse-answers (server/reuse.py)
    routers: dict = field(default_factory=dict)     # config.toml's, by name (server/routers.py)
    # One request's model, in the view server/hosting.py makes for it (unset on the server):
    worker: object = None                   # server.worker.Worker
    session: object = None                  # the model's session: tokenizer and template
    names: tuple[str, ...] = ()             # names[0]: the one it answers with
    request_ctx: int = 0                    # the tokens one request may fill
    model_path: Path | None = None          # the GGUF, for Ollama's /api/tags and /api/show
    need: object | None = None              # server.pool_state.Need: its memory
    embeddings: object | None = None        # server.embedder.Embeddings, opened on first use
    release: Callable[[], None] = lambda: None      # gives the model's lease back
    # the events of the requests under way, for close()
    under_way: set[asyncio.Queue] = field(default_factory=set, init=False, repr=False)

    def close(self) -> None:
        """The server is stopping (in its event loop): every answer under way ends now."""
        for events in self.under_way:
            events.put_nowait(_CLOSING)


def make_app(served: Served, cors: str | None = None):
    async def health(request: Request):
        return JSONResponse({"status": "error" if served.models.broken() else "ok"})

    async def models(request: Request):
        listed = await asyncio.to_thread(served.models.listed)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "localinfer",
             # what one request may use, under the names vLLM and OpenRouter-style clients read
             **({"context_length": ctx, "max_model_len": ctx} if ctx else {}),
             # a loaded model's projector: "vision", "audio" (as /api/show's capabilities)
             **({"capabilities": media} if media else {})}
            for name, ctx, media in listed] + routers.openai_models(served)})

    async def chat(request: Request):
        return await _complete(served, request, chat=True)

    async def completions(request: Request):
        return await completing.complete(served, request)

    middleware = [Middleware(CORSMiddleware, allow_origins=[cors], allow_methods=["*"],
                             allow_headers=["*"])] if cors else []
    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            *responses.routes(served),
                            *anthropic.routes(served), *ollama.routes(served),
                            *embeddings.routes(served), *served_metrics.routes(served),
                            *tokenizer.routes(served)],
                    middleware=middleware,
                    exception_handlers={Exception: guard.internal_error, 404: _not_found,
                                        405: _not_allowed})
    endpoints = frozenset(route.path for route in app.routes)
    app = guard.guarded(app, key=served.api_key, hosts=served.hosts, port=served.port,
                        log=served.log)
    return access.logged(app, served.request_log,
                         lambda path, status: served.metrics.request(path, status, endpoints))


_PATHS = ("/v1/chat/completions, /v1/completions, /v1/responses (and input_tokens, GET and "
          "DELETE of /v1/responses/ID), /v1/embeddings, /v1/models, /v1/messages, "
          "/v1/messages/count_tokens, /health, /metrics, /tokenize, /detokenize, "
          "/tokenizer_info, and Ollama's /api/chat, /api/generate, "
          "/api/embed, /api/tags, /api/show, /api/ps and /api/version")


async def _not_found(request: Request, exc: HTTPException) -> JSONResponse:
    return error_for(request.url.path)(
        f"no such endpoint: {request.method} {_shown(request)}; this server has {_PATHS}", 404,
        code="unknown_url")


async def _not_allowed(request: Request, exc: HTTPException) -> JSONResponse:
    allow = (exc.headers or {}).get("Allow", "")
    return error_for(request.url.path)(
        f"{request.method} is not allowed on {_shown(request)}; use {allow}", 405,
        code="method_not_allowed", headers=exc.headers)


def _shown(request: Request) -> str:
    path = request.url.path
    return path if len(path) <= access.MAX_PATH else path[:access.MAX_PATH] + "…"


async def _complete(served: Served, request: Request, *, chat: bool):
    try:
        raw = await read_body(request, seconds=served.body_seconds)
        body = with_priority_header(await asyncio.to_thread(parse, raw), request.headers)
    except BadRequest as e:
        return e.response()

    async def attempt(seen, gate):      # on the model named, or the one a router chose
        try:
            prepared = await hosting.prepared(seen, prepare, body, seen.session, seen.names,
                                              seen.request_ctx, chat=chat,
                                              defaults=seen.defaults)
        except BadRequest as e:
            return e.response()
        reply = _Reply(seen.names[0], chat, prepared, served.log, seen.session)
        if prepared.others:                 # n choices, each with a reply of its own
            try:
                choices.check_n(prepared, seen.worker.batch.n_seq - 1)
            except BadRequest as e:
                seen.release()
                return e.response()
            reply = choices.ChatChoices([reply, *(_Reply(seen.names[0], chat, other, served.log,
                                                         seen.session)
                                                  for other in prepared.others)],
                                        prepared.include_usage)
        return await run(seen, request, prepared, reply, error, gate)
    return await routers.answer(served, request, body, attempt, lambda e: e.response())


async def _framed(stream):
    async for data in stream:
        yield f"data: {data}\n\n"


class _Reply:
    """The OpenAI shapes of one answer: chunks while it streams, or the whole object."""

    keep_alive = ": keep-alive\n\n"     # an SSE comment, which clients skip (server/jobs.py)

    def __init__(self, model: str, chat: bool, prepared: Prepared,
                 log: Callable[[str], None], session=None) -> None:
        self.model, self.chat, self.job, self.log = model, chat, prepared.job, log
        # the tokens' log-probabilities, when asked (server/logprob_shapes.py): in the whole
        # answer, or each chunk with the entries of the tokens whose text it carries
        self.session, self.logprobs = session, prepared.job.limits.logprobs is not None
        self.follow, self.scored = logprob_shapes.Following(session, self.job), []
        self.constrained, self.style = prepared.constrained, prepared.style
        self.tools, self.include_usage = prepared.tools, prepared.include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def failure(self) -> JSONResponse | None:
        """The error reply when the job failed: the request's own grammar at a dead end is a
        400; anything else is the engine's, a 500 (and one line in the log)."""
        problem = self.job.error
        if problem is None:
            return None
        if self.constrained is not None and self.constrained.failed is not None:
            param = "tools" if self.tools is not None else "response_format"
            return error(f"{param}: {self.constrained.failed}", 400, param=param,
                         code="grammar_dead_end")
        self.log(f"a request failed: {problem}")
        return error(problem, 500)

    def frames(self, events: asyncio.Queue):
        """The server-sent events of a streamed reply (server/jobs.py sends them)."""
        return _framed(self.stream(events))

    def _envelope(self, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": ("chat.completion" if self.chat else "text_completion")
                + (".chunk" if "delta" in choice else ""), "created": self.created,
                "model": self.model, "choices": [{"index": 0, **choice}], **extra}

    def _usage(self) -> dict:
        prompt, done = self.job.stats.prompt_tokens, self.job.stats.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                **reuse.usage(self.job)}

    def _finish(self) -> str:
        return _FINISH.get(self.job.stats.finish_reason, "stop")

    def whole(self) -> dict:
        text, finish = self.job.text, self._finish()
        choice = {"message": reasoning.message(self.style, text)} if self.chat else \
            {"text": text, "logprobs": None}
        if self.chat:
            choice["logprobs"] = self._logprobs(logprob_shapes.shown(self.session, self.job),
                                                whole=True)
        if self.chat and self.tools is not None:
            content, calls = tools.split(self.tools, choice["message"]["content"], text)
            choice["message"]["content"] = content      # a text answer out of its format's JSON
            if calls:
                choice["message"]["tool_calls"] = calls
                finish = "tool_calls"
        return self._envelope({**choice, "finish_reason": finish, **closed_early(self.job)},
                              usage=self._usage())

    def _piece(self, delta: dict | None, finish: str | None) -> str:
        """One event: a chat's `delta` (content, or a thinking model's trace fields), or a
        completion's text."""
        if self.chat:
            choice = {"delta": delta or {}, "logprobs": self._logprobs(self.scored),
                      "finish_reason": finish}
            self.scored = []
        else:
            choice = {"text": (delta or {}).get("content", ""), "finish_reason": finish}
        body = self._envelope(choice)
        if not self.chat:
            body["object"] = "text_completion"
        if finish:
            body["choices"][0].update(closed_early(self.job))
        return json.dumps(body)

    async def stream(self, events: asyncio.Queue):
        """The data of each server-sent event."""
        deltas = reasoning.Deltas(self.style if self.chat else None)
        calls = tool_stream.CallStream(self.tools)    # content held back, calls as they come
        if self.chat:
            yield json.dumps(self._envelope(
                {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
        sent = 0
        while (text := await events.get()) is not None:
            if text is _CLOSING:        # cut short, and said so: an error event, as below
                self.job.cancelled = True
                yield error(_SHUTTING_DOWN, 503, code="server_shutting_down").body.decode()
                return
            if self.logprobs:           # the next chunk sent carries them
                sent += len(text)
                self.scored += self.follow.upto(sent)
            calls.see(text)
            for delta in deltas.feed(text):
                if "content" in delta and not (delta := _content(delta, calls.feed)):
                    continue
                yield self._piece(delta, None)
            for call in calls.pending():
                yield self._piece({"tool_calls": [call]}, None)
        failed = self.failure()
        if failed is not None:          # the stream has begun: an error event, as OpenAI's
            yield failed.body.decode()
            return
        for delta in deltas.flush():    # what the splitter held back for a marker
            if "content" in delta and not (delta := _content(delta, calls.feed)):
                continue
            yield self._piece(delta, None)
        if self.logprobs:
            self.scored += self.follow.rest()
        ending = calls.ending()
        if ending.rest:
            yield self._piece({"content": ending.rest}, None)
        for call in ending.deltas:      # the rest of each call begun; a call not begun, whole
            yield self._piece({"tool_calls": [call]}, None)
        yield self._piece(None, "tool_calls" if ending.calls and not ending.cut
                          else self._finish())
        if self.include_usage:          # OpenAI's last chunk: usage and no choices, when asked
            yield json.dumps({**self._envelope({"delta": {}}), "choices": [],
                              "usage": self._usage()})
        yield "[DONE]"

    def _logprobs(self, scored: list, *, whole: bool = False) -> dict | None:
        if not self.logprobs or not (scored or whole):
            return None
        return {"content": logprob_shapes.entries(self.session, scored), "refusal": None}


def _content(delta: dict, feed) -> dict:
    """A content delta with what the tool-call filter lets through now ({} when nothing)."""
    shown = feed(delta["content"])
    return {**delta, "content": shown} if shown else {}
