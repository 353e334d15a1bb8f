"""The answer store: deterministic answers kept on disk, so a request asked again is answered from
it instead of being decoded again (`--reuse-answers`; `map` also shares one answer between the
lines of one input that repeat, whatever the flag: cache/answer_reuse.py does both).

Only a deterministic request is stored or looked up: greedy (temperature 0), or sampled with a
fixed seed. A request drawing a fresh seed is never stored and never answered from the store.

The key is a digest of everything that decides the answer:
- the model as the prompt cache keys it (`session.state_identity()`: the file's path, size and
  time, the engine build, KV types, offload...), and the decode path (one sequence or the batch
  scheduler, whose kernels may part at a near tie) and the context size (an answer cut by the
  context is cut elsewhere in another);
- the prompt's tokens as rendered: after the chat template, so system prompt, tools and
  thinking switch are in them;
- the sampling parameters (the seed only where it counts: not for greedy), stop strings, max
  tokens, the grammar (a schema's is its GBNF), the thinking budget, logprobs asked for, and for
  a sampled request the drafter (its rounds decide which random numbers are drawn).

Normalisation: the key is the rendered TOKENS, never a normalised copy of the text. A key on
normalised text would answer "a  b" with the answer to "a b", which the model, seeing other
tokens, may not give: the replay would no longer be the answer the request gets. Instead,
with `--reuse-answers` the user's prompt text itself is normalised before the template
(`normalise`: Unicode NFC, whitespace at its two ends), so canonically equal prompts become
one token sequence and the answer replayed is exactly the answer decoded for it. Whitespace
inside the text is left alone: in code, tables and diffs it is meaning.

Entries reuse the prompt cache's file format and rules (entry, paths, prompt_cache.evict):
`<root>/<model key>/<request key>.kv`, a checksummed header naming the full key, the answer's
tokens, then the answer as JSON; written atomically, bounded in size, evicted least recently used
over the cap, never followed through a link. An entry that fails any check is refused, removed and
reported in one line; it is never replayed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from localinfer.cache import entry, paths, prompt_cache
from localinfer.cache.entry import CorruptEntry

FOLDER = "answers"                  # under the cache folder, beside the prompt cache's
DEFAULT_CAP_BYTES = 256_000_000
# An answer is text and maybe every token's top-20 log-probabilities: a whole context's worth is
# a few megabytes. A file larger than this is not an entry of ours.
MAX_ENTRY_BYTES = 64 << 20
FINISHES = ("stop", "length", "context")      # only a complete answer is stored
# Saves per sweep of the store, on average. A sweep (eviction over the cap, a dead writer's
# leftovers) lists every entry, and answers are small, so the store holds many: a sweep on every
# save would make a map of many lines quadratic. Between sweeps the store outgrows its cap by a few
# entries at most.
SWEEP_EVERY = 16
FORMAT = 1


@dataclass(frozen=True)
class Answer:
    """One decoded answer, as the generation gave it: the text pieces in the order and sizes
    they streamed, the tokens, how it ended, and (when asked) each token's log-probabilities
    as (token, logprob, ((id, logprob), ...))."""

    pieces: tuple[str, ...]
    tokens: tuple[int, ...]
    finish_reason: str
    stop_string: str = ""
    closed_at: int = -1
    logprobs: tuple | None = None
    saved: float = field(default=0.0, compare=False)     # when it was decoded (time.time())
    entry: str = field(default="", compare=False)         # the entry's name, for -v

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def deterministic(params) -> bool:
    """Whether the sampling parameters give the same answer every time: greedy, or a fixed seed."""
    return params.temperature <= 0 or params.rng_seed is not None


def settings_of(params, limits, *, via: str, n_ctx: int, gbnf: str | None = None,
                think_budget: int | None = None, raw: bool = False, draft: str = "auto",
                draft_max: int = 8) -> dict | None:
    """What decides the answer besides the model and the prompt's tokens, as plain JSON; None
    when the request is not deterministic (it is then never stored nor looked up)."""
    if not deterministic(params):
        return None
    sampling = asdict(params)
    sampled = params.temperature > 0
    if not sampled:
        sampling.pop("seed")        # greedy: the seed draws nothing
    grammar = hashlib.sha256(gbnf.encode()).hexdigest() if gbnf is not None else None
    return {"via": via, "n_ctx": n_ctx, "sampling": sampling, "max_tokens": limits.max_tokens,
            "stop": list(limits.stop), "ignore_eos": limits.ignore_eos,
            "shown": sorted(limits.shown), "logprobs": limits.logprobs, "grammar": grammar,
            "think_budget": think_budget, "raw": raw,
            "draft": [draft, draft_max] if sampled else None, "format": FORMAT}


def normalise(text: str) -> str:
    """The user's text as `--reuse-answers` sends it: Unicode NFC, no whitespace at either end."""
    return nfc(text).strip()


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


