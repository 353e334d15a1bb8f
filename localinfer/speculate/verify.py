"""Speculative decoding: a drafter guesses, the target verifies the guesses in one batch.

The output is exactly the target's. Greedy: a guess is kept while it equals the target's own
argmax, and the target's token replaces the first wrong one. Sampling: the speculative-sampling rule
(keep a guess with probability min(1, p/q), else draw from the normalised max(0, p − q)), which
leaves the distribution of every token equal to the target's p. Verification batches are cut into
chunks no longer than the engine evaluates bit-identically to single steps (see exactness.py), so
greedy output is the same token for token as plain decoding's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from localinfer.backends import Grammar
from localinfer.engine import closing
from localinfer.engine.constrain import Constraint
from localinfer.engine.decode import Emitter, Limits, Stats
from localinfer.engine.kv import KVCache
from localinfer.engine.logprobs import TokenLogprob, token_logprob
from localinfer.engine.sampling import (HISTORY_TAIL, SamplingParams, candidate_probs,
                                        make_sampler, penalise)
from localinfer.errors import LocalinferError
from localinfer.speculate.adaptive import Controller
from localinfer.speculate.drafters import Distribution, Draft, Drafter, blind_to_media

# A token the verification settled on, with its log-probabilities when the limits ask for them:
# scored while its row is the engine's, before the next chunk's eval may overwrite it.
Settled = tuple[int, TokenLogprob | None]


@dataclass
class SpecStats(Stats):
    """Stats plus what speculation did; the plain estimate uses the measured single-step time."""

    drafter: str = ""
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    chunk: int = 0                # the most tokens verified per eval (exactness limit)
    plain_step_s: float = 0.0     # measured time of one plain decode step

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def speedup(self) -> float | None:
        """Decode time plain decoding would have taken (steps × measured step) over the actual;
        None without a figure to give: nothing drafted (the decoding was plain, and a ratio
        would only measure noise), or no step measured."""
        steps = self.generated_tokens - 1
        if self.drafted == 0 or steps <= 0 or self.decode_s <= 0 or self.plain_step_s <= 0:
            return None
        return steps * self.plain_step_s / self.decode_s

    def as_dict(self) -> dict:
        return {**super().as_dict(), "speculation": {
            "drafter": self.drafter, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance": round(self.acceptance, 4), "rounds": self.rounds,
            "verify_chunk": self.chunk, "plain_step_ms": round(self.plain_step_s * 1000, 3),
            "speedup_vs_plain_estimate": None if self.speedup is None
            else round(self.speedup, 3)}}


class SamplingPolicy:
    """The target's sampling filters as a distribution (for the acceptance rule) and a chooser."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator | None = None) -> None:
        self.params = params
        self.greedy = params.temperature == 0
        self.rng = rng or np.random.default_rng(params.rng_seed)
        self._plain = make_sampler(params)   # greedy choices go through the plain sampler itself
        self.constraint = Constraint(params)

    def choose(self, logits: np.ndarray, history: Sequence[int],
               grammar: Grammar | None = None) -> int:
        """The target's token; with a grammar, one it allows (the grammar is not moved on)."""
        if self.greedy:
            if grammar is None:
                return self._plain(logits, history)
            return self.constraint.choose(logits, history, grammar)
        return self.draw(self.distribution(logits, history, grammar))

    def distribution(self, logits: np.ndarray, history: Sequence[int],
                     grammar: Grammar | None = None) -> Distribution:
        if grammar is not None and not self.greedy:
            return self.constraint.distribution(logits, history, grammar)
        p = self.params
        logits = penalise(logits, history, p)     # bias and penalties, as the plain sampler's
        if self.greedy:
            return np.array([int(np.argmax(logits))]), np.array([1.0])
        return candidate_probs(logits, p)

    def draw(self, dist: Distribution) -> int:
        ids, probs = dist
        return int(ids[min(int(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(),
                                                side="right")), len(ids) - 1)])


