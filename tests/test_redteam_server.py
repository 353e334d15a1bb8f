"""Issue 41's findings on what a request may touch, in-process on fakes and tiny files (the live
server on the real models is tests/test_redteam_serve.py): a model name from the network is never
a path on the server's disk, and listing or describing models reads no whole file on the request
path (digests are computed once, in the background, cached by file identity)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import time
from pathlib import Path

import pytest

from localinfer.server.errors import BadRequest

# Names a client sent in the red team's probes: files that exist, one that does not, a process's
# environment, the home folder, the root, a bare file name; all must read the same.
PATH_NAMES = ("/etc/hostname", "/etc/no-such-file", "/proc/self/environ", "~/.bashrc",
              "../../..", "./smollm2", "some-model.gguf", "models/x", "/etc/hostname:Q4_1")


@pytest.fixture
def models(home, monkeypatch):
    """hosting.Models over the real Loader in an empty home, and a record of the disk looks."""
    from localinfer.fit.options import FitOptions
    from localinfer.server.hosting import Models
    from localinfer.server.loading import Loader
    from localinfer.server.pool import Need, Pool
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    looked: list[str] = []
    for method in ("is_file", "exists", "resolve", "expanduser", "stat"):
        original = getattr(pathlib.Path, method)

        def recorded(self, *args, _original=original, **kwargs):
            looked.append(str(self))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(pathlib.Path, method, recorded)
    pool = Pool(Need(10 ** 9), lambda name: None, lambda name, plan: None, reaper=False)
    hosted = Models(Loader(FitOptions(offline=True)), pool)
    hosted.looked = looked
    return hosted


def _refusal(models, name: str) -> BadRequest:
    with pytest.raises(BadRequest) as refused:
        asyncio.run(models._key_or_404(name))
    return refused.value


def test_a_name_from_the_network_is_never_a_path_on_the_disk(models):
    """Issue 41: `/api/show {"model": "/etc/hostname"}` said "is not a GGUF model file", a name
    that does not exist "no such model file", /proc/self/environ "cannot read /proc/…": any
    client could probe the disk and load any GGUF on it."""
    said = set()
    for name in PATH_NAMES:
        refused = _refusal(models, name)
        assert refused.status == 404 and refused.code == "model_not_found"
        said.add(str(refused).replace(name, "NAME", 1))
    assert len(said) == 1, said
    assert "never a file" in said.pop()
    outside = [p for p in models.looked if not p.startswith(os.environ["LOCALINFER_HOME"])]
    assert outside == []                        # nothing outside the home was looked at


def test_an_unknown_catalogue_name_is_still_a_404_naming_it(models):
    refused = _refusal(models, "no-such-model")
    assert refused.status == 404 and "no-such-model" in str(refused)
    assert "never a file" not in str(refused)


# -- listing: never hashing on the request path, never failing on one bad file -----------------
@pytest.fixture
def listing(home, monkeypatch):
    """A server app (no model loaded) over a store of two tiny GGUFs and one damaged file;
    sha256 slowed to 1.5 s a file and counted; and the server's log."""
    from starlette.testclient import TestClient

    from localinfer.fit.options import FitOptions
    from localinfer.models import fetch
    from localinfer.server.api import Served, make_app
    from localinfer.server.hosting import Models
    from localinfer.server.loading import Loader
    from localinfer.server.pool import Need, Pool
    from tiny_gguf import Shape, write_tiny
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    store = home / "data" / "models"
    shape = Shape(layers=1, n_embd=64, n_head=1, n_kv=1, head_dim=64, n_ff=64)
    for name in ("tiny-a", "tiny-b"):
        (store / name).mkdir(parents=True)
        write_tiny(store / name / f"{name}-F16.gguf", "qwen3", shape)
    (store / "damaged").mkdir()
    whole = (store / "tiny-a" / "tiny-a-F16.gguf").read_bytes()
    (store / "damaged" / "damaged-Q4_1.gguf").write_bytes(whole[:1500])   # cut in its header
    hashed: list[Path] = []
    real_sha = fetch.sha256_of

    def slow_sha(path):
        hashed.append(Path(path))
        time.sleep(1.5)
        return real_sha(path)
    monkeypatch.setattr(fetch, "sha256_of", slow_sha)
    log: list[str] = []
    pool = Pool(Need(10 ** 9), lambda name: None, lambda name, plan: None, reaper=False)
    models = Models(Loader(FitOptions(offline=True)), pool, log=log.append)
    with TestClient(make_app(Served(models, log=log.append))) as client:
        yield client, store, hashed, log


def _timed_get(client, path: str) -> tuple[float, dict]:
    started = time.perf_counter()
    reply = client.get(path)
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - started, reply.json()


def _digests(client) -> dict[str, str]:
    return {m["name"]: m["digest"] for m in client.get("/api/tags").json()["models"]}


def test_listing_answers_at_once_and_digests_come_in_the_background(listing):
    """Issue 41: the first /api/tags hashed every file on the request path (48.6 s for 8 GB) and
    held one lock across it, so /api/ps and `localinfer ps` waited too."""
    from helpers import sha256_of
    client, store, hashed, _ = listing
    seconds, tags = _timed_get(client, "/api/tags")
    assert seconds < 1.0
    assert {m["name"]: m["digest"] for m in tags["models"]} == \
        {"tiny-a:F16": "", "tiny-b:F16": ""}           # not known yet: Ollama's shape, a string
    assert _timed_get(client, "/api/ps")[0] < 1.0        # nothing waits on the hashing
    assert _timed_get(client, "/api/tags")[0] < 1.0
    files = {name: store / name.split(":")[0] / f"{name.replace(':', '-')}.gguf"
             for name in ("tiny-a:F16", "tiny-b:F16")}
    expected = {name: sha256_of(path) for name, path in files.items()}
    deadline = time.monotonic() + 20
    while _digests(client) != expected:
        assert time.monotonic() < deadline, _digests(client)
        time.sleep(0.1)
    assert sorted(hashed) == sorted(files.values())      # each file hashed once
    # The same file is not hashed again; a rewritten one (another identity) is.
    path = files["tiny-a:F16"]
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
    assert _digests(client)["tiny-a:F16"] == ""
    deadline = time.monotonic() + 20
    while _digests(client)["tiny-a:F16"] != expected["tiny-a:F16"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(hashed) == 3


def test_a_damaged_file_in_the_store_is_left_out_of_every_list_and_logged_once(listing):
    """Issue 41: one damaged file made /api/tags a 500 (ModelLoadError … declares N tensors)."""
    client, _, _, log = listing
    for _ in range(3):
        tags = client.get("/api/tags")
        assert tags.status_code == 200, tags.text
        assert sorted(m["name"] for m in tags.json()["models"]) == ["tiny-a:F16", "tiny-b:F16"]
        listed = client.get("/v1/models")
        assert sorted(m["id"] for m in listed.json()["data"]) == ["tiny-a:F16", "tiny-b:F16"]
    said = [line for line in log if "damaged-Q4_1.gguf" in line]
    assert len(said) == 1 and said[0].startswith("left out of the model lists: "), log
