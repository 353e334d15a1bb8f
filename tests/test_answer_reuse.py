"""Answer reuse (issue 45, section 2, exact matching): a deterministic request asked again is
answered from the answer store byte for byte as it was decoded (run, map, the Python API), a
sampled one never is; map decodes repeated lines once; the store keeps to the prompt cache's
safety (a writer killed mid-write, hostile entries) and `cache ls/clear` see it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli

from localinfer.cache import answers, entry
from localinfer.cache.answers import Answer, AnswerStore
from localinfer.engine.decode import Limits
from localinfer.engine.sampling import SamplingParams

GREEDY = answers.settings_of(SamplingParams(temperature=0), Limits(16), via="single", n_ctx=512)
ANSWER = Answer(("Hel", "lo", " there"), (5, 6, 7), "stop",
                logprobs=((5, -0.5, ((5, -0.5), (9, -1.25))), (6, -0.125, ((6, -0.125),)),
                          (7, -2.0, ((4, -1.0),))))
PROMPT = [1, 2, 3]


def _store(root: Path, notes: list[str] | None = None) -> AnswerStore:
    return AnswerStore(root, {"model": "m.gguf"}, label="m.gguf", cap_bytes=1 << 20,
                       n_vocab=1000, notify=(notes if notes is not None else []).append)


# -- the key ------------------------------------------------------------------------------------

def test_only_a_deterministic_request_has_a_key_and_every_setting_is_in_it(tmp_path):
    settings = answers.settings_of
    assert settings(SamplingParams(temperature=0.8), Limits(16), via="single", n_ctx=512) is None
    assert settings(SamplingParams(temperature=0.8, seed=-1), Limits(16), via="single",
                    n_ctx=512) is None
    seeded = settings(SamplingParams(temperature=0.8, seed=3), Limits(16), via="single", n_ctx=512)
    assert seeded is not None and seeded["sampling"]["seed"] == 3
    # greedy: the seed draws nothing, so it does not part two requests
    assert settings(SamplingParams(temperature=0, seed=5), Limits(16), via="single",
                    n_ctx=512) == GREEDY
    store = _store(tmp_path)
    key = store.key(PROMPT, GREEDY)
    others = [store.key([1, 2, 4], GREEDY),
              _store(tmp_path).key(PROMPT, GREEDY | {"n_ctx": 1024})]
    for limits in (Limits(17), Limits(16, ("\n",)), Limits(16, logprobs=2)):
        others.append(store.key(PROMPT, settings(SamplingParams(temperature=0), limits,
                                                 via="single", n_ctx=512)))
    for change in ({"gbnf": "root ::= \"a\""}, {"think_budget": 8}, {"raw": True}):
        others.append(store.key(PROMPT, settings(SamplingParams(temperature=0), Limits(16),
                                                 via="single", n_ctx=512, **change)))
    others.append(store.key(PROMPT, settings(SamplingParams(temperature=0), Limits(16),
                                             via="batch", n_ctx=512)))
    others.append(AnswerStore(tmp_path, {"model": "other.gguf"}, label="o", cap_bytes=1 << 20,
                              n_vocab=1000).key(PROMPT, GREEDY))
    assert len({key, *others}) == len(others) + 1
    assert store.key(PROMPT, dict(GREEDY)) == key


def test_normalise_is_nfc_and_trims_only_the_ends():
    assert answers.normalise("  Cafe\u0301  au\tlait \n") == "Caf\u00e9  au\tlait"


# -- the store's safety -------------------------------------------------------------------------

_KILLED_WRITER = """
import os, sys
from pathlib import Path
from localinfer.cache.answers import Answer, AnswerStore
real = os.fdopen
class Torn:
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *exc): return False
    def write(self, data):
        self.f.write(data[:len(data) // 2]); self.f.flush(); os._exit(9)   # killed mid-write
os.fdopen = lambda fd, mode: Torn(real(fd, mode))
store = AnswerStore(Path(sys.argv[1]), {"model": "m.gguf"}, label="m.gguf", cap_bytes=1 << 20,
                    n_vocab=1000)
store.save(sys.argv[2], Answer(("x" * 5000,), (5, 6, 7), "stop"))
"""


def test_a_writer_killed_mid_write_leaves_nothing_replayed_and_is_cleaned(tmp_path, monkeypatch):
    monkeypatch.setattr(answers, "SWEEP_EVERY", 1)     # every save sweeps (1 in 16 otherwise)
    notes: list[str] = []
    store = _store(tmp_path, notes)
    key = store.key(PROMPT, GREEDY)
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), key],
                            capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr
    torn = list(store.dir.glob(".tmp-*"))
    assert len(torn) == 1 and 0 < torn[0].stat().st_size
    assert store.lookup(key) is None and notes == []         # never published: not an entry
    assert answers.usage(tmp_path).entries == 0
    # The same torn bytes where an entry belongs (a file system that lost the rename's order)
    store.path(key).write_bytes(torn[0].read_bytes())
    assert store.lookup(key) is None
    assert len(notes) == 1 and not store.path(key).exists()
    # A writer's leftover an hour old is removed by a sweep, after a save that is then replayed.
    old = time.time() - 7200
    os.utime(torn[0], (old, old))
    assert store.save(key, ANSWER) is not None
    assert not torn[0].exists()
    assert store.lookup(key) == ANSWER


def test_the_store_keeps_to_its_cap_evicting_the_least_recently_used(tmp_path, monkeypatch):
    monkeypatch.setattr(answers, "SWEEP_EVERY", 1)
    store = AnswerStore(tmp_path, {"model": "m.gguf"}, label="m.gguf", cap_bytes=4000,
                        n_vocab=1000)
    keys = [store.key([i], GREEDY) for i in range(12)]
    for n, key in enumerate(keys):
        store.save(key, Answer((f"answer {n} " * 20,), (5, 6, 7), "length"))
        os.utime(store.path(key), (1000 + n, 1000 + n))       # saved in this order
        if n == 6:
            assert store.lookup(keys[0]) is not None           # a hit makes it recent again
    assert answers.usage(tmp_path).bytes <= 4000
    assert store.lookup(keys[0]) is not None and store.lookup(keys[-1]) is not None
    assert store.lookup(keys[1]) is None                       # the oldest unused went first
    assert store.save(store.key([99], GREEDY), Answer(("x" * 5000,), (5,), "stop")) is None


def _damage(store: AnswerStore, key: str, case: str, outside: Path) -> None:
    path = store.path(key)
    if case == "damaged":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x20
        path.write_bytes(bytes(data))
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    elif case == "wrong key inside":      # another request's entry under this one's name
        other = store.key([7, 7], GREEDY)
        store.save(other, Answer(("wrong",), (8,), "stop"))
        os.replace(store.path(other), path)
    elif case in ("token outside the vocabulary", "bad logprobs"):
        tokens = [5, 6, 70000] if case.startswith("token") else [5, 6, 7]
        body = {"format": answers.FORMAT, "pieces": ["a"], "finish_reason": "stop",
                "stop_string": "", "closed_at": -1, "saved": 1.0,
                "logprobs": None if case.startswith("token") else [[5, -1.0, []]]}
        entry.write(path, key=key, label="m.gguf", tokens=tokens,
                    state=json.dumps(body).encode())
    elif case == "entry links outside":
        outside.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(outside)
    elif case == "folder links outside":
        outside.mkdir()
        os.replace(path, outside / path.name)
        store.dir.rmdir()
        store.dir.symlink_to(outside, target_is_directory=True)


HOSTILE = ["damaged", "truncated", "oversized", "wrong key inside", "token outside the vocabulary",
           "bad logprobs", "entry links outside", "folder links outside"]


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_entry_is_refused_dropped_in_one_line_and_never_replayed(tmp_path, case,
                                                                         monkeypatch):
    notes: list[str] = []
    store = _store(tmp_path / "answers", notes)
    key = store.key(PROMPT, GREEDY)
    store.save(key, ANSWER)
    outside = tmp_path / "outside"
    _damage(store, key, case, outside)
    if case == "oversized":
        monkeypatch.setattr(answers, "MAX_ENTRY_BYTES", store.path(key).stat().st_size - 1)
    kept = sorted((p, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()
                  and p.is_relative_to(outside))
    assert store.lookup(key) is None
    assert len(notes) == 1 and "\n" not in notes[0] and "dropped entry" in notes[0], notes
    assert not os.path.lexists(store.path(key)) or case == "folder links outside"
    assert not os.path.islink(store.dir)
    assert sorted((p, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()
                  and p.is_relative_to(outside)) == kept        # nothing outside touched
    assert store.lookup(key) is None and len(notes) == 1        # gone: the next look finds none
    monkeypatch.undo()
    assert store.save(key, ANSWER) is not None and store.lookup(key) == ANSWER


# -- run, map and the Python API on SmolLM2 -----------------------------------------------------

RUN = ("--temp", "0", "-n", "12", "--draft", "none")     # replayed byte for byte at any length


def test_run_replays_the_answer_byte_for_byte(smollm_path, tmp_path):
    args = ("run", str(smollm_path), "Name three colours.", *RUN)
    plain = run_cli(*args, home=tmp_path)
    first = run_cli(*args, "--reuse-answers", "-v", home=tmp_path)
    again = run_cli("run", str(smollm_path), "  Name three colours.\n", *RUN, "--reuse-answers",
                    "-v", home=tmp_path)            # NFC and trimmed: the same request
    record = json.loads(run_cli(*args, "--reuse-answers", "--json", home=tmp_path).stdout)
    decoded = json.loads(run_cli(*args, "--json", home=tmp_path).stdout)
    assert plain.returncode == first.returncode == again.returncode == 0, first.stderr
    assert plain.stdout == first.stdout == again.stdout and plain.stdout.strip()
    assert "answer reused" not in first.stderr
    assert "answer reused from the answer store" in again.stderr and "none decoded" in again.stderr
    assert record["text"] == decoded["text"] and record["reused"] is True
    assert "reused" not in decoded
    assert record["generated_tokens"] == decoded["generated_tokens"] and record["decode_tps"] == 0
    # A damaged entry is dropped in one line and the answer decoded again, the same.
    (path,) = (tmp_path / "cache" / "answers").glob("*/*.kv")
    path.write_bytes(path.read_bytes()[:-3] + b"!!!")
    damaged = run_cli(*args, "--reuse-answers", home=tmp_path)
    assert damaged.returncode == 0 and damaged.stdout == plain.stdout
    assert [line for line in damaged.stderr.splitlines() if "answer store" in line] == \
        [line for line in damaged.stderr.splitlines() if line.strip()]
    assert len(damaged.stderr.strip().splitlines()) == 1 and "dropped entry" in damaged.stderr


def test_a_sampled_request_is_never_stored_nor_reused(smollm_path, tmp_path):
    args = ("run", str(smollm_path), "Tell me a word.", "--temp", "0.9", "-n", "12",
            "--reuse-answers", "--json", "--draft", "none")
    for _ in range(2):
        record = json.loads(run_cli(*args, home=tmp_path).stdout)
        assert "reused" not in record
    assert answers.usage(tmp_path / "cache" / "answers").entries == 0
    seeded = [json.loads(run_cli(*args, "--seed", "7", home=tmp_path).stdout) for _ in range(2)]
    assert "reused" not in seeded[0] and seeded[1]["reused"] is True
    assert seeded[0]["text"] == seeded[1]["text"]
    mapped = run_cli("map", str(smollm_path), "Name a {} fruit.", "--temp", "0.9", "-n", "8",
                     "--jsonl", home=tmp_path, input="red\nred\nred\n")
    assert mapped.returncode == 0, mapped.stderr
    assert not any(json.loads(line).get("reused") for line in mapped.stdout.splitlines())


def test_map_decodes_a_repeated_line_once_and_replays_it(smollm_path, tmp_path):
    lines = "red\nblue\nred\nred\nblue\ngreen\n"
    args = ("map", str(smollm_path), "Name a fruit that is {}.", "--temp", "0", "-n", "16",
            "-P", "2", "--jsonl", "-v")
    shared = run_cli(*args, home=tmp_path, input=lines)
    assert shared.returncode == 0, shared.stderr
    records = [json.loads(line) for line in shared.stdout.splitlines()]
    assert [r["input"] for r in records] == lines.split()
    assert [bool(r.get("reused")) for r in records] == [False, False, True, True, True, False]
    by_input = {}
    for r in records:
        assert by_input.setdefault(r["input"], r["answer"]) == r["answer"]
    assert "map: 3 of 6 lines decoded; 3 given the answer of an identical earlier line" in \
        shared.stderr
    stored = run_cli(*args, "--reuse-answers", home=tmp_path, input=lines)
    replayed = run_cli(*args, "--reuse-answers", home=tmp_path, input=lines)
    assert stored.stdout == shared.stdout
    again = [json.loads(line) for line in replayed.stdout.splitlines()]
    assert [r["answer"] for r in again] == [r["answer"] for r in records]
    assert all(r["reused"] for r in again)
    assert "map: 0 of 6 lines decoded; 3 given the answer of an identical earlier line; 3 " \
        "answered from the answer store" in replayed.stderr


def test_the_python_api_replays_the_pieces_as_they_streamed(smollm_path, tmp_path, monkeypatch):
    import localinfer
    monkeypatch.setenv("LOCALINFER_HOME", str(tmp_path))
    with localinfer.load(str(smollm_path)) as model:
        ask = dict(temperature=0, max_tokens=24, draft="none", reuse_answers=True)
        decoded = list(model.stream("Name a colour.", **ask))
        assert "reused" not in model.stats.as_dict()
        replayed = list(model.stream("Name a colour.", **ask))
        assert model.stats.as_dict()["reused"] is True
        assert replayed == decoded and len(decoded) > 1
        assert model.chat([{"role": "user", "content": "Hi"}], **ask) == \
            model.chat([{"role": "user", "content": "Hi"}], **ask)
        assert model.stats.as_dict()["reused"] is True


def test_cache_ls_stats_and_clear_see_the_answers(smollm_path, tmp_path):
    (tmp_path / "config").mkdir()       # the flag as a config key
    (tmp_path / "config" / "config.toml").write_text("[defaults]\nreuse-answers = true\n")
    args = ("run", str(smollm_path), "Say yes.", *RUN, "--json")
    assert "reused" not in json.loads(run_cli(*args, home=tmp_path).stdout)
    assert json.loads(run_cli(*args, home=tmp_path).stdout)["reused"] is True
    rows = json.loads(run_cli("cache", "ls", "--json", home=tmp_path).stdout)
    mine = [r for r in rows if r["cache"] == "answers"]
    assert len(mine) == 1 and mine[0]["model"] == smollm_path.name and mine[0]["tokens"] > 0
    assert "answers " in run_cli("cache", "ls", home=tmp_path).stdout
    stats = run_cli("cache", "stats", home=tmp_path).stdout
    assert "answers: 1 entry" in stats
    cleared = run_cli("cache", "clear", "answers", home=tmp_path)
    assert cleared.returncode == 0 and "answers: removed 1 entry" in cleared.stderr
    rows = json.loads(run_cli("cache", "ls", "--json", home=tmp_path).stdout)
    assert [r for r in rows if r["cache"] == "answers"] == []
    assert "reused" not in json.loads(run_cli(*args, home=tmp_path).stdout)
