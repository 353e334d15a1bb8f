"""What an Emitter reads of a batched session, for one of its sequences (engine/scheduler.py)."""

from __future__ import annotations


class SeqView:
    """A session as one sequence sees it: the model's vocabulary and its share of the context."""

    def __init__(self, session, n_ctx: int) -> None:
        self.session = self
        self._s, self.n_ctx = session, n_ctx

    def is_eog(self, token: int) -> bool:
        return self._s.is_eog(token)

    def piece(self, token: int) -> bytes:
        return self._s.piece(token)

    # What a constrained sampler asks to narrow its grammar as the reply's room runs out.
    @property
    def base(self):
        return self._s

    @property
    def eos_token(self) -> int | None:
        return self._s.eos_token

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return self._s.tokenize(text, special=special)
