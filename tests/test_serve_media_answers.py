"""`serve` answers images and audio (issue 46): a served model with a projector beside its file
reads media in its batched scheduler (engine/scheduler_media.py) and answers a greedy request
with the same text as the Python API's generate(images=...) (`run --image`'s path), through the
official OpenAI, Anthropic and Ollama clients; co-batched requests answer as alone; a repeated
picture continues from the slot's cells. SmolLM2 with tiny random-weight projectors
(tests/mmproj_writer.py): the mechanics, never what a model sees or hears."""

from __future__ import annotations

import base64
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from media_files import data_url, png, wav
from mmproj_writer import smolvlm_text_model, write_idefics3, write_ultravox

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

ASK, N = "What is in it?", 10


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm_path):
    """One server holding SmolLM2-with-SmolVLM's-tokens twice, beside a vision projector and
    beside an audio one; the paths, the URL, and the reference answers of the Python API."""
    import localinfer
    from helpers import start_server
    root = tmp_path_factory.mktemp("served-media")
    text = smolvlm_text_model(smollm_path, root / "text.gguf")
    paths = {}
    for kind, write in (("vision", write_idefics3), ("audio", write_ultravox)):
        (root / kind).mkdir()
        paths[kind] = root / kind / f"smolvlm-{kind}.gguf"
        os.link(text, paths[kind])
        write(root / kind / f"mmproj-{kind}.gguf")
    media = {"a": png(100, 30, seed=3), "b": png(48, 48, seed=5), "clip": wav(1.0)}
    said = {}
    with localinfer.load(str(paths["vision"])) as model:
        for key in ("a", "b"):
            said[key] = model.generate(ASK, images=[media[key]], temperature=0, max_tokens=N,
                                       cache=False)
        said["text"] = model.generate("Name a color.", temperature=0, max_tokens=N, cache=False)
    with localinfer.load(str(paths["audio"])) as model:
        said["clip"] = model.generate(ASK, audio=[media["clip"]], temperature=0, max_tokens=N,
                                      cache=False)
    proc, url = start_server(str(paths["vision"]), str(paths["audio"]), "--ctx", "2048",
                             "--parallel", "2")
    s = {"url": url, "media": media, "said": said, "vision": str(paths["vision"]),
         "audio": str(paths["audio"])}
    # The first requests, at once, on a fresh pool: the scheduler's answers are a lone
    # request's only while no cell is freed under a running one (see the test below).
    with ThreadPoolExecutor(2) as pool:
        together = [pool.submit(_ask_openai, s, s["media"]["b"]),
                    pool.submit(_ask_openai, s, None, "Name a color.")]
        s["together"] = [f.result() for f in together]
    yield s
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


def _openai(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["url"] + "/v1", api_key="-", max_retries=0)


def _ask_openai(s, image: bytes | None, text: str = ASK) -> str:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}] if image else []
    reply = _openai(s).chat.completions.create(
        model=s["vision"], max_tokens=N, temperature=0,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}])
    return reply.choices[0].message.content


def test_every_client_answers_a_picture_as_generate_does(served):
    s, said = served, served["said"]
    assert said["a"] and said["a"] != said["b"]         # two pictures, two answers
    assert _ask_openai(s, s["media"]["a"]) == said["a"]
    claude = anthropic.Anthropic(base_url=s["url"], api_key="-", max_retries=0)
    reply = claude.messages.create(model=s["vision"], max_tokens=N, extra_body={
        "temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(s["media"]["b"]).decode()}},
            {"type": "text", "text": ASK}]}])
    assert reply.content[0].text == said["b"]
    chat = ollama.Client(host=s["url"]).chat(
        model=s["vision"], options={"temperature": 0, "num_predict": N},
        messages=[{"role": "user", "content": ASK, "images": [s["media"]["a"]]}])
    assert chat.message.content == said["a"]


def test_a_picture_and_a_text_request_together_answer_as_alone(served):
    """The server's first two requests, at once on two slots: one reads a picture (its media
    steps between the co-batched steps), the other only text; each answers what it answers
    alone. On a pool whose slots keep other requests' cells the scheduler's answers can part
    from a lone request's, text only as well (seen with the scheduler of before media): the
    lead has a reproduction."""
    assert served["together"] == [served["said"]["b"], served["said"]["text"]]


def test_a_repeated_picture_continues_from_the_slots_cells(served):
    s = served

    def ask():
        return _openai(s).responses.create(
            model=s["vision"], max_output_tokens=N, temperature=0, input=[
                {"role": "user", "content": [
                    {"type": "input_image", "image_url": data_url(s["media"]["a"])},
                    {"type": "input_text", "text": ASK}]}])
    first, again = ask(), ask()
    assert first.output_text == again.output_text == s["said"]["a"]
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < again.usage.input_tokens       # the picture's cells, not the end


def test_audio_is_answered_as_generate_does(served):
    s = served
    reply = _openai(s).chat.completions.create(
        model=s["audio"], max_tokens=N, temperature=0, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(s["media"]["clip"]).decode(), "format": "wav"}},
            {"type": "text", "text": ASK}]}])
    assert reply.choices[0].message.content == s["said"]["clip"]


def test_a_slots_cells_are_continued_only_where_a_cold_evaluation_cuts():
    """The cut rules alone (a stand-in projector: ids from 100 are placeholders, one medium of
    5 at id 1000): a slot whose cells end inside the medium is continued from its start, never
    from inside it; cells not read as a prompt with media are not continued at all."""
    from types import SimpleNamespace

    from localinfer.engine.batching import Exact
    from localinfer.engine.scheduler_media import MEDIA, MediaSteps
    from localinfer.engine.slots import Held
    medium = SimpleNamespace(n=5)
    projector = SimpleNamespace(n_vocab=100, item=lambda t: medium if t == 1000 else None)
    steps = MediaSteps(SimpleNamespace(session=SimpleNamespace(media=projector)), chunk=2)
    prompt = [1, 2, 3, *range(1000, 1005), 4, 5, 6]
    assert steps.cuts(prompt, 0) == [2, 3, 8, 10, 11]
    assert steps.outside(prompt, 5) == 3 and steps.outside(prompt, 8) == 8
    cut_short = Held(prompt[:5], 0, Exact(MEDIA, 0, 5))         # its end dropped for room
    assert steps.reusable(cut_short, prompt, len(prompt), base=0, own=False) == 3
    assert steps.reusable(cut_short, prompt, len(prompt), base=0, own=True) == 3
    whole = Held(prompt, 0, Exact(MEDIA, 0, len(prompt)))
    assert steps.reusable(whole, prompt, len(prompt), base=0, own=False) == 10    # a text cut
    as_text = Held(prompt, 0, Exact(True, 0, len(prompt)))
    assert steps.reusable(as_text, prompt, len(prompt), base=0, own=False) == 0
