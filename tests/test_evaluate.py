"""`eval`: perplexity, KL and top-1 agreement against hand-computed values on a fake backend, and
perplexity against llama.cpp's own llama-perplexity figure on the real SmolLM2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from localinfer.measure import quality


class FixedDistribution:
    """A Session whose next-token distribution is the same at every position."""

    def __init__(self, probs: list[float]):
        self.row = np.log(np.asarray(probs, dtype=np.float32))
        self.n_vocab, self.n_past = len(probs), 0
        self.bos_token, self.add_bos = None, False
        self.resets = 0

    def eval(self, tokens, *, logits="last"):
        self.n_past += len(tokens)
        rows = np.tile(self.row, (len(tokens), 1))
        return rows if logits == "all" else rows[-1]

    def reset(self):
        self.n_past, self.resets = 0, self.resets + 1


P = [0.5, 0.25, 0.125, 0.125]
Q = [0.25, 0.25, 0.25, 0.25]


def test_perplexity_scores_the_second_half_of_each_chunk():
    tokens = [0, 1, 2, 3, 0, 1, 2, 3] * 2        # two chunks of 8
    model = FixedDistribution(P)
    result = quality.evaluate(model, tokens, n_ctx=8)
    # Scored: positions 4..6 of each chunk predict tokens at 5..7, i.e. tokens 1, 2, 3.
    nll = -(math.log(0.25) + math.log(0.125) + math.log(0.125))
    assert result.tokens_scored == 6 and model.resets == 2
    assert result.perplexity == pytest.approx(math.exp(nll / 3), rel=1e-6)
    assert result.mean_kl is None


def test_kl_and_top1_against_a_reference():
    tokens = [0, 1, 2, 3] * 4
    result = quality.evaluate(FixedDistribution(P), tokens, n_ctx=16,
                               reference=FixedDistribution(Q))
    expected_kl = sum(q * math.log(q / p) for p, q in zip(P, Q))      # KL(reference || model)
    assert result.mean_kl == pytest.approx(expected_kl, rel=1e-5)
    assert result.top1_agreement == 1.0                                 # argmax 0 for both


def test_text_shorter_than_a_chunk_is_refused():
    with pytest.raises(quality.UsageError, match="fewer than one chunk"):
        quality.evaluate(FixedDistribution(P), [0, 1, 2], n_ctx=8)


def test_default_text_is_shipped():
    text = quality.default_text()
    assert text.startswith("[Alice's Adventures in Wonderland by Lewis Carroll 1865]")
    assert len(text) > 30_000


@pytest.mark.slow
def test_perplexity_matches_llama_perplexity(smollm_path: Path):
    # llama-perplexity (same llama.cpp) -c 256 --chunks 2 on the default text: PPL = 16.5029 on an
    # earlier build machine. The same engine and settings gave 16.696 on a later one (other CPU
    # kernels), and the bf16 K cache (backends/llama/session.py) moves it 0.1% more: 2% still fails
    # on a scoring bug such as scoring the wrong half of a chunk.
    result = run_cli("eval", str(smollm_path), "--ctx", "256", "--chunks", "2", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["perplexity"] == pytest.approx(16.5029, rel=0.02)
    assert record["tokens_scored"] == 254
