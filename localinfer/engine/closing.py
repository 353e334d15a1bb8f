"""A constrained answer that always completes: when the tokens left (-n, max_tokens or the
context) are just enough to close the document, the grammar is narrowed to the tokens after which
it can still be closed in time, so the answer ends as a whole, valid document.

How closing goes is read from llama.cpp's own grammar state. From a clone, a walk writes one
character a step, taking the first character the grammar allows of a fixed preference order —
closers first (`"`, `}`, `]`), then `,` and `:`, then the shortest values (`0`, `true`, `null`,
`[]`, `{}`) — until the grammar allows the end of generation: it closes an open string, writes
each required key with a minimal value and closes every object and array. Its text is then
spelled with the model's tokens, longest first (a Speller), and that many tokens is the closing
length. The walk from the state after one of those tokens is the rest of the walk, spelled the
same way, so the first token of a closing always leaves one token less to go.

Every decision depends only on the tokens accepted so far and the budget fixed when decoding
starts, never on timing, so plain and speculative decoding (which clone the grammar and accept
the same tokens) narrow at the same places: greedy speculation stays token-for-token exact.

Far from the budget this costs a walk now and then (each one schedules the next by how far the
budget still is). Within a window of the closing length, each token the sampler picks is checked
by one walk, and a token after which the document could not be closed in time is refused. The
window is WINDOW tokens, or the first closing measured (the whole minimal document) when longer:
one token can start one more element of the document (Mistral's `[TOOL_CALLS]` starts another
whole call), so the checks begin before such a token could leave too little room to close.
"""

from __future__ import annotations

import weakref

import numpy as np

from localinfer.backends import Grammar

# The walk's preference order: closers, separators, the shortest values, then any text.
PREFERENCE = ('"}],:0tn[{f-123456789.' + "abcdeghijklmopqrsuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
              + "_+!#$%&'()*/;<=>?@\\^`|~" + " \n\t")
MAX_WALK = 512          # the longest closing looked for, in characters
MAX_PIECE = 16          # the longest token spelled in a closing, in characters
WINDOW = 16             # within this many tokens of the closing length, each token is checked
FEW = 64                # a query about more ids checks the closing's own tokens and this many
                        # of the likeliest others (so greedy picks what a window of them picks)


