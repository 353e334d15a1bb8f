"""A GGUF model's vocabulary through llama.cpp, loaded without its weights.

Backends other than llama.cpp tokenize with this, so token ids, special tokens and end-of-generation
rules are identical across backends: a prompt-cache key or a draft model means the same on each.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

from localinfer.backends.llama_cpp import _init, _lib
from localinfer.errors import ModelLoadError


class LlamaVocab:
    """Tokenizer, detokenizer and metadata of one GGUF file (llama.cpp `vocab_only` load)."""

    def __init__(self, path: Path, *, verbose: bool = False) -> None:
        lib = _lib()
        log = _init(verbose)
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            reason = log.last_error() or "llama.cpp could not read its vocabulary"
            raise ModelLoadError(f"cannot load {path.name}: {reason}")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self._model)
        self.metadata = self._read_metadata()
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._read_facts()

    def _read_metadata(self) -> dict[str, str]:
        lib = _lib()
        buf = ctypes.create_string_buffer(1 << 16)
        meta: dict[str, str] = {}
        for i in range(lib.llama_model_meta_count(self._model)):
            n = lib.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            key = buf.value.decode("utf-8", "replace") if n >= 0 else ""
            n = lib.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            if key and n >= 0:
                meta[key] = buf.value.decode("utf-8", "replace")
        return meta

    def _read_facts(self) -> None:
        lib = _lib()
        v = self._vocab
        bos, eos = lib.llama_vocab_bos(v), lib.llama_vocab_eos(v)
        self.bos_token = bos if bos >= 0 else None
        self.eos_token = eos if eos >= 0 else None
        self.add_bos = bool(lib.llama_vocab_get_add_bos(v)) and self.bos_token is not None
        template = lib.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode("utf-8") if template else None

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        lib = _lib()
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
        cached = self._pieces.get(token)
        if cached is None:
            n = _lib().llama_token_to_piece(self._vocab, token, self._piece_buf, 256, 0, False)
            cached = self._piece_buf.raw[:max(n, 0)]
            self._pieces[token] = cached
        return cached

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.piece(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return bool(_lib().llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        return _lib().llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def close(self) -> None:
        if getattr(self, "_model", None):
            _lib().llama_model_free(self._model)
            self._model = None
