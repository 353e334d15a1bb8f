"""Ollama's API: POST /api/chat and /api/generate (this module), GET /api/tags, POST /api/show,
GET /api/ps and GET /api/version (server/ollama_models.py), and GET or HEAD / ("Ollama is running",
which clients probe). /api/embed is server/embeddings.py's.

A request is checked here in Ollama's terms, then said as the chat (or completion) request
server/requests.py prepares for the OpenAI endpoints: the same template, tokens, sampling,
thinking, tools and checks, and the same job through jobs.run (queue, cancellation, shutdown).
`options`, `format`, `think` and `keep_alive` are server/ollama_options.py's; the reply's shapes
(NDJSON while it streams, which is Ollama's default) server/ollama_reply.py's. Every refusal is
Ollama's `{"error": "..."}` with its status. Names: the served names, each also with Ollama's
`:latest` tag (clients add it to a name without one).

/api/chat: messages (system, user, assistant, tool) with an assistant's `thinking` and
`tool_calls` (arguments an object), a tool result's `tool_name`; `tools` as OpenAI's; a
message's `images` (base64) before its text, for a model with a projector (server/media_parts.py).
Both: `logprobs` and `top_logprobs` (0 to 20) give each object's `logprobs`, Ollama's list of
the tokens it carries with their log-probabilities and alternatives (server/ollama_reply.py).
/api/generate: `prompt` in the model's chat template after `system`, or as it is with `raw`
(or when the model has no template), `images` before the prompt (not with raw). `suffix`
(fill-in-the-middle), `template` (a Go template) and `context` (the tokens of an earlier reply)
are refused: none is implemented.
No prompt, or no messages: the model is loaded (done_reason "load"), as Ollama answers; with
keep_alive 0 too, it is unloaded instead (done_reason "unload"), nothing loaded to say so.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from localinfer.engine.prompt import uses_chat_template
from localinfer.server import hosting, jobs, ollama_models, ollama_options, ollama_reply, routers
from localinfer.server import logprob_fields, media_parts, requests
from localinfer.server.errors import BadRequest, ollama_error
from localinfer.server.requests import Prepared

ROLES = ("system", "user", "assistant", "tool")
# Ollama's answer to GET / and HEAD /, which its clients use to find a server
RUNNING = "Ollama is running"
# What no request here gets: refused with these words when a request asks for it
_NOT_GENERATED = (("suffix", "fill-in-the-middle ('suffix') is not supported here"),
                  ("template", "'template' (a Go template) is not supported here; the model's "
                               "own chat template is used, or none with raw"),
                  ("context", "'context' (an earlier reply's tokens) is not supported here; "
                              "send the conversation to /api/chat"),
                  *((f, f"'{f}' is for image generation, which is not supported here")
                    for f in ("width", "height", "steps")))


def routes(served) -> list[Route]:
    async def root(request: Request):
        return PlainTextResponse(RUNNING)

    async def chat(request: Request):
        return await _answer(served, request, chat=True)

    async def generate(request: Request):
        return await _answer(served, request, chat=False)

    return [Route("/", root, methods=["GET", "HEAD"]),
            Route("/api/chat", chat, methods=["POST"]),
            Route("/api/generate", generate, methods=["POST"]),
            *ollama_models.routes(served)]


async def _answer(served, request: Request, *, chat: bool):
    started = time.perf_counter_ns()
    try:
        body, unloads = await _read(served, request, chat)
        if unloads:
            return await _unload(served, body, chat)
    except BadRequest as e:
        return e.response(ollama_error)

    async def attempt(seen, gate):      # on the model named, or the one a router chose
        try:
            name, prepared = await hosting.prepared(seen, _prepare, body, seen, chat)
        except BadRequest as e:
            return e.response(ollama_error)
        if prepared is None:        # Ollama's way to load a model (keep_alive 0: to unload it)
            seen.release()
            return JSONResponse(ollama_reply.loaded(name, chat))
        reply = ollama_reply.Reply(name, chat, prepared, served.log, started, seen.session)
        return await jobs.run(seen, request, prepared, reply, ollama_error, gate)
    return await routers.answer(served, request, body, attempt,
                                lambda e: e.response(ollama_error), tag=":latest")


async def _read(served, request: Request, chat: bool) -> tuple[dict, bool]:
    """The body, and whether it asks for its model's unload (in a thread: parsing is work)."""
    raw = await requests.read_body(request, seconds=served.body_seconds)
    said = request.headers.get(requests.PRIORITY_HEADER)
    return await asyncio.to_thread(_parsed, raw, said, chat)