class Speller:
    """A vocabulary's tokens for the closing's characters: the single ones, in PREFERENCE order,
    and the longest token for a run of them (asked of the tokenizer once per text)."""

    def __init__(self, session) -> None:
        self._session = session
        self._known: dict[str, int | None] = {}
        self.char_of: dict[int, str] = {}
        for c in PREFERENCE:
            token = self.token_for(c)
            if token is not None:
                self.char_of.setdefault(token, c)
        self.chars = np.array(list(self.char_of), dtype=np.int32)

    def token_for(self, text: str) -> int | None:
        """The one token that spells `text`, if the tokenizer writes it so."""
        known = self._known
        if text not in known:
            ids = self._session.tokenize(text, special=False)
            known[text] = ids[0] if len(ids) == 1 and \
                self._session.piece(ids[0]) == text.encode() else None
        return known[text]

    def piece(self, token: int) -> bytes:
        return self._session.piece(token)

    def spell(self, text: str) -> list[int]:
        """`text` in tokens, the longest that fits first at each place."""
        out, at = [], 0
        while at < len(text):
            for n in range(min(MAX_PIECE, len(text) - at), 0, -1):
                token = self.token_for(text[at:at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:
                raise AssertionError("every character of a walk has a token")
        return out


_SPELLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def speller(session) -> Speller:
    """The session's Speller, made once per model (a batch's view of a sequence shares it)."""
    base = getattr(session, "base", session)
    made = _SPELLERS.get(base)
    if made is None:
        made = _SPELLERS[base] = Speller(base)
    return made


class Closing:
    """`inner`, narrowed when the `limit` of tokens it may accept comes close: see the module.
    `end`: an end-of-generation token (the grammar allows it where the document may end);
    `stats` gets `closed_at`, the index of the first token whose choice the budget narrowed."""

    def __init__(self, inner: Grammar, limit: int, spell: Speller, end: int,
                 stats=None) -> None:
        self.inner, self.limit, self.spell, self.end, self.stats = inner, limit, spell, end, stats
        self.probe = np.concatenate([[end], spell.chars]).astype(np.int32)
        self.used = 0                 # tokens accepted
        self.mode = "far"             # "far", "near" (each token checked) or "off" (hopeless)
        self.next_check = 0           # `used` at which the closing is measured again
        self.window: int | None = None        # tokens before the closing where checks begin
        self.verdicts: dict[int, bool] = {}   # this state's: whether a token leaves room
        self.first: int | None = None         # this state's closing's first token, once known
        self.open = b""               # the accepted text's last character, if not yet whole

    # -- Grammar ----------------------------------------------------------------------------
    def allows(self, ids: np.ndarray) -> np.ndarray:
        ok = self.inner.allows(ids)
        if not self._near():
            return ok
        few = len(ids) <= FEW
        for i in np.flatnonzero(ok):
            token = int(ids[i])
            if not ((few or token in self.spell.char_of or token == self._first())
                    and self._fits(token)):
                ok[i] = False
                self._pressed()
        return ok

    def mask(self, logits: np.ndarray) -> np.ndarray:
        row = self.inner.mask(logits)
        if not self._near():
            return row
        first = self._first()
        allowed = np.flatnonzero(np.isfinite(row))
        likeliest = allowed[np.argsort(-row[allowed], kind="stable")[:FEW]]
        ids = np.concatenate([self.probe, likeliest, [] if first is None else [first]])
        keep = [t for t in dict.fromkeys(ids.astype(int).tolist()) if np.isfinite(row[t])
                and self._fits(t)]
        narrowed = np.full_like(row, -np.inf)
        narrowed[keep] = row[keep]
        if int(np.isfinite(row).sum()) > len(set(keep)):
            self._pressed()
        return narrowed

    def accept(self, token: int) -> None:
        self.inner.accept(token)
        self.used += 1
        self.verdicts, self.first = {}, None
        if token != self.end:
            self.open = open_tail(self.open + self.spell.piece(token))

    def clone(self) -> Closing:
        twin = object.__new__(Closing)
        twin.__dict__.update(self.__dict__)
        twin.inner, twin.verdicts = self.inner.clone(), dict(self.verdicts)
        return twin

    def close(self) -> None:
        self.inner.close()

    # -- the budget ---------------------------------------------------------------------------
    def _pressed(self) -> None:
        if self.stats is not None and self.stats.closed_at < 0:
            self.stats.closed_at = self.used

    def _near(self) -> bool:
        """Whether the tokens left are close enough to the closing length that each token must
        be checked: measured at scheduled points while far; near stays near."""
        if self.mode != "far" or self.used < self.next_check:
            return self.mode == "near"
        left = self.limit - self.used
        path = walk(self.inner, self.probe, MAX_WALK)
        if path is None:                 # no closing within MAX_WALK characters
            if left <= MAX_WALK:
                self.mode = "off"        # it cannot be closed in time: leave the grammar be
            else:
                self.next_check = self.used + (left - MAX_WALK) // 4 + 1
            return False
        if self.window is None:         # the first closing: the most one token may add
            self.window = max(WINDOW, len(path))
        # Characters first (each has a token, so they bound the tokens); spelled when close.
        tokens = len(path) if len(path) + self.window < left else len(self._spelled(path))
        if tokens > left:
            self.mode = "off"
            return False
        gap = left - tokens - self.window
        if gap <= 0:
            self.mode = "near"
            return True
        # A token rarely adds more than a few characters to the closing: a quarter of the gap
        # is passed before looking again.
        self.next_check = self.used + max(1, gap // 4)
        return False

    def _spelled(self, path: list[int]) -> list[int]:
        spelled = self.spell.spell(self._text(path))
        if self.first is None and spelled:
            self.first = spelled[0]
        return spelled

    def _first(self) -> int | None:
        """This state's closing's first token: always among those offered when near."""
        if self.first is None:
            path = walk(self.inner, self.probe, MAX_WALK)
            if path:
                self._spelled(path)
        return self.first

    def _fits(self, token: int) -> bool:
        """Whether after `token` the document can still be closed within the tokens left."""
        if token == self.end:
            return True
        verdict = self.verdicts.get(token)
        if verdict is None and open_tail(self.open + self.spell.piece(token)):
            # It stops inside a character (a byte token of a multi-byte one): the walk cannot
            # finish that character, so no closing could be measured after it.
            verdict = self.verdicts[token] = False
        if verdict is None:
            room = self.limit - self.used - 1
            trial = self.inner.clone()
            try:
                trial.accept(token)
                path = _walk(trial, self.probe, MAX_WALK, dead=True)
            finally:
                trial.close()
            # A dead end is a grammar the walk cannot spell (a thinking model's forced close
            # marker, a character without a token): not the budget's to refuse.
            verdict = path is _DEAD or path is not None and (
                len(path) <= room or len(self.spell.spell(self._text(path))) <= room)
            self.verdicts[token] = verdict
        return verdict

    def _text(self, path: list[int]) -> str:
        return "".join(self.spell.char_of[t] for t in path)


def open_tail(data: bytes) -> bytes:
    """The bytes at the end of `data` that begin a UTF-8 character not yet whole (b"" if none)."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 != 0x80:             # not a continuation byte: where a character starts
            need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else \
                4 if lead >> 3 == 0b11110 else 1
            return data[-back:] if need > back else b""
    return b""


def walk(grammar: Grammar, probe: np.ndarray, most: int) -> list[int] | None:
    """The walk's single-character tokens from `grammar`'s state (see the module), None when it
    is longer than `most` or meets a dead end; `probe` is [end of generation, the characters in
    preference order]. The grammar itself is not moved on."""
    g = grammar.clone()
    try:
        return _walk(g, probe, most)
    finally:
        g.close()


_DEAD: list[int] = []       # a walk's verdict where no character can follow (see _fits)


def _walk(g: Grammar, probe: np.ndarray, most: int, *, dead: bool = False) -> list[int] | None:
    """`g` moved along the walk; its characters, or None (or _DEAD for a dead end, if asked)."""
    path: list[int] = []
    for step in range(most + 1):
        ok = g.allows(probe)
        if ok[0]:
            return path
        hit = np.flatnonzero(ok[1:])
        if not hit.size:
            return _DEAD if dead else None
        if step == most:
            return None
        token = int(probe[1 + hit[0]])
        g.accept(token)
        path.append(token)
    return None


def fit(grammar: Grammar, session, limit: int, stats=None) -> Grammar:
    """`grammar` narrowed to close within `limit` tokens, or itself when the session cannot say
    which tokens spell characters or end generation (a fake, a vocabulary without them)."""
    end = getattr(session, "eos_token", None)
    if limit <= 0 or end is None or not hasattr(session, "tokenize"):
        return grammar
    spell = speller(session)
    if not len(spell.chars):
        return grammar
    return Closing(grammar, limit, spell, end, stats)
