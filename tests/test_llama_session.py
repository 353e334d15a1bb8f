"""The llama.cpp session on a real model: logits read in place stay right whatever mix of batch
shapes came before (the single-row view is reused between one-token steps)."""

from __future__ import annotations

import numpy as np

from localinfer.backends import LoadOptions
from localinfer.backends.llama.session import LlamaCppSession

TEXT = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father "
        "had done, and lit the lamp before the fishing boats came home across the bay.")


def test_one_token_steps_after_many_row_batches_read_the_current_logits(smollm_path):
    session = LlamaCppSession(smollm_path, LoadOptions(n_ctx=512, n_threads=2))
    fresh = LlamaCppSession(smollm_path, LoadOptions(n_ctx=512, n_threads=2))
    try:
        tokens = session.tokenize(TEXT, special=False)
        assert len(tokens) > 30
        session.eval(tokens[:5])
        first = session.eval(tokens[5:6]).copy()       # makes and keeps the one-row view
        rows = session.eval(tokens[6:26], logits="all")  # 20 output rows: the buffer may move
        assert rows.shape == (20, session.n_vocab)
        step = session.eval(tokens[26:27])
        expected = fresh.eval(tokens[:27])
        np.testing.assert_allclose(step, expected, atol=2e-2)
        assert step.argmax() == expected.argmax()
        assert not np.allclose(step, first, atol=2e-2)   # a stale view would still show the old row
    finally:
        session.close()
        fresh.close()
