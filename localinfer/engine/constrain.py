"""Constrained sampling: every token chosen is one the grammar allows.

The grammar is asked about the token the sampler chose first, which costs one token's check; only
when it rejects that token is the whole vocabulary masked and the token drawn again (as llama.cpp's
own common sampler does). Drawing from the filtered distribution and, on rejection, from the
masked one gives each allowed token the probability the masked distribution gives it, so the
speculative path can use that mixture as the target's distribution and stay exact.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from localinfer.backends import Grammar
from localinfer.engine.sampling import Sampler
from localinfer.errors import LocalinferError

Distribution = tuple[np.ndarray, np.ndarray]     # (token ids, probabilities)


def allowed_only(logits: np.ndarray, grammar: Grammar) -> np.ndarray:
    """The row with every token the grammar forbids at -inf; refused when none is left."""
    masked = grammar.mask(logits)
    if not np.isfinite(masked.max()):
        raise LocalinferError("the grammar allows no token of this model's vocabulary here; "
                              "check that its literals can be spelled with the model's tokens")
    return masked


def pick(sample: Sampler, logits: np.ndarray, history: Sequence[int], grammar: Grammar) -> int:
    """The sampler's token if the grammar allows it, else its token from the masked row."""
    token = sample(logits, history)
    if grammar.allows(np.array([token], dtype=np.int32))[0]:
        return token
    return sample(allowed_only(logits, grammar), history)


class ConstrainedSampler:
    """A sampler whose tokens the grammar allows; it moves the grammar on by each token it picks."""

    def __init__(self, sample: Sampler, grammar: Grammar) -> None:
        self.sample, self.grammar = sample, grammar

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        token = pick(self.sample, logits, history, self.grammar)
        self.grammar.accept(token)
        return token


def constrained_distribution(filtered: Distribution, logits: np.ndarray, grammar: Grammar,
                             distribution_of: Callable[[np.ndarray], Distribution]) -> Distribution:
    """The distribution `pick` draws from: the allowed part of `filtered` (the sampler's
    distribution of `logits`) and, with the mass the grammar rejects, `distribution_of` the
    masked row."""
    ids, probs = filtered
    ok = grammar.allows(ids.astype(np.int32))
    kept = float(probs[ok].sum())
    if kept >= 1.0 or ok.all():
        return ids, probs
    if kept <= 0.0:
        return distribution_of(allowed_only(logits, grammar))
    q_ids, q_probs = distribution_of(allowed_only(logits, grammar))
    merged, where = np.unique(np.concatenate([ids[ok], q_ids]), return_inverse=True)
    weights = np.bincount(where, weights=np.concatenate([probs[ok], (1.0 - kept) * q_probs]))
    order = np.argsort(-weights, kind="stable")
    return merged[order], weights[order] / weights.sum()
