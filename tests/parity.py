"""Greedy parity between two implementations of one model (MLX or ONNX against llama.cpp).

Two engines that round differently agree token for token until the reference's top two logits
are closer than their rounding differences; from there either may take the other branch. Which
prompt reaches such a near-tie first depends on the CPU's kernels (AVX2 repacked matrices on one
machine, AVX-512 on another), so a test asks that the sequences agree, or part only where the
reference itself nearly ties.
"""

from __future__ import annotations

import numpy as np

# Top logits closer than this are a tie to engines that round activations differently (measured:
# ONNX parts from llama.cpp's AVX-512 kernels on SmolLM2 after 5 tokens at a gap of 0.007).
NEAR_TIE = 0.1


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Index of the first token where two greedy sequences differ; None when one is a prefix."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def parting_gap(reference, prompt: list[int], ours: list[int], theirs: list[int]) -> float:
    """How far apart the reference's logits put its own token and ours where the sequences part
    (0 when they do not): a near-tie is a small number. `reference` is the Session `theirs` came
    from; it is reset and evaluated again on the prompt and the tokens both chose."""
    i = first_difference(ours, theirs)
    if i is None:
        return 0.0
    reference.reset()
    logits = np.asarray(reference.eval(prompt + theirs[:i], logits="last"), dtype=np.float64)
    # Evaluated in one batch rather than step by step, the reference may itself lean the other way.
    return abs(float(logits[theirs[i]] - logits[ours[i]]))
