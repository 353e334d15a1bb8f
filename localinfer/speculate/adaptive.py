"""Decide, round by round, how many tokens to draft — zero when drafting does not pay here.

The model: each drafted token is accepted with probability `a` (given the ones before it were), so
a round drafting k tokens yields 1 + a + … + a^k tokens. It costs the drafting plus the verification
chunks actually evaluated (a later chunk only runs when every guess before it was accepted).
Plain decoding yields one token per single step. Both costs are measured on this machine as
generation goes, so the choice follows the hardware, the model and the prompt.
"""

from __future__ import annotations

import math

DECAY = 0.85            # per round: recent rounds count most, a change of topic is noticed quickly
PRIOR_ACCEPTED = 2.0    # an optimistic start (a = 2/3): drafting gets a chance to prove itself
PRIOR_REJECTED = 1.0
MARGIN = 1.05           # draft only when expected to be at least this much faster than plain
EXPLORE_EVERY = 24      # while off, try one short draft this often to notice when it would pay
EXPLORE_MAX = 384       # ... backing off (doubling) each time a try does not turn drafting back on
EMA = 0.2


class Controller:
    """Tracks acceptance and costs; `draft_length` is the number of tokens to draft next round."""

    def __init__(self, max_draft: int, chunk: int, *, adaptive: bool = True) -> None:
        self.max_draft, self.chunk, self.adaptive = max_draft, max(1, chunk), adaptive
        self.accepted, self.rejected = PRIOR_ACCEPTED, PRIOR_REJECTED
        self.step_s: float | None = None              # one plain decode step of the target
        self.chunk_s: dict[int, float] = {}            # a verification eval of this many tokens
        self.draft_token_s = 0.0                       # proposing one token
        self.plain_since_draft = 0
        self.explore_every = EXPLORE_EVERY

    # -- measurements ---------------------------------------------------------------------------
    def record_step(self, seconds: float) -> None:
        self.step_s = _ema(self.step_s, seconds)
        self.plain_since_draft += 1

    def record_chunk(self, size: int, seconds: float) -> None:
        if size == 1:
            self.step_s = _ema(self.step_s, seconds)
        self.chunk_s[size] = _ema(self.chunk_s.get(size), seconds)

    def record_round(self, drafted: int, accepted: int, draft_s: float) -> None:
        self.plain_since_draft = 0
        if drafted == 0:
            return
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (1 if accepted < drafted else 0)
        self.draft_token_s = _ema(self.draft_token_s or None, draft_s / drafted)

    # -- decision -------------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def draft_length(self, limit: int) -> int:
        """How many tokens to draft now (0: take a plain step); never more than `limit`."""
        limit = min(limit, self.max_draft)
        if limit <= 0:
            return 0
        if not self.adaptive:
            return limit
        if self.step_s is None:
            return 0                        # measure one plain step first: the yardstick
        best_k, best_rate = 0, MARGIN / self.step_s
        for k in range(1, limit + 1):
            rate = self.expected_tokens(k) / self.expected_cost(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k > 0:
            self.explore_every = EXPLORE_EVERY
        elif self.plain_since_draft >= self.explore_every:
            # Each try costs a verification (and, for a draft model, catching up on every token
            # since the last one): try ever more rarely while tries keep failing to pay.
            self.explore_every = min(2 * self.explore_every, EXPLORE_MAX)
            return min(2, limit)
        return best_k

    def expected_tokens(self, k: int) -> float:
        a = self.acceptance
        return sum(a ** i for i in range(k + 1))

    def expected_cost(self, k: int) -> float:
        a, cost = self.acceptance, k * self.draft_token_s
        batch = k + 1                       # the last emitted token and k guesses
        for first in range(0, batch, self.chunk):
            size = min(self.chunk, batch - first)
            reached = a ** first            # evaluated only if guesses 1..first were accepted
            cost += reached * self.chunk_cost(size)
        return cost

    def chunk_cost(self, size: int) -> float:
        if size in self.chunk_s:
            return self.chunk_s[size]
        assert self.step_s is not None
        return self.step_s * (1 + 0.25 * (size - 1))   # a prior until measured; replaced quickly

    def plain_step_s(self) -> float:
        return self.step_s or 0.0


def _ema(old: float | None, new: float) -> float:
    return new if old is None or math.isnan(old) else old + EMA * (new - old)
