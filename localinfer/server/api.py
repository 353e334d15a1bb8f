"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions, /health.

Every request is checked before it reaches the model (a JSON object of bounded size, the fields
people use with the types OpenAI documents, n = 1, a prompt that fits a request's share of the
context); a bad one is a 400 in OpenAI's error shape, an unknown model a 404, a full queue a 429
with Retry-After. A client that disconnects cancels its job, which frees its sequence before the
next decode step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Limits
from localinfer.engine.prompt import chat_tokens, raw_tokens, uses_chat_template
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.engine.scheduler import Job
from localinfer.engine.structured import from_schema
from localinfer.errors import LocalinferError

MAX_BODY = 4 << 20            # bytes of one request body
ROLES = ("system", "user", "assistant")
_FINISH = {"stop": "stop", "length": "length", "context": "length"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error(message: str, status: int, *, param=None, code=None, headers=None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
            500: "server_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


@dataclass
class Served:
    worker: object            # server.worker.Worker
    session: object           # the loaded model's session: tokenizer and template
    names: tuple[str, ...]    # what `model` may say; names[0] is what /v1/models lists
    seq_ctx: int              # each request's share of the context
    api_key: str | None = None


def make_app(served: Served, cors: str | None = None) -> Starlette:
    async def health(request: Request):
        return JSONResponse({"status": "ok" if served.worker.error is None else "error"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": served.names[0], "object": "model", "created": 0, "owned_by": "localinfer"}]})

    async def chat(request: Request):
        return await _complete(served, request, chat=True)

    async def completions(request: Request):
        return await _complete(served, request, chat=False)

    middleware = [Middleware(CORSMiddleware, allow_origins=[cors], allow_methods=["*"],
                             allow_headers=["*"])] if cors else []
    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/completions", completions, methods=["POST"])],
                    middleware=middleware)
    return _with_key(app, served.api_key)


def _with_key(app, key: str | None):
    """Every endpoint but /health needs `Authorization: Bearer KEY` when a key is set."""
    if not key:
        return app

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {key}":
                await error("a valid API key is needed (Authorization: Bearer KEY)", 401,
                            code="invalid_api_key")(scope, receive, send)
                return
        await app(scope, receive, send)
    return guarded


async def _complete(served: Served, request: Request, *, chat: bool):
    try:
        body = await _body(request)
        _check_model(body, served.names)
        job, stream = _job(body, served, chat=chat)
    except BadRequest as e:
        return error(str(e), e.status, param=e.param, code=e.code)
    if served.worker.error is not None:
        return error(f"the model failed: {served.worker.error}", 500)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    job.on_text = lambda text: _hand_over(loop, events, text)
    if not served.worker.submit(job, lambda j: _hand_over(loop, events, None)):
        return error("too many requests are waiting; try again shortly", 429,
                     headers={"Retry-After": "1"})
    reply = _Reply(served.names[0], chat, job)
    if stream:
        from sse_starlette.sse import EventSourceResponse
        return EventSourceResponse(reply.stream(events))
    try:
        while await events.get() is not None:
            pass
    except asyncio.CancelledError:        # the client left before the answer was whole
        job.cancelled = True
        raise
    return JSONResponse(reply.whole())


def _hand_over(loop, events: asyncio.Queue, item: str | None) -> None:
    """From the scheduler's thread to the request's handler (None: the answer is complete)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, item)
    except RuntimeError:        # the server's loop has closed (shutting down): nobody is waiting
        pass


async def _body(request: Request) -> dict:
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        raise BadRequest(f"the request body is over {MAX_BODY >> 20} MB")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise BadRequest(f"the request body is over {MAX_BODY >> 20} MB")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _check_model(body: dict, names: tuple[str, ...]) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' is required and must be a string", "model")
    if model not in names:
        raise BadRequest(f"the model '{model}' does not exist here; this server has "
                         f"'{names[0]}'", "model", status=404, code="model_not_found")


def _job(body: dict, served: Served, *, chat: bool) -> tuple[Job, bool]:
    session = served.session
    if chat:
        if not uses_chat_template(session, False):
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        tokens = chat_tokens(session, _messages(body.get("messages")))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string", "prompt")
        tokens = raw_tokens(session, prompt)
    if len(tokens) >= served.seq_ctx:
        raise BadRequest(f"the prompt is {len(tokens)} tokens; a request here may use "
                         f"{served.seq_ctx}", "messages" if chat else "prompt",
                         code="context_length_exceeded")
    if _number(body, "n", int, 1, 1, 128) != 1:
        raise BadRequest("only n = 1 is supported", "n")
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    limit = -1 if most is None else _number({"max_tokens": most}, "max_tokens", int, 1, 1, 10**7)
    params = SamplingParams(temperature=_number(body, "temperature", float, 1.0, 0.0, 2.0),
                            top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
                            seed=_number(body, "seed", int, None, -1, 2**63 - 1))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    schema = _response_schema(body.get("response_format"))
    sampler = make_sampler(params) if schema is None else _constrained(params, schema, session)
    return Job(tokens, sampler, Limits(limit, _stops(body.get("stop")))), stream


def _response_schema(response_format) -> dict | None:
    """The JSON schema an answer must match: OpenAI's {"type": "json_schema", "json_schema":
    {"schema": ...}}, or {"type": "json_object"} (any object, or llama-server's "schema")."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return response_format.get("schema") or {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequest("response_format.json_schema needs a 'schema'", "response_format")
        return spec["schema"]
    raise BadRequest("response_format.type must be text, json_object or json_schema",
                     "response_format")


def _constrained(params: SamplingParams, schema, session) -> ConstrainedSampler:
    """The same check and grammar as `run --json-schema` (llama.cpp's own parse of the
    converter's grammar is left to the grammar sampler: the check's stderr capture would take
    the server's own log lines with it)."""
    try:
        gbnf = from_schema(schema, "response_format", check_parse=False).gbnf
        return ConstrainedSampler(params, session.grammar(gbnf))
    except LocalinferError as e:          # a UsageError is one too
        raise BadRequest(str(e), "response_format") from None


def _messages(messages) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] needs a role of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):     # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                 "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _number(body: dict, key: str, kind, default, low, high):
    value = body.get(key, default)
    if value is None or value is default:
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or not low <= value <= high:
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'} "
                         f"from {low} to {high}", key)
    return kind(value)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of at most 4 strings", "stop")
    return tuple(stops)


