"""Hostile images and audio (issue 46): each refused in one line naming the input and the reason,
from its header, before any decoder sees it, in bounded time and memory — on the command line
and on the APIs, where the server answers the next request as before."""

from __future__ import annotations

import base64
import resource
import time

import pytest
from media_files import bmp, data_url, flac, gif, inflating, jpeg, mp3, png, wav

from localinfer.media import (MAX_BYTES, MAX_ITEMS, MediaError, check, count_ok, from_base64,
                              from_data_url, read_path)

VALID = {"png": png(), "jpeg": jpeg(), "gif": gif(), "bmp": bmp(), "wav": wav(), "mp3": mp3(),
         "flac": flac()}
# name -> (bytes, words the refusal holds)
HOSTILE = {
    "not media": (b"just some text, no picture", "not an image or audio file"),
    "empty": (b"", "is empty"),
    "webp": (b"RIFF\x1a\x00\x00\x00WEBPVP8 " + bytes(14), "WebP"),
    "bomb by header": (png(50_000, 50_000, stream=b"x\x9c\x03\x00\x00\x00\x00\x01"),
                       "50,000x50,000 pixels"),
    "bomb by data": (png(16, 16, stream=inflating(4 << 20)), "decompression bomb"),
    "truncated png": (png()[:-30], "truncated"),
    "png bad crc": (png()[:40] + bytes([png()[40] ^ 1]) + png()[41:], "truncated or corrupt"),
    "truncated jpeg": (jpeg(end=False), "truncated"),
    "jpeg cut in header": (jpeg()[:12], "truncated"),
    "animated png": (png(frames=2), "animated PNG"),
    "animated gif": (gif(frames=3), "animated GIF"),
    "truncated gif": (gif()[:-3], "truncated"),
    "truncated bmp": (bmp()[:-8], "truncated"),
    "wav riff lies": (wav(riff=1 << 30), "does not match the file"),
    "wav data lies": (wav(data_size=1 << 30), "bytes of samples"),
    "wav no channels": (wav(channels=0), "0 channels"),
    "flac lying count": (flac(samples=1 << 35), "lasts"),
    "mp3 of junk": (b"\xff\xfb" + b"\xff" * 50_000, "no MP3 frame"),
}


@pytest.mark.parametrize("fmt", sorted(VALID))
def test_valid_media_pass(fmt):
    media = check(VALID[fmt], fmt)
    assert media.format == fmt and media.data == VALID[fmt] and len(media.digest) == 64
    assert (media.width, media.height) > (0, 0) if media.kind == "image" else media.seconds > 0


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_media_refused_from_the_header(name):
    data, words = HOSTILE[name]
    started, peak = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MediaError) as refused:
        check(data, "photo")
    message = str(refused.value)
    assert message.startswith("photo") and words in message and "\n" not in message
    assert time.monotonic() - started < 1.0
    # nothing decoded: the process grew by no more than a few MB (ru_maxrss is in KB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 << 10


def test_audio_duration_bound():
    # 1 kHz mono 16-bit samples: 20 minutes in 1.2 MB, all of it there (the header is honest)
    head = wav(seconds=0, rate=1000)
    size = 1200 * 1000 * 2
    clip = head[:4] + (len(head) - 8 + size).to_bytes(4, "little") + head[8:-4] + \
        size.to_bytes(4, "little") + bytes(size)
    with pytest.raises(MediaError, match="lasts 1,200 s; at most 600 s"):
        check(clip, "clip")
    with pytest.raises(MediaError, match="lasts"):
        check(mp3(frames=24_000), "clip")      # 627 s of MPEG frames, counted one by one


def test_a_large_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.png"
    with open(big, "wb") as f:          # sparse: 2 GB on paper, nothing on disk
        f.write(png())
        f.truncate(2 << 30)
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"big.png is 2,147,483,648 bytes; a medium may have "
                                         r"at most 20 MB"):
        read_path(big)
    assert time.monotonic() - started < 0.5
    assert read_path(_written(tmp_path / "ok.png", png())).width == 8


def _written(path, data: bytes):
    path.write_bytes(data)
    return path


def test_too_many_media():
    count_ok(MAX_ITEMS, "the request")
    with pytest.raises(MediaError, match="1,000 images or audio clips; at most 32"):
        count_ok(1000, "the request")


