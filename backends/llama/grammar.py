"""Constrained output through llama.cpp's own grammar sampler (GBNF), and llama-cpp-python's
JSON-schema-to-GBNF converter. We write no grammar engine: this module only carries tokens and
verdicts across the C boundary.

llama.cpp aborts the process when a grammar is asked to accept a token it does not allow (an
exception thrown through the C API, or GGML_ABORT for an end-of-generation token), so `accept` is
only ever called with a token `allows`/`mask` has passed.
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
from typing import Any

import numpy as np

from localinfer.backends.llama.engine import engine, init_engine
from localinfer.errors import LocalinferError

ROOT = b"root"
FEW_ROWS = 2048             # the most token ids asked about at once short of the whole vocabulary
# One llama_token_data (id, logit, p), as numpy sees it, so rows are filled without a Python loop.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class Grammar:
    """One grammar's parse state over one vocabulary; a clone continues from the same state."""

    def __init__(self, vocab: ctypes.c_void_p, n_vocab: int, gbnf: str, *,
                 sampler: ctypes.c_void_p | None = None, scratch: _Scratch | None = None) -> None:
        lib = engine()
        self._vocab, self.n_vocab = vocab, n_vocab
        self._sampler = sampler or lib.llama_sampler_init_grammar(vocab, gbnf.encode(), ROOT)
        if not self._sampler:    # checked before loading (grammar_error); what is left: <token>s
            raise LocalinferError("llama.cpp refused the grammar for this model's vocabulary "
                                  "(a <token> it does not have?); -v shows llama.cpp's reason")
        self._gbnf = gbnf
        # Shared with clones: one thread drives a grammar and its clones, one call at a time.
        self._scratch = scratch or _Scratch(n_vocab)

    def allows(self, ids: np.ndarray) -> np.ndarray:
        """Which of these token ids the grammar allows next (a bool per id)."""
        return self._apply(self._scratch.rows(len(ids)), ids)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a logits row with every token the grammar does not allow set to -inf."""
        ok = self._apply(self._scratch.rows(self.n_vocab), self._scratch.every_id())
        return np.where(ok, logits, np.float32(-np.inf))

    def accept(self, token: int) -> None:
        engine().llama_sampler_accept(self._sampler, token)

    def clone(self) -> Grammar:
        return Grammar(self._vocab, self.n_vocab, self._gbnf, scratch=self._scratch,
                       sampler=engine().llama_sampler_clone(self._sampler))

    def close(self) -> None:
        if getattr(self, "_sampler", None):
            engine().llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        try:
            self.close()
        except ImportError:     # at interpreter exit the bindings cannot be reached; nor needed
            pass

    def _apply(self, rows: _TokenRows, ids: np.ndarray) -> np.ndarray:
        view = rows.view[:len(ids)]
        view["id"] = ids
        view["logit"] = 0.0
        rows.array.size = len(ids)
        rows.array.selected = -1
        engine().llama_sampler_apply(self._sampler, ctypes.byref(rows.array))
        return view["logit"] != -np.inf


class _Scratch:
    """Token rows to hand llama.cpp: a few thousand, and the whole vocabulary once needed."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._few = _TokenRows(min(FEW_ROWS, n_vocab))
        self._all: _TokenRows | None = None
        self._ids: np.ndarray | None = None

    def rows(self, n: int) -> _TokenRows:
        if n <= self._few.capacity:
            return self._few
        if n > self.n_vocab:
            return _TokenRows(n)
        if self._all is None:
            self._all = _TokenRows(self.n_vocab)
        return self._all

    def every_id(self) -> np.ndarray:
        if self._ids is None:
            self._ids = np.arange(self.n_vocab, dtype=np.int32)
        return self._ids


class _TokenRows:
    """A llama_token_data_array with room for `capacity` rows, and a numpy view of its rows."""

    def __init__(self, capacity: int) -> None:
        lib = engine()
        self.capacity = capacity
        self._data = (lib.llama_token_data * capacity)()
        self.view = np.frombuffer(self._data, dtype=_TOKEN_DATA, count=capacity)
        self.array = lib.llama_token_data_array(
            data=ctypes.cast(self._data, ctypes.POINTER(lib.llama_token_data)),
            size=capacity, selected=-1, sorted=False)


