"""Images and audio in (issue 46) on SmolLM2 with tiny random-weight projectors (mmproj_writer):
the mechanics of `run --image/--audio`, the Python API, chat's /image, the prompt cache and the
refusals. Random weights say nothing about what a model sees: no quality is claimed here. The
tokens' equality with llama.cpp's own llama-mtmd-cli is tests/test_multimodal_parity.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import error_line, run_cli
from media_files import png, wav
from mmproj_writer import smolvlm_text_model, write_idefics3, write_ultravox

PROMPT = "Describe this."


@pytest.fixture(scope="module")
def mm(tmp_path_factory, smollm_path) -> Path:
    """vision/ and audio/: SmolLM2 with SmolVLM's image tokens beside a projector each; plain/:
    SmolLM2 alone; a few images and a clip."""
    root = tmp_path_factory.mktemp("mm")
    text = smolvlm_text_model(smollm_path, root / "smolvlm-text.gguf")
    for kind, write in (("vision", write_idefics3), ("audio", write_ultravox)):
        (root / kind).mkdir()
        os.link(text, root / kind / "model.gguf")
        write(root / kind / f"mmproj-{kind}.gguf")
    (root / "plain").mkdir()
    os.symlink(smollm_path, root / "plain" / "model.gguf")
    for name, (w, h) in {"small": (32, 32), "wide": (100, 30), "big": (200, 200)}.items():
        (root / f"{name}.png").write_bytes(png(w, h, seed=w))
    (root / "clip.wav").write_bytes(wav(1.0))
    (root / "notes.txt").write_text("not an image\n")
    return root


def _run(mm: Path, home: Path, kind: str, *args: str):
    """A greedy run; plain decoding unless `args` name a drafter: a lookup draft would first
    probe how the model batches in each test's fresh home (test_exactness_key.py's subject)."""
    draft = () if "--draft" in args else ("--draft", "none")
    return run_cli("run", str(mm / kind / "model.gguf"), PROMPT, "--temp", "0", "-n", "12",
                   *draft, *args, home=home)


def test_an_image_is_answered_the_same_cold_and_from_the_prompt_cache(mm, tmp_path):
    """The second run restores the state saved at the image's end (keyed by the decoded pixels)
    and continues exactly as the first: the same tokens."""
    cold = _run(mm, tmp_path, "vision", "--image", str(mm / "big.png"), "-v")
    warm = _run(mm, tmp_path, "vision", "--image", str(mm / "big.png"), "-v")
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr + warm.stderr
    assert cold.stdout.strip() and warm.stdout == cold.stdout
    assert "prompt cache: miss" in cold.stderr
    assert "prompt cache: hit" in warm.stderr, warm.stderr
    other = _run(mm, tmp_path, "vision", "--image", str(mm / "wide.png"), "-v")
    assert "prompt cache: hit" not in other.stderr     # another picture shares no cells


@pytest.mark.exhaustive     # the drafters' exactness with media: tests/test_speculation_media.py
def test_run_speculates_around_an_image_and_answers_as_plain(mm, tmp_path):
    """The drafter sees the text only (tests/test_speculation_media.py); the answer is plain's."""
    plain = _run(mm, tmp_path, "vision", "--image", str(mm / "wide.png"), "--no-cache",
                 "--draft", "none")
    drafted = _run(mm, tmp_path, "vision", "--image", str(mm / "wide.png"), "--no-cache",
                   "--draft", "lookup", "-v")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and "speculation: lookup" in drafted.stderr


def test_audio_is_answered(mm, tmp_path):
    result = _run(mm, tmp_path, "audio", "--audio", str(mm / "clip.wav"), "--no-cache")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