class AnswerStore:
    """The answers of one model (identity) under `root`, capped at `cap_bytes` for the whole store.
    `n_vocab` bounds the token ids an entry may hold; `notify` hears of each entry refused."""

    def __init__(self, root: Path, identity: dict[str, object], *, label: str, cap_bytes: int,
                 n_vocab: int, notify: Callable[[str], None] = lambda line: None) -> None:
        self.root, self.label, self.cap_bytes = root, label, cap_bytes
        self.n_vocab, self.notify = n_vocab, notify
        self.model_key = json.dumps(identity, sort_keys=True, default=str)
        self.dir = root / hashlib.sha256(self.model_key.encode()).hexdigest()[:16]
        self._saves = 0

    def key(self, tokens: Sequence[int], settings: dict) -> str:
        digest = hashlib.sha256(self.model_key.encode())
        digest.update(json.dumps(settings, sort_keys=True).encode())
        digest.update(np.asarray(tokens, dtype="<i4").tobytes())
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        return self.dir / f"{key[:32]}{paths.SUFFIX}"

    def lookup(self, key: str) -> Answer | None:
        """The stored answer for `key`, verified; None when there is none or it fails a check
        (it is then removed, and `notify` told in one line)."""
        path = self.path(key)
        if not paths.is_key_dir(self.root, self.dir):
            if os.path.lexists(self.dir):   # a link or a file in a folder's place: never followed
                self._refuse(self.dir, "its folder is not a folder of the store")
            return None
        try:
            size = os.lstat(path).st_size
        except OSError:
            return None                     # not stored (or removed meanwhile)
        try:
            if size > MAX_ENTRY_BYTES:
                raise CorruptEntry(f"{size:,} bytes, over the {MAX_ENTRY_BYTES >> 20} MiB "
                                   "an answer may take")
            head = entry.read_head(path)
            answer = parse(entry.read_state(head, key), head.tokens, self.n_vocab)
        except CorruptEntry as e:
            self._refuse(path, str(e))
            return None
        except OSError:
            return None
        prompt_cache._touch(path)           # least recently used is evicted first
        return Answer(answer.pieces, answer.tokens, answer.finish_reason, answer.stop_string,
                      answer.closed_at, answer.logprobs, answer.saved, path.stem)

    def save(self, key: str, answer: Answer) -> Path | None:
        """Store `answer` under `key` (atomically), then now and then (SWEEP_EVERY) evict the
        least recently used entries over the cap. A complete answer only; a full disk or a
        read-only store stores nothing."""
        if answer.finish_reason not in FINISHES or self.cap_bytes <= 0:
            return None
        body = json.dumps({"format": FORMAT, "pieces": list(answer.pieces),
                           "finish_reason": answer.finish_reason,
                           "stop_string": answer.stop_string, "closed_at": answer.closed_at,
                           "logprobs": answer.logprobs, "saved": time.time()},
                          ensure_ascii=False, allow_nan=False).encode()
        if len(body) + 4 * len(answer.tokens) > min(MAX_ENTRY_BYTES, self.cap_bytes):
            return None
        path = self.path(key)
        if not paths.prepare_key_dir(self.root, self.dir):
            return None
        try:
            entry.write(path, key=key, label=self.label, tokens=list(answer.tokens), state=body)
        except (OSError, ValueError):
            return None
        self._saves += 1
        if self._saves % SWEEP_EVERY == 0 or random.random() < 1 / SWEEP_EVERY or \
                len(body) * SWEEP_EVERY > self.cap_bytes:
            prompt_cache.evict(self.root, self.cap_bytes, keep=path)
        return path

    def _refuse(self, path: Path, why: str) -> None:
        drop(self.root, self.dir, path)
        self.notify(f"answer store: dropped entry {path.stem[:12]} ({why}); it is not replayed")


