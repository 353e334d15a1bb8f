"""A catalogue or Hub model's projector counted by the fit before it is pulled (issue 46): its
recorded or listed size, and its encoder's compute from its header read from the Hub (only the
first bytes, faked here at the network boundary: hub._first_bytes); `info` names it. In
process; nothing is downloaded (the pull is the boundary: a test stops there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localinfer.engine.media import AUTO
from localinfer.errors import DoesNotFit
from localinfer.fit import auto
from localinfer.fit.options import FitOptions
from localinfer.fit.projector import encoder_compute, planned_bytes
from localinfer.gguf.header import read_header
from localinfer.models import hub, hub_files, refs
from localinfer.models.catalogue import HubFile, HubSource, Variant
from mmproj_writer import write_idefics3

MB = 10 ** 6
REPO = "tests/tiny-vlm"


class Pulled(Exception):
    """Raised where the fit would start a download: the ref it chose."""


@pytest.fixture
def remote(tmp_path, smollm_path, monkeypatch) -> dict[str, Path]:
    """Each Hub file's first bytes from a local file: the model's from SmolLM2, the
    projector's from a tiny idefics3 projector; pulls stop at the boundary."""
    projector = write_idefics3(tmp_path / "mmproj-tiny.gguf")
    files = {"tiny-vlm-Q8_0.gguf": smollm_path, "tiny-vlm-Q4_1.gguf": smollm_path,
             "mmproj-tiny-vlm-f16.gguf": projector}
    asked: list[str] = []

    def first_bytes(source: HubSource, n: int) -> bytes:
        asked.append(source.file)
        with open(files[source.file], "rb") as f:
            return f.read(n)

    def pull(ref, *args, **kwargs):
        raise Pulled(ref.quant)
    monkeypatch.setattr(hub, "_first_bytes", first_bytes)
    monkeypatch.setattr(refs, "locate", pull)
    monkeypatch.setenv("LOCALINFER_HOME", str(tmp_path / "home"))
    return {"projector": projector, "asked": asked}


def _hub_spec(projector_size: int):
    listed = [HubFile("tiny-vlm-Q8_0.gguf", 300 * MB, "a" * 64),
              HubFile("tiny-vlm-Q4_1.gguf", 100 * MB, "b" * 64),
              HubFile("mmproj-tiny-vlm-f16.gguf", projector_size, "c" * 64)]
    return hub_files.spec("hf--tests--tiny-vlm", REPO, "1" * 40, listed)


def _pulled(spec, mmproj: str, memory: str) -> str:
    ref = refs.ModelRef(f"hf:{REPO}", spec, None, None)
    fit = FitOptions(memory=memory, mmproj=mmproj, ctx=512)
    with pytest.raises(Pulled) as pulled:
        auto.resolve(refs.Named(f"hf:{REPO}", ref), fit)
    return str(pulled.value)


def test_a_hub_projector_is_counted_before_the_quant_is_chosen(remote):
    """Q8_0 fits alone; with the listed projector's 250 MB only Q4_1 does, and that is the
    file the fit asks for: the choice is made before any download."""
    spec = _hub_spec(250 * MB)
    assert _pulled(spec, "", "550MB") == "Q8_0"
    assert _pulled(spec, AUTO, "550MB") == "Q4_1"
    assert "mmproj-tiny-vlm-f16.gguf" in remote["asked"]      # its header, not the file


def test_the_planned_bytes_are_the_listed_size_and_the_headers_compute(remote):
    meta = read_header(remote["projector"]).metadata
    source = HubSource(REPO, "mmproj-tiny-vlm-f16.gguf", "1" * 40)
    listed = Variant("MMPROJ", 250 * MB, None, (source,))
    assert planned_bytes(listed, remote=True) == 250 * MB + encoder_compute(meta)
    assert encoder_compute(meta) > 0
    assert planned_bytes(listed, remote=False) == 250 * MB        # offline: the size alone
    # No size recorded (most catalogue entries): the header's tensors give it.
    unknown = planned_bytes(Variant("MMPROJ", None, None, (source,)), remote=True)
    size = os.path.getsize(remote["projector"])
    assert 0.99 * size <= unknown - encoder_compute(meta) <= size


CATALOGUE = """
[models.tiny-vlm]
family = "tests"
architecture = "llama"
parameters = "135M"
context_length = 2048
kind = "instruct"
license = "apache-2.0"
default_quant = "Q4_1"
description = "SmolLM2 as a vision model's language model, for tests"

[models.tiny-vlm.quants.Q4_1]
sources = [{ hub = "tests/tiny-vlm", file = "tiny-vlm-Q4_1.gguf" }]

[models.tiny-vlm.projector]
size = 3000000000
sources = [{ hub = "tests/tiny-vlm", file = "mmproj-tiny-vlm-f16.gguf" }]
"""


def test_a_catalogue_projector_not_on_disk_is_counted_by_its_recorded_size(
        remote, tmp_path, smollm_path):
    """The model is on disk, its 3 GB projector not yet: offline, the fit counts the recorded
    size and refuses; without media the model alone fits. `info` gives the size."""
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "models.toml").write_text(CATALOGUE)
    named = refs.name("tiny-vlm", "auto", offline=True)
    stored = refs.model_store().path_for("tiny-vlm", "Q4_1")
    stored.parent.mkdir(parents=True)
    os.symlink(smollm_path, stored)
    fit = FitOptions(memory="1GB", ctx=512, offline=True)
    assert auto.resolve(named, fit).ref.quant == "Q4_1"
    with pytest.raises(DoesNotFit):
        auto.resolve(named, FitOptions(memory="1GB", ctx=512, offline=True, mmproj=AUTO))
    from localinfer.cli.info import describe
    assert describe(named.ref, refs.model_store())["projector_size"] == 3_000_000_000


def test_info_gives_the_projector_beside_a_model_file(tmp_path, smollm_path):
    from localinfer.cli.info import describe
    model = tmp_path / "tiny-vlm-Q4_1.gguf"
    os.symlink(smollm_path, model)
    projector = write_idefics3(tmp_path / "mmproj-tiny-vlm-f16.gguf")
    facts = describe(refs.ModelRef(str(model), None, None, model), refs.model_store())
    assert facts["projector"] == str(projector)
    assert facts["projector_size"] == projector.stat().st_size
    assert facts["projector_compute"] == encoder_compute(read_header(projector).metadata) > 0


def test_show_names_the_projector_beside_a_model_file(tmp_path, smollm_path):
    import json
    from helpers import run_cli
    from localinfer.units import human_size
    model = tmp_path / "tiny-vlm-Q4_1.gguf"
    os.symlink(smollm_path, model)
    projector = write_idefics3(tmp_path / "mmproj-tiny-vlm-f16.gguf")
    compute = encoder_compute(read_header(projector).metadata)
    shown = json.loads(run_cli("show", str(model), "--json", home=tmp_path / "home").stdout)
    assert (shown["projector"], shown["projector_compute"]) == (str(projector), compute)
    text = run_cli("show", str(model), home=tmp_path / "home").stdout
    assert f"\nmmproj {projector} ({human_size(projector.stat().st_size)}; encoder compute " \
        f"{human_size(compute)} an image or clip)\n" in text
