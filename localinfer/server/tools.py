"""Tool calls behind the chat API (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

Request: each tool a function with a name and a JSON schema for its arguments, checked alone
under the loose rule for tools (engine/schema_loose.py: what the grammar cannot enforce is left to
the tool, a malformed schema is a 400 naming the tool and its own path); a typed answer beside
the calls (`with_answer`: one grammar, a call or the answer); `tool_choice` "auto" (the default
with tools), "none", "required" or {"type": "function", "function": {"name": ...}}. History: an
assistant turn's `tool_calls` (content may be null) and `tool` messages. Tools and history reach
the model through its own template where it speaks a known format (engine/toolcalls.py), else
through llama.cpp's generic format: the tools in a system message, the answer one JSON object.
A tool's text and a call's are text, as a message's is (engine/prompt.py): one that spells a
control token gets those characters, never the token.

`tool_choice: "none"`: the model is not shown the tools and nothing is constrained; should it write
a call anyway (an earlier call in the history invites it), the reply keeps that text as its
content and is never read for calls, as llama-server does: a client that said none gets no
`tool_calls` and no finish_reason "tool_calls", and sees what the model wrote.

Reply: `message.tool_calls` (id, type "function", function.name, function.arguments as a JSON
string) and finish_reason "tool_calls"; streamed, the content as it comes (held back where it may
begin a call), and each call's arguments as they are decoded (server/tool_stream.py; Ollama's
API, whose clients take a call whole, gets each in one chunk). Call ids are ours (`new_id`), never what a model
wrote; a template that insists on its own shape of id (Mistral's 9 letters and digits) gets each
history id mapped to one (ToolFormat.template_id).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from localinfer.engine import toolcalls
from localinfer.engine.structured import checked, from_checked
from localinfer.engine.toolcalls.common import renamed
from localinfer.errors import LocalinferError
from localinfer.server.errors import BadRequest

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
_CHOICES = "'tool_choice' must be none, auto, required or {\"type\": \"function\", " \
           "\"function\": {\"name\": ...}}"


@dataclass
class Plan:
    tools: list[dict]               # as the request sent them (checked)
    params: dict[str, dict]         # name -> parameters schema
    choice: str                     # "auto", "none", "required" or a tool's name
    parallel: bool
    format: toolcalls.ToolFormat    # the template's (toolcalls.format_of)
    answer: dict | None = None      # a typed answer's schema (checked), beside the calls

    @property
    def active(self) -> bool:
        return self.choice != "none"


def plan(body: dict, template: str) -> Plan | None:
    """The request's tools, checked; None when it has none."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    params: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                             f"{{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, _, . "
                             f"or -", "tools")
        if name in params:
            raise BadRequest(f"tools[{i}]: a second tool named '{name}'", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise BadRequest(f"tools[{i}].function.description must be a string", "tools")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema (an "
                             f"object)", "tools")
        params[name] = _parameters(schema, f"tools[{i}] '{name}'")
    if choice is None or choice in ("auto", "none", "required"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in params:
            raise BadRequest(f"'tool_choice' names the function '{str(choice)[:64]}', which is "
                             f"not among 'tools'", "tool_choice")
    else:
        raise BadRequest(_CHOICES, "tool_choice")
    return Plan(tools, params, choice, parallel, toolcalls.format_of(template))


def with_answer(plan_: Plan | None, schema: dict | None, where: str) -> Plan | None:
    """The plan with a typed answer beside its calls (response_format, Anthropic's
    output_config.format, the Responses API's text.format): one grammar then allows a call of
    a tool or an answer in `schema`. The schema keeps --json-schema's strict rule."""
    if plan_ is None or not plan_.active or schema is None:
        return plan_
    if plan_.format.covers_trace:
        raise BadRequest(f"'{where}' together with tools is not supported for this model's "
                         f"tool format ({plan_.format.name}); send one or the other", where)
    try:
        plan_.answer = checked(schema, where)
    except (LocalinferError, RecursionError) as e:
        reason = str(e) if isinstance(e, LocalinferError) else f"{where}: nested too deeply"
        raise BadRequest(reason, where) from None
    return plan_


def _parameters(schema: dict, where: str) -> dict:
    """A tool's parameters as the grammar takes them: checked alone, so an error names the
    tool and its own path, under the loose rule for tools (engine/schema_loose.py)."""
    try:
        return checked(schema, f"{where}: parameters", loose=True)
    except (LocalinferError, RecursionError) as e:
        reason = str(e) if isinstance(e, LocalinferError) else \
            f"{where}: parameters nest too deeply"
        raise BadRequest(reason, "tools") from None


def history(message: dict, index: int) -> dict:
    """An earlier turn's tool fields as the template gets them: an assistant's `tool_calls`
    (arguments as an object, as Hugging Face templates read them), a tool result's id."""
    where = f"messages[{index}]"
    if message["role"] == "tool":
        ident = message.get("tool_call_id")
        if not isinstance(ident, str):
            raise BadRequest(f"{where}.tool_call_id must be a string", "messages")
        name = message.get("name")
        return {"tool_call_id": ident, **({"name": name} if isinstance(name, str) else {})}
    calls = message.get("tool_calls")
    if calls is None or message["role"] != "assistant":
        return {}
    if not isinstance(calls, list) or not calls:
        raise BadRequest(f"{where}.tool_calls must be a non-empty list", "messages")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(fn.get("name") if fn else None, str) or not isinstance(parsed, dict):
            raise BadRequest(f"{where}.tool_calls[{k}] needs function.name and function."
                             f"arguments (a JSON object as a string)", "messages")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": parsed}})
    return {"tool_calls": out}


def for_template(plan_: Plan | None, messages: list[dict], template: str) -> list[dict]:
    """The messages the template renders: in the generic format, the tools and the answer's
    shape in the system message, calls and results written as text for a template without
    them."""
    messages = _ids_for(toolcalls.format_of(template), messages)
    if plan_ is None or plan_.format.renders_tools:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls") and "tool_calls" not in template:
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"],
                      "id": c["id"]} for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps(
                {"tool_calls": calls} if len(calls) > 1 else {"tool_call": calls[0]})}
        elif m["role"] == "tool" and "tool" not in template:
            m = {"role": "user", "content": json.dumps({"tool_response": {
                "tool_call_id": m["tool_call_id"], "content": m["content"]}})}
        out.append(m)
    if not plan_.active:
        return out
    described = ("You can call these tools:\n" + "\n".join(
        json.dumps(t, ensure_ascii=False) for t in plan_.tools) + "\n\n"
        + (toolcalls.GENERIC_INSTRUCTION if plan_.answer is None else _TYPED_INSTRUCTION
           + json.dumps(plan_.answer, ensure_ascii=False)))
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + described}, *out[1:]]
    return [{"role": "system", "content": described}, *out]


