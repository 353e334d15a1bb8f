"""Multimodal models in the catalogue, the Hub and the store (issue 46): every vision or audio
entry names its projector; a Hub repository's mmproj file is chosen and pulled with the model,
never listed as a quant; the store keeps it beside the quants and removes it with the model; a
projector beside a local .gguf is found by name. In process, nothing downloaded."""

from __future__ import annotations

import pytest

from localinfer.errors import FetchError
from localinfer.models import catalogue, fetch, hub_files, projector
from localinfer.models.catalogue import HubFile, HubSource, Variant
from localinfer.models.store import PROJECTOR, Store

MULTIMODAL = ("gemma-3-4b-it", "qwen2.5-vl-3b-instruct", "qwen2.5-vl-7b-instruct",
              "smolvlm2-256m-video-instruct", "smolvlm2-500m-video-instruct",
              "smolvlm2-2.2b-instruct", "qwen2.5-omni-3b")


@pytest.mark.parametrize("name", MULTIMODAL)
def test_catalogue_entries_carry_their_projector(name):
    spec = catalogue.load().get(name)
    assert spec is not None and spec.projector is not None and spec.projector.quant == PROJECTOR
    (source, *_) = spec.projector.sources
    model = spec.variant(None).sources[0]
    assert "mmproj" in source.file and source.repo == model.repo    # the same conversion


def test_a_hub_listing_gives_its_projector_not_a_quant():
    files = [HubFile("Qwen2.5-VL-3B-Instruct-Q4_K_M.gguf", 1900, "a" * 64),
             HubFile("Qwen2.5-VL-3B-Instruct-Q8_0.gguf", 3300, "b" * 64),
             HubFile("mmproj-Qwen2.5-VL-3B-Instruct-Q8_0.gguf", 800, "c" * 64),
             HubFile("mmproj-Qwen2.5-VL-3B-Instruct-f16.gguf", 1300, "d" * 64),
             HubFile("../mmproj-evil-f16.gguf", 1, "e" * 64)]
    spec = hub_files.spec("hf--ggml-org--qwen", "ggml-org/Qwen", "1" * 40, files)
    assert set(spec.variants) == {"Q4_K_M", "Q8_0"}
    assert spec.projector == Variant(PROJECTOR, 1300, "d" * 64, (HubSource(
        "ggml-org/Qwen", "mmproj-Qwen2.5-VL-3B-Instruct-f16.gguf", "1" * 40),),
        "the listing of hf:ggml-org/Qwen")
    assert hub_files.spec("x", "a/b", "1" * 40, files[:2]).projector is None


def test_the_store_keeps_the_projector_beside_the_quants(tmp_path):
    store = Store(tmp_path)
    model, proj = store.path_for("smolvlm2", "Q8_0"), store.path_for("smolvlm2", PROJECTOR)
    model.parent.mkdir(parents=True)
    model.write_bytes(b"m")
    proj.write_bytes(b"p")
    assert [(m.name, m.quant) for m in store.installed()] == [("smolvlm2", "Q8_0")]
    assert projector.beside(model) == proj
    assert store.remove("smolvlm2", None) == [model, proj] and not model.parent.exists()


def test_a_projector_beside_a_local_file_is_found_by_name(tmp_path):
    model = tmp_path / "Qwen2.5-VL-7B-Instruct-Q4_K_M.gguf"
    model.write_bytes(b"m")
    assert projector.beside(model) is None
    lone = tmp_path / "mmproj-model-f16.gguf"
    lone.write_bytes(b"p")
    assert projector.beside(model) == lone
    # two: the one whose name is the model's wins; no winner, none (name it with --mmproj)
    mine = tmp_path / "mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf"
    mine.write_bytes(b"p")
    (tmp_path / "mmproj-SmolVLM2-500M-Video-Instruct-Q8_0.gguf").write_bytes(b"p")
    assert projector.beside(model) == mine
    assert projector.beside(tmp_path / "other.gguf") is None


