"""A thinking model behind the chat API: the request fields that steer its trace, and the reply
fields that carry it apart from the answer.

Request: `chat_template_kwargs` (the template's own variables, as transformers' and llama-server's
apply_chat_template take them), `reasoning_effort` (gpt-oss's variable; accepted and ignored by a
model that has another switch or none; "none" turns any thinking model's trace off),
`thinking_budget` (ours: trace tokens before the close is written), and an earlier assistant
turn's `reasoning_content`, passed on only to a template that reads it (Qwen3's puts it back
inside `<think>`), else dropped as `chat` drops it.

Reply: the trace as `reasoning_content` (llama-server's name) and `reasoning` (vLLM's and Ollama's
OpenAI layer), in `message` or in each streamed `delta`; `content` holds the answer alone. A reply
without a trace (a model that writes none, or thinking switched off) has neither field, as
llama-server leaves them out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from localinfer.thinking import setup
from localinfer.thinking.split import ANSWER, Part, split_text, splitter
from localinfer.thinking.style import EFFORTS, Style, Think, detect
from localinfer.server.errors import BadRequest

NO_EFFORT = "none"             # OpenAI's reasoning_effort for no reasoning at all
KWARGS_BYTES = 4096           # chat_template_kwargs as JSON: a few switches, never a document
KWARGS_NAMES = 32
# What the renderer sets itself and the helpers templates call: a client's variable never
# replaces them (a `messages` of its own would render a conversation nobody checked).
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                      "raise_exception", "strftime_now", "namespace", "range", "dict", "cycler",
                      "joiner", "lipsum"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_KWARGS_SHAPE = (f"'chat_template_kwargs' must be a JSON object of at most {KWARGS_NAMES} names "
                 f"(letters, digits, _) with string, number or true/false values, "
                 f"{KWARGS_BYTES:,} bytes in all")


# -- the request -------------------------------------------------------------------------------
def template_vars(body: dict, template: str, server: Think) -> dict[str, object]:
    """The variables a chat request renders its template with: those of the server's --think,
    then its reasoning_effort, then its chat_template_kwargs, each over the one before."""
    variables = setup.template_vars(template, server.think)
    effort = _effort(body)
    if effort in EFFORTS and _switch(template) == "reasoning_effort":
        variables["reasoning_effort"] = effort
    variables.update(_kwargs(body.get("chat_template_kwargs")))
    return variables


def think_of(body: dict, server: Think) -> Think:
    """The thinking a chat request asks for: `reasoning_effort: "none"` turns it off, as
    --no-think does (the template's switch, or an empty trace); else the server's."""
    return dataclasses.replace(server, think="off") if _effort(body) == NO_EFFORT else server


def _effort(body: dict) -> str | None:
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in (NO_EFFORT, *EFFORTS):
        raise BadRequest(f"'reasoning_effort' must be one of {NO_EFFORT}, {', '.join(EFFORTS)}",
                         "reasoning_effort")
    return effort


def _switch(template: str) -> str:
    """The template's thinking variable ("enable_thinking", "reasoning_effort") or ""."""
    style = detect(template, "", lambda text: False)
    return style.switch if style else ""


def _kwargs(kwargs) -> dict[str, object]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or len(kwargs) > KWARGS_NAMES \
            or not all(_NAME.match(k) and _plain(v) for k, v in kwargs.items()) \
            or len(json.dumps(kwargs).encode()) > KWARGS_BYTES:
        raise BadRequest(_KWARGS_SHAPE, "chat_template_kwargs")
    taken = sorted(RESERVED.intersection(kwargs))
    if taken:
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(taken)}: the request's "
                         f"own fields and the template's helpers are not variables to replace",
                         "chat_template_kwargs")
    return dict(kwargs)


def _plain(value) -> bool:
    # json.loads takes NaN and Infinity, which a template would print as no JSON number
    return isinstance(value, (str, bool, int)) or (isinstance(value, float)
                                                  and math.isfinite(value))


def earlier_trace(message: dict, index: int, template: str) -> dict[str, str]:
    """An assistant message's `reasoning_content` as the template gets it: only where the
    template reads that field (its text is text, as a message's is: engine/prompt.py)."""
    trace = message.get("reasoning_content")
    if trace is None or message.get("role") != "assistant":
        return {}
    if not isinstance(trace, str):
        raise BadRequest(f"messages[{index}].reasoning_content must be a string", "messages")
    if not trace or "reasoning_content" not in template:
        return {}
    return {"reasoning_content": trace}


# -- the reply ---------------------------------------------------------------------------------
def message(style: Style | None, text: str) -> dict:
    """A whole reply's `message`: the answer as content, the trace beside it when there is one."""
    trace, answer = split_text(style, text)
    return {"role": "assistant", "content": answer, **_trace_fields(trace)}


def _trace_fields(trace: str) -> dict[str, str]:
    return {"reasoning_content": trace, "reasoning": trace} if trace else {}


class Deltas:
    """A streamed reply's `delta`s: each text piece cut into answer and trace (a model without a
    trace: all answer, as before)."""

    def __init__(self, style: Style | None) -> None:
        self.cut = splitter(style) if style is not None else None

    def feed(self, text: str) -> list[dict]:
        if self.cut is None:
            return [{"content": text}]
        return [_delta(part) for part in self.cut.feed(text)]

    def flush(self) -> list[dict]:
        """What the splitter held back (a partial marker, trailing space) once the reply ends."""
        return [_delta(part) for part in self.cut.flush()] if self.cut is not None else []


def _delta(part: Part) -> dict:
    return {"content": part.text} if part.kind == ANSWER else _trace_fields(part.text)