# The vendored converter's string character lets raw control characters through, which JSON
# forbids (json.loads refuses them); llama.cpp's current converter writes this rule instead.
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    """llama-cpp-python's converter (llama.cpp's json_schema_to_grammar.py, vendored there), with
    its literals escaped as llama.cpp's current converter escapes them."""
    import json

    from llama_cpp.llama_grammar import SchemaConverter

    class _Converter(SchemaConverter):
        def _format_literal(self, literal: str) -> str:
            # Constants, enum values and property names arrive here as json.dumps' text, which
            # holds backslashes (a quote inside is \\"); the vendored version leaves them
            # unescaped, so the grammar's literal ended early or did not parse.
            return '"' + "".join(_LITERAL_ESCAPES.get(c, c) for c in literal) + '"'

    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    copy = json.loads(json.dumps(schema))          # resolve_refs rewrites every $ref in place
    converter.visit(converter.resolve_refs(copy, "stdin"), "")
    return converter.format_grammar().replace(_LOOSE_CHAR, _JSON_CHAR)


_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\r": "\\r", "\n": "\\n"}


def grammar_error(gbnf: str) -> str | None:
    """Why llama.cpp's parser refuses this grammar, or None when it parses.

    The parser needs no model: it runs here with no vocabulary, before any model loads. It
    prints its reasons to the C stderr (or its log), so they are read back from there.
    """
    lib = engine()
    log = init_engine(False)
    with _captured_stderr() as captured:
        sampler = lib.llama_sampler_init_grammar(None, gbnf.encode(), ROOT)
    if sampler:
        lib.llama_sampler_free(sampler)
        return None
    said = captured.read() + "\n" + "\n".join(log.recent)
    if "no vocab to parse token" in said:
        return None      # <token> references need the model's vocabulary: checked when loaded
    return _reason(said, gbnf)


def _reason(said: str, gbnf: str) -> str:
    """`line L, column C: what` from llama.cpp's "error parsing grammar: WHAT at REST" line,
    where REST (the grammar's text from there on) gives the place and is never repeated."""
    marker = "error parsing grammar: "
    if marker in said:
        what = said.split(marker, 1)[1]
        what = what.rsplit("\n\n" + gbnf, 1)[0] if gbnf else what    # its echo of the grammar
        message, rest = _split_at_rest(what, gbnf)
        if rest is not None:
            return f"{_place(gbnf, len(gbnf) - len(rest))}: {_short(message)}"
        message = message.split(" at ", 1)[0].strip().split("\n", 1)[0]
        return _undefined(message, gbnf) or _short(message)
    for line in said.replace(gbnf, "").splitlines():     # llama.cpp's lines, not the grammar's
        if "grammar" in line and ("root" in line or "recursion" in line or "undefined" in line):
            return _short(line.strip().rstrip("."))
    return "it does not parse"


def _undefined(message: str, gbnf: str) -> str | None:
    """"Undefined rule identifier 'NAME'" as the place NAME is first used, not NAME itself."""
    name = message.partition("Undefined rule identifier '")[2].rstrip("'")
    used = re.search(rf"(?<![a-zA-Z0-9-]){re.escape(name)}(?![a-zA-Z0-9-])", gbnf) if name else None
    if not used:
        return None
    return f"{_place(gbnf, used.start())}: a rule that is never defined"


def _place(gbnf: str, offset: int) -> str:
    line = gbnf.count("\n", 0, offset) + 1
    return f"line {line}, column {offset - (gbnf.rfind(chr(10), 0, offset) + 1) + 1}"


def _short(message: str) -> str:
    """llama.cpp's own words, one printable line; a name from the grammar in them (an undefined
    rule) is cut short."""
    message = "".join(c if c.isprintable() else "?" for c in message)
    return message if len(message) <= 120 else message[:117] + "..."


def _split_at_rest(what: str, gbnf: str) -> tuple[str, str | None]:
    """Split "expecting name at <rest of the grammar>" where <rest> ends the grammar's text."""
    start = 0
    while (at := what.find(" at ", start)) >= 0:
        rest = what[at + 4:]
        if gbnf.endswith(rest):          # "" too: the error is at the very end
            return what[:at], rest
        start = at + 1
    return what, None


class _captured_stderr:
    """Redirects the process's file descriptor 2 (C code's stderr) to a temporary file."""

    def __enter__(self):
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)

    def read(self) -> str:
        self._file.seek(0)
        text = self._file.read(1 << 16).decode("utf-8", "replace")
        self._file.close()
        return text
