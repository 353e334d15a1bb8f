"""Images and audio into a llama.cpp session through libmtmd, llama.cpp's multimodal library.

    from localinfer.backends.llama.mtmd import attach
    projector = attach(session, Path("mmproj-model.gguf"))     # session.media is the projector
    photo = localinfer.media.read_path("photo.png")            # checked before any decoding
    tokens = projector.tokenize([("<|im_start|>user\\n", True), photo,
                                 ("Describe this.<|im_end|>\\n<|im_start|>assistant\\n", True)])
    logits, cached = KVCache(session).prefill(tokens)          # engine/media.py evaluates it

A prompt stays a list of token ids: each medium is a run of placeholder ids past the vocabulary
(`is_placeholder`), as many as the positions its embeddings take, derived from a hash of the
projector and of the decoded pixels or samples. So prefix reuse, the prompt cache and the decode
loop see a medium as tokens that match only the same medium; engine/media.py cuts a prompt into
text runs (session.eval) and whole media (`evaluate`), as llama-mtmd-cli does chunk by chunk.

libmtmd tokenizes as llama-mtmd-cli does (mtmd_tokenize_from_parts: the text between media,
SmolVLM's or Gemma's wrapping tokens, an image's tiles as chunks of their own), encodes with
mtmd_batch (consecutive media in one batch, as the CLI), and the embeddings are decoded here
through the session's own context and steering (steer.py) in batches of n_batch. Encoded
embeddings are kept (a few hundred MB at most) so a conversation never encodes a medium twice.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from localinfer.backends.llama.engine import engine, init_engine
from localinfer.errors import LocalinferError, ModelLoadError, UsageError
from localinfer.media import Media

EMBD_CACHE_BYTES = 256 << 20     # encoded media kept for reuse (a conversation's pictures)
_ID_SPACE = 1 << 30              # placeholder ids: n_vocab + [0, 2**30), so they fit int32
_TEXT, _IMAGE, _AUDIO = 0, 1, 2  # MTMD_INPUT_CHUNK_TYPE_*

Part = Union[tuple[str, bool], Media]     # (text, parse special tokens) or a checked medium


def bindings():
    from llama_cpp import mtmd_cpp   # loads libmtmd beside libllama
    return mtmd_cpp


@dataclass
class Item:
    """One medium's chunk as libmtmd made it: `n` positions starting at placeholder id `base`."""

    base: int
    n: int
    kind: str
    chunk: int            # an owned mtmd_input_chunk copy
    key: str              # the hash the ids come from
    medium: str = ""      # the image or clip it is part of (an image's tiles share it)
    used: float = 0.0     # when a prompt last named it (monotonic): serve keeps recent ones


def attach(session, path: Path, *, verbose: bool = False) -> Projector:
    """Load the projector `path` beside the session's model; `session.media` becomes it."""
    projector = Projector(session, path, verbose=verbose)
    session.media = projector
    return projector


def capabilities(path: Path) -> tuple[bool, bool]:
    """(vision, audio) of a projector file, read from its header without loading it."""
    from localinfer.errors import LocalinferError as Bad
    from localinfer.gguf.header import CorruptFile, check_tensors, read_header
    try:
        header = read_header(path)         # truncated, overlapping or unknown tensors: refused
        check_tensors(header)              # a zero dimension, which ggml asserts on
    except (OSError, Bad, CorruptFile) as e:
        raise UsageError(f"cannot read the projector {path}: {e}") from None
    meta = header.metadata
    if str(meta.get("general.architecture", "")) != "clip":
        raise UsageError(f"{path.name} is not a multimodal projector (mmproj) file")
    return bool(meta.get("clip.has_vision_encoder")), bool(meta.get("clip.has_audio_encoder"))


