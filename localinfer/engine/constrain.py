"""Constrained sampling: every token chosen is one the grammar allows.

The grammar is asked about the token the sampler chose first, which costs one token's check. Only
when it rejects that token is the row masked and the token drawn again (as llama.cpp's own common
sampler does), and even then the grammar is asked about the most likely tokens first: when those
settle what the sampler can pick (greedy: any of them allowed; top-k: k of them allowed), the
rest of the vocabulary, 262k tokens on Gemma 3, is never checked.

Drawing from the filtered distribution and, on rejection, from the masked one gives each allowed
token the probability the masked distribution gives it, so the speculative path can use that
mixture as the target's distribution and stay exact.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localinfer.backends import Grammar
from localinfer.engine import closing
from localinfer.engine.sampling import (FAR_BELOW, SamplingParams, candidate_probs,
                                        make_sampler, penalise)
from localinfer.errors import LocalinferError

Distribution = tuple[np.ndarray, np.ndarray]     # (token ids, probabilities)
# Most likely tokens asked about, in turn, before the whole vocabulary is.
WINDOWS = (64, 2048)


class Constraint:
    """One sampler's choices narrowed by a grammar; the grammar is passed in, never moved on."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        # Bias and penalties are applied here, before the mask, so masks see the sampler's logits.
        self._sample = make_sampler(params.unpenalised())
        self.masked = 0               # choices that needed more than the first token's check

    def choose(self, logits: np.ndarray, history: Sequence[int], grammar: Grammar) -> int:
        """The sampler's token if the grammar allows it, else its token from the masked row."""
        logits = self._penalised(logits, history)
        token = self._sample(logits, history)
        if grammar.allows(np.array([token], dtype=np.int32))[0]:
            return token
        self.masked += 1
        return self._sample(self.masked_row(logits, grammar), history)

    def distribution(self, logits: np.ndarray, history: Sequence[int],
                     grammar: Grammar) -> Distribution:
        """The distribution `choose` draws from: the allowed part of the filtered distribution
        and, with the mass the grammar rejects, the filtered distribution of the masked row."""
        logits = self._penalised(logits, history)
        ids, probs = candidate_probs(logits, self.params)
        ok = grammar.allows(ids.astype(np.int32))
        kept = float(probs[ok].sum())
        if ok.all():
            return ids, probs
        q_ids, q_probs = candidate_probs(self.masked_row(logits, grammar), self.params)
        if kept <= 0.0:
            return q_ids, q_probs
        merged, where = np.unique(np.concatenate([ids[ok], q_ids]), return_inverse=True)
        weights = np.bincount(where, weights=np.concatenate([probs[ok], (1.0 - kept) * q_probs]))
        order = np.argsort(-weights, kind="stable")
        return merged[order], weights[order] / weights.sum()

    def masked_row(self, logits: np.ndarray, grammar: Grammar) -> np.ndarray:
        """A row in which every token the sampler could pick is masked as the grammar says."""
        n = logits.shape[0]
        for size in WINDOWS:
            if size >= n:
                break
            ids = np.argpartition(logits, n - size)[n - size:].astype(np.int32)
            ok = grammar.allows(ids)
            if self._settled(logits, ids, ok):
                row = np.full_like(logits, -np.inf)
                row[ids[ok]] = logits[ids[ok]]
                return row
        masked = grammar.mask(logits)
        if not np.isfinite(masked.max()):
            raise LocalinferError("the grammar allows no token of this model's vocabulary here; "
                                  "check that its literals can be spelled with the model's tokens")
        return masked

    def _settled(self, logits: np.ndarray, ids: np.ndarray, ok: np.ndarray) -> bool:
        """Whether the tokens outside `ids` (all less likely) cannot be picked anyway."""
        if not ok.any():
            return False
        p = self.params
        if p.temperature == 0:
            return True
        if p.top_k > 0:
            return int(ok.sum()) >= p.top_k
        return float(logits[ids].min()) < float(logits[ids[ok]].max()) - FAR_BELOW

    def _penalised(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        return penalise(logits, history, self.params)


class ConstrainedSampler:
    """A sampler (as make_sampler's) whose tokens the grammar allows; it moves the grammar on.

    Handed the Emitter's history, it learns at its first token how many tokens the reply may
    have and narrows the grammar to close the document within them (engine/closing.py)."""

    def __init__(self, params: SamplingParams, grammar: Grammar) -> None:
        self.constraint, self.grammar = Constraint(params), grammar
        self.picked = 0

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self.picked == 0:
            emitter = getattr(history, "emitter", None)
            if emitter is not None and not emitter.tokens:
                self.grammar = closing.fit(self.grammar, emitter.session, emitter.room(),
                                           emitter.stats)
        token = self.constraint.choose(logits, history, self.grammar)
        self.grammar.accept(token)
        self.picked += 1
        return token


def sampler_for(params: SamplingParams, grammar: Grammar | None = None):
    """The sampler a generation uses: constrained to `grammar` when there is one, else plain."""
    return ConstrainedSampler(params, grammar) if grammar is not None else make_sampler(params)
