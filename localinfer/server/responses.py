"""OpenAI's Responses API: POST /v1/responses, POST /v1/responses/input_tokens, and GET and DELETE
/v1/responses/{id} (what Codex CLI, the OpenAI Agents SDK and the `openai` package's
`responses` speak).

A request is checked in the Responses API's terms (server/responses_input.py), then said as the
chat request server/requests.py prepares for /v1/chat/completions: the same template, tokens,
sampling, thinking, tools, schemas and checks, and the same job through jobs.run (queue,
cancellation, shutdown). The answer comes back as a response object or its events
(server/responses_reply.py).

`store` (true unless the request says false) keeps the finished response in memory
(server/responses_store.py, bounded in count, bytes and age) for `previous_response_id`, whose
conversation (its input and output, not its instructions) comes before the new input, and for
GET and DELETE; an id not kept is a 404. `include: ["message.output_text.logprobs"]` (or a
`top_logprobs` above 0) puts the answer's log-probabilities in its output_text and in each
output_text delta event, `top_logprobs` (0 to 20) alternatives each (server/logprob_shapes.py).
Fields this server cannot honour are refused when they ask for something (`background: true`,
a `conversation`, a stored `prompt`); those that
only describe the client (`user`, `safety_identifier`, `prompt_cache_key`, `service_tier`,
`truncation`) are accepted and echoed. Tools of kinds other than function, and input items of
OpenAI's hosted tools, are left out of what the model sees, and the response lists them in
`ignored_tools` and `ignored_input_items`. Every refusal is in OpenAI's error shape. A stream
with nothing to say for a while (a long prompt read) sends OpenAI's numbered `keepalive` event,
which clients skip.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.errors import LocalinferError, ModelLoadError
from localinfer.server import fields, hosting, jobs, requests, responses_input, routers, tools
from localinfer.server.errors import BadRequest, error
from localinfer.server.requests import Prepared
from localinfer.server.responses_reply import Reply
from localinfer.server.responses_store import Store

LATEST = ":latest"            # Ollama's tag, as Codex's Ollama mode names a model
MAX_METADATA = 16             # OpenAI's bounds on `metadata`
ENCRYPTED = "reasoning.encrypted_content"
LOGPROBS = "message.output_text.logprobs"
# Extra fields the chat request takes as they are (llama-server's sampling, ours)
_PASSED = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "stop", "stream",
           "priority", "thinking_budget", "chat_template_kwargs")
# The chat request's words for a field, in the Responses API's
_OUR_TERMS = {"messages": "input", "max_tokens": "max_output_tokens",
              "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def routes(served) -> list[Route]:
    store = Store()

    async def create(request: Request):
        return await _create(served, store, request)

    async def input_tokens(request: Request):
        try:
            body, _ = await _opened(served, request, view=False)
            seen = await routers.counting_view(served, body, tag=LATEST)
        except BadRequest as e:
            return e.response()
        try:
            count = await asyncio.to_thread(_count, body, seen, store)
        except BadRequest as e:
            return e.response()
        finally:
            seen.release()
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    async def one(request: Request):
        ident = request.path_params["response_id"]
        if request.method == "DELETE":
            if not store.delete(ident):
                return _not_kept(ident)
            return JSONResponse({"id": ident, "object": "response.deleted", "deleted": True})
        kept = store.get(ident)
        return _not_kept(ident) if kept is None else JSONResponse(kept.response)

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
            Route("/v1/responses/{response_id}", one, methods=["GET", "DELETE"])]


def _not_kept(ident: str) -> JSONResponse:
    return error(_not_kept_text(ident), 404, code="not_found")


async def _opened(served, request: Request, *, job: bool = True, view: bool = True):
    """The request's body, and the server as it sees it (its model leased; None: not yet)."""
    raw = await requests.read_body(request, seconds=served.body_seconds)
    body = requests.with_priority_header(await asyncio.to_thread(requests.parse, raw),
                                         request.headers)
    return body, (await hosting.open_view(served, body, tag=LATEST, job=job) if view else None)


async def _create(served, store: Store, request: Request):
    try:
        body, _ = await _opened(served, request, view=False)
    except BadRequest as e:
        return e.response()

    async def attempt(seen, gate):      # on the model named, or the one a router chose
        try:
            prepared, echo, conversation = await hosting.prepared(seen, _prepare, body, seen,
                                                                  store)
        except BadRequest as e:
            return e.response()

        def keep(response: dict, message: dict) -> None:
            if echo["store"]:
                store.put(response, [*conversation, message])
        include = body.get("include") or ()
        reply = _KeptAlive(prepared, echo, session=seen.session, encrypted=ENCRYPTED in include,
                           max_calls=body.get("max_tool_calls"), log=served.log, keep=keep)
        return await jobs.run(seen, request, prepared, reply, error, gate)
    return await routers.answer(served, request, body, attempt, lambda e: e.response(),
                                tag=LATEST)


class _KeptAlive(Reply):
    """A reply whose stream, silent while a long prompt is read or text that may be a call is
    held back, sends OpenAI's `keepalive` event (server/jobs.py): an SSE comment would not do,
    since Codex's client skips comments and ends a stream that sent no event for its idle
    timeout."""

    def keep_alive(self) -> str:
        return f"event: keepalive\ndata: {json.dumps(self.event('keepalive'))}\n\n"


# -- the request -------------------------------------------------------------------------------
def _prepare(body: dict, seen, store: Store) -> tuple[Prepared, dict, list[dict]]:
    requests.check_model(body, seen.names)
    chat, echo, conversation = _translate(body, seen, store)
    try:
        prepared = requests.prepare(chat, seen.session, seen.names, seen.request_ctx,
                                    chat=True, defaults=seen.defaults)
    except BadRequest as e:
        raise _in_our_terms(e) from None
    return prepared, echo, conversation


