"""The prompt cache trusts nothing on disk: it never follows a symlink out of its root, and a
damaged entry — fuzzed from a real one made by running SmolLM2 — is detected and dropped or
replaced, never trusted, never a crash, and costs no more memory than a small multiple of its size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import threading
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import run_cli

from localinfer.cache import entry, prompt_cache
from localinfer.cache.entry import CorruptEntry
from localinfer.cache.prompt_cache import PromptCache

SMOLLM = "smollm2-135m-instruct"
# Over 64 tokens, the least the cache keeps an entry for.
PROMPT = ("List the planets of the solar system in order from the sun, with one fact about each: "
          "its size, its moons, its day and its year, and what a visitor would see in its sky. ") * 2
RUN = ("run", "smollm2", PROMPT, "--raw", "--temp", "0", "-n", "2", "--draft", "none")


@dataclass(frozen=True)
class RealEntry:
    home: Path
    key_dir: Path
    name: str               # the entry's file name
    data: bytes             # the whole file as the real run wrote it
    key: str
    tokens: list[int]
    state: bytes
    head_end: int           # where the state starts: magic, header and tokens come before it


@pytest.fixture(scope="module")
def real_entry(tmp_path_factory, smollm_path: Path) -> RealEntry:
    """One prompt-cache entry written by a real `localinfer run` of SmolLM2 in a fresh home."""
    home = tmp_path_factory.mktemp("cache") / "home"
    model = home / "data" / "models" / SMOLLM / f"{SMOLLM}-Q4_1.gguf"
    model.parent.mkdir(parents=True)
    try:
        os.link(smollm_path, model)
    except OSError:
        shutil.copyfile(smollm_path, model)
    result = run_cli(*RUN, home=home)
    assert result.returncode == 0, result.stderr
    (path,) = (home / "cache" / "prompts").glob("*/*.kv")
    head = entry.read_head(path)
    state = entry.read_state(head, head.key)
    return RealEntry(home, path.parent, path.name, path.read_bytes(), head.key, head.tokens, state,
                     head.data_offset)


def cache_for(root: Path, entry: RealEntry) -> PromptCache:
    cache = PromptCache(root, json.loads(entry.key), label="fuzz", cap_bytes=1 << 40)
    assert cache.key == entry.key and cache.dir.name == entry.key_dir.name
    return cache


def tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in folder.rglob("*")}


# -- 4. symlinks ---------------------------------------------------------------------------------
def test_a_key_folder_replaced_by_a_symlink_is_not_followed(real_entry: RealEntry, tmp_path: Path):
    """Before: `*.kv` files behind the link were deleted and new entries written there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.kv").write_bytes(b"not a cache entry, and not the cache's to delete")
    (victim / real_entry.name).write_bytes(real_entry.data)     # even a valid entry stays put
    before = tree(victim)
    shutil.rmtree(real_entry.key_dir)
    real_entry.key_dir.symlink_to(victim, target_is_directory=True)

    result = run_cli(*RUN, "-v", home=real_entry.home)
    assert result.returncode == 0, result.stderr
    assert "prompt cache: miss" in result.stderr          # nothing read through the link
    assert tree(victim) == before
    assert not real_entry.key_dir.is_symlink()             # a real folder took the link's place
    assert [p.name for p in real_entry.key_dir.iterdir()] == [real_entry.name]

    real_entry.key_dir.rename(tmp_path / "saved")
    real_entry.key_dir.symlink_to(victim, target_is_directory=True)
    for command in (("cache", "clear"), ("cache", "ls")):
        assert run_cli(*command, home=real_entry.home).returncode == 0
    assert tree(victim) == before


def test_eviction_and_reads_never_reach_through_links(real_entry: RealEntry, tmp_path: Path):
    root = tmp_path / "prompts"
    cache = cache_for(root, real_entry)
    outside = tmp_path / "outside.kv"
    outside.write_bytes(real_entry.data)
    cache.dir.mkdir(parents=True)
    (cache.dir / "linked.kv").symlink_to(outside)
    fifo = cache.dir / "fifo.kv"
    os.mkfifo(fifo)

    assert cache.longest_prefix(real_entry.tokens) is None
    assert prompt_cache.evict(root, 0) == 0 and prompt_cache.clear(root).entries == 0
    assert outside.read_bytes() == real_entry.data
    with pytest.raises(CorruptEntry, match="symlink"):
        entry.read_head(cache.dir / "linked.kv")
    done = threading.Event()

    def read_fifo() -> None:
        with pytest.raises(CorruptEntry, match="not a regular file"):
            entry.read_head(fifo)
        done.set()
    threading.Thread(target=read_fifo, daemon=True).start()
    assert done.wait(5), "reading a FIFO in place of an entry blocked"


