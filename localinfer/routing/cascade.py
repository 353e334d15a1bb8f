"""The cascade over any decoder: the cheapest model's first tokens are held back until its
confidence decides; then they are shown and it goes on, or it is stopped, nothing of it shown,
and the next model answers. A streamed answer so never shows text that is later withdrawn.

This module knows nothing of how a model decodes: an attempt is anything that yields text
pieces and keeps the chosen tokens' scores in a growing `logprobs` list (engine.decode's
Generation and speculate's SpeculativeGeneration do, with Limits.logprobs set; serve's jobs can
be wrapped to). `routing.generate` builds attempts from loaded models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from localinfer.engine.logprobs import TokenLogprob
from localinfer.routing.policy import Cascade


class Attempt(Protocol):
    """One model's decode of the request. `logprobs` is read after each piece: the scores of the
    tokens chosen so far (at least the chosen token's; the runner-up's too for the margin)."""

    logprobs: Sequence[TokenLogprob]

    def __iter__(self) -> Iterator[str]: ...


@dataclass
class Step:
    """One model tried: its name, its confidence over the decision's tokens, and whether its
    answer stood (the last model's always does, unmeasured: confidence None)."""

    model: str
    confidence: float | None
    accepted: bool
    tokens: int = 0              # tokens it decoded (the decision's, or its whole answer)
    seconds: float = 0.0         # from its start (its load, when it loads) to its decision


@dataclass
class Outcome:
    """How a request went through a cascade; complete once its stream ends."""

    threshold: float | None          # None: a rule router's choice (no confidence measured)
    steps: list[Step] = field(default_factory=list)
    rule: str | None = None          # a rule router's: the rule that chose ("rule 2", "default")
    ttft_s: float = 0.0          # from the request's start to the first text shown
    total_s: float = 0.0         # from the request's start to the end of the answer

    @property
    def routed_to(self) -> str:
        return self.steps[-1].model if self.steps else ""

    @property
    def index(self) -> int:
        """The answering model's place in the cascade (0: the cheapest)."""
        return len(self.steps) - 1

    @property
    def confidence(self) -> float | None:
        """The last confidence measured: the answering model's when its answer stood on it, else
        the one that sent the request up."""
        measured = [s.confidence for s in self.steps if s.confidence is not None]
        return measured[-1] if measured else None

    def fields(self) -> dict:
        """`routed_to`, `confidence`, `threshold` and the models tried, as --json gives them
        (JSON has no nan or infinity: those are null)."""
        if self.threshold is None:
            return {"routed_to": self.routed_to, "rule": self.rule}
        return {"routed_to": self.routed_to, "confidence": _json(self.confidence),
                "threshold": self.threshold if math.isfinite(self.threshold)
                else str(self.threshold),         # "inf" / "-inf": always / never up
                "route": [{"model": s.model, "confidence": _json(s.confidence),
                           "accepted": s.accepted} for s in self.steps]}

    def describe(self, router: str, policy: Cascade | None) -> str:
        """The -v line: who answered, on what confidence, against which threshold (a rule
        router's: by which rule)."""
        if policy is None:
            return f"router {router}: {self.rule} sent it to {self.routed_to}"
        tried = "; ".join(
            f"{s.model} answered" if s.confidence is None else
            f"{s.model} at {s.confidence:.3f}: {'kept' if s.accepted else 'passed on'}"
            for s in self.steps)
        return (f"router {router}: answered by {self.routed_to} ({tried}; {policy.measure} "
                f"confidence over the first {policy.tokens} tokens, threshold "
                f"{policy.threshold:g}) · ttft {self.ttft_s * 1000:.0f} ms")


def _json(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def stream(policy: Cascade, models: Sequence[str], starts: Sequence[Callable[[], Attempt]],
           outcome: Outcome, *, passed_on: Callable[[int, Attempt], None] | None = None,
           kept: Callable[[int, Attempt], None] | None = None,
           clock: Callable[[], float] = time.perf_counter) -> Iterator[str]:
    """The answer's text through the cascade: `starts[i]()` begins model i's attempt (loading it
    if need be) only when the request reaches it. `passed_on(i, attempt)` hears of an attempt
    stopped (to free its model or save its prompt cache), `kept(i, attempt)` of the one whose
    answer stands, before its held text is shown. `outcome` is filled as it goes."""
    if len(models) != len(starts) or not starts:
        raise ValueError("one start per model, at least one")
    begun = clock()
    shown = False
    for i, start in enumerate(starts):
        step_start = clock()
        attempt = start()
        pieces = iter(attempt)
        last = i == len(starts) - 1
        held: list[str] = []
        try:
            if not last:
                for piece in pieces:
                    held.append(piece)
                    if len(attempt.logprobs) >= policy.tokens:
                        break
                measured = policy.confidence(attempt.logprobs)
                keep = policy.decide(measured)
                outcome.steps.append(Step(models[i], measured, keep, len(attempt.logprobs),
                                          clock() - step_start))
                if not keep:
                    _close(pieces)
                    if passed_on is not None:
                        passed_on(i, attempt)
                    continue
            else:
                outcome.steps.append(Step(models[i], None, True))
            if kept is not None:
                kept(i, attempt)
            for piece in _chain(held, pieces):
                if not shown:
                    outcome.ttft_s, shown = clock() - begun, True
                yield piece
            outcome.total_s = clock() - begun
            outcome.ttft_s = outcome.ttft_s if shown else outcome.total_s
            return
        finally:
            _close(pieces)


def _chain(held: list[str], rest: Iterator[str]) -> Iterator[str]:
    yield from held
    yield from rest


def _close(pieces: Iterator[str]) -> None:
    close = getattr(pieces, "close", None)
    if close is not None:
        close()
