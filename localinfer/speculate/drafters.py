"""Drafters: cheap guesses of the next few tokens, which the target model then verifies in one batch.

A drafter sees the whole token sequence so far (prompt and output) and proposes up to n tokens;
of a prompt with images or audio, only the text (MediaBlind).
With sampling it also says how likely it found each guess (its distribution q), because the
acceptance rule needs q; a deterministic drafter (prompt lookup) proposes with q = 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from localinfer.backends import Session
from localinfer.engine.kv import KVCache, common_prefix
from localinfer.engine.media import holds_media, projector_of
from localinfer.engine.sampling import HISTORY_TAIL
from localinfer.errors import UsageError

# (candidate ids, their probabilities) after the sampling filters; None means "the token, surely".
Distribution = tuple[np.ndarray, np.ndarray]


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    q: list[Distribution] | None = None     # one per token; None for a deterministic drafter
    seconds: float = 0.0                    # what proposing cost, for the adaptive controller


class Policy(Protocol):
    """How tokens are chosen: greedy or sampled, with the same filters the target uses."""

    greedy: bool

    def choose(self, logits: np.ndarray, history: Sequence[int]) -> int: ...
    def distribution(self, logits: np.ndarray, history: Sequence[int]) -> Distribution: ...
    def draw(self, dist: Distribution) -> int: ...


class Drafter(Protocol):
    name: str

    def prepare(self, prompt: Sequence[int]) -> None: ...
    def propose(self, context: Sequence[int], n: int, policy: Policy) -> Draft: ...
    def close(self) -> None: ...


class PromptLookup:
    """Propose what followed the most recent earlier occurrence of the last few tokens.

    Strong wherever the output copies from the input (edits, extraction, code) and free to run:
    an index from n-gram to its latest end position, extended as the sequence grows.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0        # n-grams ending before this position are in the index

    def prepare(self, prompt: Sequence[int]) -> None:
        self.index.clear()
        self.indexed = 0

    def propose(self, context: Sequence[int], n: int, policy: Policy) -> Draft:
        start = time.perf_counter()
        self._sync(context)
        end = len(context)
        for size in range(self.max_ngram, self.min_ngram - 1, -1):
            if end < size + 1:
                continue
            at = self.index.get(tuple(context[end - size:end]))
            if at is not None:
                tokens = list(context[at + 1:at + 1 + n])
                if tokens:
                    return Draft(tokens, None, time.perf_counter() - start)
        return Draft([], None, time.perf_counter() - start)

    def _sync(self, context: Sequence[int]) -> None:
        # Between prepare() calls the context only grows (accepted tokens are appended), so only
        # the new tail is indexed: comparing or copying the whole context each round would cost
        # O(context) on the per-token path. A shorter context means a new sequence.
        if len(context) - 1 < self.indexed:
            self.prepare(context)
        # Index n-grams ending at every position except the last: the last one is the query.
        for end in range(self.indexed, len(context) - 1):
            for size in range(self.min_ngram, self.max_ngram + 1):
                if end + 1 >= size:
                    self.index[tuple(context[end + 1 - size:end + 1])] = end
        self.indexed = max(self.indexed, len(context) - 1)

    def close(self) -> None:
        pass


class DraftModel:
    """A smaller model with the target's vocabulary, kept in step with the target's sequence.

    Its KV cache follows the accepted sequence by prefix: rejected guesses are trimmed away at the
    next proposal, so it never re-evaluates what it already holds.
    """

    def __init__(self, session: Session, name: str = "draft") -> None:
        self.session, self.name = session, name
        self.cache = KVCache(session)

    def prepare(self, prompt: Sequence[int]) -> None:
        self._catch_up(list(prompt))

    def propose(self, context: Sequence[int], n: int, policy: Policy) -> Draft:
        start = time.perf_counter()
        n = min(n, self.session.n_ctx - len(context))
        if n <= 0:
            return Draft()
        logits = self._catch_up(context)
        tokens, dists = [], []
        history = list(context[-HISTORY_TAIL:])
        for i in range(n):
            if policy.greedy:
                token = policy.choose(logits, history)
            else:
                dist = policy.distribution(logits, history)
                dists.append(dist)
                token = policy.draw(dist)
            tokens.append(token)
            history.append(token)
            if i + 1 < n:
                logits = self._eval([token])
        return Draft(tokens, None if policy.greedy else dists, time.perf_counter() - start)

    def _catch_up(self, context: Sequence[int]) -> np.ndarray:
        # Keep at least the last token to evaluate: its logits start the draft.
        keep = min(common_prefix(self.cache.tokens, context), len(context) - 1)
        # tokens first: an interrupt between the cuts leaves them claiming no cell the session lacks
        del self.cache.tokens[keep:]
        if not self.session.trim(keep):
            self.cache.tokens.clear()
            self.session.reset()
            keep = 0
        return self._eval(context[keep:])

    def _eval(self, tokens: Sequence[int]) -> np.ndarray:
        logits = self.session.eval(tokens)
        self.cache.tokens.extend(tokens)
        return logits

    def close(self) -> None:
        self.session.close()


