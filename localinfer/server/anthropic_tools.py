"""Anthropic's tools said as OpenAI's, for server/tools.py: `tools` with `input_schema`,
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), an assistant's `tool_use`
blocks and a user's `tool_result` blocks in the history; and the calls of a reply back as
`tool_use` blocks (id, name, input)."""

from __future__ import annotations

import json

from localinfer.server.errors import BadRequest


def request_fields(body: dict) -> dict:
    """`tools`, `tool_choice` and `parallel_tool_calls` as the chat request takes them."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    out: dict = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list")
        out["tools"] = [_tool(tool, i) for i, tool in enumerate(tools)] or None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise BadRequest("'tool_choice' must be {\"type\": auto, any, tool (with a name) "
                             "or none}")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            out["tool_choice"] = {"any": "required"}.get(kind, kind)
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    if out.get("tools") is None:
        out.pop("tools", None)
        if out.get("tool_choice") not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'")
        if out.get("tool_choice") == "auto":
            del out["tool_choice"]
    return out


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise BadRequest(f"tools[{i}] must be a custom tool ({{\"name\", \"description\", "
                         f"\"input_schema\"}}); Anthropic's server tools are not supported here")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise BadRequest(f"tools[{i}].input_schema must be a JSON schema (an object)")
    fn = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def tool_use(block: dict, where: str) -> dict:
    """An assistant's tool_use block as an OpenAI tool call."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), dict):
        raise BadRequest(f"{where} needs an id, a name and an input object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def tool_result(block: dict, where: str) -> dict:
    """A user's tool_result block as an OpenAI tool message."""
    if not isinstance(block.get("tool_use_id"), str):
        raise BadRequest(f"{where}.tool_use_id must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        if not all(isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) for b in content):
            raise BadRequest(f"{where}.content: only text blocks are supported here")
        content = "".join(b["text"] for b in content)
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or text blocks")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def blocks(calls: list[dict]) -> list[dict]:
    """A reply's calls (OpenAI's shape, from server/tools.py) as tool_use blocks."""
    return [{"type": "tool_use", "id": block_id(c["id"]), "name": c["function"]["name"],
             "input": json.loads(c["function"]["arguments"])} for c in calls]


def block_id(call_id: str) -> str:
    """A call's id (server/tools.py's new_id) as a tool_use block's."""
    return "toolu_" + call_id.removeprefix("call_")
