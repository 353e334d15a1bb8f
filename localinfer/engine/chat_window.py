"""Which part of a conversation fits the context: the newest turns, the system message always."""

from __future__ import annotations

from typing import Callable

from localinfer.errors import ContextOverflow

Messages = list[dict[str, str]]


def fit(messages: Messages, render: Callable[[Messages], list[int]], limit: int) -> tuple[list[int], int]:
    """Tokens of the newest messages that render within `limit` tokens, and how many were dropped.

    `messages` holds no system message (render adds it) and ends with the new user message; older
    messages are dropped a whole exchange (user, assistant) at a time, so the history never starts
    with an answer to a question that is gone.
    """
    dropped = 0
    while True:
        tokens = render(messages[dropped:])
        if len(tokens) <= limit:
            return tokens, dropped
        if len(messages) - dropped <= 1:
            raise ContextOverflow(f"the message is {len(tokens)} tokens with the system message, "
                                  f"more than the {limit} the context leaves for it; raise --ctx")
        dropped += 2 if len(messages) - dropped > 2 else 1
