"""The KV cache as the decode loops see it: which tokens a session holds, so a new prompt
re-evaluates only what differs, and the persistent prompt cache plugged in behind it."""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

import numpy as np

from localinfer.backends import Session
from localinfer.engine import batching, media
from localinfer.engine.prefix import CacheEvent, common_prefix  # both re-exported here
from localinfer.errors import ContextOverflow, LocalinferError


class KVCache:
    """The tokens a session holds in its KV cache, so a new prompt re-evaluates only what differs.

    Prefill cuts the prompt into batches by the rules of `batching`, which make a state restored
    from the prompt cache continue exactly as a cold run would: greedy output is the same token for
    token, while a cold prompt still goes through the engine in full batches.
    """

    def __init__(self, session: Session, store: PromptStore | None = None) -> None:
        self.session = session
        self.tokens: list[int] = []
        self.store = store
        self.last_event: CacheEvent | None = None
        self._canonical = 0        # leading KV entries computed as any cold run would compute them
        self._pending: list[tuple[list[int], bytes]] = []
        self.canonical_media = 0   # leading cells as a cold run with media computes them (media.py)
        self._window = int(getattr(session, "sliding_window", 0) or 0)
        self._n_batch = int(getattr(session, "n_batch", 512))

    def prefill(self, prompt: Sequence[int]) -> tuple[np.ndarray, int]:
        """Evaluate the prompt, reusing the longest common prefix; returns (last logits, reused)."""
        if media.holds_media(self.session, prompt):    # images or audio: their own rules
            return media.prefill(self, prompt)
        n = len(prompt)
        if n > self.session.n_ctx:
            raise ContextOverflow(
                f"the prompt is {n} tokens but the context holds {self.session.n_ctx}; "
                "raise --ctx or shorten the prompt")
        limit = batching.restore_limit(n, self._window)
        # Never claim more than the session holds: an interrupt can land after a cut of the session
        # and before the same cut of `tokens` (the reverse, fewer tokens than cells, trim repairs).
        del self.tokens[self.session.n_past:]
        # Always evaluate at least the last prompt token: its logits give the first new token.
        reuse = min(common_prefix(self.tokens, prompt), n - 1)
        if self.store is not None:
            reuse = self._restore(prompt, reuse, limit)
        if not self.session.trim(reuse):
            self.session.reset()
            reuse = 0
        del self.tokens[reuse:]
        self._canonical = min(self._canonical, reuse)
        self.canonical_media = min(self.canonical_media, reuse)
        canonical = reuse == self._canonical and reuse % batching.GRAIN == 0 and reuse <= limit
        logits = self._evaluate(prompt, reuse, snapshots=canonical and self.store is not None)
        if canonical:
            self._canonical = max(reuse, batching.canonical_end(n, self._window))
        return logits, reuse

    def step(self, token: int) -> np.ndarray:
        logits = self.session.eval((token,))
        self.tokens.append(token)
        return logits

    def follow(self, earlier: KVCache) -> None:
        """Take over what `earlier`, the last cache on this session, knew of its cells: the next
        prefill keeps their common prefix, as one KVCache kept across a chat's turns does (a
        routed chat makes a cache per turn, routing.Pool)."""
        if earlier.session is self.session and not self.tokens:
            self.tokens = list(earlier.tokens)
            self._canonical, self.canonical_media = earlier._canonical, earlier.canonical_media

    def clear(self) -> None:
        self.tokens.clear()
        self._canonical = self.canonical_media = 0
        self.session.reset()

    def persist(self) -> int:
        """Save the last prefill's states to the prompt cache; returns the longest entry saved in
        tokens (0 for none). Called after the reply, so writing costs no time to first token."""
        pending, self._pending = self._pending, []
        if self.store is None:
            return 0
        return max((len(tokens) for tokens, state in pending if self.store.save(tokens, state)),
                   default=0)

    def _evaluate(self, prompt: Sequence[int], start: int, *, snapshots: bool) -> np.ndarray:
        """Evaluate prompt[start:] batch by batch; with `snapshots`, keep the states to save."""
        n = len(prompt)
        keep = set(batching.snapshot_ends(start, n, self._n_batch, self._window)) if snapshots else ()
        self._pending = []
        logits = None
        for end in batching.batch_ends(start, n, self._n_batch, self._window):
            logits = self.session.eval(prompt[start:end])
            self.tokens.extend(prompt[start:end])
            start = end
            if end in keep:
                self._pending.append((list(prompt[:end]), self.session.state()))
        assert logits is not None
        return logits

    def _restore(self, prompt: Sequence[int], reuse: int, limit: int) -> int:
        """Load the longest cached prefix from disk when it beats what the session already holds."""
        store = self.store
        assert store is not None
        # A sliding-window state longer than the window cannot be trimmed back: such an entry is
        # only usable when it is wholly a prefix of this prompt.
        found = store.longest_prefix(prompt, limit=limit, rigid_over=self._window or None,
                                     longest=self.session.n_ctx)
        usable = found[1] // batching.GRAIN * batching.GRAIN if found else 0
        if found is None or usable <= reuse:
            note = f"nothing on disk beats the {reuse} tokens the session holds" if reuse else "miss"
            self.last_event = CacheEvent(False, note=note)
            return reuse
        head = found[0]
        start = time.perf_counter()
        state = store.load(head)
        if state is None:
            self.last_event = CacheEvent(False, note="corrupt entry dropped")
            return reuse
        self.tokens.clear()        # the session's cells change now, even if an interrupt cuts in
        self._canonical = 0
        try:
            self.session.restore(state, len(head.tokens))
        except LocalinferError:    # the engine refused it: never trust that entry again
            store.drop(head)
            self.last_event = CacheEvent(False, note="entry rejected by the engine, dropped")
            return 0
        self.tokens = list(head.tokens)
        self._canonical = len(head.tokens)
        self.last_event = CacheEvent(True, usable, time.perf_counter() - start)
        return usable


class PromptStore(Protocol):
    """The prompt cache as KVCache uses it (prompt_cache.PromptCache)."""

    def longest_prefix(self, tokens: Sequence[int], *, limit: int, rigid_over: int | None = None,
                       longest: int | None = None) -> tuple[Any, int] | None: ...
    def load(self, head: Any) -> bytes | None: ...
    def drop(self, head: Any) -> None: ...
    def save(self, tokens: Sequence[int], state: bytes) -> Any: ...