_TYPED_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call "
                      "tools) or with a JSON document that matches this schema: ")


def _ids_for(fmt: toolcalls.ToolFormat, messages: list[dict]) -> list[dict]:
    """The history's call ids, unique across the conversation, as the template takes them
    (Mistral's insists on 9 letters and digits): an id met again (a client that kept a model's
    `call_1`, or sent none) becomes another, and each result pairs with the latest call of its
    id, mapped the same way, so they still pair."""
    seen: set[str] = set()
    latest: dict[str, str] = {}
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                unique, k = c["id"] or "call", 1
                while unique in seen:
                    k += 1
                    unique = f"{c['id'] or 'call'}_{k}"
                seen.add(unique)
                latest[c["id"]] = unique
                calls.append({**c, "id": fmt.template_id(unique)})
            m = {**m, "tool_calls": calls}
        if "tool_call_id" in m:
            ident = m["tool_call_id"]
            m = {**m, "tool_call_id": fmt.template_id(latest.get(ident, ident))}
        out.append(m)
    return out


def template_vars(plan_: Plan | None) -> dict:
    """The template's `tools`: in its own format, unless the request says none."""
    if plan_ is None or not plan_.active or not plan_.format.renders_tools:
        return {}
    return {"tools": plan_.tools}


def grammar(plan_: Plan | None, session):
    """The grammar the reply keeps to (None: free): a call of the chosen tool(s) in the format's
    own syntax, from the start (required, a named function, the generic format) or from the
    format's trigger (auto)."""
    if plan_ is None or not plan_.active:
        return None
    fmt = plan_.format
    chosen = plan_.params if plan_.choice in ("auto", "required") else \
        {plan_.choice: plan_.params[plan_.choice]}
    typed = plan_.answer is not None and plan_.choice == "auto"
    lazy = plan_.choice == "auto" and bool(fmt.trigger) and not typed
    g = session.grammar(call_or_answer(plan_) if typed else fmt.grammar(
        chosen, _gbnf, parallel=plan_.parallel and fmt.parallel, auto=plan_.choice == "auto"))
    return toolcalls.trigger_gate(session, fmt.trigger, g, anchored=fmt.anchored) if lazy else g


def covers_trace(plan_: Plan | None) -> bool:
    """Whether the tools' grammar spans the whole output, a thinking model's trace included
    (harmony's): then no trace gate goes around it."""
    return plan_ is not None and plan_.active and plan_.format.covers_trace


def call_or_answer(plan_: Plan) -> str:
    """GBNF of a reply that is a call in the format's syntax (from its start) or a typed answer:
    a JSON document in `plan_.answer`."""
    calls = plan_.format.grammar(plan_.params, _gbnf, auto=False,
                                 parallel=plan_.parallel and plan_.format.parallel)
    answer = _gbnf(plan_.answer, "response_format")
    return f"root ::= c-root | a-root\n{renamed(calls, 'c-')}\n{renamed(answer, 'a-')}"