class _Reply:
    """The OpenAI shapes of one answer: chunks while it streams, or the whole object."""

    def __init__(self, model: str, chat: bool, job: Job) -> None:
        self.model, self.chat, self.job = model, chat, job
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _envelope(self, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": ("chat.completion" if self.chat else "text_completion")
                + (".chunk" if "delta" in choice else ""), "created": self.created,
                "model": self.model, "choices": [{"index": 0, **choice}], **extra}

    def _usage(self) -> dict:
        prompt, done = self.job.stats.prompt_tokens, self.job.stats.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _finish(self) -> str:
        return _FINISH.get(self.job.stats.finish_reason, "stop")

    def whole(self) -> dict:
        text = self.job.text
        choice = {"message": {"role": "assistant", "content": text}} if self.chat else \
            {"text": text, "logprobs": None}
        return self._envelope({**choice, "finish_reason": self._finish()}, usage=self._usage())

    def _piece(self, text: str | None, finish: str | None) -> str:
        if self.chat:
            choice = {"delta": {"content": text} if text is not None else {},
                      "finish_reason": finish}
        else:
            choice = {"text": text or "", "finish_reason": finish}
        body = self._envelope(choice)
        if not self.chat:
            body["object"] = "text_completion"
        if finish:
            body["usage"] = self._usage()
        return json.dumps(body)

    async def stream(self, events: asyncio.Queue):
        try:
            if self.chat:
                yield {"data": json.dumps(self._envelope(
                    {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}))}
            while (text := await events.get()) is not None:
                yield {"data": self._piece(text, None)}
            yield {"data": self._piece(None, self._finish())}
            yield {"data": "[DONE]"}
        finally:
            if self.job.stats.finish_reason == "":     # the client left mid-answer
                self.job.cancelled = True