class Projector:
    """libmtmd's context for one session's model and the media it has tokenized."""

    def __init__(self, session, path: Path, *, verbose: bool = False) -> None:
        # serve tokenizes in its request threads while its scheduler encodes and forgets: one
        # of them at a time touches libmtmd's context and the media registered here.
        self._lock = threading.RLock()
        self._items: dict[int, Item] = {}
        self.vision, self.audio = capabilities(path)    # a clear refusal before libmtmd reads it
        # Tensors whose shapes libmtmd never compares abort it: tried in a child first, once.
        from localinfer.backends.llama.projector_check import check
        check(session._path, path, threads=session.n_threads)
        lib, log = bindings(), init_engine(verbose)
        # libmtmd logs through a callback of its own: into the engine's router, like libllama's.
        lib.mtmd_log_set(log._callback, None)
        lib.mtmd_helper_log_set(log._callback, None)
        self._session, self.path = session, path
        params = lib.mtmd_context_params_default()
        params.use_gpu = session.offload.gpu_layers > 0
        params.print_timings = False
        params.n_threads = session.n_threads
        self._ctx = lib.mtmd_init_from_file(str(path).encode(), session._model, params)
        if not self._ctx:
            raise UsageError(f"cannot load the projector {path.name}: "
                             f"{log.last_error() or 'libmtmd refused it'}")
        if lib.mtmd_decode_use_mrope(self._ctx):
            self.close()
            raise ModelLoadError(f"{path.name} places media by M-RoPE (Qwen2-VL and later), "
                                 "which localinfer does not decode yet")
        self.vision = bool(lib.mtmd_support_vision(self._ctx))
        self.audio = bool(lib.mtmd_support_audio(self._ctx))
        st = path.stat()
        self._identity = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        self.n_vocab = session.n_vocab
        self.n_embd = engine().llama_model_n_embd_inp(session._model)
        self._embd: OrderedDict[str, np.ndarray] = OrderedDict()
        self._embd_bytes = 0
        self.encode_s = 0.0          # time spent encoding media, for the stats
        self.encoded = 0             # media encoded (a cached one is not counted)

    # -- tokenizing --------------------------------------------------------------------------
    def tokenize(self, parts: Sequence[Part], *, add_special: bool = False) -> list[int]:
        """The prompt's tokens: each (text, special) part tokenized as llama-mtmd-cli does,
        each medium decoded by libmtmd (stb_image, miniaudio) and replaced by its placeholders."""
        with self._lock:
            return self._tokenize(parts, add_special)

    def _tokenize(self, parts: Sequence[Part], add_special: bool) -> list[int]:
        lib = bindings()
        texts, bitmaps, pointers = [], [], []
        try:
            for part in parts:
                if isinstance(part, Media):
                    bitmap = self._bitmap(part)
                    bitmaps.append(bitmap)
                    pointers.append(lib.mtmd_input_part(None, bitmap))
                else:
                    raw = part[0].encode("utf-8", "surrogatepass")
                    text = lib.mtmd_input_text(raw, len(raw), False, bool(part[1]))
                    texts.append((raw, text))
                    pointers.append(lib.mtmd_input_part(ctypes.pointer(text), None))
            array = (ctypes.POINTER(lib.mtmd_input_part) * len(pointers))(
                *[ctypes.pointer(p) for p in pointers])
            chunks = lib.mtmd_input_chunks_init()
            try:
                rc = lib.mtmd_tokenize_from_parts(self._ctx, chunks, array, len(pointers),
                                                  add_special)
                if rc != 0:
                    raise UsageError(f"libmtmd could not tokenize the prompt with its media "
                                     f"(code {rc})")
                return self._walk(chunks)
            finally:
                lib.mtmd_input_chunks_free(chunks)
        finally:
            for bitmap in bitmaps:
                lib.mtmd_bitmap_free(bitmap)

    def _bitmap(self, medium: Media):
        """libmtmd's decoded bitmap of a checked medium (its id: the hash of what it decodes to)."""
        lib = bindings()
        wanted = self.vision if medium.kind == "image" else self.audio
        if not wanted:
            raise UsageError(f"this model's projector ({self.path.name}) takes no "
                             f"{'images' if medium.kind == 'image' else 'audio'}")
        buf = (ctypes.c_uint8 * len(medium.data)).from_buffer_copy(medium.data)
        bitmap = lib.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(medium.data), False)
        if not bitmap:
            raise UsageError(f"libmtmd could not decode the {medium.describe()}")
        if bool(lib.mtmd_bitmap_is_audio(bitmap)) != (medium.kind == "audio"):
            lib.mtmd_bitmap_free(bitmap)
            raise UsageError(f"libmtmd decoded the {medium.describe()} as another kind of medium")
        size = lib.mtmd_bitmap_get_n_bytes(bitmap)
        digest = hashlib.sha256(self._identity.encode())
        digest.update(f"|{medium.kind}|{lib.mtmd_bitmap_get_nx(bitmap)}x"
                      f"{lib.mtmd_bitmap_get_ny(bitmap)}|".encode())
        digest.update(ctypes.string_at(lib.mtmd_bitmap_get_data(bitmap), size))
        lib.mtmd_bitmap_set_id(bitmap, digest.hexdigest().encode())
        return bitmap

    def _walk(self, chunks) -> list[int]:
        """Text chunks' tokens as they are; each media chunk registered and its placeholders."""
        lib = bindings()
        tokens: list[int] = []
        seen: dict[bytes, int] = {}      # an image's tiles are chunks of one id: numbered apart
        for i in range(lib.mtmd_input_chunks_size(chunks)):
            chunk = lib.mtmd_input_chunks_get(chunks, i)
            kind = lib.mtmd_input_chunk_get_type(chunk)
            if kind == _TEXT:
                n = ctypes.c_size_t(0)
                ptr = lib.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                text = [ptr[k] for k in range(n.value)]
                if any(not 0 <= t < self.n_vocab for t in text):   # a wrapping token it lacks
                    raise ModelLoadError(f"the projector {self.path.name} wraps media in tokens "
                                         "this model's vocabulary does not have")
                tokens += text
            elif kind in (_IMAGE, _AUDIO):
                medium = lib.mtmd_input_chunk_get_id(chunk) or b""
                seen[medium] = seen.get(medium, -1) + 1
                tokens += self._register(chunk, "image" if kind == _IMAGE else "audio",
                                         medium.decode(), seen[medium])
            else:
                raise LocalinferError(f"libmtmd returned a chunk of unknown type {kind}")
        return tokens

    def _register(self, chunk, kind: str, medium: str, ordinal: int) -> range:
        lib = bindings()
        n = lib.mtmd_input_chunk_get_n_tokens(chunk)
        if n <= 0 or n != lib.mtmd_input_chunk_get_n_pos(chunk) or n > _ID_SPACE // 4:
            raise LocalinferError(f"libmtmd made a {kind} chunk of {n} tokens, which cannot "
                                  "be placed")
        key = f"{medium}|{ordinal}|{n}"
        base = self.n_vocab + int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) % (
            _ID_SPACE - n)
        known = self._items.get(base)
        if known is not None:
            known.used = time.monotonic()
        else:
            for other in self._items.values():     # ranges must not overlap (2**30 ids: rare)
                if other.base < base + n and base < other.base + other.n:
                    raise LocalinferError("two media in this conversation hash to overlapping "
                                          "placeholders; start a new one")
            self._items[base] = Item(base, n, kind, lib.mtmd_input_chunk_copy(chunk), key,
                                     medium, time.monotonic())
        return range(base, base + n)

    # -- evaluation --------------------------------------------------------------------------
    def is_placeholder(self, token: int) -> bool:
        return token >= self.n_vocab

    def item(self, base: int) -> Item | None:
        """The medium whose placeholders start at id `base`, if one is known."""
        with self._lock:
            return self._items.get(base)

    def item_at(self, tokens: Sequence[int], i: int) -> Item:
        """The medium whose placeholders start at tokens[i] (all of them must be there)."""
        with self._lock:
            item = self._items.get(tokens[i])
        if item is None or list(tokens[i:i + item.n]) != list(range(item.base, item.base + item.n)):
            raise UsageError("the prompt holds a medium's placeholders out of order; media come "
                             "only from --image/--audio or the APIs' media parts")
        return item

    def evaluate(self, session, item: Item, later: Sequence[Item] = ()) -> None:
        """Decode `item`'s embeddings into the session's KV cache at its n_past; `later`, the
        media that follow it with no text between, are encoded in the same batch when new."""
        decode_embeddings(session, self.embeddings(item, later), causal=self.causal(item))

    def embeddings(self, item: Item, later: Sequence[Item] = ()) -> np.ndarray:
        """`item`'s embeddings (n rows of the model's input width), encoded unless kept; `later`
        as for `evaluate`."""
        with self._lock:
            embd = self._embd.get(item.key)
            if embd is None:
                self._encode([item, *[m for m in later if m.key not in self._embd]])
                embd = self._embd[item.key]
            else:
                self._embd.move_to_end(item.key)
            return embd

    def causal(self, item: Item) -> bool:
        """False where the model attends over a medium both ways (Gemma 3's images): its
        decode then runs with causal attention off, as libmtmd's helper decodes it."""
        with self._lock:
            return not bindings().mtmd_decode_use_non_causal(self._ctx, item.chunk)

    def _encode(self, items: list[Item]) -> None:
        lib = bindings()
        start = time.perf_counter()
        batch = lib.mtmd_batch_init(self._ctx)
        try:
            added = [items[0]]
            if lib.mtmd_batch_add_chunk(batch, items[0].chunk) != 0:
                raise LocalinferError(f"libmtmd could not batch a {items[0].kind}")
            for item in items[1:]:
                if lib.mtmd_batch_add_chunk(batch, item.chunk) != 0:
                    break
                added.append(item)
            if lib.mtmd_batch_encode(batch) != 0:
                raise LocalinferError(f"libmtmd could not encode the {items[0].kind}")
            for item in added:
                ptr = lib.mtmd_batch_get_output_embd(batch, item.chunk)
                if not ptr:
                    raise LocalinferError(f"libmtmd returned no embeddings for a {item.kind}")
                rows = np.ctypeslib.as_array(ptr, shape=(item.n * self.n_embd,))
                self._keep(item.key, rows.reshape(item.n, self.n_embd).copy())
        finally:
            lib.mtmd_batch_free(batch)
        self.encode_s += time.perf_counter() - start
        self.encoded += len(added)

    def _keep(self, key: str, embd: np.ndarray) -> None:
        self._embd[key] = embd
        self._embd_bytes += embd.nbytes
        while self._embd_bytes > EMBD_CACHE_BYTES and len(self._embd) > 1:
            _, old = self._embd.popitem(last=False)
            self._embd_bytes -= old.nbytes

    def forget(self, keep: Sequence[int], *, grace: float = 0.0) -> None:
        """Free the media whose placeholders are not in `keep` (the session's tokens), nor
        named by a prompt in the last `grace` seconds (serve: a request tokenized, not yet
        handed to the scheduler)."""
        held, recent = set(keep), time.monotonic() - grace
        with self._lock:
            for base in [b for b, m in self._items.items()
                         if b not in held and not (grace and m.used >= recent)]:
                bindings().mtmd_input_chunk_free(self._items.pop(base).chunk)

    def close(self) -> None:
        lib = bindings()
        with self._lock:
            self._close(lib)

    def _close(self, lib) -> None:
        for item in self._items.values():
            lib.mtmd_input_chunk_free(item.chunk)
        self._items.clear()
        if getattr(self, "_ctx", None):
            lib.mtmd_free(self._ctx)
            self._ctx = None


