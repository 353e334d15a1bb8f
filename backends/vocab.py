"""The token side of a Session for backends that compute with another engine but tokenize with
llama.cpp (MLX, ONNX Runtime): token ids, special tokens and end-of-generation rules then match
the llama.cpp backend exactly, so a prompt-cache key or a draft model means the same on each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from localinfer.backends import context_length

if TYPE_CHECKING:
    from localinfer.backends.llama.vocab import LlamaVocab


class BorrowedVocabulary:
    """Session methods and facts answered by a llama.cpp vocabulary-only load (`_vocab`)."""

    _vocab: LlamaVocab | None

    def _adopt_vocabulary(self, vocab: LlamaVocab, n_ctx: int) -> None:
        """Take the vocabulary and what it says about the model; `n_ctx` as LoadOptions gives it."""
        self._vocab = vocab
        self.metadata = vocab.metadata
        self.n_vocab = vocab.n_vocab
        self.n_ctx = context_length(n_ctx, vocab.n_ctx_train)
        self.bos_token, self.eos_token = vocab.bos_token, vocab.eos_token
        self.add_bos, self.chat_template = vocab.add_bos, vocab.chat_template

    def _close_vocabulary(self) -> None:
        if getattr(self, "_vocab", None) is not None:
            self._vocab.close()
            self._vocab = None

    def close(self) -> None:
        self._close_vocabulary()

    def __del__(self) -> None:
        try:
            self.close()        # the session's own close, which ends with _close_vocabulary
        except Exception:       # a half-made session, or the interpreter shutting down
            pass

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return self._vocab.tokenize(text, special=special)

    def piece(self, token: int) -> bytes:
        return self._vocab.piece(token)

    def grammar(self, gbnf: str):
        return self._vocab.grammar(gbnf)

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return self._vocab.detokenize(tokens)

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(token)

    def token_text(self, token: int) -> str:
        return self._vocab.token_text(token)