def drop(root: Path, folder: Path, path: Path) -> None:
    """A refused entry (or `folder` itself, when it is a link) removed from the store."""
    if path == folder:
        try:
            os.unlink(path)             # the link itself, never its target
        except OSError:
            pass
    else:
        paths.remove(root, path)


def parse(body: bytes, tokens: Sequence[int], n_vocab: int) -> Answer:
    """An entry's answer, every field checked (types, token ids within the vocabulary, one
    log-probability record per token); CorruptEntry otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise CorruptEntry("not an answer: bad JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorruptEntry("not an answer of this format")
    pieces, finish = data.get("pieces"), data.get("finish_reason")
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        raise CorruptEntry("bad pieces")
    if finish not in FINISHES or not isinstance(data.get("stop_string"), str):
        raise CorruptEntry("bad finish")
    closed = data.get("closed_at")
    if not _whole(closed) or not -1 <= closed <= len(tokens):
        raise CorruptEntry("bad closed_at")
    if not all(0 <= t < n_vocab for t in tokens):
        raise CorruptEntry("a token outside the vocabulary")
    saved = data.get("saved")
    return Answer(tuple(pieces), tuple(tokens), finish, data["stop_string"], closed,
                  _logprobs(data.get("logprobs"), tokens, n_vocab),
                  saved if isinstance(saved, float) else 0.0)


def _logprobs(records, tokens: Sequence[int], n_vocab: int) -> tuple | None:
    if records is None:
        return None
    if not isinstance(records, list) or len(records) != len(tokens):
        raise CorruptEntry("bad logprobs")
    out = []
    for record, token in zip(records, tokens):
        if not (isinstance(record, list) and len(record) == 3 and record[0] == token
                and _number(record[1]) and isinstance(record[2], list) and len(record[2]) <= 20):
            raise CorruptEntry("bad logprobs")
        top = []
        for pair in record[2]:
            if not (isinstance(pair, list) and len(pair) == 2 and _whole(pair[0])
                    and 0 <= pair[0] < n_vocab and _number(pair[1])):
                raise CorruptEntry("bad logprobs")
            top.append((pair[0], float(pair[1])))
        out.append((token, float(record[1]), tuple(top)))
    return tuple(out)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return (isinstance(value, float) or _whole(value)) and not math.isnan(value) and value <= 0


def root() -> Path:
    from localinfer import settings
    return settings.load().cache_dir / FOLDER


def open_for(session, *, notify: Callable[[str], None] = lambda line: None) -> AnswerStore:
    """The answer store for a loaded session."""
    identity = {**session.state_identity(), "format": entry.VERSION}
    return AnswerStore(root(), identity, label=Path(str(identity["model"])).name,
                       cap_bytes=DEFAULT_CAP_BYTES, n_vocab=session.n_vocab, notify=notify)


def entries(where: Path | None = None):
    """Every readable entry, most recently used first (prompt_cache.EntryHead: label, tokens of
    the answer, size, last use, path)."""
    return prompt_cache.entries(where or root())


def usage(where: Path | None = None) -> prompt_cache.Usage:
    return prompt_cache.usage(where or root())


def clear(where: Path | None = None) -> prompt_cache.Usage:
    """Delete every entry, and what writers that died mid-write left; returns what was there."""
    where = where or root()
    for path in paths.all_files(where, temporary=True):
        paths.remove(where, path)
    return prompt_cache.clear(where)