def decode_embeddings(session, embd: np.ndarray, *, causal: bool = True) -> None:
    """Append rows of input embeddings to the session's KV cache at n_past, n_batch at a time,
    no logits out (as mtmd_helper_decode_image_chunk does), steered like any decode."""
    lib = engine()
    n, width = embd.shape
    if session.n_past + n > session.n_ctx:
        from localinfer.errors import ContextOverflow
        raise ContextOverflow(f"the context is full ({session.n_ctx} tokens); raise --ctx or "
                              "send fewer or smaller media")
    step = session.n_batch
    batch = lib.llama_batch_init(min(step, n), width, 1)
    ctx = session._ctx
    try:
        if not causal:
            lib.llama_set_causal_attn(ctx, False)
        for start in range(0, n, step):
            rows = embd[start:start + step]
            count, pos = len(rows), session.n_past
            ctypes.memmove(batch.embd, np.ascontiguousarray(rows, np.float32).ctypes.data,
                           rows.nbytes)
            for i in range(count):
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = False
            batch.n_tokens = count
            session.steer_rows(count)
            session.advance_unsure()
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise LocalinferError(f"llama_decode failed with code {rc} at position {pos}")
            session.advanced(pos + count)
    finally:
        if not causal:
            lib.llama_set_causal_attn(ctx, True)
        lib.llama_batch_free(batch)