def test_offline_a_missing_projector_leaves_the_text_model(tmp_path):
    spec = catalogue.load().get("smolvlm2-256m-video-instruct")
    store = Store(tmp_path)
    path = store.path_for(spec.name, "Q8_0")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"m")
    notes: list[str] = []
    assert fetch.ensure(spec, spec.variant(None), store, offline=True, notify=notes.append) == \
        path
    assert notes and "projector is not on disk" in notes[0] and "text only" in notes[0]
    store.path_for(spec.name, PROJECTOR).write_bytes(b"p")
    notes.clear()
    assert fetch.ensure(spec, spec.variant(None), store, offline=True, notify=notes.append) == \
        path and notes == []
    with pytest.raises(FetchError):          # the model itself is still required
        fetch.ensure(spec, spec.variant(None), Store(tmp_path / "empty"), offline=True)


# -- the fit counts the projector ---------------------------------------------------------------
def _projector_file(path, *, image_size=896, patch_size=14, heads=16, width=4304):
    """A projector's header as libmtmd reads it (clip keys), and 1 MB standing for its weights."""
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in (("image_size", image_size), ("patch_size", patch_size),
                       ("attention.head_count", heads), ("embedding_length", 1152),
                       ("feed_forward_length", width)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_tensor("v.patch_embd.weight", np.zeros((512, 512), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_fit_counts_the_projector_and_its_encoder(tmp_path):
    from localinfer.fit import auto, memory, rules
    from localinfer.fit.projector import projector_bytes
    proj = _projector_file(tmp_path / "mmproj.gguf")
    patches = (896 // 14) ** 2          # Gemma 3's SigLIP at 896 px: 4,096 patches
    assert projector_bytes(proj) == proj.stat().st_size + patches ** 2 * 16 * 4 + \
        patches * 4304 * 4 * 8
    assert projector_bytes("") == 0
    hostile = _projector_file(tmp_path / "mmproj-hostile.gguf", image_size=1 << 31, patch_size=1)
    assert projector_bytes(hostile) < 1 << 45         # bounded, however the header lies
    gib = 1 << 30
    model = memory.ModelFacts("llama", 1 * gib, 24, 2048, 8192, 49152, (2048,) * 24,
                              (False,) * 24, 0, 0, 8192)
    machine = rules.Machine(4 * gib, 3 * gib)
    alone = auto.Fitting(machine, rules.budget(machine), 4096, None)
    assert alone.place(model).fits
    seeing = auto.Fitting(machine, rules.budget(machine), 4096, None,
                          projector=projector_bytes(proj) + 2 * gib)
    assert not seeing.place(model).fits
    refusal = seeing.refusal("smolvlm2", model, "a smaller quant")
    assert refusal.startswith("smolvlm2") and "\n" not in refusal


def test_the_fit_finds_the_projector_to_be_loaded(tmp_path):
    from localinfer.fit import auto
    from localinfer.fit.projector import projector_bytes
    from localinfer.models.refs import ModelRef
    spec = catalogue.load().get("smolvlm2-256m-video-instruct")
    store = Store(tmp_path / "store")
    pulled = ModelRef("smolvlm2", spec, "Q8_0", None)
    assert auto._projector("auto", pulled, store) == 0          # not on disk yet: nothing
    stored = store.path_for(spec.name, PROJECTOR)
    stored.parent.mkdir(parents=True)
    _projector_file(stored)
    assert auto._projector("auto", pulled, store) == projector_bytes(stored) > 0
    local = tmp_path / "mine" / "SmolVLM2-500M-Q8_0.gguf"
    local.parent.mkdir()
    local.write_bytes(b"m")
    beside = _projector_file(local.with_name("mmproj-SmolVLM2-500M-f16.gguf"))
    assert auto._projector("maybe", ModelRef(str(local), None, None, local), store) == \
        projector_bytes(beside)
    assert auto._projector(str(beside), pulled, store) == projector_bytes(beside)
    assert auto._projector("", pulled, store) == 0
