"""Sampling: turn one row of logits into the next token.

A sampler is a plain callable `(logits, history) -> token`. Greedy is one argmax; otherwise we
narrow the vocabulary to a few candidates with `np.argpartition` before any sort, because a full
sort of Gemma 3's 262k logits each token would cost more than the model step itself.

Before any of that, `penalise` changes the row as llama.cpp's logit-bias and penalties samplers
do: each biased token's logit gets its bias added, then each token among the last
`repeat_last_n` of prompt and output (llama.cpp's window, not OpenAI's whole output: the window
is what speculation verifies against and what llama-server penalises) is divided (or, negative,
multiplied) by the repeat penalty and lowered by frequency_penalty per occurrence and
presence_penalty once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from localinfer.errors import UsageError

Sampler = Callable[[np.ndarray, Sequence[int]], int]

# Without top-k, candidates are the logits within this many nats of the best one (at temperature 1):
# anything further has probability below e^-30 relative to the top token.
FAR_BELOW = 30.0
# llama.cpp's command-line tools take seed -1 to mean a random seed; so does --seed here.
RANDOM_SEED = -1


# The most recent tokens a sampler may look back at (the repeat penalty's window); loops that
# keep long histories hand samplers only this tail.
HISTORY_TAIL = 256
# OpenAI's ranges: penalties within ±2, a token's bias within ±100 (-100 bans it, 100 forces it);
# the number of biased tokens is bounded so that a request's cost per token stays small.
PENALTY_RANGE = 2.0
BIAS_RANGE = 100.0
MAX_BIASED = 1024


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; temperature 0 means greedy and fully deterministic."""

    temperature: float = 0.8
    top_k: int = 40               # 0 disables
    top_p: float = 0.95           # 1 disables
    min_p: float = 0.05           # 0 disables
    repeat_penalty: float = 1.0   # 1 disables
    repeat_last_n: int = 64       # at most HISTORY_TAIL; 0 turns every penalty off
    seed: int | None = None       # None or RANDOM_SEED: a different draw on every run
    frequency_penalty: float = 0.0    # OpenAI's, per occurrence in the window; 0 disables
    presence_penalty: float = 0.0     # OpenAI's, once for any occurrence; 0 disables
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias) pairs

    @property
    def penalised(self) -> bool:
        """Whether `penalise` changes anything."""
        return bool(self.logit_bias) or self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0
            or self.presence_penalty != 0)

    def unpenalised(self) -> SamplingParams:
        """The same filters with no bias or penalty (for a caller that penalised the row)."""
        return replace(self, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                       logit_bias=())

    @property
    def rng_seed(self) -> int | None:
        """The seed for numpy's generator: None (fresh entropy) for RANDOM_SEED, as llama.cpp's -1."""
        return None if self.seed == RANDOM_SEED else self.seed

    def __post_init__(self) -> None:
        self.validate()     # refused where the options are read, before any model is pulled or loaded

    def validate(self) -> None:
        if self.seed is not None and self.seed < RANDOM_SEED:
            raise UsageError("--seed must be -1 (random) or a number from 0 up")
        if not self.temperature >= 0:        # written so that nan fails too
            raise UsageError("--temp must be 0 or more")
        if self.top_k < 0:
            raise UsageError("--top-k must be 0 (off) or more")
        if not 0 < self.top_p <= 1:
            raise UsageError("--top-p must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise UsageError("--min-p must be in [0, 1)")
        if not 0 < self.repeat_penalty < float("inf"):
            raise UsageError("--repeat-penalty must be greater than 0")
        for name, value in (("frequency", self.frequency_penalty),
                            ("presence", self.presence_penalty)):
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise UsageError(f"--{name}-penalty must be from -{PENALTY_RANGE:g} to "
                                 f"{PENALTY_RANGE:g} (0 = off)")
        check_logit_bias(self.logit_bias)


def check_logit_bias(pairs: Sequence[tuple[int, float]], n_vocab: int | None = None) -> None:
    """Token ids from 0 (below n_vocab, when known), biases within ±BIAS_RANGE, at most
    MAX_BIASED of them."""
    if len(pairs) > MAX_BIASED:
        raise UsageError(f"--logit-bias: {len(pairs):,} tokens; at most {MAX_BIASED:,}")
    for token, bias in pairs:
        if token < 0 or n_vocab is not None and token >= n_vocab:
            raise UsageError(f"--logit-bias: token {token} is not in the vocabulary "
                             f"(ids 0 to {n_vocab - 1 if n_vocab else 'its size'})")
        if not -BIAS_RANGE <= bias <= BIAS_RANGE:
            raise UsageError(f"--logit-bias: the bias of token {token} must be from "
                             f"-{BIAS_RANGE:g} to {BIAS_RANGE:g}")


def make_sampler(params: SamplingParams) -> Sampler:
    params.validate()
    rng = np.random.default_rng(params.rng_seed)

    penalised = params.penalised

    def sample(logits: np.ndarray, history: Sequence[int]) -> int:
        if penalised:
            logits = penalise(logits, history, params)
        if params.temperature == 0:
            return int(logits.argmax())     # the method skips np.argmax's Python wrapper
        ids, probs = candidate_probs(logits, params)
        return int(ids[_draw(probs, rng)])

    return sample


def penalise(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """The row as the sampler sees it: logit bias added, then the penalties over the window (see
    the module's notes). The row itself when nothing applies, else a copy."""
    out = logits
    if params.logit_bias:
        if max(token for token, _ in params.logit_bias) >= logits.shape[0]:
            check_logit_bias(params.logit_bias, logits.shape[0])
        out = logits.copy()
        for token, bias in params.logit_bias:
            out[token] += bias
    n = params.repeat_last_n
    recent = history[-n:] if n > 0 else ()
    if not len(recent) or not (params.repeat_penalty != 1.0 or params.frequency_penalty
                               or params.presence_penalty):
        return out
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    if ids[-1] >= out.shape[0]:     # a medium's placeholders (engine/media.py): not tokens
        ids, counts = ids[ids < out.shape[0]], counts[ids < out.shape[0]]
    if out is logits:
        out = logits.copy()
    vals = out[ids]
    if params.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    if params.frequency_penalty or params.presence_penalty:
        vals = vals - counts * params.frequency_penalty - params.presence_penalty
    out[ids] = vals
    return out


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty on tokens seen recently: positive logits divided, negative multiplied.

    Works on a copy of the few touched entries only; the returned array is a copy of the row.
    """
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def candidate_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate token ids and their normalised probabilities after top-k, temperature, top-p, min-p.

    Ids come back sorted by descending probability.
    """
    ids = _top_candidates(logits, params.top_k)
    scaled = logits[ids].astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    ids, scaled = ids[order], scaled[order]
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    keep = len(probs)
    if params.top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (always at least one token).
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= params.min_p * probs[0]))))
    ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


def _top_candidates(logits: np.ndarray, top_k: int) -> np.ndarray:
    n = logits.shape[0]
    if 0 < top_k < n:
        return np.argpartition(logits, n - top_k)[n - top_k:]
    # No top-k: drop the long tail that cannot be drawn anyway, so the sort stays small.
    return np.flatnonzero(logits >= logits.max() - FAR_BELOW)


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cumulative = np.cumsum(probs)
    return min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")),
               len(probs) - 1)