def accept_or_resample(p: Distribution, guess: int, q: Distribution | None,
                       rng: np.random.Generator) -> int | None:
    """The speculative-sampling rule for one guess: None to keep it, else the token to emit instead.

    q None means the drafter proposed `guess` with certainty (prompt lookup).
    """
    p_ids, p_probs = p
    p_guess = float(p_probs[p_ids == guess].sum())
    q_guess = 1.0 if q is None else float(q[1][q[0] == guess].sum())
    if q_guess > 0 and rng.random() * q_guess < p_guess:      # probability min(1, p/q)
        return None
    residual = p_probs.astype(np.float64).copy()
    if q is None:
        residual[p_ids == guess] = 0.0
    else:
        q_on_p = np.zeros_like(residual)
        lookup = dict(zip(q[0].tolist(), q[1].tolist()))
        q_on_p[:] = [lookup.get(t, 0.0) for t in p_ids.tolist()]
        residual = np.maximum(residual - q_on_p, 0.0)
    total = residual.sum()
    if total <= 0:          # p ≤ q everywhere means p == q: the guess is always kept above
        return guess
    cumulative = np.cumsum(residual)
    at = int(np.searchsorted(cumulative, rng.random() * total, side="right"))
    return int(p_ids[min(at, len(p_ids) - 1)])


