"""The decode loop: prefill a prompt, then sample, stream and evaluate one token at a time.

Per token the loop does one `eval`, one sample and one cached detokenize; everything else here is
bookkeeping sized by the stop strings, never by the vocabulary.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from localinfer.engine.kv import KVCache
from localinfer.engine.logprobs import TokenLogprob, token_logprob
from localinfer.engine.sampling import Sampler


@dataclass
class Stats:
    """Figures for one generation; times in seconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens already in the KV cache, not evaluated again
    prefill_s: float = 0.0
    ttft_s: float = 0.0           # from the start of prefill to the first generated token
    decode_s: float = 0.0         # from the first generated token to the last
    generated_tokens: int = 0
    finish_reason: str = ""       # "stop" (end of generation or stop string), "length", "context"
    stop_string: str = ""         # the stop string that ended it, if one did
    load_s: float = 0.0
    # A grammar's answer narrowed to close in the tokens left (engine/closing.py): the index of the
    # first token so chosen, else -1.
    closed_at: int = -1

    @property
    def closed_tokens(self) -> int:
        """Tokens written since the budget narrowed the answer to close in time (0: it did not)."""
        return self.generated_tokens - self.closed_at if self.closed_at >= 0 else 0

    @property
    def prefill_tps(self) -> float:
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of prefill; each later one costs one decode step.
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "load_s": round(self.load_s, 4),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": round(self.ttft_s, 4),
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "generated_tokens": self.generated_tokens,
            "finish_reason": self.finish_reason,
        } | ({"closed_early": True, "closed_tokens": self.closed_tokens}
             if self.closed_at >= 0 else {})


class StopMatcher:
    """Holds back text that might be the start of a stop string, so a stop never leaks out."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = ""             # the stop string reached (the earliest in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            at = min(hits)
            self.hit = next(s for s in self.stops if self.pending.find(s) == at)
            out, self.pending = self.pending[:at], ""
            return out, True
        hold = self._longest_partial_stop()
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _longest_partial_stop(self) -> int:
        for n in range(min(len(self.pending), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


@dataclass
class Limits:
    max_tokens: int = -1          # -1: until end of generation or a full context
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False      # benchmarks decode a fixed number of tokens
    # Control tokens whose text a thinking model's splitter must see (harmony's `<|channel|>`):
    # they render as no text otherwise.
    shown: Mapping[int, bytes] = field(default_factory=dict)
    # Log-probabilities of the emitted tokens (engine/logprobs.py): None off (nothing computed),
    # 0 the chosen token's alone, N also the N likeliest tokens' (at most logprobs.MAX_TOP).
    logprobs: int | None = None


class History(list):
    """The tokens a sampler looks back over (prompt and output), and the Emitter writing them: a
    constrained sampler learns from it how many tokens are left (engine/closing.py)."""

    emitter: Emitter | None = None


class Emitter:
    """Turns chosen tokens into text pieces and figures, and says when generation ends.

    Plain and speculative decoding both hand every token they keep to `take`, so both end, stream
    and count in the same way.
    """

    def __init__(self, cache: KVCache, prompt: Sequence[int], limits: Limits, stats: Stats) -> None:
        self.session, self.limits, self.stats = cache.session, limits, stats
        self.n_prompt = len(prompt)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []     # one per token in `tokens`, when asked for
        # The repeat penalty looks back over prompt and output alike.
        self.history = History(prompt)
        self.history.emitter = self
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(limits.stop)
        self._start = time.perf_counter()
        self._first = 0.0
        self._hit_stop_string = False

    def prefilled(self, cached_tokens: int) -> None:
        self.stats.cached_tokens = cached_tokens
        self.stats.prefill_s = time.perf_counter() - self._start

    def score(self, row: np.ndarray, token: int) -> TokenLogprob | None:
        """`token`'s log-probabilities under the raw logits `row` it was chosen from, when the
        limits ask for them (None otherwise: nothing is computed). Called before the engine's
        next eval, which may overwrite the row."""
        if self.limits.logprobs is None:
            return None
        return token_logprob(row, token, self.limits.logprobs)

    def take(self, token: int, scored: TokenLogprob | None = None) -> tuple[str, bool]:
        """Emit one token; returns (text safe to print now, whether generation ends here).
        `scored` is its `score`, kept alongside it (the end-of-generation token's is dropped)."""
        stats, limits, session = self.stats, self.limits, self.session
        now = time.perf_counter()
        if not self.tokens:
            self._first = now
            stats.ttft_s = now - self._start
        stats.decode_s = now - self._first
        if session.is_eog(token) and not limits.ignore_eos:
            stats.finish_reason = "stop"
            return "", True
        self.tokens.append(token)
        if limits.logprobs is not None:
            if scored is None or scored.token != token:
                raise AssertionError("a token taken with logprobs on needs its own score")
            self.logprobs.append(scored)
        self.history.append(token)
        stats.generated_tokens = len(self.tokens)
        # The incremental decoder keeps a multi-byte character split across tokens until whole.
        piece = session.piece(token) or self.limits.shown.get(token, b"")
        text, self._hit_stop_string = self._stops.feed(self._utf8.decode(piece))
        if self._hit_stop_string:
            stats.finish_reason, stats.stop_string = "stop", self._stops.hit
            return text, True
        if len(self.tokens) == limits.max_tokens:
            stats.finish_reason = "length"
            return text, True
        # The token just emitted needs a KV slot to be evaluated; none left ends the reply.
        if self.n_prompt + len(self.tokens) - 1 >= session.n_ctx:
            stats.finish_reason = "context"
            return text, True
        return text, False

    def room(self) -> int:
        """Tokens it may still take before -n or the context ends the reply (the next included)."""
        room = self.session.n_ctx - self.n_prompt + 1 - len(self.tokens)
        if self.limits.max_tokens > 0:
            room = min(room, self.limits.max_tokens - len(self.tokens))
        return room

    def tail(self) -> str:
        """Text held back for a possible stop string, and an unfinished character; none after a
        stop string was reached."""
        if self._hit_stop_string:
            return ""
        return self._stops.flush() + self._utf8.decode(b"", final=True)


class Generation:
    """Iterate for text pieces; `stats` is complete once iteration ends (or is interrupted)."""

    style = None       # a thinking model's thinking.style.Style: its pieces hold trace and answer

    def __init__(self, cache: KVCache, prompt: Sequence[int], sampler: Sampler,
                 limits: Limits) -> None:
        self.cache, self.prompt, self.sampler, self.limits = cache, list(prompt), sampler, limits
        self.stats = Stats(prompt_tokens=len(prompt))
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []     # one per token, when limits.logprobs is set

    def __iter__(self) -> Iterator[str]:
        emit = Emitter(self.cache, self.prompt, self.limits, self.stats)
        self.tokens, self.logprobs = emit.tokens, emit.logprobs
        logits, cached = self.cache.prefill(self.prompt)
        emit.prefilled(cached)
        while True:
            # The raw row is scored after the sampler chose from it: samplers never write to it.
            token = self.sampler(logits, emit.history)
            text, done = emit.take(token, emit.score(logits, token))
            if text:
                yield text
            if done:
                break
            logits = self.cache.step(emit.tokens[-1])
        tail = emit.tail()
        if tail:
            yield tail