def _parsed(raw: bytes, said: str | None, chat: bool) -> tuple[dict, bool]:
    body = requests.parse(raw)
    if said is not None:            # under the name the options take it by
        options = body.setdefault("options", {})
        if isinstance(options, dict):
            options.setdefault("priority", said.strip().lower())
    asked = body.get("messages") if chat else body.get("prompt")
    unloads = asked in (None, "", []) and \
        ollama_options.check_keep_alive(body.get("keep_alive")) == 0
    return body, unloads


async def _unload(served, body: dict, chat: bool) -> JSONResponse:
    """Ollama's unload (keep_alive 0 and nothing to answer): the model goes once its requests
    are done, and nothing is loaded to say so. `unloaded` (not Ollama's) is false when no model
    was loaded under that name, which `localinfer stop` reports."""
    name = body.get("model")
    bare = name.removesuffix(":latest") if isinstance(name, str) else name
    unloaded = await served.models.unload(bare or name)
    return JSONResponse({**ollama_reply.loaded(name, chat), "done_reason": "unload",
                         "unloaded": unloaded})


# -- the request -------------------------------------------------------------------------------
def _prepare(body: dict, served, chat: bool) -> tuple[str, Prepared | None]:
    """The name the request used and its job (None: nothing to generate, only a load)."""
    name = ollama_models.served_name(body, served.names)
    said = {"model": served.names[0]}
    defaults, steering = ollama_options.apply(body, said, served.defaults)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    said["stream"] = stream is not False            # Ollama streams unless told not to
    templated = _chat_body(body, said) if chat else _generate_body(body, said, served.session)
    if templated is None:
        return name, None
    ctx = ollama_options.check_num_ctx(steering, served.request_ctx)
    try:
        prepared = requests.prepare(json.dumps(said).encode(), served.session, served.names,
                                    ctx, chat=templated, defaults=defaults)
    except BadRequest as e:
        raise _in_ollamas_terms(e) from None
    if steering.think and prepared.style is None:
        raise BadRequest(f"'{name[:200]}' does not think: its chat template writes no thinking "
                         f"trace" + ("" if templated else " (and a raw prompt has no template)"))
    limits = prepared.job.limits
    # `logprobs` and `top_logprobs` as the chat endpoint checks them, for a raw prompt too
    limits.logprobs = logprob_fields.asked(
        {"logprobs": body.get("logprobs"), "top_logprobs": body.get("top_logprobs")}, chat=True)
    if steering.stops:
        limits.stop = steering.stops
    if steering.num_ctx is not None:        # the answer too stays within the request's context
        room = ctx - len(prepared.job.prompt)
        limits.max_tokens = room if limits.max_tokens < 0 else min(limits.max_tokens, room)
    return name, prepared


def _in_ollamas_terms(e: BadRequest) -> BadRequest:
    """A refusal of the OpenAI-shaped request, worded with the fields the client sent."""
    message = str(e)
    if e.param in ollama_options.SAMPLING:
        message = message.replace(f"'{e.param}'", f"'options.{e.param}'", 1)
    elif e.param == "response_format":
        message = message.replace("response_format", "format")
    message = message.replace("use /v1/completions", "use /api/generate")
    return BadRequest(message, status=e.status, headers=e.headers)


def _refuse(body: dict, fields: tuple[tuple[str, str], ...]) -> None:
    """A field that asks for what is not implemented here is refused, not ignored."""
    for field, why in fields:
        if body.get(field) not in (None, False, "", []):
            raise BadRequest(why)


