"""The red team's cases against `localinfer serve`, with more variants than they named: every bad
body is a 4xx in OpenAI's error shape, the server's stderr never holds a traceback, and after any
mix of bad and good requests the next good request answers exactly as the first did (greedy).
Good requests go through the official `openai` client, malformed ones through raw HTTP.

Also here: Host names (DNS rebinding), a client that leaves a non-streamed request, work kept
off the event loop, header and body time limits, and the scheduler's side of "one request's
failure ends that request alone" and "the shared pool never overfills"."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import MODELS_HOME, free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct:Q4_1"
GOOD = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
            temperature=0, max_tokens=12)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.log()


def start(*args: str, tmp: Path) -> Server:
    """A live server whose stderr goes to a file (a pipe nobody reads could fill and stall it)."""
    port = free_port()
    log_path = tmp / f"serve-{port}.log"
    with open(log_path, "w") as log:
        # One thread: ggml's threads spin-wait for one another at every step, and on a machine
        # whose cores other processes share a step then takes from 1 to 50 times as long, which
        # would drown the timings measured here.
        proc = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", "smollm2",
                                 "--offline", "--port", str(port), "--threads", "1", *args],
                                env={**os.environ, "LOCALINFER_HOME": str(MODELS_HOME)},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    server = Server(proc, f"http://127.0.0.1:{port}", port, log_path)
    for _ in range(600):
        try:
            urllib.request.urlopen(server.url + "/health", timeout=1)
            return server
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                raise AssertionError(server.log())
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start")


def serving(*args: str):
    """A module's server: started in a folder of its own, stopped after its tests, and its log
    then read for a traceback, which no request may cause."""
    with tempfile.TemporaryDirectory() as tmp:
        s = start(*args, tmp=Path(tmp))
        yield s
        s.stop()
        assert "Traceback" not in s.log() and "ASGI callable" not in s.log()


@pytest.fixture(scope="module")
def server(models_home):
    yield from serving("--parallel", "2", "--queue", "4", "--ctx", "2048")


@pytest.fixture(scope="module")
def first_answer(server) -> str:
    return server.client().chat.completions.create(**GOOD).choices[0].message.content


def post(url: str, body: bytes, headers: dict | None = None, timeout: float = 120):
    """(status, content type, parsed JSON body or the raw text)."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, kind, raw = r.status, r.headers.get("content-type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, kind, raw = e.code, e.headers.get("content-type", ""), e.read()
    try:
        return status, kind, json.loads(raw)
    except ValueError:
        return status, kind, raw.decode(errors="replace")


def assert_openai_error(status: int, kind: str, reply, low: int = 400, high: int = 499) -> None:
    assert low <= status <= high, (status, reply)
    assert kind.startswith("application/json"), (kind, reply)
    error = reply["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and {"param", "code"} <= error.keys()


def chat_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                       **fields}).encode()


def nested(depth: int, kind: str = "array") -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth


