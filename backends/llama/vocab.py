"""A GGUF model's vocabulary through llama.cpp, loaded without its weights.

Backends other than llama.cpp tokenize with this, so token ids, special tokens and end-of-generation
rules are identical across backends: a prompt-cache key or a draft model means the same on each.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

from localinfer.backends.llama.engine import engine, init_engine
from localinfer.errors import ModelLoadError
from localinfer.gguf.checks import check_model
from localinfer.gguf.text import decoded


class GGUFVocabulary:
    """Metadata, tokenizer and detokenizer of a loaded llama.cpp model (`_model`, `_vocab`).

    Shared by the llama.cpp session and the vocabulary-only load other backends tokenize with, so
    token ids mean the same on every backend.
    """

    _model: ctypes.c_void_p
    _vocab: ctypes.c_void_p

    def _init_vocabulary(self, path: Path) -> None:
        lib = engine()
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.metadata = self._read_metadata()
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._read_vocab_facts(path)

    def _read_metadata(self) -> dict[str, str]:
        lib = engine()
        buf = ctypes.create_string_buffer(1 << 16)
        meta: dict[str, str] = {}
        for i in range(lib.llama_model_meta_count(self._model)):
            n = lib.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            key = buf.value.decode("utf-8", "replace") if n >= 0 else ""
            n = lib.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            if key and n >= 0:
                meta[key] = buf.value.decode("utf-8", "replace")
        return meta

    def _read_vocab_facts(self, path: Path) -> None:
        lib = engine()
        v = self._vocab
        bos, eos = lib.llama_vocab_bos(v), lib.llama_vocab_eos(v)
        self.bos_token = bos if bos >= 0 else None
        self.eos_token = eos if eos >= 0 else None
        self.add_bos = bool(lib.llama_vocab_get_add_bos(v)) and self.bos_token is not None
        template = lib.llama_model_chat_template(self._model, None)
        # Not UTF-8: kept to be shown, refused where it would be rendered (gguf/text.py).
        self.chat_template = decoded(template, f"the chat template of {path.name}") \
            if template else None
        self.architecture = self.metadata.get("general.architecture", "unknown")

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        lib = engine()
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (lib.llama_token * capacity)()
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, False, special)
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (lib.llama_token * capacity)()
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, False, special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for (control tokens render as nothing); cached per token."""
        cached = self._pieces.get(token)
        if cached is None:
            if not 0 <= token < self.n_vocab:     # a medium's placeholder (mtmd.py): no text
                return b""                        # (llama.cpp would abort on the id)
            lib = engine()
            n = lib.llama_token_to_piece(self._vocab, token, self._piece_buf, 256, 0, False)
            cached = self._piece_buf.raw[:max(n, 0)]
            self._pieces[token] = cached
        return cached

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.piece(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, <end_of_turn>, ...); asked per token rather than scanning
        a 262k vocabulary at load, and remembered: a dict lookup is cheaper than a ctypes call."""
        known = self._eog.get(token)
        if known is None:
            if not 0 <= token < self.n_vocab:
                return False
            known = self._eog[token] = bool(engine().llama_vocab_is_eog(self._vocab, token))
        return known

    def token_text(self, token: int) -> str:
        if not 0 <= token < self.n_vocab:
            return ""
        return engine().llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def grammar(self, gbnf: str):
        from localinfer.backends.llama.grammar import Grammar
        return Grammar(self._vocab, self.n_vocab, gbnf)


class LlamaVocab(GGUFVocabulary):
    """Tokenizer, detokenizer and metadata of one GGUF file (llama.cpp `vocab_only` load)."""

    def __init__(self, path: Path, *, verbose: bool = False) -> None:
        check_model(path)        # what llama.cpp's vocabulary loader would abort on
        lib = engine()
        log = init_engine(verbose)
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            reason = log.last_error() or "llama.cpp could not read its vocabulary"
            raise ModelLoadError(f"cannot load {path.name}: {reason}")
        self._init_vocabulary(path)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self._model)

    def close(self) -> None:
        if getattr(self, "_model", None):
            engine().llama_model_free(self._model)
            self._model = None