@pytest.mark.parametrize("args, says", [
    (("plain", "--image", "{mm}/small.png"), "has no projector"),
    (("vision", "--image", "{mm}/notes.txt"), "notes.txt"),
    (("vision", "--image", "{mm}/missing.png"), "missing.png"),
    (("vision", "--audio", "{mm}/clip.wav"), "takes no audio"),
    (("vision", "--image", "{mm}/small.png", "--mmproj", "{mm}/small.png"), "projector"),
])
def test_bad_media_or_no_projector_is_one_line_before_anything_loads(mm, tmp_path, args, says):
    kind, *rest = (a.format(mm=mm) for a in args)
    result = run_cli("run", str(mm / kind / "model.gguf"), PROMPT, *rest, home=tmp_path)
    assert result.returncode == 2
    assert says in error_line(result)


def test_python_generate_with_images_is_run(mm, tmp_path, monkeypatch):
    import localinfer
    monkeypatch.setenv("LOCALINFER_HOME", str(tmp_path))
    image = mm / "small.png"
    cli = _run(mm, tmp_path, "vision", "--image", str(image), "--no-cache")
    with localinfer.load(str(mm / "vision" / "model.gguf")) as model:
        text = model.generate(PROMPT, images=[image], temperature=0, max_tokens=12, cache=False,
                              draft="none")
        assert text == cli.stdout.rstrip("\n")
        again = model.generate(PROMPT, images=[image.read_bytes()], temperature=0,
                               max_tokens=12, cache=False, draft="none")
        assert again == text                       # bytes or a path: the same medium
        with pytest.raises(localinfer.errors.UsageError, match="takes no"):
            model.generate(PROMPT, audio=[mm / "clip.wav"])
        with pytest.raises(localinfer.errors.UsageError, match="must be a path"):
            model.generate(PROMPT, images=[0])          # not stdin's descriptor


def test_a_conversation_keeps_its_image_without_encoding_it_again(mm):
    """The second turn's prompt holds the first turn's image: its placeholders match the cells
    already there, nothing is encoded or evaluated again, and the placeholders never reach
    llama.cpp's vocabulary (which would abort on them)."""
    from localinfer import media
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.session import LlamaCppSession
    from localinfer.engine.kv import KVCache
    from localinfer.engine.prompt import chat_media_tokens
    session = LlamaCppSession(mm / "vision" / "model.gguf",
                              LoadOptions(n_ctx=1024, mmproj=str(mm / "vision" /
                                                                 "mmproj-vision.gguf")))
    try:
        picture = media.read_path(mm / "big.png", "image")
        turn = [{"role": "user", "content": media.MARKER + PROMPT}]
        first = chat_media_tokens(session, turn, None, [picture])
        cache = KVCache(session)
        logits, _ = cache.prefill(first)
        assert session.media.encoded == 5            # the overview and a 2 x 2 grid of tiles
        reply = [int(logits.argmax())]
        cache.step(reply[0])
        turn += [{"role": "assistant", "content": session.detokenize(reply).decode()},
                 {"role": "user", "content": "And the colours?"}]
        second = chat_media_tokens(session, turn, None, [picture])
        _, reused = cache.prefill(second)
        assert second[:len(first)] == first and reused >= len(first)
        assert session.media.encoded == 5
        placeholder = max(first)
        assert placeholder >= session.n_vocab
        assert session.piece(placeholder) == b"" and not session.is_eog(placeholder)
    finally:
        session.close()


def test_chat_takes_an_image_command(mm, tmp_path):
    chat = run_cli("chat", str(mm / "vision" / "model.gguf"), "--temp", "0", "-n", "6",
                   "--no-cache", home=tmp_path,
                   input=f"/image {mm}/missing.png\n/image {mm}/small.png\n{PROMPT}\n"
                         f"/audio {mm}/clip.wav\nAnd in {mm}/wide.png?\n")
    assert chat.returncode == 0, chat.stderr
    assert "missing.png" in chat.stderr and "PNG image, 32x32" in chat.stderr
    assert "PNG image, 100x30" in chat.stderr      # a path in the message, as Ollama takes it
    assert "takes no audio" in chat.stderr
    assert chat.stdout.strip()