# -- 6. damaged entries --------------------------------------------------------------------------
def mutate(data: bytes, head_end: int, rng: random.Random) -> bytes:
    """A damaged copy: bytes changed or cut, mostly in the header and tokens, where a change is
    more than a checksum mismatch (the state is most of the file)."""
    out = bytearray(data)
    kind = rng.choice(("head", "head", "head", "anywhere", "cut head", "cut", "grow"))
    if kind in ("head", "anywhere"):
        end = head_end if kind == "head" else len(out)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(end)] ^= rng.randint(1, 255)
        return bytes(out)
    if kind == "grow":
        return data + rng.randbytes(rng.randint(1, 64))
    return data[:rng.randrange(head_end if kind == "cut head" else len(data))]


def check_damaged(cache: PromptCache, entry: RealEntry, data: bytes, *, resave: bool) -> None:
    """Look the damaged entry up as a run would: never a crash, bounded memory, and a state comes
    back only if it is the real one; with `resave`, a fresh save then replaces the damaged file."""
    path = cache.dir / entry.name
    path.write_bytes(data)
    tracemalloc.reset_peak()
    found = cache.longest_prefix(entry.tokens)
    state = cache.load(found[0]) if found else None
    peak = tracemalloc.get_traced_memory()[1]
    assert peak < 3 * len(entry.data) + (1 << 20), f"{peak} bytes for a {len(data)}-byte entry"
    if state is not None:        # only a change the checksum does not cover (e.g. the label)
        assert state == entry.state and found[0].tokens == entry.tokens
    if not resave:
        return
    assert cache.save(entry.tokens, entry.state) == path
    head, shared = cache.longest_prefix(entry.tokens)
    assert shared == len(entry.tokens) and cache.load(head) == entry.state


def run_fuzz(entry: RealEntry, root: Path, cases: range) -> None:
    cache = cache_for(root, entry)
    cache.dir.mkdir(parents=True)
    tracemalloc.start()
    try:
        for case in cases:
            rng = random.Random(case)       # the case number reproduces the damage
            data = mutate(entry.data, entry.head_end, rng)
            try:
                check_damaged(cache, entry, data, resave=case % 10 == 0)   # 2 MB more to write
            except BaseException as e:
                raise AssertionError(f"fuzz case {case}: {e!r}") from e
    finally:
        tracemalloc.stop()


def test_damaged_entries_are_never_trusted(real_entry: RealEntry, tmp_path: Path):
    run_fuzz(real_entry, tmp_path / "prompts", range(300))


@pytest.mark.fuzz
def test_damaged_entries_are_never_trusted_long(real_entry: RealEntry, tmp_path: Path):
    run_fuzz(real_entry, tmp_path / "prompts", range(300, 10_300))


def hand_made(head: bytes, *, head_len: int | None = None, rest: bytes = b"") -> bytes:
    length = len(head) if head_len is None else head_len
    return entry.MAGIC + struct.pack("<I", length) + head + rest


def head_of(**fields) -> bytes:
    base = {"version": 1, "key": "k", "label": "m", "n_tokens": 1, "state_len": 3,
            "sha256": "0" * 64}
    return json.dumps({**base, **fields}).encode()


@pytest.mark.parametrize("data", [
    b"", b"LIPCACHE", b"LIPCACH\0" + bytes(100),
    hand_made(b"{}", head_len=0xFFFFFFFF),
    hand_made(b"[" * 200_000 + b"]" * 200_000),                   # nesting past the recursion limit
    hand_made(b'{"version": 1, "n_tokens": 1e400}'),
    hand_made(head_of(n_tokens=-1), rest=bytes(7)),
    hand_made(head_of(n_tokens=10 ** 30), rest=bytes(7)),
    hand_made(head_of(n_tokens=float("nan")), rest=bytes(7)),
    hand_made(head_of(state_len="3"), rest=bytes(7)),
    hand_made(head_of(n_tokens=True), rest=bytes(7)),
    hand_made(head_of(version=2), rest=bytes(7)),
    hand_made(head_of(key=5), rest=bytes(7)),
    hand_made(b"[1, 2, 3]", rest=bytes(7)),
    hand_made(b'"text"', rest=bytes(7)),
    hand_made(b'{"version": 1, "key": "\xff\xfe"}', rest=bytes(7)),
    hand_made(head_of(), rest=bytes(7)),                           # well formed, wrong checksum
], ids=lambda d: repr(d[12:40]))
def test_hostile_headers_are_corrupt_entries(tmp_path: Path, data: bytes):
    cache = PromptCache(tmp_path, {"k": 1}, label="m", cap_bytes=1 << 30)
    cache.dir.mkdir(parents=True)
    path = cache.dir / "x.kv"
    path.write_bytes(data)
    try:
        head = entry.read_head(path)
        with pytest.raises(CorruptEntry):
            entry.read_state(head, head.key)
    except CorruptEntry:
        pass
    found = cache.longest_prefix([0])
    assert found is None or cache.load(found[0]) is None
    assert prompt_cache.usage(tmp_path).entries == 0
