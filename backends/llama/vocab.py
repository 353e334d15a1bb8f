"""A GGUF model's vocabulary through llama.cpp, loaded without its weights.

Backends other than llama.cpp tokenize with this, so token ids, special tokens and end-of-generation
rules are identical across backends: a prompt-cache key or a draft model means the same on each.
"""

from __future__ import annotations

from pathlib import Path

from localinfer.backends.llama.session import GGUFVocabulary, engine, init_engine
from localinfer.errors import ModelLoadError
from localinfer.gguf.checks import check_model


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
        self._init_vocabulary()
        self.n_ctx_train = lib.llama_model_n_ctx_train(self._model)

    def close(self) -> None:
        if getattr(self, "_model", None):
            engine().llama_model_free(self._model)
            self._model = None