def with_raw(field: str, raw: str, **fields) -> bytes:
    """A chat body whose `field` is the JSON text `raw` as is (what json.dumps cannot write)."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields})
    return (body[:-1] + f', "{field}": {raw}}}').encode()


def schema_body(schema) -> bytes:
    return chat_body(response_format={"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": schema}})


BIG = 10 ** 400
CHAT, COMPLETE = "/v1/chat/completions", "/v1/completions"
BAD_BODIES = {
    # nesting: top level, inside a field, inside a schema, inside a prompt
    "arrays-100k-top": (CHAT, nested(100_000).encode()),
    "objects-100k-top": (CHAT, nested(100_000, "object").encode()),
    "arrays-100k-messages": (CHAT, ('{"model": "%s", "messages": %s}' % (MODEL, nested(100_000))).encode()),
    "objects-100k-content": (CHAT, with_raw("messages", '[{"role": "user", "content": %s}]'
                                            % nested(100_000, "object"))),
    "arrays-100k-unknown-field": (CHAT, with_raw("metadata", nested(100_000))),
    "arrays-900-unknown-field": (CHAT, with_raw("metadata", nested(900))),
    "schema-100k-deep": (CHAT, with_raw("response_format", '{"type": "json_schema", "json_schema": '
                                        '{"name": "x", "schema": %s}}' % nested(100_000, "object"))),
    "schema-items-500-deep": (CHAT, schema_body(json.loads('{"items": ' * 500 + "{}" + "}" * 500))),
    "prompt-100k-deep": (COMPLETE, ('{"model": "%s", "prompt": %s}' % (MODEL, nested(100_000))).encode()),
    # lone surrogates anywhere
    "surrogate-content": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "\ud800"}]}).encode()),
    "low-surrogate-inside-text": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "a\udc00b"}]}).encode()),
    "reversed-pair": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "\udc00\ud800"}]}).encode()),
    "surrogate-system": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "system", "content": "\udfff"}, {"role": "user", "content": "Hi"}]}).encode()),
    "surrogate-model": (CHAT, json.dumps({"model": "\ud800", "messages": []}).encode()),
    "surrogate-role": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "\ud800", "content": "x"}]}).encode()),
    "surrogate-key": (CHAT, chat_body(**{"\ud800": 1})),
    "surrogate-stop": (CHAT, chat_body(stop=["\ud800"])),
    "surrogate-enum": (CHAT, schema_body({"enum": ["\ud800"]})),
    "surrogate-text-part": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}).encode()),
    "surrogate-prompt": (COMPLETE, json.dumps({"model": MODEL, "prompt": "x\ud800"}).encode()),
    # numbers: huge, not finite, too many digits to parse
    "max-tokens-400-digits": (CHAT, chat_body(max_tokens=BIG)),
    "max-completion-tokens-negative-400-digits": (CHAT, chat_body(max_completion_tokens=-BIG)),
    "seed-400-digits": (CHAT, chat_body(seed=BIG)),
    "temperature-400-digits": (CHAT, chat_body(temperature=BIG)),
    "top-p-400-digits": (CHAT, chat_body(top_p=BIG)),
    "n-400-digits": (CHAT, chat_body(n=BIG)),
    "temperature-1e400": (CHAT, with_raw("temperature", "1e400")),
    "temperature-nan": (CHAT, with_raw("temperature", "NaN")),
    "top-p-minus-infinity": (CHAT, with_raw("top_p", "-Infinity")),
    "max-tokens-5000-digits": (CHAT, with_raw("max_tokens", "9" * 5000)),
    "content-400-digits": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": BIG}]}).encode()),
    "completions-max-tokens-400-digits": (COMPLETE, json.dumps({"model": MODEL, "prompt": "x",
                                                                "max_tokens": BIG}).encode()),
    # schema keywords of the wrong JSON type
    "schema-type-object": (CHAT, schema_body({"type": {"a": 1}})),
    "schema-type-list-of-list": (CHAT, schema_body({"type": [["string"]]})),
    "schema-type-list-of-object": (CHAT, schema_body({"type": [{"a": 1}]})),
    "schema-format-list": (CHAT, schema_body({"type": "string", "format": ["date"]})),
    "schema-format-object": (CHAT, schema_body({"type": "string", "format": {"a": 1}})),
    "schema-nested-type-object": (CHAT, schema_body({"type": "object", "properties": {
        "a": {"type": {"b": 2}}}})),
    # messages: too many, wrong shapes
    "messages-121000": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x"}] * 121_000}).encode()),
    "messages-5000": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x"}] * 5_000}).encode()),
    "messages-object": (CHAT, json.dumps({"model": MODEL, "messages": {"role": "user"}}).encode()),
    "message-string": (CHAT, json.dumps({"model": MODEL, "messages": ["hi"]}).encode()),
    "role-list": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": ["user"], "content": "x"}]}).encode()),
    "content-object": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": {"text": "x"}}]}).encode()),
    "image-part": (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode()),
    # the body itself
    "empty": (CHAT, b""),
    "null": (CHAT, b"null"),
    "string": (CHAT, b'"hello"'),
    "not-utf8": (CHAT, b'{"model": "\xff\xfe"}'),
    "truncated": (CHAT, chat_body()[:-3]),
    # fields
    "model-missing": (CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()),
    "model-list": (CHAT, json.dumps({"model": [MODEL], "messages": []}).encode()),
    "model-unknown": (CHAT, json.dumps({"model": "gpt-9" * 1000, "messages": []}).encode()),
    "stream-string": (CHAT, chat_body(stream="yes")),
    "stop-five": (CHAT, chat_body(stop=list("abcde"))),
    "stop-number": (CHAT, chat_body(stop=[1])),
    "max-tokens-zero": (CHAT, chat_body(max_tokens=0)),
    "max-tokens-fraction": (CHAT, chat_body(max_tokens=1.5)),
    "max-tokens-string": (CHAT, chat_body(max_tokens="5")),
    "max-tokens-true": (CHAT, chat_body(max_tokens=True)),
    "response-format-list": (CHAT, chat_body(response_format=["json"])),
    "json-schema-string": (CHAT, chat_body(response_format={"type": "json_schema",
                                                             "json_schema": "x"})),
    "prompt-token-out-of-vocabulary": (COMPLETE, json.dumps({"model": MODEL,
                                                             "prompt": [1, 2, 10**9]}).encode()),
    "prompt-empty": (COMPLETE, json.dumps({"model": MODEL, "prompt": ""}).encode()),
    "prompt-too-long": (COMPLETE, json.dumps({"model": MODEL, "prompt": "x " * 5000}).encode()),
}
# Schemas a reader may take or refuse (200 or 4xx), never a 5xx: the red team's poisons among them.
ODD_SCHEMAS = {
    "enum-nul": {"enum": ["\u0000"]},
    "const-nul": {"const": "\u0000"},
    "empty-class": {"type": "string", "pattern": "^[]$"},
    "pattern-nul": {"type": "string", "pattern": "^\u0000$"},
    "min-length-400-digits": {"type": "string", "minLength": BIG},
    "max-items-400-digits": {"type": "array", "maxItems": BIG},
    "enum-400-digits": {"enum": [BIG]},
    "const-400-digits": {"const": BIG},
    "properties-list": {"type": "object", "properties": []},
    "required-object": {"type": "object", "required": {"a": 1}},
    "enum-object": {"enum": {"a": 1}},
    "pattern-list": {"type": "string", "pattern": ["^a$"]},
    "schema-number": 5,
    "schema-list": [{"type": "string"}],
}


def _after(server, first_answer) -> None:
    """What must hold after each case: the next good request answers as the first did, and the
    log holds no traceback."""
    again = server.client().chat.completions.create(**GOOD)
    assert again.choices[0].message.content == first_answer
    log = server.log()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_a_bad_body_is_a_4xx_in_openai_shape(server, first_answer, case):
    path, body = BAD_BODIES[case]
    assert_openai_error(*post(server.url + path, body))
    _after(server, first_answer)


# exhaustive: [enum-400-digits] shows this by default; a const goes through the same constant
# check and grammar rule (schema_check._check_constants), and its 400-digit answer costs as much.
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.exhaustive)
                                  if case == "const-400-digits" else case for case in ODD_SCHEMAS])
def test_an_odd_schema_is_answered_or_refused_never_a_5xx(server, first_answer, case):
    status, kind, reply = post(server.url + CHAT, schema_body(ODD_SCHEMAS[case]))
    if status != 200:
        assert_openai_error(status, kind, reply)
    _after(server, first_answer)


def test_top_p_zero_is_greedy_as_in_llama_cpp(server, first_answer):
    reply = server.client().chat.completions.create(**{**GOOD, "temperature": 1.0}, top_p=0)
    assert reply.choices[0].message.content == first_answer
    _after(server, first_answer)


def test_a_streamed_bad_body_is_refused_before_the_stream(server, first_answer):
    status, kind, reply = post(server.url + CHAT, with_raw("stream", "true", max_tokens=BIG))
    assert_openai_error(status, kind, reply)
    _after(server, first_answer)


def test_other_endpoints_and_methods_answer_in_json(server, first_answer):
    for path, method, status in [("/v1/nothing", "GET", 404), ("/v1/chat/completions", "GET", 405),
                                 ("/health", "POST", 405), ("/v1/models", "DELETE", 405),
                                 ("/" + "x" * 5000, "GET", 404), ("/v1/%0a%1b[31m", "PUT", 404),
                                 ("/v1/embeddings", "GET", 405), ("/api/embed", "GET", 405),
                                 ("/api/embeddings", "PUT", 405), ("/v1/embeddings", "POST", 400),
                                 ("/api/embed", "POST", 400), ("/api/chat", "GET", 405),
                                 ("/api/generate", "PUT", 405), ("/api/tags", "POST", 405),
                                 ("/api/chat", "POST", 400), ("/api/generate", "POST", 400),
                                 ("/api/show", "POST", 400), ("/api/nothing", "GET", 404)]:
        request = urllib.request.Request(server.url + path, method=method, data=b"" if
                                         method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        raw = e.value.read()
        assert e.value.code == status, raw
        if path.startswith("/api/"):
            assert_ollama_error(status, e.value.headers["content-type"], json.loads(raw), status)
        else:
            assert_openai_error(status, e.value.headers["content-type"], json.loads(raw))
        assert len(raw) < 1000          # the path is named, within bounds
    _after(server, first_answer)


# -- Host names ------------------------------------------------------------------------------------
def _get(server, path: str, host: str | None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("GET", path, skip_host=True)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    reply = conn.getresponse()
    status, kind, body = reply.status, reply.getheader("content-type", ""), reply.read()
    conn.close()
    return status, kind, json.loads(body)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "localhost.evil.example",
                                  "127.0.0.1.nip.io:{port}", "localhost:1", "[::1]:1",
                                  "127.0.0.1:{port}0", "[::1]x", ""])
def test_a_name_the_server_is_not_served_under_is_a_403(server, first_answer, host):
    for path in ("/health", "/v1/models", "/v1/embeddings"):
        status, kind, reply = _get(server, path, host.format(port=server.port))
        assert_openai_error(status, kind, reply, 403, 403)
        assert reply["error"]["code"] == "host_not_allowed"
    for path in ("/api/embed", "/api/embeddings", "/api/chat", "/api/tags", "/api/version"):
        # Ollama's paths: in Ollama's shape
        status, kind, reply = _get(server, path, host.format(port=server.port))
        assert_ollama_error(status, kind, reply, 403)
        assert "--allowed-hosts" in reply["error"]
    _after(server, first_answer)


def assert_ollama_error(status: int, kind: str, reply, expected: int) -> None:
    assert status == expected and kind.startswith("application/json"), (status, kind, reply)
    assert list(reply) == ["error"] and isinstance(reply["error"], str) and reply["error"]


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("body", [
    nested(200).encode(), nested(100, "object").encode(), b'"a string"', b"[1, 2]",
    b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800", "messages": "\\ud800"}',
    json.dumps({"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}],
                "options": {"num_predict": 10 ** 400}}).encode(),
    json.dumps({"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}],
                "options": {"temperature": float("nan")}}).encode()],
    ids=["deep-array", "deep-object", "a-string", "a-list", "surrogates",
         "num-predict-400-digits", "temperature-nan"])
def test_a_bad_ollama_body_is_a_4xx_in_ollamas_shape(server, first_answer, path, body):
    status, kind, reply = post(server.url + path, body)
    assert 400 <= status < 500
    assert_ollama_error(status, kind, reply, status)
    _after(server, first_answer)


@pytest.mark.parametrize("host", ["localhost:{port}", "LOCALHOST:{port}", "127.0.0.1:{port}",
                                  "[::1]:{port}", "localhost", "127.0.0.1", "[::1]"])
def test_loopback_names_are_answered(server, host):
    status, _, reply = _get(server, "/v1/models", host.format(port=server.port))
    assert status == 200 and reply["data"][0]["id"] == MODEL


def test_allowed_hosts_adds_names_and_star_allows_any(models_home, tmp_path):
    named = start("--allowed-hosts", "box.lan,my.box", "--allowed-hosts", "other.box",
                  tmp=tmp_path)
    try:
        for host in ("box.lan", "my.box:%d" % named.port, "other.box", "localhost"):
            assert _get(named, "/health", host)[0] == 200, host
        assert _get(named, "/health", "evil.example")[0] == 403
    finally:
        named.stop()
    anything = start("--allowed-hosts", "*", tmp=tmp_path)
    try:
        assert _get(anything, "/health", "evil.example")[0] == 200
    finally:
        anything.stop()


def test_a_wrong_key_of_any_length_is_a_401(models_home, tmp_path):
    keyed = start("--api-key", "s3cret", tmp=tmp_path)
    try:
        for key in ("s3cre", "s3cret!", "", "s3cret" * 100, "S3CRET"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=keyed.url + "/v1", api_key=key or "x",
                              max_retries=0).models.list()
        ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.models.list().data[0].id == MODEL
        wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cre", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.embeddings.create(model=MODEL, input="a")
        assert len(ok.embeddings.create(model=MODEL, input="a").data) == 1
        for path in ("/api/embed", "/api/embeddings"):    # Ollama's: a 401 in its shape
            for key in ("s3cre", None):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                status, kind, reply = post(keyed.url + path, json.dumps(
                    {"model": MODEL, "input": "a", "prompt": "a"}).encode(), headers)
                assert_ollama_error(status, kind, reply, 401)
            status, _, reply = post(keyed.url + path, json.dumps(
                {"model": MODEL, "input": "a", "prompt": "a"}).encode(),
                {"Authorization": "Bearer s3cret"})
            assert status == 200 and (reply.get("embeddings") or reply.get("embedding")), reply
    finally:
        keyed.stop()


# -- a client that leaves, work off the event loop, time limits ------------------------------------
COUNTING = "Count from 1 to 1000: " + ", ".join(str(i) for i in range(1, 40)) + ","


def _raw_request(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def test_a_client_that_leaves_a_whole_request_frees_the_only_slot(models_home, tmp_path):
    lone = start("--parallel", "1", "--queue", "0", "--ctx", "4096", tmp=tmp_path)
    try:
        client = lone.client()
        timed = time.perf_counter()
        short = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=40,
                                          temperature=0)
        per_token = (time.perf_counter() - timed) / short.usage.completion_tokens
        long = json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 3000,
                           "temperature": 0}).encode()
        sock = _raw_request(lone.port, long)
        time.sleep(1.0)                  # decoding by now
        sock.close()                     # gone, before a byte of the answer
        t0 = time.perf_counter()
        again = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=40,
                                          temperature=0)
        waited = time.perf_counter() - t0
        print(f"answered {waited:.2f} s after the client left; 3,000 tokens would take "
              f"~{3000 * per_token:.0f} s ({per_token * 1000:.1f} ms a token)")
        assert again.choices[0].text == short.choices[0].text
        assert waited < 0.2 * 3000 * per_token, (waited, per_token)
        assert "Traceback" not in lone.log()
    finally:
        lone.stop()


def test_health_answers_while_heavy_requests_are_prepared(server, first_answer):
    """Tokenizing a 3.9 MB message took 3.3 s on the event loop, and /health waited for it; three
    such requests at once wait in turn there."""
    words = ("lorem ipsum dolor sit amet " * 150_000)[:3_900_000]
    heavy = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}]}).encode()
    replies: list = []
    threads = [threading.Thread(target=lambda: replies.append(post(server.url + CHAT, heavy)))
               for _ in range(3)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    slowest = 0.0
    while any(t.is_alive() for t in threads) and time.perf_counter() - t0 < 120:
        t = time.perf_counter()
        urllib.request.urlopen(server.url + "/health", timeout=60).read()
        slowest = max(slowest, time.perf_counter() - t)
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    print(f"heavy requests {time.perf_counter() - t0:.1f} s; slowest /health {slowest:.3f} s")
    assert len(replies) == 3
    for reply in replies:
        assert_openai_error(*reply)
        assert reply[2]["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.0
    _after(server, first_answer)


@pytest.fixture(scope="module")
def impatient(models_home):
    yield from serving("--parallel", "1", "--ctx", "1024", "--request-timeout", "2")


def _closed_within(sock: socket.socket, seconds: float) -> tuple[float, bytes]:
    """Seconds until the server closed the connection, and what it sent before."""
    sock.settimeout(seconds)
    t0, got = time.perf_counter(), b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s; got {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    return time.perf_counter() - t0, got


@pytest.mark.parametrize("head", [b"", b"POST /v1/chat/completions HTTP/1.1\r\n",
                                  b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                  b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1"])
def test_a_connection_that_never_finishes_its_headers_is_closed(impatient, head):
    sock = socket.create_connection(("127.0.0.1", impatient.port), timeout=10)
    sock.sendall(head)
    took, _ = _closed_within(sock, 8)
    sock.close()
    assert took < 4, took              # the limit is 2 s
    assert urllib.request.urlopen(impatient.url + "/health", timeout=5).status == 200


def test_headers_sent_a_byte_at_a_time_are_closed_too(impatient):
    sock = socket.create_connection(("127.0.0.1", impatient.port), timeout=10)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" * 4
    t0 = time.perf_counter()
    try:
        for byte in head:
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass
    _closed_within(sock, 8)
    sock.close()
    assert time.perf_counter() - t0 < 5


def test_a_body_that_never_finishes_is_a_408_and_the_connection_closes(impatient):
    sock = socket.create_connection(("127.0.0.1", impatient.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    took, got = _closed_within(sock, 8)
    sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and took < 4, got
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert "Traceback" not in impatient.log()


def test_a_keep_alive_connection_gets_a_fresh_header_limit_per_request(impatient):
    conn = http.client.HTTPConnection("127.0.0.1", impatient.port, timeout=10)
    for i in range(3):              # 1.5 s apart: over the 2 s limit in all, under it each time
        if i:
            time.sleep(1.5)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}'
    conn.close()


# -- the scheduler: one request's failure, and a pool one request may fill -------------------------
def _scheduler_parts():
    from localinfer.engine.decode import Limits
    from localinfer.engine.sampling import SamplingParams, make_sampler
    from localinfer.engine.scheduler import Job, Scheduler
    return Job, Scheduler, Limits, lambda: make_sampler(SamplingParams(temperature=0))


def _batch(path, n_ctx: int, parallel: int):
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.batched import SequenceBatch
    return SequenceBatch(path, LoadOptions(n_ctx=n_ctx), parallel + 1)


def _prompt(batch, text: str) -> list[int]:
    from localinfer.engine.prompt import chat_tokens, messages_for
    return chat_tokens(batch.session, messages_for(text, None))


def test_a_job_whose_sampler_fails_ends_alone_and_the_others_answer_as_alone(smollm_path):
    from localinfer.errors import LocalinferError
    Job, Scheduler, Limits, greedy = _scheduler_parts()
    batch = _batch(smollm_path, 1024, 3)
    prompts = [_prompt(batch, q) for q in ("Name a colour.", "What is rain?", "Say hi.")]

    def dead_end_after(n: int):
        sampler, calls = greedy(), []

        def sample(logits, history):
            calls.append(1)
            if len(calls) > n:
                raise LocalinferError("the grammar allows no token of this model's vocabulary")
            return sampler(logits, history)
        return sample
    alone = []
    for p in prompts:
        job = Job(p, greedy(), Limits(16))
        Scheduler(batch, request_ctx=batch.n_ctx).run([job])
        alone.append(job.tokens)
    jobs = [Job(prompts[0], greedy(), Limits(16)), Job(prompts[1], dead_end_after(3), Limits(16)),
            Job(prompts[2], greedy(), Limits(16)), Job(prompts[1], lambda *_: 1 // 0, Limits(16))]
    done = []
    Scheduler(batch, request_ctx=batch.n_ctx).run(jobs, done.append)
    assert len(done) == 4 and jobs[1].error.startswith("the grammar allows no token")
    assert jobs[1].stats.finish_reason == "error" and len(jobs[1].tokens) == 3
    assert jobs[3].error == "internal error: ZeroDivisionError: integer division or modulo by zero"
    # The others go on to their end (batched kernels round apart from one sequence's, so their
    # tokens need not equal those alone once the batch changes: docs/batching.md).
    for job in (jobs[0], jobs[2]):
        assert job.error is None and job.text and job.stats.finish_reason in ("stop", "length")
    # And after it the same batch answers as before: nothing of the failure stayed in the pool.
    after = Job(prompts[1], greedy(), Limits(16))
    Scheduler(batch, request_ctx=batch.n_ctx).run([after])
    assert after.tokens == alone[1]
    batch.close()


def test_a_failed_decode_ends_that_step_and_the_engine_goes_on(smollm_path):
    from localinfer.engine import scheduler as sched
    from localinfer.errors import LocalinferError
    Job, Scheduler, Limits, greedy = _scheduler_parts()
    batch = _batch(smollm_path, 512, 2)
    real, calls = batch.decode, []

    def failing_once(pieces):
        calls.append(1)
        if len(calls) == 3:
            raise LocalinferError("llama_decode failed with code -1")
        return real(pieces)
    batch.decode = failing_once
    prompt = _prompt(batch, "Name a colour.")
    first = [Job(prompt, greedy(), Limits(8)) for _ in range(2)]
    Scheduler(batch, request_ctx=batch.n_ctx).run(first)
    assert [j.error for j in first] == ["the model failed: llama_decode failed with code -1"] * 2
    second = Job(prompt, greedy(), Limits(8))
    Scheduler(batch, request_ctx=batch.n_ctx).run([second])
    assert second.error is None and len(second.tokens) == 8
    batch.decode = lambda pieces: (_ for _ in ()).throw(LocalinferError("gone"))
    with pytest.raises(LocalinferError):           # the engine cannot go on: run says so
        Scheduler(batch, request_ctx=batch.n_ctx).run([Job(prompt, greedy(), Limits(8))
                                                       for _ in range(2 * sched.ENGINE_FAILURES)])
    batch.decode = real
    batch.close()


def test_requests_without_max_tokens_share_the_pool_and_the_youngest_pauses_when_it_is_full(
        smollm_path):
    Job, Scheduler, Limits, greedy = _scheduler_parts()
    batch = _batch(smollm_path, 256, 2)                 # the smallest pool: fewer steps to fill
    prompt = list(range(1000, 1075))                    # 75 tokens each
    jobs = [Job(prompt, greedy(), Limits(-1, ignore_eos=True)) for _ in range(2)]
    done = []
    Scheduler(batch, request_ctx=batch.n_ctx).run(jobs, done.append)
    assert [j.error for j in jobs] == [None, None]
    # The second paused when the two of them filled the pool, the first went on to its context,
    # and then the second went on to its own (engine/admission.py): neither was cut short.
    # (the last token of each is chosen, not evaluated: its cell was never needed)
    assert done[0] is jobs[0] and done[1] is jobs[1]
    assert [(j.stats.finish_reason, len(j.tokens)) for j in jobs] == \
        [("context", batch.n_ctx - len(prompt) + 1)] * 2
    batch.close()


def test_a_request_with_max_tokens_waits_for_its_room_and_is_never_cut_short(smollm_path):
    from localinfer.engine.batching import restore_limit
    Job, Scheduler, Limits, greedy = _scheduler_parts()
    batch = _batch(smollm_path, 256, 2)                 # the smallest pool: fewer steps
    prompt = list(range(1000, 1150))                    # more than a share (128) of the pool
    jobs = [Job(prompt, greedy(), Limits(50, ignore_eos=True)) for _ in range(2)]
    order = []
    Scheduler(batch, request_ctx=batch.n_ctx).run(jobs, lambda j: order.append(jobs.index(j)))
    # 2 x 200 cells do not fit 256: the second started when the first was done (it asks more
    # than its share, so it may not pause the first), continuing its cells as far as that keeps
    # its logits a cold run's (engine/batching.py).
    assert order == [0, 1] and jobs[1].stats.cached_tokens == restore_limit(len(prompt), 0)
    assert [(j.error, j.stats.finish_reason, len(j.tokens)) for j in jobs] == [(None, "length", 50)] * 2
    batch.close()


def test_a_prompt_that_can_never_fit_the_pool_is_refused_alone(smollm_path):
    Job, Scheduler, Limits, greedy = _scheduler_parts()
    batch = _batch(smollm_path, 512, 2)
    jobs = [Job(list(range(1000, 1600)), greedy(), Limits(4)),
            Job(list(range(1000, 1400)), greedy(), Limits(4))]
    Scheduler(batch, request_ctx=batch.n_ctx).run(jobs)
    assert "600 tokens, more than the 512 each request has (raise --ctx)" in jobs[0].error
    assert jobs[1].error is None and len(jobs[1].tokens) == 4      # 400 of 512: one may use it all
    batch.close()


def test_a_client_that_leaves_before_its_body_is_whole_leaves_no_error(server, first_answer):
    for cut in (0, 10, 50):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        body = chat_body()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:cut])
        time.sleep(0.3)
        sock.close()
    time.sleep(0.5)
    assert "internal error" not in server.log()
    _after(server, first_answer)


# -- what no real request can show on demand: a bug of ours, a job that failed ---------------------
def _asgi_post(app, path: str, body: bytes):
    """One request through the ASGI app in process: (status, content type, body)."""
    import asyncio
    sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json")],
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("localhost", 1),
             "client": ("127.0.0.1", 2), "asgi": {"version": "3.0"}, "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return (start["status"], dict(start["headers"])[b"content-type"].decode(),
            json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")))


def test_an_exception_no_check_foresaw_is_a_json_500_and_one_log_line():
    from localinfer.server.api import Served, make_app

    class Broken:                       # a session whose tokenizer has a bug
        chat_template = "{{ messages[0].content }}"
        bos_token = eos_token = None
        add_bos = False
        n_vocab = 8                     # the Session protocol's (logit_bias ids are checked)

        def tokenize(self, text, *, special):
            raise RuntimeError("a bug of ours")

    class Idle:
        error = None

        def expect(self):
            return lambda: None

    class OneModel:                     # the server's models: one, leased as the pool leases it
        model = SimpleNamespace(names=(MODEL,), worker=Idle(), session=Broken(), n_ctx=512,
                                path=None, need=None, embeddings=None)

        released: list[bool] = []

        async def lease(self, name, keep_alive):
            return SimpleNamespace(model=self.model, release=lambda: self.released.append(True))

        def status(self):
            return []
    logged: list[str] = []
    models = OneModel()
    app = make_app(Served(models, port=1, log=logged.append, hosts=frozenset({"localhost"})))
    status, kind, reply = _asgi_post(app, CHAT, chat_body())
    assert_openai_error(status, kind, reply, 500, 500)
    assert logged == [f"POST {CHAT}: internal error: RuntimeError: a bug of ours"]
    assert models.released == [True]            # the model's lease is given back all the same


def test_a_failed_job_is_a_400_when_its_grammar_failed_and_a_500_otherwise():
    import asyncio

    from localinfer.engine.decode import Limits
    from localinfer.engine.scheduler import Job
    from localinfer.server.api import _Reply
    from localinfer.server.requests import Prepared, _OwnFailure
    from localinfer.errors import LocalinferError

    def dead_end(logits, history):
        raise LocalinferError("the grammar allows no token of this model's vocabulary here")
    own = _OwnFailure(dead_end)
    job = Job([1, 2], own, Limits(4))
    with pytest.raises(LocalinferError):
        job.sampler(None, [])
    job.error = own.failed
    logged: list[str] = []
    reply = _Reply(MODEL, True, Prepared(job, True, own), logged.append)
    failed = reply.failure()
    assert failed.status_code == 400 and json.loads(failed.body)["error"]["code"] == "grammar_dead_end"

    async def streamed():
        events = asyncio.Queue()
        events.put_nowait(None)
        return [data async for data in reply.stream(events)]
    chunks = asyncio.run(streamed())
    assert "[DONE]" not in chunks and json.loads(chunks[-1])["error"]["param"] == "response_format"
    engine = Job([1, 2], dead_end, Limits(4), error="the model failed: llama_decode failed")
    failed = _Reply(MODEL, False, Prepared(engine, False, None), logged.append).failure()
    assert failed.status_code == 500 and logged == ["a request failed: the model failed: "
                                                    "llama_decode failed"]
