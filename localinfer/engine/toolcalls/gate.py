"""The gate behind `tool_choice: auto`: any text until the reply writes its format's trigger,
then the call's grammar for the rest."""

from __future__ import annotations

import copy
import weakref
from typing import Callable

import numpy as np

from localinfer.backends import Grammar

# session -> {character: the tokens whose text holds it}: found once per loaded model, and gone
# with the session (a key of id(session) would outlive it and could be taken by the next one).
_CANDIDATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ending_ids(session, char: str, text_of: Callable[[int], str]) -> np.ndarray:
    """The tokens whose text holds `char` (the trigger's last): only these can complete it."""
    try:
        found = _CANDIDATES.setdefault(session, {})
    except TypeError:               # a session that takes no weak reference: not cached
        found = {}
    if char not in found:
        found[char] = np.array([t for t in range(session.n_vocab) if char in text_of(t)],
                               dtype=np.int32)
    return found[char]


class TriggerGate:
    """Any text until the reply writes `trigger`, then `after` (the call's grammar) for the rest;
    `anchored`: the trigger counts only as the reply's first text (spaces aside), and once the
    reply has begun otherwise the gate stands open for good.

    A token whose text would complete the trigger with more text after it is refused, so the
    trigger always ends at a token's end and the grammar takes the very next token. Each choice
    depends only on the tokens accepted before (speculation stays exact), as thinking/gate.py's."""

    def __init__(self, trigger: str, after: Grammar, text_of: Callable[[int], str],
                 candidates: np.ndarray, *, anchored: bool = False) -> None:
        self.trigger, self.after, self.text_of = trigger, after, text_of
        self.candidates, self.anchored = candidates, anchored
        self.tail = ""        # the last characters written (anchored: all of them, spaces off)
        self.on = False       # the trigger was written: `after` decides
        self.off = False      # anchored, and the reply began otherwise: free to the end

    def _refused(self, token: int) -> bool:
        joined = self.tail + self.text_of(token)
        if self.anchored:
            joined = joined.lstrip()
            return joined.startswith(self.trigger) and len(joined) > len(self.trigger)
        at = joined.find(self.trigger)
        return at >= 0 and at + len(self.trigger) != len(joined)

    def allows(self, ids: np.ndarray) -> np.ndarray:
        if self.on:
            return self.after.allows(ids)
        if self.off:
            return np.ones(len(ids), dtype=bool)
        return np.array([not self._refused(int(t)) for t in ids], dtype=bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if self.on:
            return self.after.mask(logits)
        if self.off:
            return logits
        row = logits.copy()
        for t in self.candidates:
            if self._refused(int(t)):
                row[t] = -np.inf
        return row

    def accept(self, token: int) -> None:
        if self.on:
            self.after.accept(token)
            return
        if self.off:
            return
        joined = self.tail + self.text_of(token)
        if self.anchored:
            joined = joined.lstrip()
            self.on = joined == self.trigger
            self.off = not self.trigger.startswith(joined)
            self.tail = joined
            return
        self.on = joined.endswith(self.trigger)
        self.tail = joined[-(len(self.trigger) - 1):]

    def clone(self) -> TriggerGate:
        twin = copy.copy(self)
        twin.after = self.after.clone()
        return twin

    def close(self) -> None:
        self.after.close()


def trigger_gate(session, trigger: str, after: Grammar, *, anchored: bool = False) -> TriggerGate:
    """The gate for `trigger` on this model, `after` the grammar from the trigger on."""
    def text_of(token: int) -> str:
        return session.piece(token).decode("utf-8", "ignore")
    return TriggerGate(trigger, after, text_of, _ending_ids(session, trigger[-1], text_of),
                       anchored=anchored)