class SpeculativeGeneration:
    """Like decode.Generation (iterate for text pieces; `stats` complete at the end), with a drafter.

    Per round: emit a token, ask the controller how many guesses pay, let the drafter propose them,
    evaluate [token, guesses…] in exact chunks, keep the agreeing prefix, trim the rest.

    With a grammar, each row's token is the constrained choice, so a guess the grammar rejects is
    never kept; `grammar` always stands after every token emitted or forced to come next.
    """

    style = None       # as decode.Generation's

    def __init__(self, cache: KVCache, prompt: Sequence[int], params: SamplingParams,
                 limits: Limits, drafter: Drafter, *, max_draft: int = 8, chunk: int = 1,
                 adaptive: bool = True, grammar: Grammar | None = None) -> None:
        self.cache, self.prompt, self.limits = cache, list(prompt), limits
        # Media stay the target's: the drafter sees the text around them and drafts only text.
        self.drafter = blind_to_media(drafter, cache.session, self.prompt)
        self.grammar = grammar
        self.policy = SamplingPolicy(params)
        self.control = Controller(max_draft, chunk, adaptive=adaptive)
        self.stats = SpecStats(prompt_tokens=len(prompt), drafter=drafter.name, chunk=chunk)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []     # one per token, when limits.logprobs is set
        self.history: list[int] = []

    # -- the loop --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        emit = Emitter(self.cache, self.prompt, self.limits, self.stats)
        self.tokens, self.history, self.logprobs = emit.tokens, emit.history, emit.logprobs
        if self.grammar is not None:       # as ConstrainedSampler narrows it in plain decoding
            self.grammar = closing.fit(self.grammar, self.cache.session, emit.room(), self.stats)
        logits, cached = self.cache.prefill(self.prompt)
        self.drafter.prepare(self.prompt)
        emit.prefilled(cached)
        forced: Settled | None = None
        try:
            while True:
                if forced is not None:
                    token, scored = forced
                else:
                    token = self.policy.choose(logits, self._tail(), self.grammar)
                    scored = emit.score(logits, token)
                    if self.grammar is not None:
                        self.grammar.accept(token)
                text, done = emit.take(token, scored)
                if text:
                    yield text
                if done:
                    break
                logits, forced, accepted = self._advance(token)
                for guess, scored in accepted:
                    text, done = emit.take(guess, scored)
                    if text:
                        yield text
                    if done:
                        break
                if done:
                    break
        finally:
            self.stats.plain_step_s = self.control.plain_step_s()
        tail = emit.tail()
        if tail:
            yield tail

    def _advance(self, token: int) -> tuple[np.ndarray | None, Settled | None, list[Settled]]:
        """Evaluate `token` (plus guesses); returns (next logits or None, forced next, accepted)."""
        k = self.control.draft_length(self._room())
        draft = self.drafter.propose(self.history, k, self.policy) if k else Draft()
        if not draft.tokens:
            start = time.perf_counter()
            logits = self.cache.step(token)
            self.control.record_step(time.perf_counter() - start)
            return logits, None, []
        logits, forced, accepted = self._verify(token, draft)
        self.stats.rounds += 1
        self.stats.drafted += len(draft.tokens)
        self.stats.accepted += len(accepted)
        self.control.record_round(len(draft.tokens), len(accepted), draft.seconds)
        return logits, forced, accepted

    def _room(self) -> int:
        """Most guesses worth drafting: none past max_tokens, none past the context."""
        room = self.cache.session.n_ctx - len(self.cache.tokens) - 1
        if self.limits.max_tokens > 0:
            room = min(room, self.limits.max_tokens - len(self.tokens) - 1)
        return room

    def _verify(self, token: int, draft: Draft
                ) -> tuple[np.ndarray | None, Settled | None, list[Settled]]:
        """Keep the guesses the target agrees with; a grammar moves on along what is kept."""
        trial = self.grammar.clone() if self.grammar is not None else None
        try:
            return self._verify_along(token, draft, trial)
        finally:
            if trial is not None:      # the trial state is now the state after this round
                self.grammar, old = trial, self.grammar
                old.close()

    def _verify_along(self, token: int, draft: Draft, trial: Grammar | None
                      ) -> tuple[np.ndarray | None, Settled | None, list[Settled]]:
        batch, guesses = [token, *draft.tokens], draft.tokens
        base = len(self.cache.tokens)
        accepted: list[Settled] = []
        tail = self._tail()
        chunk = self.control.chunk
        for first in range(0, len(batch), chunk):
            part = batch[first:first + chunk]
            start = time.perf_counter()
            rows = extend(self.cache, part)
            self.control.record_chunk(len(part), time.perf_counter() - start)
            for j, row in enumerate(rows):
                i = first + j                      # row i predicts the token after batch[i]
                if i == len(guesses):              # every guess kept: row is the next logits
                    return row.copy(), None, accepted
                verdict = self._judge(row, tail + guesses[:i], guesses[i], draft, i, trial)
                if trial is not None:
                    trial.accept(guesses[i] if verdict is None else verdict)
                if verdict is not None:            # rejected: drop the guesses' KV entries
                    rollback(self.cache, base + i + 1)
                    return None, (verdict, self._score(row, verdict)), accepted
                accepted.append((guesses[i], self._score(row, guesses[i])))
        raise AssertionError("the last row always ends verification")

    def _judge(self, row: np.ndarray, history: list[int], guess: int, draft: Draft,
               i: int, grammar: Grammar | None) -> int | None:
        if self.policy.greedy:
            target = self.policy.choose(row, history, grammar)
            return None if target == guess else target
        p = self.policy.distribution(row, history, grammar)
        q = draft.q[i] if draft.q is not None else None
        verdict = accept_or_resample(p, guess, q, self.policy.rng)
        if verdict == guess and grammar is not None:     # p == q with the guess outside both
            return self.policy.draw(p)
        return verdict

    def _score(self, row: np.ndarray, token: int) -> TokenLogprob | None:
        n = self.limits.logprobs
        return None if n is None else token_logprob(row, token, n)

    def _tail(self) -> list[int]:
        return self.history[-HISTORY_TAIL:]


def extend(cache: KVCache, tokens: Sequence[int]) -> np.ndarray:
    """Evaluate tokens in one batch, keeping cache.tokens in step; returns one logits row each."""
    rows = cache.session.eval(tokens, logits="all")
    cache.tokens.extend(tokens)
    return rows


def rollback(cache: KVCache, n_keep: int) -> None:
    """Forget KV entries past n_keep (rejected guesses), in cache.tokens and in the engine: in that
    order, so an interrupt between the two leaves cache.tokens claiming no cell the engine lacks."""
    del cache.tokens[n_keep:]
    if not cache.session.trim(n_keep):
        raise LocalinferError("this backend cannot trim its KV cache; use --draft none")
