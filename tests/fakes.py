"""A tiny deterministic Session for what a real model cannot show on demand (split UTF-8 bytes,
an exact stop position). It follows the backends.Session protocol without inheriting anything."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ScriptedSession:
    """Emits a fixed script of tokens: after n tokens in the cache, logits favour script[n - offset].

    Each token id stands for the bytes in `pieces`; token 0 is end-of-generation.
    """

    def __init__(self, pieces: list[bytes], script: list[int], prompt_len: int, n_ctx: int = 64):
        self.pieces, self.script, self.prompt_len = pieces, script, prompt_len
        self.n_vocab, self.n_ctx, self.n_past = len(pieces), n_ctx, 0
        self.bos_token, self.eos_token, self.add_bos, self.chat_template = None, 0, False, None
        self.evaluated: list[int] = []      # every token ever evaluated, to see what was reused
        self.kv: list[int] = []

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return [self.pieces.index(ch.encode()) for ch in text]

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.pieces[t] for t in tokens)

    def is_eog(self, token: int) -> bool:
        return token == 0

    def token_text(self, token: int) -> str:
        return self.pieces[token].decode("utf-8", "replace")

    def eval(self, tokens: Sequence[int], *, logits: str = "last") -> np.ndarray:
        self.kv.extend(tokens)
        self.evaluated.extend(tokens)
        self.n_past = len(self.kv)
        step = self.n_past - self.prompt_len
        nxt = self.script[step] if 0 <= step < len(self.script) else 0
        row = np.zeros(self.n_vocab, dtype=np.float32)
        row[nxt] = 10.0
        return row

    def trim(self, n_keep: int) -> bool:
        del self.kv[n_keep:]
        self.n_past = len(self.kv)
        return True

    def reset(self) -> None:
        self.kv.clear()
        self.n_past = 0
