"""The pure parts of `hf:` references, in process: parsing a reference, store names, a repository's
file names to quant variants, a saved listing read back as hostile input, and the checks of a
split GGUF's parts (tests/test_hub.py drives the CLI against a stand-in Hub)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from localinfer.errors import ModelLoadError, UsageError
from localinfer.models import hub, hub_files
from localinfer.gguf import checks as gguf_checks
from localinfer.models.catalogue import HubFile
from localinfer.models.store import Store, is_safe_name

SHA = "a" * 64


@pytest.mark.parametrize("text, repo, quant, file", [
    ("hf:bartowski/SmolLM2-135M-Instruct-GGUF", "bartowski/SmolLM2-135M-Instruct-GGUF", None, None),
    ("hf:a/b:q4_k_m", "a/b", "Q4_K_M", None),
    ("hf:a/b/sub/Model-Q8_0.gguf", "a/b", None, "sub/Model-Q8_0.gguf"),
    ("  hf:a.b/c_d-e  ", "a.b/c_d-e", None, None),
])
def test_parse(text, repo, quant, file):
    assert hub.parse(text) == hub.HubRef(repo, quant, file)


@pytest.mark.parametrize("text", [
    "hf:", "hf:a", "hf:/b", "hf:a/", "hf:a/b:", "hf:../b", "hf:a/..", "hf:a--x/b", "hf:a/b..c",
    "hf:-a/b", "hf:a/b:Q4 K", "hf:a/b:../x", "hf:a/b/../x.gguf", "hf:a/b//x.gguf", "hf:a/b/.x.gguf",
    "hf:a/b/x.bin", "hf:a/b/x\\y.gguf", "hf:a/b/x\n.gguf", "hf:a/" + "b" * 97,
])
def test_malformed(text):
    if text == "hf:a/b:":       # an empty quant tag is no quant: the default
        assert hub.parse(text).quant is None
        return
    with pytest.raises(UsageError):
        hub.parse(text)


def test_store_names_are_safe_distinct_and_bounded():
    names = {hub.store_name(r) for r in ("a/b", "a/b-c", "a-b/c", "A/B.c", "a/b.c")}
    assert len(names) == 4 and hub.store_name("A/B") == hub.store_name("a/b") == "hf--a--b"
    long = hub.store_name("o" * 96 + "/" + "r" * 96)
    assert is_safe_name(long) and len(long) == 80
    assert long != hub.store_name("o" * 96 + "/" + "r" * 95)


def files(*names: str) -> list[HubFile]:
    return [HubFile(n, 100, SHA) for n in names]


def test_variants_from_file_names():
    found = hub_files.variants(files(
        "README.md", "Llama-3-8B-Instruct-Q4_K_M.gguf", "Llama-3-8B-Instruct.Q8_0.gguf",
        "IQ4_XS/Llama-3-8B-Instruct-IQ4_XS-00002-of-00002.gguf",
        "IQ4_XS/Llama-3-8B-Instruct-IQ4_XS-00001-of-00002.gguf",
        "F16/Llama-3-8B-Instruct-f16-00001-of-00003.gguf",      # incomplete: left out
        "mmproj-model-f16.gguf", "imatrix.gguf", "../evil-Q2_K.gguf", "/abs-Q3_K_S.gguf"))
    assert sorted(found) == ["IQ4_XS", "Q4_K_M", "Q8_0"]
    assert [f.path for f in found["IQ4_XS"]] == [
        "IQ4_XS/Llama-3-8B-Instruct-IQ4_XS-00001-of-00002.gguf",
        "IQ4_XS/Llama-3-8B-Instruct-IQ4_XS-00002-of-00002.gguf"]
    assert hub_files.default_quant(found) == "Q4_K_M"


def test_two_models_with_one_quant_are_told_apart_by_their_names():
    found = hub_files.variants(files("base-Q4_0.gguf", "chat-Q4_0.gguf", "model.gguf"))
    assert sorted(found) == ["BASE-Q4_0", "CHAT-Q4_0", "MODEL"]


def test_spec_sizes_and_sources():
    listed = [HubFile("m-Q4_0-00001-of-00002.gguf", 10, SHA),
              HubFile("m-Q4_0-00002-of-00002.gguf", 20, "b" * 64), HubFile("m-Q8_0.gguf", 50, SHA)]
    spec = hub_files.spec("hf--a--b", "a/b", "1" * 40, listed)
    split, whole = spec.variants["Q4_0"], spec.variants["Q8_0"]
    assert (split.size, split.sha256, len(split.sources[0].parts)) == (30, None, 2)
    assert (whole.size, whole.sha256, whole.sources[0].parts) == (50, SHA, ())
    assert whole.sources[0].revision == "1" * 40 and spec.display_name == "hf:a/b"


def write_listing(store: Store, data) -> None:
    path = hub.listing_path(store, "hf--a--b")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


GOOD = {"repo": "a/b", "revision": "1" * 40, "files": [{"path": "m-Q4_0.gguf", "size": 5,
                                                         "sha256": SHA}]}


@pytest.mark.parametrize("bad", [
    "not json", "[]", "{}", {**GOOD, "repo": "a/c"}, {**GOOD, "repo": "../x"},
    {**GOOD, "revision": "main"}, {**GOOD, "files": {}},
    {**GOOD, "files": [{"path": "x.gguf", "size": -1, "sha256": None}]},
    {**GOOD, "files": [{"path": "x.gguf", "size": 1.5, "sha256": None}]},
    {**GOOD, "files": [{"path": "x.gguf", "size": 1, "sha256": "zz"}]},
    {**GOOD, "files": [{"path": ["x"], "size": 1, "sha256": None}]},
    "[" * 100_000,
])
def test_a_listing_on_disk_is_hostile_input(tmp_path, bad):
    store = Store(tmp_path)
    write_listing(store, bad)
    assert hub.load_listing(store, "hf--a--b", "a/b") is None
    write_listing(store, GOOD)
    assert hub.load_listing(store, "hf--a--b", "A/B").files[0].path == "m-Q4_0.gguf"


def test_an_oversized_listing_is_not_read(tmp_path):
    store = Store(tmp_path)
    write_listing(store, {**GOOD, "pad": "x" * hub.MAX_LISTING_BYTES})
    assert hub.load_listing(store, "hf--a--b", "a/b") is None


# -- split GGUF files, checked before llama.cpp opens them -----------------------------------------
@pytest.fixture(scope="module")
def split_parts(smollm_path, tmp_path_factory) -> list[Path]:
    from test_hub import split_gguf
    out = tmp_path_factory.mktemp("split") / "m-Q4_1.gguf"
    return split_gguf(smollm_path, out, 3)


def copy_parts(parts: list[Path], folder: Path) -> list[Path]:
    folder.mkdir()
    for p in parts:
        os.link(p, folder / p.name)
    return [folder / p.name for p in parts]


def test_a_whole_split_model_passes(split_parts):
    header = gguf_checks.check_model(split_parts[0])
    assert header.metadata["split.count"] == 3


def test_a_missing_part_is_refused(split_parts, tmp_path):
    parts = copy_parts(split_parts, tmp_path / "m")
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match="part 3 of 3, m-Q4_1-00003-of-00003.gguf, is missing"):
        gguf_checks.check_model(parts[0])


def test_a_part_named_alone_or_out_of_place_is_refused(split_parts, tmp_path):
    with pytest.raises(ModelLoadError, match="loads such a model from its first file"):
        gguf_checks.check_model(split_parts[1])
    parts = copy_parts(split_parts, tmp_path / "m")
    renamed = parts[0].with_name("m-Q4_1.gguf")          # the first part, without its split name
    shutil.copyfile(parts[0], renamed)
    with pytest.raises(ModelLoadError, match="loads such a model from its first file"):
        gguf_checks.check_model(renamed)


def test_parts_swapped_are_refused(split_parts, tmp_path):
    parts = copy_parts(split_parts, tmp_path / "m")
    tmp = parts[1].with_suffix(".tmp")
    os.replace(parts[1], tmp)
    os.replace(parts[2], parts[1])
    os.replace(tmp, parts[2])
    with pytest.raises(ModelLoadError, match="says it is part 3 of 3, not part 2 of 3"):
        gguf_checks.check_model(parts[0])


def test_a_damaged_later_part_is_refused(split_parts, tmp_path):
    parts = copy_parts(split_parts, tmp_path / "m")
    data = bytearray(parts[1].read_bytes()[:4096])
    parts[1].unlink()
    parts[1].write_bytes(bytes(data))                   # cut short
    with pytest.raises(ModelLoadError, match="m-Q4_1-00002-of-00003.gguf"):
        gguf_checks.check_model(parts[0])


def test_a_header_from_the_first_bytes_of_a_file(smollm_path):
    """What auto-fit reads from the Hub before pulling: a file's start, parsed as its header."""
    from localinfer.gguf.header import parse_start, read_header
    size = smollm_path.stat().st_size
    with open(smollm_path, "rb") as f:
        start = f.read(4 << 20)
    assert parse_start(start[:100_000], size, "m.gguf") is None      # ends inside the vocabulary
    header = parse_start(start, size, "m.gguf")
    assert header is not None and header.tensors == read_header(smollm_path).tensors
    with pytest.raises(ModelLoadError, match="truncated"):            # the data runs past its end
        parse_start(start, len(start), "m.gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        parse_start(b"<html>", size, "m.gguf")
