"""A model's special tokens as its GGUF header declares them: the roles (BOS, EOS, EOT, padding,
...) with their ids and text, and the control tokens of the vocabulary, read from the file without
loading the model (`show`).

The header reader leaves a vocabulary in the file (gguf_header.ArrayInfo); the few texts needed
here are found in one pass over its string lengths (80 ms for Gemma 3's 262,144 tokens). The
caller passes a header that gguf_checks.check_model has checked: every special id is a token of
the vocabulary, and the arrays lie inside the file.
"""

from __future__ import annotations

import array
import mmap
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from localinfer.gguf.header import ArrayInfo, Header

_SPECIAL_ID = re.compile(r"tokenizer\.ggml\.(\w+)_token_id")
# llama.cpp's key names, as a user reads them elsewhere.
_ROLE_NAMES = {"padding": "pad", "unknown": "unk", "seperator": "sep"}
_TOKENS, _TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
CONTROL = 3                     # llama_token_type: LLAMA_TOKEN_TYPE_CONTROL
# Placeholders a vocabulary reserves by the hundred (Gemma's <unused0>, Llama 3's
# <|reserved_special_token_0|>): counted, not listed.
_PLACEHOLDER = re.compile(r"<\|?(unused|reserved_special_token_)\d+\|?>|\[unused\d+\]")
_INT_ARRAYS = {4: "I", 5: "i"}  # GGUF value types of 32-bit integer elements
_U64 = struct.Struct("<Q").unpack_from


@dataclass(frozen=True)
class Token:
    id: int
    text: str


@dataclass(frozen=True)
class SpecialTokens:
    roles: dict[str, Token]     # "bos", "eos", "eot", "pad", ... in the file's order
    control: list[Token]        # control tokens of the vocabulary, placeholders left out
    placeholders: int           # control tokens left out as <unusedN>-style placeholders
    add_bos: bool | None        # whether a prompt starts with BOS (None: the file does not say)


def special_tokens(path: Path, header: Header, *, most_control: int = 256) -> SpecialTokens:
    """The special tokens of the model at `path` (its checked `header`); at most `most_control`
    control tokens are listed."""
    meta = header.metadata
    ids = {_ROLE_NAMES.get(m[1], m[1]): value for key, value in meta.items()
           if (m := _SPECIAL_ID.fullmatch(key)) and type(value) is int}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        control = _control_ids(buf, header)
        texts = _texts(buf, header, {*ids.values(), *control})
    listed = [Token(i, texts.get(i, "")) for i in control]
    kept = [t for t in listed if not _PLACEHOLDER.fullmatch(t.text)]
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return SpecialTokens(roles={role: Token(i, texts.get(i, "")) for role, i in ids.items()},
                         control=kept[:most_control], placeholders=len(listed) - len(kept),
                         add_bos=add_bos if isinstance(add_bos, bool) else None)


def _control_ids(buf, header: Header) -> list[int]:
    """The ids whose token type is CONTROL."""
    types = header.metadata.get(_TYPES)
    if isinstance(types, list):
        return [i for i, t in enumerate(types) if t == CONTROL]
    if not isinstance(types, ArrayInfo) or types.element_type not in _INT_ARRAYS:
        return []
    start = header.array_offsets[_TYPES]
    values = array.array(_INT_ARRAYS[types.element_type], buf[start:start + 4 * types.length])
    if sys.byteorder == "big":          # GGUF is little-endian
        values.byteswap()
    return [i for i, t in enumerate(values) if t == CONTROL]


def _texts(buf, header: Header, wanted: set[int]) -> dict[int, str]:
    """The texts of the tokens `wanted`, by id."""
    tokens = header.metadata.get(_TOKENS)
    if isinstance(tokens, list):
        return {i: tokens[i] for i in wanted if 0 <= i < len(tokens)}
    if not isinstance(tokens, ArrayInfo) or not wanted:
        return {}
    found, pos, last = {}, header.array_offsets[_TOKENS], max(wanted)
    for token_id in range(min(tokens.length, last + 1)):
        length = _U64(buf, pos)[0]
        if token_id in wanted:
            found[token_id] = bytes(buf[pos + 8:pos + 8 + length]).decode("utf-8", "replace")
        pos += 8 + length
    return found
