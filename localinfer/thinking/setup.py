"""A thinking model's trace for one generation on a loaded model: which Style it writes (told
from the template and the prompt's end), the control markers its text must show, and the gate
a budget or an answer's grammar needs."""

from __future__ import annotations

from typing import Sequence

from localinfer.backends import Grammar, Session
from localinfer.thinking import style as styles
from localinfer.thinking.style import CLOSE, HARMONY_MARKERS, OPEN, Style, Think, detect

# Prompt tokens read back to see how the prompt ends (`<think>\n`, `<|start|>assistant`).
_TAIL_TOKENS = 16


def style_of(session: Session, prompt: Sequence[int], raw: bool) -> Style | None:
    """The trace this model writes after `prompt` (None: it writes none)."""
    template = None if raw else session.chat_template
    tail = "".join(_prompt_text(session, t) for t in prompt[-_TAIL_TOKENS:])
    return detect(template, tail, lambda text: _one_token(session, text) is not None)


def template_vars(template: str | None, think: str | None) -> dict[str, object]:
    """The variables that render `template` with `--think THINK`."""
    return styles.template_vars(think, detect(template, "", lambda text: False))


# Bytes the empty trace of `--think off` may add to a prompt: a bound for sizing the context.
EMPTY_TRACE_BOUND = "x" * 32


def empty_trace_tokens(session: Session, prompt: Sequence[int], think: str | None) -> list[int]:
    """The empty trace that closes the thinking of a model without a switch (`--think off`)."""
    if think != "off":
        return []
    text = styles.empty_trace(think, style_of(session, prompt, raw=False))
    return session.tokenize(text, special=True) if text else []


def shown_markers(session: Session, style: Style | None) -> dict[int, bytes]:
    """The control tokens among the Style's markers, which render as no text, with the text the
    splitter needs to see for them."""
    if style is None:
        return {}
    markers = HARMONY_MARKERS if style.kind == "harmony" else (OPEN, CLOSE)
    shown = {}
    for marker in markers:
        token = _one_token(session, marker)
        if token is not None and not session.piece(token):
            shown[token] = marker.encode()
    return shown


def gate_for(session: Session, style: Style | None, think: Think,
             answer: Grammar | None) -> Grammar | None:
    """The gate this generation needs: only where a trace meets a budget or a grammar."""
    from localinfer.thinking.gate import TraceGate     # numpy: only for a gated generation
    if style is None or (think.budget is None and answer is None):
        return None
    shown = shown_markers(session, style)
    opening = session.tokenize(OPEN, special=True) \
        if style.kind == "tags" and not style.starts_inside else []
    return TraceGate(style, lambda token: _text(session, token, shown),
                     close=session.tokenize(style.close_text, special=True), opening=opening,
                     budget=think.budget, answer=answer)


def _text(session: Session, token: int, shown: dict[int, bytes]) -> str:
    """A token's text as the decode loop shows it, the Style's control markers included."""
    return (session.piece(token) or shown.get(token, b"")).decode("utf-8", "ignore")


def _prompt_text(session: Session, token: int) -> str:
    """A prompt token's text, control tokens spelled out (`<|start|>`)."""
    piece = session.piece(token)
    return piece.decode("utf-8", "ignore") if piece else session.token_text(token)


def _one_token(session: Session, text: str) -> int | None:
    """The token that is `text` whole, if the vocabulary has one."""
    tokens = session.tokenize(text, special=True)
    return tokens[0] if len(tokens) == 1 and session.token_text(tokens[0]) == text else None


def check_asked(style: Style | None, think: Think, name: str, raw: bool = False) -> None:
    """UsageError when `think` asks for thinking (--think on or an effort, --think-budget) of a
    model that writes no trace: nothing would honour it. The server refuses the same with a 400
    in the same words (server/ollama.py). `--think off` asks nothing of such a model."""
    from localinfer.errors import UsageError
    asked = [f"--think {think.think}"] if think.think not in (None, "off") else []
    asked += ["--think-budget"] if think.budget is not None else []
    if style is None and asked:
        raise UsageError(f"{name} does not think: its chat template writes no thinking trace"
                         + (" (and --raw sends no template)" if raw else "")
                         + f"; drop {' and '.join(asked)}")


def no_answer(in_trace: bool, finish: str, max_tokens: int, n_ctx: int) -> str | None:
    """Why the model wrote no answer (its trace used up -n or the context, or it ended there),
    or None when the answer began."""
    if not in_trace or finish not in ("length", "context", "stop"):
        return None
    if finish == "stop":
        return ("no answer: the model ended its output inside its trace; try again, or give "
                "--think-budget N so that the trace ends after N tokens")
    if finish == "length":
        spent = f"-n {max_tokens} ran out"
    else:
        spent = f"the context ({n_ctx:,} tokens) filled"
    return (f"no answer: the model was still thinking when {spent}; raise -n, or give "
            "--think-budget N so that the trace ends after N tokens")
