"""From text to prompt tokens: the model's chat template, or the text as is."""

from __future__ import annotations

from localinfer.backends import Session
from localinfer.errors import ModelLoadError


def messages_for(text: str, system: str | None) -> list[dict[str, str]]:
    """One user turn, after a system message when there is one."""
    turns = [{"role": "system", "content": system}] if system else []
    turns.append({"role": "user", "content": text})
    return turns


def uses_chat_template(session: Session, raw: bool) -> bool:
    return not raw and bool(session.chat_template)


def chat_tokens(session: Session, messages: list[dict[str, str]]) -> list[int]:
    """Render the model's own chat template and tokenize it, special tokens included."""
    from localinfer.engine import templates  # jinja2: only for chat models, not for every command
    if not session.chat_template:
        raise ModelLoadError("this model has no chat template; use --raw")
    text = templates.render(session.chat_template, messages,
                            bos_token=_text(session, session.bos_token),
                            eos_token=_text(session, session.eos_token))
    return with_bos(session, session.tokenize(text, special=True))


def raw_tokens(session: Session, text: str) -> list[int]:
    return with_bos(session, session.tokenize(text, special=True))


def with_bos(session: Session, tokens: list[int]) -> list[int]:
    # Templates usually write BOS themselves; add it only when the model wants it and it is missing.
    if session.add_bos and session.bos_token is not None and tokens[:1] != [session.bos_token]:
        return [session.bos_token, *tokens]
    return tokens


def _text(session: Session, token: int | None) -> str:
    return session.token_text(token) if token is not None else ""
