"""The Responses API's shapes of one answer (server/responses.py makes the request): the whole
response object, or its server-sent events while it streams.

Output items: a thinking model's trace as a `reasoning` item (its text as `reasoning_text`
content, as vLLM and llama-server give an open model's trace; `encrypted_content` is the same
text, not encrypted, where `include` asks for it), then the answer as a `message` with one
`output_text` part, then each tool call a `function_call` item (call ids are ours: server/
tools.py). A reply of calls alone has no message item. An answer cut by max_output_tokens (or
the context) has status `incomplete`, incomplete_details.reason `max_output_tokens`.

Events: response.created, response.in_progress, then per item output_item.added, its content
part (content_part.added), its deltas (output_text.delta, reasoning_text.delta,
function_call_arguments.delta: a call's arguments in one delta, once the call is whole), their
.done events, output_item.done; then response.completed (response.incomplete for a cut answer,
response.failed for a failure, with the error). Every event has its `sequence_number`, from 0.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Callable

from starlette.responses import JSONResponse

from localinfer.server import jobs, logprob_shapes, reasoning, reuse, tool_stream, tools
from localinfer.server.errors import error
from localinfer.server.requests import Prepared


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """One answer's response object and events. `echo`: the request's fields the response
    object repeats; `keep(response, message)`: called with the finished response and its
    assistant turn (chat shape), to store it."""

    def __init__(self, prepared: Prepared, echo: dict, *, session, encrypted: bool,
                 max_calls: int | None, log: Callable[[str], None],
                 keep: Callable[[dict, dict], None]) -> None:
        self.job, self.style, self.tools = prepared.job, prepared.style, prepared.tools
        self.constrained, self.session, self.echo = prepared.constrained, session, echo
        self.encrypted, self.max_calls, self.log, self.keep = encrypted, max_calls, log, keep
        self.id = new_id("resp")
        self.created = int(time.time())
        self.sequence = 0
        # the tokens' log-probabilities, when `include` asks (server/logprob_shapes.py): each
        # text delta carries those of the tokens whose text it holds, the message all of them
        self.logprobs = self.job.limits.logprobs is not None
        self.follow = logprob_shapes.Following(session, self.job)
        self.scored: list = []          # for the next text delta
        self.given: list = []           # every entry the deltas carried

    # -- the whole response ------------------------------------------------------------------
    def failure(self) -> JSONResponse | None:
        """The error reply when the job failed: the request's own grammar at a dead end is a
        400 naming its field; anything else the engine's, a 500 (and one line in the log)."""
        problem = self.job.error
        if problem is None:
            return None
        if self.constrained is not None and self.constrained.failed is not None:
            param = "tools" if self.tools is not None and self.tools.active else "text.format"
            return error(f"{param}: {self.constrained.failed}", 400, param=param,
                         code="grammar_dead_end")
        self.log(f"a request failed: {problem}")
        return error(problem, 500)

    def whole(self) -> dict:
        said = reasoning.message(self.style, self.job.text)
        trace = said.get("reasoning_content") or ""
        text, calls = tools.split(self.tools, said["content"], self.job.text)
        calls = calls[:self.max_calls]
        status = self._status(calls)
        output = [self._reasoning(new_id("rs"), trace)] if trace else []
        if text or not calls:
            scored = logprob_shapes.shown(self.session, self.job) if self.logprobs else []
            output.append(self._message(new_id("msg"), text or "", status,
                                        self._entries(scored)))
        output += [self._call(new_id("fc"), c) for c in calls]
        return self._finished(status, output, trace, text or "", calls)

    def _status(self, calls: list) -> str:
        cut = self.job.stats.finish_reason in ("length", "context")
        return "incomplete" if cut and not calls else "completed"

    def _finished(self, status: str, output: list, trace: str, text: str,
                  calls: list) -> dict:
        response = self.response(status, output)
        message = {"role": "assistant", "content": text,
                   **({"reasoning_content": trace} if trace else {}),
                   **({"tool_calls": [{k: c[k] for k in ("id", "type", "function")}
                                      for c in calls]} if calls else {})}
        self.keep(response, message)
        return response

    def response(self, status: str, output: list, error_: dict | None = None) -> dict:
        done = status != "in_progress"
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "completed_at": int(time.time()) if done else None,
                "error": error_,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "output": output, **self.echo,
                "usage": self._usage(output) if done else None,
                **jobs.closed_early(self.job)}

    def _usage(self, output: list) -> dict:
        stats = self.job.stats
        traces = [c["text"] for item in output if item["type"] == "reasoning"
                  for c in item["content"]]
        thought = sum(len(self.session.tokenize(t, special=False)) for t in traces)
        return {"input_tokens": stats.prompt_tokens,
                "input_tokens_details": {"cached_tokens": stats.cached_tokens},
                "output_tokens": stats.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": stats.prompt_tokens + stats.generated_tokens,
                **reuse.usage(self.job)}

    # -- output items ------------------------------------------------------------------------
    def _reasoning(self, ident: str, trace: str, status: str = "completed") -> dict:
        return {"id": ident, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": trace}] if trace else [],
                **({"encrypted_content": trace} if self.encrypted and status != "in_progress"
                   else {}), "status": status}

    @staticmethod
    def _message(ident: str, text: str | None, status: str = "completed",
                 logprobs: list | None = None) -> dict:
        return {"id": ident, "type": "message", "role": "assistant", "status": status,
                "content": [] if text is None else [_text_part(text, logprobs)]}

    def _entries(self, scored: list) -> list[dict]:
        return logprob_shapes.entries(self.session, scored) if self.logprobs else []

    def delta_logprobs(self) -> list[dict]:
        """The entries for the text delta being sent: those of the tokens its text holds."""
        scored, self.scored = self.scored, []
        self.given += scored
        return self._entries(scored)

    @staticmethod
    def _call(ident: str, call: dict, status: str = "completed") -> dict:
        arguments = "" if status == "in_progress" else call["function"]["arguments"]
        return {"id": ident, "type": "function_call", "status": status, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": arguments}

    # -- the stream --------------------------------------------------------------------------
    async def frames(self, events: asyncio.Queue):
        """Each server-sent event, framed: `event: TYPE` and its JSON `data`."""
        async for data in self._events(events):
            yield f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"

    def event(self, kind: str, **fields) -> dict:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return data

    async def _events(self, events: asyncio.Queue):
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        items, deltas = _Items(self), reasoning.Deltas(self.style)
        # text that may begin a call waits; a call's arguments come as they are decoded
        held = tool_stream.CallStream(self.tools, self.max_calls)
        sent = 0
        while (text := await events.get()) is not None:
            if text is jobs.CLOSING:            # cut short, and said so
                self.job.cancelled = True
                yield self._failed(items, jobs.SHUTTING_DOWN, "server_error")
                return
            if self.logprobs:
                sent += len(text)
                self.scored += self.follow.upto(sent)
            held.see(text)
            for delta in deltas.feed(text):
                for event in items.feed(_held(delta, held)):
                    yield event
            for event in items.calls(held.pending()):
                yield event
        failed = self.failure()
        if failed is not None:
            message = json.loads(failed.body)["error"]["message"]
            yield self._failed(items, message, "server_error" if failed.status_code >= 500
                               else "invalid_prompt")
            return
        for delta in deltas.flush():
            for event in items.feed(_held(delta, held)):
                yield event
        if self.logprobs:
            self.scored += self.follow.rest()
        ending = held.ending()
        calls = [] if ending.cut else ending.calls     # a call cut short is not kept
        status = self._status(calls)
        for event in items.feed({"content": ending.rest}) + items.calls(ending.deltas) \
                + items.close(ending.calls, status):
            yield event
        response = self._finished(status, items.output, items.trace, items.text, calls)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self.event(kind, response=response)

    def _failed(self, items: _Items, message: str, code: str) -> dict:
        return self.event("response.failed", response=self.response(
            "failed", items.output, {"code": code, "message": message}))


def _held(delta: dict, held: tool_stream.CallStream) -> dict:
    """A content delta with what the tool-call filter lets through now."""
    return {"content": held.feed(delta["content"])} if "content" in delta else delta


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class _Items:
    """Output items as a stream opens, fills and closes them: a reasoning item for the trace, a
    message for the answer, then the calls, each an item whose arguments come as decoded."""

    def __init__(self, reply: Reply) -> None:
        self.reply, self.output = reply, []     # output: the items done
        self.open: str | None = None            # "reasoning", "message" or "function_call"
        self.call: dict = {}                    # the open function_call: its call_id and name
        self.ident, self.part = "", ""          # the open item's id and its text so far
        self.trace, self.text = "", ""          # all of each, for the stored turn

    def feed(self, delta: dict) -> list[dict]:
        if delta.get("reasoning_content"):
            piece = delta["reasoning_content"]
            self.trace += piece
            return self._to("reasoning") + [self._delta("response.reasoning_text.delta", piece)]
        if delta.get("content"):
            piece = delta["content"]
            self.text += piece
            return self._to("message") + [self._delta("response.output_text.delta", piece)]
        return []

    def calls(self, deltas: list[dict]) -> list[dict]:
        """Call deltas (server/tool_stream.py): a call's start is a function_call item, each
        piece of its arguments a function_call_arguments.delta."""
        events: list[dict] = []
        for delta in deltas:
            if "id" in delta:
                events += self._close("completed")
                self.open, self.ident, self.part = "function_call", new_id("fc"), ""
                self.call = {"id": delta["id"], "function": {
                    "name": delta["function"]["name"], "arguments": ""}}
                events.append(self.reply.event(
                    "response.output_item.added", output_index=len(self.output),
                    item=self.reply._call(self.ident, self.call, "in_progress")))
            if piece := delta["function"]["arguments"]:
                self.part += piece
                events.append(self.reply.event(
                    "response.function_call_arguments.delta", item_id=self.ident,
                    output_index=len(self.output), delta=piece))
        return events

    def close(self, calls: list[dict], status: str) -> list[dict]:
        """The open item closed; a reply with neither text nor calls still has a message."""
        events = self._to("message") if not calls and not any(
            item["type"] == "message" for item in self.output) and self.open != "message" \
            else []
        return events + self._close(status)

    def _to(self, kind: str) -> list[dict]:
        if self.open == kind:
            return []
        events = self._close("completed")
        self.open, self.ident, self.part = kind, new_id("rs" if kind == "reasoning" else "msg"), ""
        reply, index = self.reply, len(self.output)
        if kind == "reasoning":
            item, part = reply._reasoning(self.ident, "", "in_progress"), \
                {"type": "reasoning_text", "text": ""}
        else:
            item, part = reply._message(self.ident, None, "in_progress"), _text_part("")
        return events + [
            reply.event("response.output_item.added", output_index=index, item=item),
            reply.event("response.content_part.added", item_id=self.ident, output_index=index,
                        content_index=0, part=part)]

    def _delta(self, kind: str, piece: str) -> dict:
        self.part += piece
        extra = {"logprobs": self.reply.delta_logprobs()} \
            if kind == "response.output_text.delta" else {}
        return self.reply.event(kind, item_id=self.ident, output_index=len(self.output),
                                content_index=0, delta=piece, **extra)

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        reply, index, text = self.reply, len(self.output), self.part
        if self.open == "function_call":
            call = {**self.call, "function": {**self.call["function"], "arguments": text}}
            item = reply._call(self.ident, call, "completed" if status == "completed"
                               else "incomplete")
            self.open = None
            self.output.append(item)
            return [reply.event("response.function_call_arguments.done", item_id=self.ident,
                                output_index=index, arguments=text),
                    reply.event("response.output_item.done", output_index=index, item=item)]
        if self.open == "reasoning":
            item = reply._reasoning(self.ident, text)
            part, done = {"type": "reasoning_text", "text": text}, reply.event(
                "response.reasoning_text.done", item_id=self.ident, output_index=index,
                content_index=0, text=text)
        else:
            reply.given, reply.scored = reply.given + reply.scored, []   # none left for a delta
            given = reply._entries(reply.given)
            item, part = reply._message(self.ident, text, status, given), \
                _text_part(text, given)
            done = reply.event("response.output_text.done", item_id=self.ident,
                               output_index=index, content_index=0, text=text, logprobs=given)
        self.open = None
        self.output.append(item)
        return [done,
                reply.event("response.content_part.done", item_id=self.ident,
                            output_index=index, content_index=0, part=part),
                reply.event("response.output_item.done", output_index=index, item=item)]