class MediaBlind:
    """A drafter that sees a prompt's text only: images and audio removed from the sequence.

    A medium is a run of placeholder ids past the vocabulary (engine/media.py): a draft model
    would hand them to llama.cpp, which has no such tokens, and prompt lookup would match into
    them and propose them. So the drafter gets the text with every medium taken out, and a draft
    stops at any id past the vocabulary: it can only guess text, and the target verifies every
    guess as before. The text view grows as the sequence does, so a draft model keeps its cells
    (by prefix) across rounds and across a conversation's turns that repeat the same media."""

    def __init__(self, drafter: Drafter, n_vocab: int) -> None:
        self.inner, self.n_vocab, self.name = drafter, n_vocab, drafter.name
        self._text: list[int] = []
        self._read = 0          # positions of the sequence already viewed

    def prepare(self, prompt: Sequence[int]) -> None:
        self._text, self._read = [], 0
        self.inner.prepare(self._view(prompt))

    def propose(self, context: Sequence[int], n: int, policy: Policy) -> Draft:
        draft = self.inner.propose(self._view(context), n, policy)
        cut = next((i for i, t in enumerate(draft.tokens) if not 0 <= t < self.n_vocab), None)
        if cut is not None:
            draft.tokens = draft.tokens[:cut]
            draft.q = draft.q[:cut] if draft.q is not None else None
        return draft

    def _view(self, context: Sequence[int]) -> list[int]:
        # Between prepare() calls the sequence only grows: only its new tail is read, so a round
        # costs what it drafts, not the context's length. A shorter one is a new sequence.
        if len(context) < self._read:
            self._text, self._read = [], 0
        self._text.extend(t for t in context[self._read:] if t < self.n_vocab)
        self._read = len(context)
        return self._text

    def close(self) -> None:
        self.inner.close()


def blind_to_media(drafter: Drafter, session: Session, prompt: Sequence[int]) -> Drafter:
    """`drafter` as it may see `prompt`: unchanged for text, MediaBlind when it holds media."""
    if not holds_media(session, prompt):
        return drafter
    return MediaBlind(drafter, projector_of(session).n_vocab)


class VocabularyMismatch(UsageError):
    """A draft model whose tokens mean something else than the target's."""


def check_vocabulary(target: Session, draft: Session, draft_name: str, samples: int = 512) -> None:
    """Refuse a draft whose vocabulary differs: same size and the same text for a spread of ids.

    Comparing every one of 262k token texts costs a noticeable fraction of a second; a spread of
    ids plus the special tokens catches every real mismatch (different families differ everywhere).
    """
    hint = "; choose a draft model of the same family (or --draft lookup)"
    if target.n_vocab != draft.n_vocab:
        raise VocabularyMismatch(f"draft model {draft_name} has a vocabulary of {draft.n_vocab} "
                                 f"tokens, the target {target.n_vocab}{hint}")
    ids = set(np.linspace(0, target.n_vocab - 1, samples, dtype=np.int64).tolist())
    ids.update(t for t in (target.bos_token, target.eos_token) if t is not None)
    for token in sorted(ids):
        if target.token_text(token) != draft.token_text(token):
            raise VocabularyMismatch(f"draft model {draft_name} gives token {token} another text "
                                     f"({draft.token_text(token)!r} vs {target.token_text(token)!r})"
                                     f"{hint}")
    if (target.bos_token, target.eos_token) != (draft.bos_token, draft.eos_token):
        raise VocabularyMismatch(f"draft model {draft_name} has other special tokens{hint}")

