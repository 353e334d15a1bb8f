"""The Responses API's request said as the chat request server/requests.py prepares: `input`
(a string, or items) as chat messages, `tools` and `tool_choice` as chat tools, `text.format` as
`response_format` and `reasoning.effort` as `reasoning_effort`. Checked here in the Responses
API's own terms (`input[3].content[1]`), so that an error names what the client sent.

Items: messages (roles user, assistant, system and developer, which is said as system; content a
string or text parts: input_text, output_text, refusal), `function_call` and
`function_call_output` (its `call_id` may be left out: a result no call asked for, which Codex
sends for its own tools), Codex's `custom_tool_call`, `local_shell_call` and their outputs (said as
function calls, their input as the arguments), and `reasoning` (its text passed on with the next
assistant turn, to a template that reads an earlier trace). Items of OpenAI's hosted tools (web
search, file search, ...) record calls this server never made: they are left out, and the reply
says which. The system text at the start (`instructions`, then the first system and developer
messages) is one system message, as every template takes it.

Tools: `function` tools reach the model; other kinds (web_search, local_shell, custom, namespace,
mcp, ...) are left out of what the model sees, not refused, and the reply lists them.
"""

from __future__ import annotations

import json

from localinfer.server import media_parts, requests, tools
from localinfer.server.errors import BadRequest

MAX_ITEMS = requests.MAX_MESSAGES
MAX_TOOLS = 512               # of every kind; function tools are bounded by tools.MAX_TOOLS
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# Items of tools run by OpenAI's servers: a record of calls made elsewhere, nothing to render.
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output", "compaction",
    "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output"})
