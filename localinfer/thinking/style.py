"""Which thinking trace a model writes, told from its chat template and vocabulary, and the
template variables that turn it on, off or set its effort.

Two ways of writing a trace are known:
- "tags": `<think>…</think>` before the answer, as Qwen3, DeepSeek-R1 and SmolLM3 write it. Some
  templates open `<think>` themselves at the end of the generation prompt (Qwen3 Thinking-2507,
  DeepSeek-R1-0528), so the model's output starts inside the trace.
- "harmony": gpt-oss's channels; the `analysis` channel is the trace, `final` the answer.
A model whose template and vocabulary show neither has no Style, and everything stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
# Harmony's markers (control tokens in gpt-oss's vocabulary).
START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
HARMONY_MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
EFFORTS = ("low", "medium", "high")
# What `--think` may say: on, off, or gpt-oss's reasoning effort.
THINK_VALUES = ("on", "off", *EFFORTS)


@dataclass(frozen=True)
class Style:
    """How one model's output carries its trace."""

    kind: str                      # "tags" or "harmony"
    starts_inside: bool = False    # tags: the generation prompt already opened the trace
    header: str = ""               # harmony: the message header the prompt left open
    switch: str = ""               # the template's variable: "enable_thinking", "reasoning_effort"

    @property
    def close_text(self) -> str:
        """What ends a trace and opens the answer, as `--think-budget` writes it."""
        if self.kind == "harmony":
            return f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
        return f"\n{CLOSE}\n\n"


@dataclass(frozen=True)
class Think:
    """What a request asks of a thinking model."""

    think: str | None = None      # --think: on, off, low, medium, high; None: the template's way
    budget: int | None = None     # --think-budget: trace tokens before the close is written


def detect(template: str | None, prompt_text: str, has_token) -> Style | None:
    """The Style of a model whose chat template is `template` (None: --raw or none), given the
    prompt text it rendered and `has_token(text)`: whether the vocabulary holds `text` as one
    token. None for a model that writes no trace."""
    source = template or ""
    if CHANNEL in source and MESSAGE in source:
        return Style("harmony", header=_open_header(prompt_text) if template else "",
                     switch="reasoning_effort" if "reasoning_effort" in source else "")
    if CLOSE in source or (has_token(OPEN) and has_token(CLOSE)):
        inside = bool(template) and prompt_text.rstrip().endswith(OPEN)
        return Style("tags", starts_inside=inside,
                     switch="enable_thinking" if "enable_thinking" in source else "")
    return None


def _open_header(prompt_text: str) -> str:
    """The header of the message the prompt leaves open (`assistant` after `<|start|>`), or ""
    when the prompt ends a message."""
    head, found, tail = prompt_text.rpartition(START)
    return tail if found and END not in tail and MESSAGE not in tail else ""


def template_vars(think: str | None, style: Style | None) -> dict[str, object]:
    """The template variables `--think VALUE` sets on a model of this Style (None: the
    template's own default)."""
    if think is None or style is None or not style.switch:
        return {}
    if style.switch == "reasoning_effort":
        return {"reasoning_effort": think if think in EFFORTS else
                ("low" if think == "off" else "medium")}
    return {"enable_thinking": think != "off"}


def empty_trace(think: str | None, style: Style | None) -> str:
    """Text put after the generation prompt so that the answer comes at once: `--think off` on
    a model of tags whose template has no switch gets an empty trace, as Qwen3's template writes
    one itself for `enable_thinking=false`."""
    if think != "off" or style is None or style.kind != "tags" or style.switch:
        return ""
    return f"\n{CLOSE}\n\n" if style.starts_inside else f"{OPEN}\n\n{CLOSE}\n\n"


def check_think(think: str | None) -> str | None:
    """`--think`'s value, or a UsageError naming what it may be."""
    if think is not None and think not in THINK_VALUES:
        from localinfer.errors import UsageError
        raise UsageError(f"--think must be one of {', '.join(THINK_VALUES)} (got {think!r})")
    return think
