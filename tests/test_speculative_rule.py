"""The speculative-sampling rule keeps the target's distribution exactly (chi-square over many draws
on a five-token vocabulary, which a real model cannot give deterministically), and the adaptive
controller drafts when guesses pay and stops when they do not."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from localinfer.engine.decode import Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.sampling import SamplingParams
from localinfer.speculate.adaptive import Controller
from localinfer.speculate.drafters import DraftModel, PromptLookup
from localinfer.speculate.verify import SamplingPolicy, SpeculativeGeneration, accept_or_resample

P = np.array([0.40, 0.25, 0.20, 0.10, 0.05])
DRAFTS = {
    "good": np.array([0.35, 0.30, 0.20, 0.10, 0.05]),
    "bad": np.array([0.02, 0.03, 0.05, 0.30, 0.60]),
    "identical": P.copy(),
}
CHI2_DF4_P001 = 18.47            # chi-square critical value, 4 degrees of freedom, p = 0.001
IDS = np.arange(5)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_rule_keeps_the_target_distribution(kind):
    q = DRAFTS[kind]
    rng = np.random.default_rng(7)
    counts = np.zeros(5)
    accepted = 0
    for _ in range(20000):
        guess = int(rng.choice(5, p=q))
        verdict = accept_or_resample((IDS, P), guess, (IDS, q), rng)
        accepted += verdict is None
        counts[guess if verdict is None else verdict] += 1
    assert _chi2(counts, P) < CHI2_DF4_P001
    if kind == "identical":
        assert accepted == 20000      # p == q: every guess is kept
    # Expected acceptance is sum(min(p, q)).
    assert abs(accepted / 20000 - np.minimum(P, q).sum()) < 0.02


def test_rule_with_a_certain_guess_keeps_the_target_distribution():
    rng = np.random.default_rng(3)
    counts = np.zeros(5)
    for _ in range(20000):
        verdict = accept_or_resample((IDS, P), 3, None, rng)   # prompt lookup always guesses 3
        counts[3 if verdict is None else verdict] += 1
    assert _chi2(counts, P) < CHI2_DF4_P001


class ConstSession:
    """Five tokens, the same distribution after every prefix: logits = log(probs)."""

    def __init__(self, probs: np.ndarray, n_ctx: int = 64) -> None:
        self.row = np.log(probs).astype(np.float32)
        self.n_vocab, self.n_ctx, self.n_past = len(probs), n_ctx, 0
        self.bos_token = self.eos_token = None

    def eval(self, tokens: Sequence[int], *, logits: str = "last") -> np.ndarray:
        self.n_past += len(tokens)
        return np.tile(self.row, (len(tokens), 1)) if logits == "all" else self.row.copy()

    def trim(self, n_keep: int) -> bool:
        self.n_past = min(self.n_past, n_keep)
        return True

    def reset(self) -> None:
        self.n_past = 0

    def is_eog(self, token: int) -> bool:
        return False

    def piece(self, token: int) -> bytes:
        return b"abcde"[token:token + 1]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["good", "bad"])
def test_whole_loop_samples_every_position_from_the_target(kind):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    counts = np.zeros((3, 5))
    for seed in range(1500):
        target = ConstSession(P)
        drafter = DraftModel(ConstSession(DRAFTS[kind]))
        gen = SpeculativeGeneration(KVCache(target), [0], SamplingParams(**{**params.__dict__,
                                    "seed": seed}), Limits(3, ignore_eos=True), drafter,
                                    max_draft=3, chunk=2, adaptive=False)
        list(gen)
        for position, token in enumerate(gen.tokens):
            counts[position, token] += 1
        assert target.n_past == len(gen.cache.tokens)
    for position in range(3):
        assert _chi2(counts[position], P) < CHI2_DF4_P001


def test_greedy_policy_matches_the_plain_sampler():
    policy = SamplingPolicy(SamplingParams(temperature=0))
    row = np.log(P).astype(np.float32)
    assert policy.choose(row, []) == 0
    assert policy.distribution(row, [])[0].tolist() == [0]


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    lookup = PromptLookup(max_ngram=3, min_ngram=2)
    context = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert lookup.propose(context, 3, SamplingPolicy(SamplingParams(temperature=0))).tokens == \
        [8, 9, 1]
    assert lookup.propose([1, 2, 3, 4], 3, SamplingPolicy(SamplingParams(temperature=0))).tokens \
        == []


def _controller(acceptance_pattern: list[tuple[int, int]], *, draft_s: float) -> Controller:
    control = Controller(max_draft=6, chunk=8)
    control.record_step(0.010)
    for size, seconds in ((2, 0.011), (4, 0.013), (7, 0.017)):
        control.record_chunk(size, seconds)
    for drafted, accepted in acceptance_pattern:
        control.record_round(drafted, accepted, draft_s * drafted)
    return control


def test_controller_drafts_long_when_guesses_are_accepted():
    control = _controller([(6, 6)] * 10, draft_s=0.0)
    assert control.draft_length(6) == 6


def test_controller_stops_drafting_when_guesses_are_rejected():
    control = _controller([(6, 0)] * 10, draft_s=0.0)
    assert control.draft_length(6) == 0


def test_controller_stops_when_the_draft_costs_as_much_as_the_target():
    control = _controller([(6, 4)] * 10, draft_s=0.010)
    assert control.draft_length(6) == 0


def test_controller_explores_again_after_a_while_off():
    control = _controller([(6, 0)] * 10, draft_s=0.0)
    for _ in range(30):
        control.record_step(0.010)
    assert control.draft_length(6) > 0
    assert control.draft_length(0) == 0


def test_controller_explores_ever_more_rarely_while_tries_fail():
    control = _controller([(6, 0)] * 10, draft_s=0.0)
    gaps, since = [], 0
    for _ in range(400):
        since += 1
        if control.draft_length(6) > 0:
            gaps.append(since)
            since = 0
            control.record_round(2, 0, 0.0)     # the try is rejected
        else:
            control.record_step(0.010)
    assert gaps[:3] == [25, 49, 97]
    assert all(later >= earlier for earlier, later in zip(gaps, gaps[1:]))
