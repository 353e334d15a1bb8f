"""Projector (mmproj) files whose tensors contradict their header or each other (issue 46): each
one kills a process that hands it to libmtmd unchecked; `run --image/--audio` with it is one
line naming the file and exit 2, because a child process tries it first
(backends/llama/projector_check.py) and only the verdict is written. Tiny random-weight
projectors from mmproj_writer, rewritten with one tensor changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import error_line, free_port, run_cli
from media_files import png, wav
from mmproj_writer import smolvlm_text_model, write_idefics3, write_ultravox

# name -> (how the file is made, the medium it is asked for)
HOSTILE = {
    "patch": "a patch embedding of 5-pixel patches where the header says 4",
    "projection": "a projection whose input width is not the pixel-shuffled tower's",
    "missing": "a block's attention query weight left out",
    "positions": "one position embedding fewer than the tile has patches",
    "stacking": "audio frames stacked by 8: libmtmd counts one token fewer than its graph makes",
}


def _rewrite(src: Path, dst: Path, name: str, data: np.ndarray | None) -> Path:
    """`src` copied with the tensor `name` replaced by `data` (None: left out)."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name != name:
            writer.add_tensor(tensor.name, np.asarray(tensor.data))
        elif data is not None:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def bad(tmp_path_factory, smollm_path) -> Path:
    """model.gguf (SmolLM2 with SmolVLM's image tokens), one projector per HOSTILE entry, a
    truncated one, an image and a clip."""
    root = tmp_path_factory.mktemp("hostile")
    smolvlm_text_model(smollm_path, root / "model.gguf")
    good = write_idefics3(root / "good.gguf")
    rows = np.random.default_rng(0).standard_normal
    f32 = lambda *shape: (rows(shape) * 0.05).astype(np.float32)     # noqa: E731
    _rewrite(good, root / "patch.gguf", "v.patch_embd.weight", f32(32, 3, 5, 5))
    _rewrite(good, root / "projection.gguf", "mm.model.fc.weight", f32(576, 100))
    _rewrite(good, root / "missing.gguf", "v.blk.1.attn_q.weight", None)
    _rewrite(good, root / "positions.gguf", "v.position_embd.weight", f32(63, 32))
    _rewrite(good, root / "width.gguf", "mm.model.fc.weight", f32(512, 128))
    write_ultravox(root / "stacking.gguf", stack=8)
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[:len(data) - 1000])
    (root / "small.png").write_bytes(png(32, 32, seed=3))
    (root / "clip.wav").write_bytes(wav(1.0))
    return root


def _medium(bad: Path, name: str) -> list[str]:
    return ["--audio", str(bad / "clip.wav")] if name == "stacking" else \
        ["--image", str(bad / "small.png")]


@pytest.mark.parametrize("name", HOSTILE)
def test_each_hostile_projector_kills_a_process_that_loads_it_unchecked(bad, name):
    """The child as it runs is what this process would do unchecked: libmtmd aborts
    (GGML_ASSERT, SIGABRT) or faults (SIGSEGV) on each file, a sound projector loads."""
    child = [sys.executable, "-m", "localinfer.backends.llama.projector_check",
             str(bad / "model.gguf")]
    died = subprocess.run([*child, str(bad / f"{name}.gguf"), "--cpu", "1"],
                          capture_output=True, timeout=120)
    assert died.returncode < 0, (name, died.returncode, died.stderr[-2000:])
    sound = subprocess.run([*child, str(bad / "good.gguf"), "--cpu", "1"],
                           capture_output=True, timeout=120)
    assert sound.returncode == 0 and sound.stdout.strip() == b"ok", sound.stderr[-2000:]


@pytest.mark.parametrize("name", [*HOSTILE, "truncated", "width"])
def test_run_refuses_a_hostile_projector_in_one_line(bad, tmp_path, name):
    """One line naming the file, exit 2, nothing on stdout; the only file written is the
    verdict (none for a truncated file, refused from its header). `width`: embeddings 512
    wide for a 576-wide model, which libmtmd refuses cleanly once it sees the model (exit 1
    before: a runtime error where every other projector fault is a usage one)."""
    result = run_cli("run", str(bad / "model.gguf"), "Describe this.", "--temp", "0", "-n", "4",
                     "--mmproj", str(bad / f"{name}.gguf"), *_medium(bad, name), home=tmp_path)
    assert result.returncode == 2, result.stderr
    line = error_line(result)
    assert f"{name}.gguf" in line
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ([] if name == "truncated" else ["cache/projectors.json"]), written


def test_the_verdict_is_kept_and_a_changed_file_is_tried_again(bad, tmp_path, monkeypatch):
    """A second check reads the verdict (no child); the file rewritten is another file."""
    from localinfer.backends.llama import projector_check
    from localinfer.errors import UsageError
    cache = tmp_path / "projectors.json"
    hostile = tmp_path / "patch.gguf"
    hostile.write_bytes((bad / "patch.gguf").read_bytes())
    model = bad / "model.gguf"
    with pytest.raises(UsageError, match="patch.gguf crashes"):
        projector_check.check(model, hostile, threads=1, cache_file=cache)
    projector_check.check(model, bad / "good.gguf", threads=1, cache_file=cache)

    def no_child(*args, **kwargs):
        raise AssertionError("a child was started for a known verdict")
    monkeypatch.setattr(projector_check.subprocess, "run", no_child)
    with pytest.raises(UsageError, match="patch.gguf crashes"):
        projector_check.check(model, hostile, threads=1, cache_file=cache)
    projector_check.check(model, bad / "good.gguf", threads=1, cache_file=cache)
    monkeypatch.undo()
    hostile.write_bytes((bad / "good.gguf").read_bytes())
    os.utime(hostile, ns=(1, 1))           # another size or time: another file, tried again
    projector_check.check(model, hostile, threads=1, cache_file=cache)


def test_a_child_killed_from_outside_is_no_verdict(bad, tmp_path, monkeypatch):
    """SIGKILL (the out-of-memory killer) says nothing about the file: an error (exit 1), no
    verdict kept, the next load tries again."""
    from localinfer.backends.llama import projector_check
    from localinfer.errors import LocalinferError, UsageError
    killed = subprocess.CompletedProcess([], -9, b"", b"")
    monkeypatch.setattr(projector_check.subprocess, "run", lambda *a, **k: killed)
    cache = tmp_path / "projectors.json"
    with pytest.raises(LocalinferError, match="was killed") as raised:
        projector_check.check(bad / "model.gguf", bad / "good.gguf", threads=1, cache_file=cache)
    assert not isinstance(raised.value, UsageError) and not cache.exists()


def test_serve_refuses_a_hostile_projector_beside_its_model_in_one_line(bad, tmp_path):
    """serve MODEL loads the projector found beside the file at start: one line naming it and
    exit 2 (it was said twice, once by the pool and once as the command's error)."""
    (tmp_path / "m").mkdir()
    os.link(bad / "model.gguf", tmp_path / "m" / "model.gguf")     # beside it, not a link to it
    (tmp_path / "m" / "mmproj-patch.gguf").write_bytes((bad / "patch.gguf").read_bytes())
    result = run_cli("serve", str(tmp_path / "m" / "model.gguf"), "--port", str(free_port()),
                     home=tmp_path / "home", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "mmproj-patch.gguf" in error_line(result)
