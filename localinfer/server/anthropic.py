"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request is checked here in Anthropic's terms (`max_tokens` required, roles user and assistant,
and system or developer turns as agents send them mid-conversation, content as a string or text
blocks (a user's image blocks too: server/anthropic_blocks.py), `system` as a string or text blocks; `output_config`'s format and effort, and the fields
that only steer Anthropic's own service, `cache_control` and `context_management`, accepted),
then said as the chat request server/requests.py prepares for /v1/chat/completions: the same
template, tokens, sampling, thinking and checks, and the same job through jobs.run (queue, cancellation, shutdown). The answer
comes back as a message: a thinking model's trace as `thinking` blocks (signature "") before the
`text` block, `stop_reason` end_turn, max_tokens or stop_sequence (with the `stop_sequence` met),
`usage` in input and output tokens; streamed as Anthropic's events (message_start, ping,
content_block_start/delta/stop, message_delta, message_stop, an `error` event when cut short).
`thinking` enabled or disabled turns a thinking model's trace on or off, as Ollama's `think` does.
Every refusal is in Anthropic's error shape. Tools go through OpenAI's tool calls
(server/tools.py, said in its terms by server/anthropic_tools.py): `tools` with `input_schema`,
`tool_choice` auto, any, tool or none, `tool_use` and `tool_result` blocks in the history, and a
reply's calls as `tool_use` blocks with stop_reason tool_use. An answer the budget closed early
(engine/closing.py) says so in `closed_early` and `closed_tokens`, beside `stop_reason` (the
message, or a stream's message_delta).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.errors import LocalinferError, ModelLoadError
from localinfer.server import anthropic_tools, fields, hosting, jobs, reasoning, requests
from localinfer.server.anthropic_blocks import billing_block as _billing_block
from localinfer.server.anthropic_blocks import text_blocks as _text_blocks
from localinfer.server import reuse, routers, tool_stream, tools
from localinfer.server.errors import BadRequest, anthropic_error
from localinfer.server.requests import Prepared
from localinfer.thinking.style import EFFORTS

MAX_STOPS = 16                # stop_sequences in one request
_ROLES = ("user", "assistant", "system", "developer")
_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_STOP_REASON = {"length": "max_tokens", "context": "max_tokens"}


def routes(served) -> list[Route]:
    async def messages(request: Request):
        return await _messages(served, request)

    async def count_tokens(request: Request):
        try:
            body, _ = await _opened(served, request, view=False)
            seen = await routers.counting_view(served, body)
        except BadRequest as e:
            return _refused(e)
        try:
            count = await asyncio.to_thread(_count, body, seen)
        except BadRequest as e:
            return _refused(e)
        finally:
            seen.release()
        return JSONResponse({"input_tokens": count})

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


def _refused(e: BadRequest) -> JSONResponse:
    return anthropic_error(str(e), e.status, headers=e.headers)


async def _opened(served, request: Request, *, view: bool = True):
    """The request's body, and the server as it sees it (its model leased; None: not yet)."""
    raw = await requests.read_body(request, seconds=served.body_seconds)
    body = requests.with_priority_header(await asyncio.to_thread(requests.parse, raw),
                                         request.headers)
    return body, (await hosting.open_view(served, body) if view else None)


async def _messages(served, request: Request):
    try:
        body, _ = await _opened(served, request, view=False)
    except BadRequest as e:
        return _refused(e)
    return await routers.run_on(served, request, body, _refused, _prepare, anthropic_error,
                                lambda seen, prepared: _Reply(seen.names[0], prepared, served.log))


# -- the request -------------------------------------------------------------------------------
def _prepare(body: dict, served) -> Prepared:
    requests.check_model(body, served.names)
    chat, defaults, stops = _translate(body, served.defaults, counting=False)
    prepared = requests.prepare(json.dumps(chat).encode(), served.session, served.names,
                                served.request_ctx, chat=True, defaults=defaults)
    prepared.job.limits.stop = stops
    return prepared


def _count(body: dict, served) -> int:
    """The prompt's tokens, as /v1/messages would make them (its context limit aside)."""
    requests.check_model(body, served.names)
    chat, defaults, _ = _translate(body, served.defaults, counting=True)
    session = served.session
    try:
        plan = tools.plan(chat, session.chat_template or "")
        return len(requests._tokens(chat, session, chat=True, defaults=defaults, plan=plan))
    except ModelLoadError as e:
        raise BadRequest(f"the chat template cannot render these messages: "
                         f"{str(e).removesuffix(requests._TEMPLATE_ADVICE)}") from None
    except LocalinferError as e:
        raise BadRequest(str(e)) from None


def _translate(body: dict, defaults, *, counting: bool):
    """Anthropic's body as the chat body requests.prepare takes (its system prompt the first
    message), the Defaults with its thinking, and its stop sequences."""
    fields.refuse(body, "count_tokens" if counting else "messages")
    system = _system(body.get("system"))
    # The top-level system prompt leads the conversation (a system turn inside `messages`, as
    # Claude Code sends, must not take its place); the server's --system is for a request
    # with none at all.
    chat = {"model": body["model"], "messages": ([{"role": "system", "content": system}]
                                                 if system is not None else [])
            + _history(body.get("messages")), **anthropic_tools.request_fields(body),
            **_output_config(body.get("output_config"))}
    if not counting:
        most = body.get("max_tokens")
        if most is None:
            raise BadRequest("'max_tokens' is required")
        chat["max_tokens"] = most
        for key in ("temperature", "top_p", "top_k", "priority"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("stream") is not None:
            chat["stream"] = body["stream"]
    defaults = _thinking(body.get("thinking"), chat, defaults)
    return chat, defaults, () if counting else _stops(body.get("stop_sequences"))


def _thinking(thinking, chat: dict, defaults):
    """`thinking` as the server's Defaults take it: enabled turns the trace on (its
    budget_tokens the chat body's thinking_budget), disabled off, as Ollama's `think` does;
    adaptive, or none sent, leaves the server's way."""
    if thinking is None:
        return defaults
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                         "{\"type\": \"disabled\"} or {\"type\": \"adaptive\"}")
    if kind == "adaptive":
        return defaults
    if kind == "enabled" and thinking.get("budget_tokens") is not None:
        chat["thinking_budget"] = thinking["budget_tokens"]
    said = defaults.think.think
    think = "off" if kind == "disabled" else said if said in EFFORTS else "on"
    return dataclasses.replace(defaults, think=dataclasses.replace(defaults.think, think=think))


def _output_config(config) -> dict:
    """`output_config`: `format` json_schema is the chat body's response_format (with tools:
    a call, or the answer in the schema); `effort` its reasoning_effort (xhigh and max are
    high there)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise BadRequest("'output_config' must be an object")
    out: dict = {}
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                or not isinstance(fmt.get("schema"), dict):
            raise BadRequest("output_config.format must be {\"type\": \"json_schema\", "
                             "\"schema\": {...}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        if effort not in _EFFORT:
            raise BadRequest(f"output_config.effort must be one of {', '.join(_EFFORT)}")
        out["reasoning_effort"] = _EFFORT[effort]
    return out


def _system(system) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return _text_blocks([b for b in system if not _billing_block(b)], "system")
    raise BadRequest("'system' must be a string or a list of text blocks")


def _history(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be user, assistant or system")
        content, trace, calls, results = m.get("content"), [], [], []
        assistant = m["role"] == "assistant"
        if m["role"] in ("system", "developer"):       # a system turn inside the conversation
            content = _system(content)
            if content is None:
                raise BadRequest(f"messages[{i}].content must be a string or text blocks")
            out.append({"role": "system", "content": content})
            continue
        if isinstance(content, list):
            content = _text_blocks(content, f"messages[{i}].content",
                                   trace if assistant else None, calls if assistant else None,
                                   None if assistant else results, images=not assistant)
        if not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string or a list of blocks")
        out.extend(results)             # a user turn's tool results: tool messages, first
        if results and not content:
            continue
        out.append({"role": m["role"], "content": content,
                    **({"reasoning_content": "".join(trace)} if trace else {}),
                    **({"tool_calls": calls} if calls else {})})
    if messages[-1].get("role") == "assistant":
        raise BadRequest("the last message must be the user's: continuing an assistant "
                         "message (prefill) is not supported here")
    return out


def _stops(stops) -> tuple[str, ...]:
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOPS \
            or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'stop_sequences' must be a list of at most {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


# -- the reply ---------------------------------------------------------------------------------
class _Reply:
    """The Anthropic shapes of one answer: the whole message, or its events while it streams."""

    keep_alive = 'event: ping\ndata: {"type": "ping"}\n\n'    # server/jobs.py sends it

    def __init__(self, model: str, prepared: Prepared, log: Callable[[str], None]) -> None:
        self.model, self.job, self.style, self.log = model, prepared.job, prepared.style, log
        self.constrained, self.tools = prepared.constrained, prepared.tools
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def failure(self) -> JSONResponse | None:
        if self.job.error is None:
            return None
        if self.constrained is not None and self.constrained.failed is not None:
            return anthropic_error(f"tools: {self.constrained.failed}", 400)
        self.log(f"a request failed: {self.job.error}")
        return anthropic_error(self.job.error, 500)

    def _stop(self, calls: list) -> tuple[str, str | None]:
        stats = self.job.stats
        if calls:
            return "tool_use", None
        if stats.stop_string:
            return "stop_sequence", stats.stop_string
        return _STOP_REASON.get(stats.finish_reason, "end_turn"), None

    def _message(self, content: list, stop: tuple[str | None, str | None],
                 output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": len(self.job.prompt), "output_tokens": output_tokens,
                          **reuse.usage(self.job)}}

    def whole(self) -> dict:
        said = reasoning.message(self.style, self.job.text)
        trace = said.get("reasoning_content")
        content = [{"type": "thinking", "thinking": trace, "signature": ""}] if trace else []
        text, calls = tools.split(self.tools, said["content"], self.job.text)
        if text or not calls:
            content.append({"type": "text", "text": text or ""})
        content += anthropic_tools.blocks(calls)
        return self._message(content, self._stop(calls), self.job.stats.generated_tokens) \
            | jobs.closed_early(self.job)

    async def frames(self, events: asyncio.Queue):
        """Each server-sent event, framed: `event: NAME` and its JSON `data`."""
        async for data in self._events(events):
            yield f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"

    async def _events(self, events: asyncio.Queue):
        yield {"type": "message_start", "message": self._message([], (None, None), 0)}
        yield {"type": "ping"}
        blocks, deltas = _Blocks(), reasoning.Deltas(self.style)
        held = tool_stream.CallStream(self.tools)   # text that may begin a call waits
        while (text := await events.get()) is not None:
            if text is jobs.CLOSING:        # cut short, and said so
                self.job.cancelled = True
                yield _error_event(jobs.SHUTTING_DOWN, 503)
                return
            held.see(text)
            for delta in deltas.feed(text):
                for event in blocks.feed(_held(delta, held)):
                    yield event
            for event in blocks.calls(held.pending()):
                yield event
        failed = self.failure()
        if failed is not None:
            yield json.loads(failed.body)
            return
        for delta in deltas.flush():
            for event in blocks.feed(_held(delta, held)):
                yield event
        ending = held.ending()
        calls = [] if ending.cut else ending.calls     # cut inside a call: max_tokens
        for event in blocks.feed({"content": ending.rest}) + blocks.calls(ending.deltas) \
                + blocks.close(ending.calls):
            yield event
        stop_reason, stop_sequence = self._stop(calls)
        yield {"type": "message_delta",
               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         **jobs.closed_early(self.job)},
               # the whole usage, as Anthropic's own now sends it (input_tokens included)
               "usage": {"input_tokens": len(self.job.prompt), **reuse.usage(self.job),
                         "output_tokens": self.job.stats.generated_tokens}}
        yield {"type": "message_stop"}


def _held(delta: dict, held: tool_stream.CallStream) -> dict:
    """A content delta with what the tool-call filter lets through now."""
    return {"content": held.feed(delta["content"])} if "content" in delta else delta


def _error_event(message: str, status: int) -> dict:
    return json.loads(anthropic_error(message, status).body)


class _Blocks:
    """Content blocks as a stream opens, fills and closes them: thinking, then text, then each
    call a tool_use block whose input comes as it is decoded."""

    def __init__(self) -> None:
        self.index, self.open = -1, None

    def feed(self, delta: dict) -> list[dict]:
        if delta.get("reasoning_content"):
            return self._to("thinking") + [self._delta(
                {"type": "thinking_delta", "thinking": delta["reasoning_content"]})]
        if delta.get("content"):
            return self._to("text") + [self._delta(
                {"type": "text_delta", "text": delta["content"]})]
        return []

    def calls(self, deltas: list[dict]) -> list[dict]:
        """Call deltas (server/tool_stream.py): a call's start opens its tool_use block, each
        piece of its arguments is an input_json_delta."""
        events: list[dict] = []
        for delta in deltas:
            if "id" in delta:
                events += self._to("tool_use")
                events[-1]["content_block"] = {
                    "type": "tool_use", "id": anthropic_tools.block_id(delta["id"]),
                    "name": delta["function"]["name"], "input": {}}
            if delta["function"]["arguments"]:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": delta["function"]["arguments"]}))
        return events

    def close(self, calls: list[dict]) -> list[dict]:
        """The last block closed; a reply with neither text nor calls still has a text
        block."""
        events = self._to("text") if self.open != "text" and not calls else []
        events += [{"type": "content_block_stop", "index": self.index}] if self.open else []
        self.open = None
        return events

    def _to(self, kind: str) -> list[dict]:
        if self.open == kind and kind != "tool_use":       # each call a block of its own
            return []
        events = [{"type": "content_block_stop", "index": self.index}] if self.open else []
        self.index, self.open = self.index + 1, kind
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        return events + [{"type": "content_block_start", "index": self.index,
                          "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
