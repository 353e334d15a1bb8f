"""The sampler on small hand-made logits, where the right answer can be computed exactly."""

import numpy as np
import pytest

from localinfer.engine.sampling import (SamplingParams, apply_repeat_penalty, candidate_probs,
                                        make_sampler)
from localinfer.errors import UsageError


def test_greedy_is_argmax_and_ignores_seed():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    for seed in (1, 2, 3):
        assert make_sampler(SamplingParams(temperature=0, seed=seed))(logits, []) == 1


def test_top_k_keeps_only_the_k_best():
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    ids, probs = candidate_probs(logits, SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0))
    assert list(ids) == [0, 1]
    np.testing.assert_allclose(probs, np.exp([5, 4]) / np.exp([5, 4]).sum())


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    probs_in = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs_in)
    ids, _ = candidate_probs(logits, SamplingParams(temperature=1, top_k=0, top_p=0.79, min_p=0))
    assert list(ids) == [0, 1]
    ids, _ = candidate_probs(logits, SamplingParams(temperature=1, top_k=0, top_p=0.81, min_p=0))
    assert list(ids) == [0, 1, 2]


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05]))
    ids, _ = candidate_probs(logits, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.1))
    assert list(ids) == [0, 1]


def test_temperature_sharpens_distribution():
    logits = np.array([1.0, 0.0])
    _, hot = candidate_probs(logits, SamplingParams(temperature=2, top_k=0, top_p=1, min_p=0))
    _, cold = candidate_probs(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1, min_p=0))
    assert cold[0] > hot[0]
    np.testing.assert_allclose(cold[0], 1 / (1 + np.exp(-2)))


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repeat_penalty(logits, [0, 1, 0], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    assert logits[0] == 2.0, "the engine's logits must not be modified"


def test_repeat_penalty_changes_the_greedy_choice():
    logits = np.array([2.0, 1.5], dtype=np.float32)
    sampler = make_sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    assert sampler(logits, [0]) == 1


def test_sampled_frequencies_match_the_distribution():
    """Chi-square goodness of fit over 20,000 draws of a 5-token distribution."""
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = np.log(probs).astype(np.float32)
    sampler = make_sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=7))
    draws = 20_000
    counts = np.bincount([sampler(logits, []) for _ in range(draws)], minlength=5)
    chi2 = (((counts - draws * probs) ** 2) / (draws * probs)).sum()
    assert chi2 < 18.47, f"chi-square {chi2:.1f} over the 0.999 quantile for 4 dof"  # p = 0.001


def test_same_seed_same_tokens_different_seed_differs():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=1000).astype(np.float32) for _ in range(50)]
    params = dict(temperature=1.5, top_k=0, top_p=1, min_p=0)
    sampler = make_sampler(SamplingParams(**params, seed=1))
    b = [sampler(r, []) for r in rows]
    sampler = make_sampler(SamplingParams(**params, seed=2))
    c = [sampler(r, []) for r in rows]
    sampler = make_sampler(SamplingParams(**params, seed=1))
    assert [sampler(r, []) for r in rows] == b
    assert b != c


@pytest.mark.parametrize("params", [
    {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 1}, {"repeat_penalty": 0},
    {"top_k": -1}, {"seed": -2}, {"temperature": float("nan")},
])
def test_invalid_params_are_usage_errors(params):
    with pytest.raises(UsageError):      # refused as soon as the options become parameters
        SamplingParams(**params)