def _chat_body(body: dict, said: dict) -> bool | None:
    """/api/chat's messages and tools into `said`; True (a chat), or None when it has none."""
    messages = body.get("messages")
    if messages is None or messages == []:
        return None
    said["messages"] = _history(messages)
    tools = body.get("tools")
    if tools is not None and tools != []:
        said["tools"] = tools
    return True


def _generate_body(body: dict, said: dict, session) -> bool | None:
    """/api/generate's prompt into `said`: True for a chat of one turn in the model's template,
    False for the prompt as it is (raw, or a model without a template); None for no prompt."""
    _refuse(body, _NOT_GENERATED)
    prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw")
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string")
    if system is not None and not isinstance(system, str):
        raise BadRequest("'system' must be a string")
    if raw is not None and not isinstance(raw, bool):
        raise BadRequest("'raw' must be true or false")
    if not prompt:
        return None
    images = _images(body.get("images"), "images")
    if raw or not uses_chat_template(session, False):
        if system or images:
            raise BadRequest(f"'{'system' if system else 'images'}' needs the model's chat "
                             "template, which "
                             + ("raw leaves out" if raw else "this model does not have"))
        said["prompt"] = prompt
        return False
    said["messages"] = [*([{"role": "system", "content": system}] if system else []),
                        {"role": "user", "content": _with_images(prompt, images)}]
    return True


def _images(images, where: str) -> list[dict]:
    """Ollama's `images` (base64 strings) as OpenAI's image parts, each named as sent."""
    if images is None or images == []:
        return []
    if not isinstance(images, list):
        raise BadRequest(f"'{where}' must be a list of base64 images")
    return [media_parts.image_part(image, f"{where}[{k}]") for k, image in enumerate(images)]


def _with_images(text: str, images: list[dict]) -> str | list[dict]:
    """A turn's text after its images, as Ollama places them."""
    return [*images, {"type": "text", "text": text}] if images else text


def _history(messages) -> list[dict]:
    """Ollama's messages as OpenAI's: an assistant's `thinking` as reasoning_content, its
    `tool_calls` with ids made up here (Ollama's have none) and arguments as JSON text, and each
    tool result tied to the earliest unanswered call of its `tool_name`."""
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list")
    out, unanswered = [], []            # (id, name) of calls no tool message answered yet
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] needs a role of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        entry = {"role": m["role"], "content": _with_images(
            content, _images(m.get("images"), f"messages[{i}].images"))}
        if m["role"] == "assistant":
            entry.update(_assistant(m, i, unanswered))
        elif m["role"] == "tool":
            entry.update(_tool_result(m, i, unanswered))
        out.append(entry)
    return out


def _assistant(m: dict, i: int, unanswered: list) -> dict:
    fields: dict = {}
    thinking = m.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, str):
            raise BadRequest(f"messages[{i}].thinking must be a string")
        fields["reasoning_content"] = thinking
    calls = m.get("tool_calls")
    if calls is None or calls == []:
        return fields
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list")
    said = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(args, dict):
            raise BadRequest(f"messages[{i}].tool_calls[{k}] needs function.name and "
                             f"function.arguments (an object)")
        ident = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{k}"
        unanswered.append((ident, fn["name"]))
        said.append({"id": ident, "type": "function",
                     "function": {"name": fn["name"], "arguments": json.dumps(args)}})
    return {**fields, "tool_calls": said}


def _tool_result(m: dict, i: int, unanswered: list) -> dict:
    """A tool message's call id: its own `tool_call_id` where the client kept one, else the
    earliest unanswered call of its `tool_name` (of any name, when it gives none)."""
    name, ident = m.get("tool_name", m.get("name")), m.get("tool_call_id")
    if name is not None and not isinstance(name, str):
        raise BadRequest(f"messages[{i}].tool_name must be a string")
    if ident is not None and not isinstance(ident, str):
        raise BadRequest(f"messages[{i}].tool_call_id must be a string")
    at = next((j for j, (known, called) in enumerate(unanswered)
               if (known == ident if ident else name in (None, called))), None)
    if at is not None:
        ident = unanswered.pop(at)[0]
    return {"tool_call_id": ident or f"call_{i}", **({"name": name} if name else {})}