_CALLS = ("function_call", "custom_tool_call", "local_shell_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


def messages(body: dict, earlier: tuple[dict, ...] = ()) -> tuple[list[dict], list[dict]]:
    """The conversation as chat messages: the earlier one's, then `input`'s; and the input items
    left out ({"index", "type"})."""
    said = body.get("input")
    items = [{"role": "user", "content": said}] if isinstance(said, str) else said
    if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
        raise BadRequest(f"'input' must be a string or a list of 1 to {MAX_ITEMS:,} items",
                         "input")
    out, left_out = _Conversation(list(earlier)), []
    for i, item in enumerate(items):
        if not out.add(item, f"input[{i}]"):
            left_out.append({"index": i, "type": item["type"][:64]})
    return out.finish(), left_out


def with_instructions(conversation: list[dict], instructions) -> list[dict]:
    """The messages the model is shown: `instructions` (this request's alone: a previous
    response's are not carried over, as OpenAI's API does) and the system messages at the start
    as one system message."""
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", "instructions")
    chat = [{"role": "system", "content": instructions}, *conversation] if instructions \
        else conversation
    first = 0
    while first < len(chat) and chat[first]["role"] == "system":
        first += 1
    if first < 2:
        return chat
    joined = "\n\n".join(m["content"] for m in chat[:first] if m["content"])
    return [{"role": "system", "content": joined}, *chat[first:]]


class _Conversation:
    """Chat messages as the items come: calls join the assistant turn before them, a reasoning
    item waits for the assistant turn after it."""

    def __init__(self, earlier: list[dict]) -> None:
        self.chat, self.trace = earlier, ""
        # call id -> the function's name, for its result (a template may print it)
        self.names: dict[str, str] = {c["id"]: c["function"]["name"] for m in earlier
                                      for c in m.get("tool_calls", ())}

    def add(self, item, where: str) -> bool:
        """Said as chat; False when the item is left out (a hosted tool's)."""
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind in _CALLS:
            self._call(kind, item, where)
        elif kind in _OUTPUTS:
            self._output(kind, item, where)
        elif kind == "reasoning":
            self.trace += _reasoning(item, where)
        elif kind in HOSTED_ITEMS:
            return False
        else:
            raise BadRequest(f"{where}.type must be message, function_call, "
                             f"function_call_output or reasoning"
                             + (f" (not {kind[:64]})" if isinstance(kind, str) else ""), "input")
        return True

    def _message(self, item: dict, where: str) -> None:
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise BadRequest(f"{where}.role must be user, assistant, system or developer",
                             "input")
        message = {"role": role, "content": _text(item.get("content"), f"{where}.content",
                                                  media=role == "user")}
        if role == "assistant" and self.trace:
            message["reasoning_content"], self.trace = self.trace, ""
        self.chat.append(message)

    def _call(self, kind: str, item: dict, where: str) -> None:
        ident = _string(item, "call_id", where)
        if kind == "function_call":
            name, arguments = _string(item, "name", where), item.get("arguments", "")
            if not isinstance(arguments, str) or not _is_object(arguments or "{}"):
                raise BadRequest(f"{where}.arguments must be a JSON object in a string", "input")
            arguments = arguments or "{}"
        elif kind == "custom_tool_call":     # a freeform tool's input: one string
            name = _string(item, "name", where)
            arguments = json.dumps({"input": _text(item.get("input"), f"{where}.input")})
        else:
            name, action = "local_shell", item.get("action")
            if not isinstance(action, dict):
                raise BadRequest(f"{where}.action must be an object", "input")
            arguments = json.dumps(action)
        self.names[ident] = name
        call = {"id": ident, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = self.chat[-1] if self.chat else None
        # A copy, never the dict itself: an earlier conversation's messages are the store's.
        if last is not None and last["role"] == "assistant" and \
                (last.get("tool_calls") or not self.trace):
            last = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
            self.chat.pop()
        else:
            last = {"role": "assistant", "content": "", "tool_calls": [call]}
        if self.trace:
            last["reasoning_content"], self.trace = self.trace, ""
        self.chat.append(last)

    def _output(self, kind: str, item: dict, where: str) -> None:
        """A tool's result. Codex sends results no call asked for (its goal tool's, with a
        `name` and `namespace` and no `call_id`): said as a result of that name, with no id."""
        key = "id" if kind == "local_shell_call_output" and "call_id" not in item else "call_id"
        ident = item.get(key)
        if ident is not None and not isinstance(ident, str):
            raise BadRequest(f"{where}.{key} must be a string", "input")
        name = self.names.get(ident) if ident else _name(item, where)
        self.chat.append({"role": "tool", "tool_call_id": ident or "",
                          "content": _text(item.get("output"), f"{where}.output"),
                          **({"name": name} if name else {})})

    def finish(self) -> list[dict]:
        if not self.chat:
            raise BadRequest("'input' holds no message to answer (only items left out)",
                             "input")
        return self.chat


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}.{key} must be a non-empty string", "input")
    return value


def _name(item: dict, where: str) -> str | None:
    """An uncalled result's tool name, in its namespace where it has one."""
    parts = [item.get(k) for k in ("namespace", "name") if item.get(k) is not None]
    if not all(isinstance(p, str) and 0 < len(p) <= 256 for p in parts):
        raise BadRequest(f"{where}.name and .namespace must be strings of 1 to 256 "
                         f"characters", "input")
    return ".".join(parts) or None


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _text(content, where: str, *, media: bool = False) -> str | list[dict]:
    """A string, or a list of text parts joined; with `media` (a user's message), input_image
    and input_audio parts too: then OpenAI's content parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text parts", "input")
    texts: list = []
    for j, part in enumerate(content):
        medium = media_parts.responses_part(part, f"{where}[{j}]") if media else None
        if medium is not None:
            texts.append(medium)
            continue
        key = _TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if key is None or not isinstance(part.get(key), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRequest(f"{where}[{j}]: only text parts (input_text, output_text) are "
                             f"supported" + (f", not {kind[:64]}" if isinstance(kind, str)
                                             else ""), "input")
        texts.append(part[key])
    if any(isinstance(t, dict) for t in texts):
        return [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]
    return "".join(texts)


def _reasoning(item: dict, where: str) -> str:
    """A reasoning item's text: its content, else its summary, else encrypted_content (which
    this server fills with the trace itself)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise BadRequest(f"{where}.{key} must be a list of {{\"type\": \"{kind}\", "
                             f"\"text\": ...}}", "input")
        if parts:
            return "".join(p["text"] for p in parts)
    encrypted = item.get("encrypted_content")
    return encrypted if isinstance(encrypted, str) else ""