def _gbnf(schema: dict, where: str = "tools") -> str:
    """The grammar of a schema made of checked parts (each tool's parameters): what can still
    fail here is the size of them all together."""
    try:
        return from_checked(schema, where, check_parse=False).gbnf
    except (LocalinferError, RecursionError) as e:
        reason = str(e) if isinstance(e, LocalinferError) else f"{where}: nested too deeply"
        if where == "tools":
            reason = "tools: the tools' schemas together are too large for one grammar " \
                     "(send fewer tools, or lower their counts)"
        raise BadRequest(reason, where) from None


# -- the reply ---------------------------------------------------------------------------------
def split(plan_: Plan | None, content: str,
          raw: str | None = None) -> tuple[str | None, list[dict]]:
    """The answer's content and its calls in OpenAI's shape; content None beside calls when the
    model wrote nothing else. `raw`: the whole output, markers shown, for a format that reads
    it (harmony's calls are in message headers the reasoning split takes off)."""
    if plan_ is None or not plan_.active:       # tool_choice none: never read for calls
        return content, []
    fmt = plan_.format
    if plan_.answer is not None and fmt.wraps_text and not _is_call(content):
        return content, []              # a typed answer: the document itself, never unwrapped
    text, calls = fmt.parse(raw if fmt.covers_trace and raw is not None else content)
    calls = [c for c in calls if c.name in plan_.params]
    if not calls:
        return (content if fmt.covers_trace else text), []
    return (text or None), [{"id": new_id(), "type": "function", "function": {
        "name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


_CALL_KEYS = ('{"tool_call"', '{"tool_calls"')


def _is_call(text: str) -> bool:
    """Whether a generic reply is (or, cut short, may still be) a call: its first key."""
    compact = "".join(text.split())
    return any(compact.startswith(k) or k.startswith(compact) for k in _CALL_KEYS)


def new_id() -> str:
    """A call's id, ours and never the model's (which may repeat one from the history, or write
    whatever its training showed): 96 random bits, so unique across any conversation. Anthropic
    says it `toolu_` + the same hex (server/anthropic_tools.py)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class Stream:
    """Content deltas as they come, held back where a call may begin (in the generic format,
    until the answer shows it is text, whose string then comes as it is written; all of it where
    the call is required); the calls whole at the end. `see` takes each raw piece of output, for
    a format whose calls show only there (harmony: once a header names a function, what follows
    is the call)."""

    def __init__(self, plan_: Plan | None) -> None:
        self.plan = plan_ if plan_ is not None and plan_.active else None
        self.text, self.sent, self.raw = "", 0, ""
        self.at: int | None = None      # where a wrapped answer's text is read from next

    def see(self, raw: str) -> None:
        if self.plan is not None and self.plan.format.covers_trace:
            self.raw += raw

    def feed(self, content: str) -> str:
        if self.plan is None:
            return content
        self.text += content
        fmt = self.plan.format
        if fmt.wraps_text and self.plan.choice == "auto":
            return self._typed() if self.plan.answer is not None else self._unwrapped()
        if not fmt.trigger or self.plan.choice != "auto":
            return ""
        if fmt.covers_trace:
            safe = self.sent if fmt.trigger in self.raw else len(self.text)
        elif fmt.anchored:
            begun = self.text.lstrip()
            safe = self.sent if begun.startswith(fmt.trigger) or \
                fmt.trigger.startswith(begun) else len(self.text)
        else:
            at = self.text.find(fmt.trigger, self.sent)
            safe = at if at >= 0 else _safe_end(self.text, self.sent, fmt.trigger)
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def _typed(self) -> str:
        """A typed answer (generic format): the document as it is written, once its first key
        shows it is no call."""
        if _is_call(self.text):
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _unwrapped(self) -> str:
        """A format that wraps a text answer in its JSON (generic): the answer's text as it is
        written, once the reply shows it is one; nothing while it may be a call."""
        fmt = self.plan.format
        if self.at is None and (start := fmt.text_start(self.text)) is not None:
            self.at = start
        if self.at is None:
            return ""
        out, self.at = fmt.text_from(self.text, self.at)
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet and the calls (with `index`, as OpenAI streams them)."""
        if self.plan is None:
            return "", []
        content, calls = split(self.plan, self.text, self.raw)
        if not calls:       # `sent` counts the content's characters: text, or an unwrapped answer
            return (content or "")[self.sent:], []
        content = content or ""
        rest = content[self.sent:] if self.text.startswith(content) else ""
        return rest, [{"index": k, **c} for k, c in enumerate(calls)]


def _safe_end(text: str, start: int, trigger: str) -> int:
    """Where text may be sent up to: before a tail that could begin the trigger."""
    for k in range(min(len(trigger) - 1, len(text) - start), 0, -1):
        if trigger.startswith(text[-k:]):
            return len(text) - k
    return len(text)
