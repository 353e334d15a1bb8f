"""The prompt cache's files without a model: lookup by prefix, LRU eviction under the byte cap,
concurrent writers, and the conversation window."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localinfer.cache import entry, prompt_cache
from localinfer.cache.prompt_cache import PromptCache
from localinfer.engine import chat_window
from localinfer.errors import ContextOverflow

ID = {"backend": "test", "model": "/m.gguf"}


def _cache(root: Path, cap: int = 10 ** 9) -> PromptCache:
    return PromptCache(root, ID, label="m.gguf", cap_bytes=cap)


def test_longest_prefix_wins_and_state_round_trips(tmp_path):
    cache = _cache(tmp_path)
    cache.save([1, 2, 3], b"short")
    cache.save([1, 2, 3, 4, 5], b"long")
    cache.save([9, 9], b"other")
    head, shared = cache.longest_prefix([1, 2, 3, 4, 7])
    assert shared == 4 and head.tokens == [1, 2, 3, 4, 5]
    assert cache.load(head) == b"long"
    assert cache.longest_prefix([5, 5]) is None


def test_least_recently_used_entries_are_evicted_over_the_cap(tmp_path):
    cache = _cache(tmp_path, cap=3 * 1400)
    paths = [cache.save([i] * 10, bytes(1000)) for i in range(3)]
    old = time.time() - 100
    for age, path in enumerate(paths):
        os.utime(path, (old + age, old + age))
    cache.load(cache.longest_prefix([0] * 10)[0])    # a hit makes entry 0 the most recent
    cache.save([7] * 10, bytes(1000))
    left = {tuple(h.tokens[:1]) for h in prompt_cache.entries(tmp_path)}
    assert left == {(0,), (2,), (7,)}
    assert prompt_cache.usage(tmp_path).bytes <= 3 * 1400


def test_an_entry_bigger_than_the_cap_is_not_written(tmp_path):
    cache = _cache(tmp_path, cap=500)
    assert cache.save([1, 2], bytes(1000)) is None
    assert prompt_cache.entries(tmp_path) == []


_WRITER = """
import sys
from pathlib import Path
from localinfer.cache.prompt_cache import PromptCache
cache = PromptCache(Path(sys.argv[1]), {"backend": "test", "model": "/m.gguf"}, label="m", cap_bytes=10**9)
state = bytes(range(256)) * 40000          # 10 MB, the same in both writers
for _ in range(int(sys.argv[2])):
    cache.save(list(range(500)), state)
    found = cache.longest_prefix(list(range(500)))
    if found is not None:
        assert cache.load(found[0]) in (state, None)
"""


def test_two_processes_writing_the_same_entry_at_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), "8"])
             for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    (head,) = prompt_cache.entries(tmp_path)
    assert _cache(tmp_path).load(head) == bytes(range(256)) * 40000
    assert not list(tmp_path.rglob(".tmp-*"))


def test_entry_from_another_key_is_refused(tmp_path):
    mine = _cache(tmp_path)
    theirs = PromptCache(tmp_path, {**ID, "model": "/other.gguf"}, label="o", cap_bytes=10 ** 9)
    path = theirs.save([1, 2, 3], b"state")
    mine.dir.mkdir(parents=True, exist_ok=True)
    os.replace(path, mine.dir / path.name)
    head, _ = mine.longest_prefix([1, 2, 3])
    assert mine.load(head) is None
    assert not (mine.dir / path.name).exists()


def test_garbage_file_is_skipped_and_removed(tmp_path):
    cache = _cache(tmp_path)
    cache.dir.mkdir(parents=True)
    junk = cache.dir / f"junk{entry.SUFFIX}"
    junk.write_bytes(b"not an entry")
    assert cache.longest_prefix([1]) is None
    assert not junk.exists()


def _render(messages):
    return [0] * (5 + 10 * len(messages))     # 5 tokens of system message, 10 per message


def test_chat_window_drops_whole_exchanges_oldest_first():
    messages = [{"role": r, "content": ""} for r in ["user", "assistant"] * 3 + ["user"]]
    tokens, dropped = chat_window.fit(messages, _render, limit=40)
    assert dropped == 4 and len(tokens) == 35
    assert chat_window.fit(messages, _render, limit=100)[1] == 0
    with pytest.raises(ContextOverflow):
        chat_window.fit(messages, _render, limit=10)