@pytest.mark.parametrize("url, words", [
    ("data:image/png,not-base64-at-all", "without ;base64"),
    ("data:image/png;base64,@@@not base64@@@", "is not base64"),
    ("data:text/plain;base64," + base64.b64encode(png()).decode(), "of text/plain"),
    ("data:;base64," + base64.b64encode(png()).decode(), "of text"),
    ("data:image/png;base64," + base64.b64encode(wav()).decode(), "holds audio (WAV)"),
    ("https://example.invalid/cat.png", "not a data: URL"),
])
def test_bad_data_urls(url, words):
    with pytest.raises(MediaError, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_data_url(url, "messages[0].content[1]", "image")


def test_base64_bounds():
    assert from_base64(base64.encodebytes(png()).decode(), "images[0]").format == "png"
    with pytest.raises(MediaError, match="characters of base64"):
        from_base64("A" * (MAX_BYTES * 2), "images[0]")
    with pytest.raises(MediaError, match="must be a base64 string"):
        from_base64(12, "images[0]")
    assert data_url(png()).startswith("data:image/png;base64,")



# -- the command line: `run --image/--audio`, refused before anything loads ----------------------
def test_hostile_media_on_the_command_line(tmp_path):
    from helpers import error_line, run_cli
    files = {name: _written(tmp_path / f"{k}.bin", HOSTILE[name][0])
             for k, name in enumerate(("bomb by header", "truncated jpeg", "animated gif",
                                       "not media", "wav data lies"))}
    big = tmp_path / "huge.png"
    with open(big, "wb") as f:
        f.truncate(2 << 30)
    ok = _written(tmp_path / "ok.png", png())
    cases = [(["--image", str(files["bomb by header"])], "50,000x50,000 pixels"),
             (["--image", str(files["truncated jpeg"])], "JPEG file is truncated"),
             (["--image", str(files["animated gif"])], "animated GIF"),
             (["--image", str(files["not media"])], "not an image or audio file"),
             (["--audio", str(files["wav data lies"])], "bytes of samples"),
             (["--image", str(big)], "2,147,483,648 bytes"),
             (["--image", str(tmp_path)], "is a directory"),
             (["--audio", str(ok)], "holds image (PNG) where audio is expected"),
             ([a for _ in range(33) for a in ("--image", str(ok))], "at most 32")]
    for args, words in cases:
        result = run_cli("run", "no-such-model-is-loaded", "Describe it.", *args,
                         "--offline", home=tmp_path / "home", timeout=60)
        assert result.returncode == 2 and words in error_line(result), (args, result.stderr)


# -- the APIs: a served SmolLM2 (no projector) checks media before it says it has none ----------
def _chat(url: str, *parts: dict) -> tuple[int, dict]:
    from helpers import post_json
    return post_json(url + "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  *parts]}]})


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_hostile_media_on_the_apis_then_the_next_request_as_before(smollm_server_512):
    from helpers import post_json
    url = smollm_server_512
    bomb = data_url(HOSTILE["bomb by header"][0])
    refusals = {
        "50,000x50,000 pixels": _chat(url, _image(bomb)),
        "decompression bomb": _chat(url, _image(data_url(HOSTILE["bomb by data"][0]))),
        "animated GIF": _chat(url, _image(data_url(gif(frames=2), "image/gif"))),
        "truncated or corrupt": _chat(url, _image(data_url(jpeg(end=False), "image/jpeg"))),
        "1,000 images or audio clips; at most 32": _chat(url, *[_image(data_url(png()))] * 1000),
        "is not base64": _chat(url, _image("data:image/png;base64,%%%")),
        "data: URL of text/plain": _chat(url, _image("data:text/plain;base64,aGk=")),
        "--allow-remote-media": _chat(url, _image("http://127.0.0.1:9/cat.png")),
        "bytes of samples": _chat(url, {"type": "input_audio", "input_audio": {
            "data": base64.b64encode(wav(data_size=1 << 30)).decode(), "format": "wav"}}),
        # a well-formed image reaches the last check: this model has no projector
        "the model 'smollm2' has no projector for images": _chat(url, _image(data_url(png()))),
    }
    for words, (status, reply) in refusals.items():
        assert status == 400 and words in reply["error"]["message"], (words, reply)
        assert reply["error"]["type"] == "invalid_request_error"
    # Ollama's and Anthropic's shapes, naming their own fields
    status, reply = post_json(url + "/api/chat", {"model": "smollm2", "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [base64.b64encode(png()).decode(),
                                                     base64.b64encode(bmp()[:-8]).decode()]}]})
    assert status == 400 and reply == {"error": "messages[0].images[1]: the BMP file is "
                                                "truncated or corrupt"}, reply
    status, reply = post_json(url + "/v1/messages", {
        "model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(frames=4)).decode()}},
            {"type": "text", "text": "hi"}]}]})
    assert status == 400 and reply["type"] == "error", reply
    assert reply["error"]["message"].startswith("messages[0].content[0]: an animated PNG"), reply
    status, reply = _chat(url)
    assert status == 200 and reply["choices"][0]["message"]["content"], reply


# -- remote URLs: only with serve --allow-remote-media, and bounded then ------------------------
@pytest.fixture(scope="module")
def web():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/cat.png":
                self._send(200, png(), "image/png")
            elif self.path == "/huge.png":            # says 2 GB; sends nothing more
                self.send_response(200)
                self.send_header("Content-Length", str(2 << 30))
                self.end_headers()
            elif self.path == "/slow.png":
                self.send_response(200)
                self.end_headers()
                for _ in range(40):
                    self.wfile.write(b"\x89PNG" * 16)
                    self.wfile.flush()
                    time.sleep(0.05)
            elif self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "file:///etc/passwd")
                self.end_headers()
            else:
                self._send(404, b"no", "text/plain")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_images_only_when_allowed_and_bounded(web):
    from localinfer.media.remote import fetch
    from localinfer.server.errors import BadRequest
    from localinfer.server.media_parts import Reader
    part = {"type": "image_url", "image_url": {"url": web + "/cat.png"}}
    with pytest.raises(BadRequest, match="only when serve runs with --allow-remote-media"):
        Reader(remote=False).text(part, "messages[0].content[0]")
    allowed = Reader(remote=True)
    assert allowed.text(part, "messages[0].content[0]") == "<__media__>"
    assert allowed.media[0].data == png()
    for path, words in (("/huge.png", "over 20 MB"), ("/nothing", "answered 404"),
                        ("/away", "cannot fetch|answered 302")):
        with pytest.raises(MediaError, match=words):
            fetch(web + path, "image")
    started = time.monotonic()
    with pytest.raises(MediaError, match="did not arrive within 0.5 s"):
        fetch(web + "/slow.png", "image", seconds=0.5)
    assert time.monotonic() - started < 1.5