def _count(body: dict, seen, store: Store) -> int:
    """The prompt's tokens, as POST /v1/responses would make them (its context limit aside)."""
    requests.check_model(body, seen.names)
    chat, _, _ = _translate(body, seen, store)
    session = seen.session
    try:
        plan = tools.plan(chat, session.chat_template or "")
        return len(requests._tokens(chat, session, chat=True, defaults=seen.defaults,
                                    plan=plan))
    except BadRequest as e:
        raise _in_our_terms(e) from None
    except ModelLoadError as e:
        raise BadRequest(f"the chat template cannot render these messages: "
                         f"{str(e).removesuffix(requests._TEMPLATE_ADVICE)}", "input") from None
    except LocalinferError as e:
        raise BadRequest(str(e)) from None


def _in_our_terms(e: BadRequest) -> BadRequest:
    """A chat request's refusal in the words of the Responses request it was made from."""
    text = str(e)
    for chat, ours in _OUR_TERMS.items():
        text = text.replace(f"'{chat}'", f"'{ours}'")
        if text.startswith(chat):
            text = ours + text.removeprefix(chat)
    return BadRequest(text, _OUR_TERMS.get(e.param, e.param), e.status, e.code, e.headers)


def _translate(body: dict, seen, store: Store) -> tuple[dict, dict, list[dict]]:
    """The chat body, the fields the response object repeats, and the conversation as the store
    keeps it (without instructions)."""
    _refuse_unsupported(body)
    previous = body.get("previous_response_id")
    earlier = ()
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequest("'previous_response_id' must be a string", "previous_response_id")
        kept = store.get(previous)
        if kept is None:
            raise BadRequest(_not_kept_text(previous), "previous_response_id", 404,
                             "previous_response_not_found")
        earlier = kept.messages
    conversation, left_items = responses_input.messages(body, earlier)
    tool_fields, left_tools = responses_input.tool_fields(body)
    chat = {"model": body["model"], "messages": responses_input.with_instructions(
        conversation, body.get("instructions")), **tool_fields,
        **{key: body[key] for key in _PASSED if body.get(key) is not None}}
    form = responses_input.response_format(body.get("text"))
    if form is not None:
        chat["response_format"] = form
    effort = responses_input.effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    top = body.get("top_logprobs")
    if LOGPROBS in (body.get("include") or ()) or top:   # checked with the chat's fields
        chat.update(logprobs=True, top_logprobs=top)
    echo = _echo(body, seen)
    if left_tools:
        echo["ignored_tools"] = left_tools
    if left_items:
        echo["ignored_input_items"] = left_items
    return chat, echo, conversation


def _not_kept_text(ident: str) -> str:
    return (f"no response with id '{ident[:200]}' is kept here (never stored, deleted, or past "
            f"its age)")


def _refuse_unsupported(body: dict) -> None:
    """Fields that ask for what this server does not do: refused, never silently dropped."""
    fields.refuse(body, "responses")
    if body.get("background") not in (None, False):
        raise BadRequest("background responses are not supported here; send background false",
                         "background")
    if body.get("conversation") is not None:
        raise BadRequest("conversations are not kept here; use previous_response_id",
                         "conversation")
    if body.get("prompt") is not None:
        raise BadRequest("stored prompt templates are not supported here; send input",
                         "prompt")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or len(include) > 32 or
                                not all(isinstance(i, str) for i in include)):
        raise BadRequest("'include' must be a list of at most 32 strings", "include")
    for key in ("store", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise BadRequest(f"'{key}' must be true or false", key)
    for key in ("user", "safety_identifier", "prompt_cache_key", "service_tier"):
        if body.get(key) is not None and not (isinstance(body[key], str)
                                              and len(body[key]) <= 512):
            raise BadRequest(f"'{key}' must be a string of at most 512 characters", key)
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise BadRequest("'truncation' must be auto or disabled", "truncation")
    calls = body.get("max_tool_calls")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int)
                              or not 1 <= calls <= tools.MAX_TOOLS):
        raise BadRequest(f"'max_tool_calls' must be an integer from 1 to {tools.MAX_TOOLS}",
                         "max_tool_calls")
    _check_metadata(body.get("metadata"))


def _check_metadata(metadata) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()):
        raise BadRequest(f"'metadata' must be an object of at most {MAX_METADATA} strings "
                         f"(keys up to 64 characters, values up to 512)", "metadata")


def _echo(body: dict, seen) -> dict:
    """The request's fields as the response object repeats them (OpenAI's defaults where it
    sent none; the server's sampling where it decides)."""
    params = seen.defaults.params
    reasoning = body.get("reasoning") or {}
    text = body.get("text") or {}
    functions = [t for t in body.get("tools") or () if t.get("type") == "function"]
    return {"model": body["model"], "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"),
                          "summary": reasoning.get("summary")},
            "store": body.get("store") is not False,
            "temperature": _said(body, "temperature", params.temperature),
            "text": {"format": text.get("format") or {"type": "text"},
                     **({"verbosity": text["verbosity"]} if text.get("verbosity") else {})},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": functions, "top_p": _said(body, "top_p", params.top_p),
            "top_logprobs": body.get("top_logprobs") or 0,
            "truncation": body.get("truncation") or "disabled", "user": body.get("user"),
            "service_tier": "default", "background": False,
            "prompt_cache_key": body.get("prompt_cache_key"),
            "safety_identifier": body.get("safety_identifier")}


def _said(body: dict, key: str, default):
    return default if body.get(key) is None else body[key]