# -- tools -------------------------------------------------------------------------------------
def tool_fields(body: dict) -> tuple[dict, list[dict]]:
    """`tools`, `tool_choice` and `parallel_tool_calls` as the chat request takes them; and the
    tools left out ({"type", "name"})."""
    said, choice = body.get("tools"), body.get("tool_choice")
    if said is None:
        said = []
    if not isinstance(said, list) or len(said) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    functions, left_out = [], []
    for i, tool in enumerate(said):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise BadRequest(f"tools[{i}] must be an object with a 'type'", "tools")
        if kind != "function":
            name = tool.get("name")
            left_out.append({"type": kind[:64], **({"name": name[:64]}
                                                  if isinstance(name, str) else {})})
            continue
        functions.append(_function(tool, i))
    out: dict = {"tools": functions} if functions else {}
    choice = _choice(choice, out)
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out, left_out


def _function(tool: dict, i: int) -> dict:
    name, description = tool.get("name"), tool.get("description")
    if not isinstance(name, str):
        raise BadRequest(f"tools[{i}].name must be a string", "tools")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"tools[{i}].description must be a string", "tools")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(f"tools[{i}].parameters must be a JSON schema (an object)", "tools")
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        raise BadRequest(f"tools[{i}].strict must be true or false", "tools")
    fn = {"name": name, **({"description": description} if description else {}),
          **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": fn}


def _choice(choice, out: dict):
    """tool_choice as chat's; `allowed_tools` narrows `out`'s tools to those it names."""
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required" and "tools" not in out:
            raise BadRequest("tool_choice 'required' needs a function tool: only function tools "
                             "reach the model here", "tool_choice")
        return choice if "tools" in out else None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        if not any(t["function"]["name"] == choice["name"] for t in out.get("tools", [])):
            raise BadRequest(f"tool_choice names the function '{choice['name'][:64]}', which is "
                             f"not among the function tools", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") \
            and isinstance(choice.get("tools"), list):
        named = {t.get("name") for t in choice["tools"]
                 if isinstance(t, dict) and t.get("type") == "function"}
        kept = [t for t in out.get("tools", []) if t["function"]["name"] in named]
        if not kept:
            raise BadRequest("tool_choice allowed_tools names none of the function tools",
                             "tool_choice")
        out["tools"] = kept
        return choice["mode"]
    raise BadRequest("'tool_choice' must be none, auto, required, {\"type\": \"function\", "
                     "\"name\": ...} or {\"type\": \"allowed_tools\", ...}; only function "
                     "tools reach the model here", "tool_choice")


# -- text.format and reasoning -----------------------------------------------------------------
def response_format(text) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object", "text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise BadRequest("text.verbosity must be low, medium or high", "text")
    form = text.get("format")
    kind = form.get("type") if isinstance(form, dict) else None
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise BadRequest("text.format.schema must be a JSON schema (an object)", "text")
        return {"type": "json_schema", "json_schema": {"name": str(form.get("name", "")),
                                                       "schema": form["schema"]}}
    raise BadRequest("text.format.type must be text, json_object or json_schema", "text")


EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high"}


def effort(said) -> str | None:
    """`reasoning.effort` as chat's reasoning_effort (minimal and xhigh as the nearest of the
    three a template knows)."""
    if said is None:
        return None
    if not isinstance(said, dict):
        raise BadRequest("'reasoning' must be an object", "reasoning")
    value = said.get("effort")
    if value is not None and value not in EFFORTS:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning")
    for key in ("summary", "generate_summary"):
        if said.get(key) not in (None, "auto", "concise", "detailed"):
            raise BadRequest(f"reasoning.{key} must be auto, concise or detailed", "reasoning")
    return EFFORTS.get(value)
