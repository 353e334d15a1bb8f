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

