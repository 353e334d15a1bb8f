"""Anthropic's content blocks in a message or the system prompt, as the chat request takes
them: text (joined), thinking, tool_use and tool_result blocks collected where a role has them,
and a user's image blocks as OpenAI's image parts (server/media_parts.py reads those)."""

from __future__ import annotations

from localinfer.server import anthropic_tools, media_parts
from localinfer.server.errors import BadRequest


def billing_block(block) -> bool:
    """Claude Code (2.1.36 on) leads its system prompt with a block for Anthropic's billing,
    `x-anthropic-billing-header: ...; cch=HASH;`, whose hash changes with every request. It
    says nothing to the model, and rendered first it would make every request's prompt differ
    from its first token, so no cached prefix could ever be reused: it is dropped."""
    return (isinstance(block, dict) and block.get("type") == "text"
            and isinstance(block.get("text"), str)
            and block["text"].startswith("x-anthropic-billing-header:"))


def text_blocks(blocks: list, where: str, thinking: list | None = None,
                calls: list | None = None, results: list | None = None,
                images: bool = False) -> str | list[dict]:
    """The text of a content list; `thinking`, `calls` and `results` (where a role may have
    them) collect thinking blocks' text, tool_use blocks and tool_result blocks. With `images`
    (a user's turn), image blocks too: then OpenAI's content parts, text and images in order."""
    texts: list = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "image" and images:
            texts.append(image(block.get("source"), f"{where}[{j}]"))
        elif kind in ("thinking", "redacted_thinking") and thinking is not None:
            if kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise BadRequest(f"{where}[{j}].thinking must be a string")
                thinking.append(block["thinking"])
        elif kind == "tool_use" and calls is not None:
            calls.append(anthropic_tools.tool_use(block, f"{where}[{j}]"))
        elif kind == "tool_result" and results is not None:
            results.append(anthropic_tools.tool_result(block, f"{where}[{j}]"))
        else:
            raise BadRequest(f"{where}[{j}]: only text blocks are supported here"
                             + (f" (not {kind})" if isinstance(kind, str) else ""))
    if any(isinstance(t, dict) for t in texts):
        return [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]
    return "".join(texts)


def image(source, where: str) -> dict:
    """An image block's source (base64, or a URL: fetched only with --allow-remote-media) as
    OpenAI's image part (server/media_parts.py reads it)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        said, data = source.get("media_type"), source.get("data")
        if not isinstance(said, str) or not said.startswith("image/") or \
                not isinstance(data, str):
            raise BadRequest(f"{where}.source needs media_type (an image type) and data "
                             "(base64)")
        return media_parts.image_part(f"data:{said[:64]};base64,{data}", where)
    if kind == "url" and isinstance(source.get("url"), str):
        return media_parts.image_part(source["url"], where)
    raise BadRequest(f"{where}.source must be base64 or url"
                     + (f" (not {kind})" if isinstance(kind, str) else ""))
