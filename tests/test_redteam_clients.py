"""The clients we ship (`ps`, `stop`, `map --server`) against hostile servers, and what reaches a
terminal from outside (a server, a GGUF file): one line and the right exit code for whatever a
server does, and no control character from outside printed raw.

The hostile servers are small HTTP servers on 127.0.0.1 in threads of the test process; each
answer is a function of the request, and every one of them ends within a bounded time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest
from gguf_patch import add_value, set_value
from helpers import SMOLLM, error_line, run_cli
from localinfer.errors import LocalinferError
from tiny_gguf import Shape, write_tiny

# What a terminal acts on: ESC (colours, clearing, the title), CR and LF, BEL, a C1 CSI, a bidi
# override, DEL.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07 a\rb\nc \x9b31m \u202eevil\x7f"
SHOWN = "\\x1b[2J\\x1b]0;pwned\\x07 a\\rb\\nc \\x9b31m \\u202eevil\\x7f"
TEMPLATE = "{{ '\x1b[2J' }}line one\n\tline two \u202e\x9b\n"
RAW = ("\x1b", "\r", "\x07", "\x9b", "\u202e", "\x7f")


def no_raw(text: str) -> bool:
    return not any(c in text for c in RAW)


# -- hostile servers ------------------------------------------------------------------------------
Respond = Callable[[BaseHTTPRequestHandler], None]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    respond: Respond
    asked: list

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.asked.append((self.command, self.path, dict(self.headers), body))
        try:
            type(self).respond(self)
        except OSError:         # the client hung up: what a hostile server ends on
            pass
        self.close_connection = True

    do_GET = do_POST = _any

    def log_message(self, *args) -> None:
        pass


def json_reply(status: int, value: object, headers: dict | None = None) -> Respond:
    def respond(h: BaseHTTPRequestHandler) -> None:
        body = json.dumps(value).encode()
        h.send_response(status)
        for name, said in {"Content-Type": "application/json", **(headers or {})}.items():
            h.send_header(name, said)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return respond


POLL_S = 0.02      # how often the hostile servers' loops look for a shutdown


@pytest.fixture
def hostile():
    """serve(respond, host) -> (url, asked): a server answering every request with `respond`."""
    servers = []

    def serve(respond: Respond, host: str = "127.0.0.1") -> tuple[str, list]:
        asked: list = []
        handler = type("Handler", (_Handler,), {"respond": staticmethod(respond), "asked": asked})
        server = ThreadingHTTPServer((host, 0), handler)
        server.daemon_threads = True
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, at every test's end
        threading.Thread(target=server.serve_forever, args=(POLL_S,), daemon=True).start()
        servers.append(server)
        return f"http://{host}:{server.server_address[1]}", asked
    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


# -- 17, 18: no control character from outside reaches the terminal ------------------------------
def test_ps_shows_a_servers_names_escaped(hostile, tmp_path: Path):
    url, _ = hostile(json_reply(200, {"models": [
        {"name": HOSTILE, "size": 1000, "expires_at": HOSTILE}, {"name": "plain:Q4_0"}]}))
    result = run_cli("ps", "--url", url, home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert no_raw(result.stdout + result.stderr)
    rows = result.stdout.splitlines()
    assert len(rows) == 3 and rows[1].startswith(SHOWN) and rows[2].startswith("plain:Q4_0")


def test_stop_names_what_is_loaded_escaped(hostile, tmp_path: Path):
    url, _ = hostile(json_reply(200, {"models": [{"name": HOSTILE}]}))
    result = run_cli("stop", "other", "--url", url, home=tmp_path)
    assert result.returncode == 2
    line = error_line(result)
    assert no_raw(result.stderr) and line.endswith(f"loaded: {SHOWN}")


def test_a_servers_error_message_is_one_escaped_line(hostile, tmp_path: Path):
    url, _ = hostile(json_reply(500, {"error": HOSTILE}))
    result = run_cli("ps", "--url", url, home=tmp_path)
    assert result.returncode == 1
    assert no_raw(result.stderr) and error_line(result).endswith(f"500 {SHOWN}")


def test_map_warns_of_a_refused_line_escaped(hostile, tmp_path: Path):
    url, _ = hostile(json_reply(400, {"error": {"message": HOSTILE, "code": "bad"}}))
    result = run_cli("map", SMOLLM, "Say {}", "--server", url, input="1\n", home=tmp_path)
    assert result.returncode == 1, result.stderr
    assert no_raw(result.stderr) and result.stdout == "\n"
    assert f"warning: line 1: {SHOWN}" in result.stderr


def test_an_error_quoting_outside_text_is_escaped(tmp_path: Path):
    result = run_cli("info", "\x1b]0;pwned\x07x", home=tmp_path)
    assert result.returncode == 2
    assert no_raw(result.stderr) and "\\x1b]0;pwned\\x07x" in error_line(result)


@pytest.fixture(scope="module")
def hostile_gguf(tmp_path_factory) -> Path:
    """A tiny model whose name and chat template hold what a terminal acts on."""
    where = tmp_path_factory.mktemp("hostile")
    tiny = write_tiny(where / "tiny.gguf", "qwen3", Shape(layers=1, n_embd=64, n_head=2, n_kv=1,
                                                          head_dim=32, n_ff=128))
    named = add_value(tiny, where / "named.gguf", "general.name", HOSTILE, 8)
    return set_value(named, where / "hostile.gguf", "tokenizer.chat_template", TEMPLATE)


def test_info_shows_a_files_name_escaped(hostile_gguf: Path, tmp_path: Path):
    result = run_cli("info", str(hostile_gguf), home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert no_raw(result.stdout + result.stderr)
    assert any(row.split(None, 1)[-1] == SHOWN for row in result.stdout.splitlines())
    facts = json.loads(run_cli("info", str(hostile_gguf), "--json", home=tmp_path).stdout)
    assert facts["name"] == HOSTILE


def test_show_escapes_a_template_but_keeps_its_lines(hostile_gguf: Path, tmp_path: Path):
    result = run_cli("show", str(hostile_gguf), home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert no_raw(result.stdout + result.stderr)
    assert "{{ '\\x1b[2J' }}line one\n\tline two \\u202e\\x9b\n" in result.stdout
    as_json = run_cli("show", str(hostile_gguf), "--json", home=tmp_path)
    assert no_raw(as_json.stdout)
    assert json.loads(as_json.stdout)["template"] == TEMPLATE
    piped = run_cli("show", str(hostile_gguf), "--template", home=tmp_path)
    assert piped.stdout == TEMPLATE     # a pipe gets the file's bytes


# -- 15: the API key goes to the address given and no other ---------------------------------------
def redirect(to: str, status: int = 302) -> Respond:
    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Location", to.replace("{path}", h.path))
        h.send_header("Content-Length", "0")
        h.end_headers()
    return respond


KEY = {"LOCALINFER_API_KEY": "sk-secret"}
PS = {"models": [{"name": "elsewhere:Q4_0", "size": 1000}]}
COMPLETION = {"choices": [{"message": {"content": "elsewhere"}, "finish_reason": "stop"}]}


@pytest.mark.parametrize("command, status", [(["ps"], 302), (["stop", "elsewhere:Q4_0"], 307),
                                             (["map"], 307)])
def test_a_redirect_to_another_origin_is_not_followed(hostile, tmp_path: Path, command, status):
    """127.0.0.2 is another origin on the same loopback: it must never see a request."""
    there, asked_there = hostile(json_reply(200, COMPLETION if command == ["map"] else PS),
                                 host="127.0.0.2")
    here, _ = hostile(redirect(there + "{path}", status))
    args = ["map", SMOLLM, "Say {}", "--server", here] if command == ["map"] else \
        [*command, "--url", here]
    result = run_cli(*args, input="1\n", env=KEY, home=tmp_path)
    assert result.returncode == 1
    line = error_line(result)
    assert f"redirects to {there}/" in line and "not followed" in line
    assert asked_there == []


def test_a_redirect_within_the_origin_is_followed_a_few_times(hostile, tmp_path: Path):
    def respond(h: BaseHTTPRequestHandler) -> None:
        if h.path == "/api/ps":
            return redirect("/v2/api/ps", 308)(h)
        if h.path == "/v2/api/ps":
            return json_reply(200, PS)(h)
        return redirect("/loop" + h.path)(h)     # a loop, on every other path
    url, asked = hostile(respond)
    shown = run_cli("ps", "--url", url, env=KEY, home=tmp_path)
    assert shown.returncode == 0 and shown.stdout.splitlines()[1].startswith("elsewhere:Q4_0")
    assert [a[1] for a in asked] == ["/api/ps", "/v2/api/ps"]
    assert all(a[2].get("Authorization") == "Bearer sk-secret" for a in asked)
    asked.clear()
    looped = run_cli("ps", "--url", url + "/x", home=tmp_path)
    assert looped.returncode == 1
    assert "redirected more than 5 times" in error_line(looped) and len(asked) == 6


# -- 16: bounded time, bounded memory, one line for what is not the API ---------------------------
def cli_with(limits: str, *args: str, home: Path, input: str | None = None,
             timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI in a subprocess, as run_cli runs it, with `limits` (Python statements) applied
    first: the clients' time limits made short enough for a test. And how long it took."""
    code = f"import sys\n{limits}\nfrom localinfer.cli.app import main\nmain(sys.argv[1:])"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code, *args], input=input,
                            stdin=None if input is not None else subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1"})
    return result, time.monotonic() - started


SHORT = ("from localinfer.cli import http_client, server_client, map_remote\n"
         "server_client.LIMITS = map_remote.LIMITS = http_client.Limits(1.5, 1.5, 4 << 20)")


def trickle(head: bytes, every_s: float = 0.25, for_s: float = 8) -> Respond:
    """`head`, then one byte every `every_s`: each read in time, the reply never whole."""
    def respond(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(head)
        h.wfile.flush()
        end = time.monotonic() + for_s
        while time.monotonic() < end:
            time.sleep(every_s)
            h.wfile.write(b" ")
            h.wfile.flush()
    return respond


TRICKLES = {"status": b"HTTP/1.1 200", "headers": b"HTTP/1.1 200 OK\r\nX-A: ",
            "body": b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{\"models\": ["}


@pytest.mark.parametrize("command, where", [(["ps"], "status"), (["ps"], "headers"),
                                            (["stop", "x"], "body"), (["map"], "body")])
def test_a_trickling_server_holds_nobody_past_the_deadline(hostile, tmp_path, where, command):
    url, _ = hostile(trickle(TRICKLES[where]))
    args = ["map", SMOLLM, "Say {}", "--server", url] if command == ["map"] else \
        [*command, "--url", url]
    result, took = cli_with(SHORT, *args, input="1\n", home=tmp_path)
    assert result.returncode == 1
    assert "no complete answer in the time allowed (1.5 s to begin, 1.5 s to finish)" in \
        error_line(result)
    assert took < 6, took


def test_the_wait_for_an_answer_and_the_reply_are_timed_apart():
    """map's request waits long for its reply to begin (the generation, the queue), and then the
    reply comes at once: a server silent for a while then quick is answered, a quick start
    and then a trickle is not."""
    from localinfer.cli import http_client
    limits = http_client.Limits(wait_s=2.5, reply_s=0.5, max_bytes=1 << 20)

    def late(h: BaseHTTPRequestHandler) -> None:
        time.sleep(1.0)
        json_reply(200, PS)(h)
    with _serving(late) as url:
        assert http_client.exchange(url, "/api/ps", limits=limits).json() == PS
    with _serving(trickle(TRICKLES["body"], every_s=0.1, for_s=3)) as url:
        started = time.monotonic()
        with pytest.raises(LocalinferError, match="no complete answer in the time allowed"):
            http_client.exchange(url, "/api/ps", limits=limits)
        assert time.monotonic() - started < 1.5


def huge(declared: bool) -> Respond:
    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        if declared:
            h.send_header("Content-Length", str(300 << 20))
        h.end_headers()
        block = b'{"models": [' + b" " * ((1 << 20) - 12)
        for _ in range(300):
            h.wfile.write(block)
            block = b" " * (1 << 20)
    return respond


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "streamed"])
def test_a_300_mb_reply_is_not_read(hostile, tmp_path: Path, declared: bool):
    """Its peak memory is measured in a process of its own (one child: the CLI)."""
    url, _ = hostile(huge(declared))
    measure = ("import resource, subprocess, sys\n"
               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
               "sys.stderr.write(r.stderr)")
    result = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "localinfer",
                             "ps", "--url", url], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "LOCALINFER_HOME": str(tmp_path)})
    code, peak_kb = map(int, result.stdout.split())
    assert code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"{url}/api/ps answered with more than 4.2 MB; not read" in result.stderr
    assert peak_kb < 150_000, peak_kb


NOT_PS = {"a list": [1, 2], "models, a string": {"models": "x"}, "a number": {"models": [1]},
          "a name, a number": {"models": [{"name": 3}]},
          "a size, text": {"models": [{"name": "a", "size": "big"}]},
          "a size, huge": {"models": [{"name": "a", "size": 10 ** 30}]},
          "a size, negative": {"models": [{"name": "a", "size": -5}]},
          "a context, text": {"models": [{"name": "a", "context_length": "4k"}]},
          "expiry, a number": {"models": [{"name": "a", "expires_at": 3}]}}


@pytest.mark.parametrize("command", ["ps", "stop"])
def test_a_reply_that_is_not_ollamas_shape_is_one_line(hostile, tmp_path, command):
    url, _ = hostile(json_reply(200, NOT_PS["a size, text"]))   # was a TypeError
    result = run_cli(*([command, "x"] if command == "stop" else [command]), "--url", url,
                     home=tmp_path)
    assert result.returncode == 1
    assert "is it a localinfer or Ollama server?" in error_line(result)


@pytest.mark.parametrize("reply", NOT_PS.values(), ids=NOT_PS)
def test_every_shape_ps_and_stop_read_is_checked(reply):
    from localinfer.cli import server_client
    with _serving(json_reply(200, reply)) as url, \
            pytest.raises(LocalinferError, match="is it a localinfer or Ollama server?"):
        server_client.ps(url, 8080)


def raw_reply(payload: bytes, status: bytes = b"200 OK", length: bool = True) -> Respond:
    def respond(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.1 " + status + b"\r\n")
        if length:
            h.wfile.write(b"Content-Length: %d\r\n" % len(payload))
        h.wfile.write(b"\r\n" + payload)
    return respond


NOT_HTTP = {"html": raw_reply(b"<html>hi</html>"), "not utf-8": raw_reply(b'{"a": "\xff"}'),
            "nested": raw_reply(b"[" * 200_000 + b"]" * 200_000),
            "no status": raw_reply(b"", status=b"", length=False),
            "not http": lambda h: h.wfile.write(b"SSH-2.0-OpenSSH\r\n\r\n"),
            "bad chunk": lambda h: h.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"
                                                 b"\r\n\r\nzz\r\n"),
            "cut short": lambda h: h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{"),
            "many headers": lambda h: h.wfile.write(b"HTTP/1.1 200 OK\r\n" +
                                                    b"X-A: 1\r\n" * 200 + b"\r\n")}


def test_a_reply_that_is_not_http_is_one_line(hostile, tmp_path):
    url, _ = hostile(NOT_HTTP["not http"])
    result = run_cli("ps", "--url", url, home=tmp_path)
    assert result.returncode == 1
    assert "did not answer as an HTTP server does" in error_line(result)


@pytest.mark.parametrize("respond", NOT_HTTP.values(), ids=NOT_HTTP)
def test_a_reply_that_is_not_json_or_not_http_is_a_localinfer_error(respond):
    from localinfer.cli import server_client
    with _serving(respond) as url, pytest.raises(LocalinferError):
        server_client.ps(url, 8080)


NOT_OPENAI = {"a list": [1], "choices, a string": {"choices": "x"},
              "a choice, a string": {"choices": ["x"]},
              "a message, a string": {"choices": [{"message": "hi"}]},
              "content, a number": {"choices": [{"message": {"content": 5}}]},
              "finish, a list": {"choices": [{"message": {"content": "a"}, "finish_reason": []}]},
              "usage, a string": {"choices": [{"message": {"content": "a"}}], "usage": "x"},
              "tokens, text": {"choices": [{"message": {"content": "a"}}],
                               "usage": {"completion_tokens": "3"}},
              "closed, text": {"choices": [{"message": {"content": "a"}, "closed_early": True,
                                            "closed_tokens": "3"}]},
              "trace, a dict": {"choices": [{"message": {"content": "",
                                                         "reasoning_content": {}}}]}}


def test_map_ends_in_one_line_on_a_reply_that_is_not_openais(hostile, tmp_path):
    url, _ = hostile(json_reply(200, NOT_OPENAI["a choice, a string"]))   # was AttributeError
    result = run_cli("map", SMOLLM, "Say {}", "--server", url, input="1\n", home=tmp_path)
    assert result.returncode == 1
    assert "did not answer as OpenAI's API does (no choices)" in error_line(result)


@pytest.mark.parametrize("reply", NOT_OPENAI.values(), ids=NOT_OPENAI)
@pytest.mark.parametrize("raw", [False, True], ids=["chat", "raw"])
def test_every_shape_map_reads_is_checked(reply, raw):
    from localinfer.cli import map_remote
    remote = map_remote.Remote("", SMOLLM, "{}", None, raw, _Params(), 8, (), None, _Think())
    with _serving(json_reply(200, reply)) as url, \
            pytest.raises(LocalinferError, match="did not answer as OpenAI's API does"):
        dataclasses.replace(remote, base=url).answer("1", 0)


class _Params:
    temperature, top_k, top_p, min_p, repeat_penalty, seed = 0.0, 40, 0.9, 0.05, 1.0, None
    frequency_penalty = presence_penalty = 0.0
    logit_bias = ()


class _Think:
    think = budget = None


@pytest.mark.parametrize("retry_after", ["99999", "nan"])
def test_a_full_queue_is_waited_out_for_a_bounded_time(hostile, tmp_path, retry_after):
    url, asked = hostile(json_reply(429, {"error": "queue full"}, {"Retry-After": retry_after}))
    result, took = cli_with("from localinfer.cli import map_remote\n"
                            "map_remote.BUSY_WAIT_S = 1.5\nmap_remote.BUSY_TRIES = 5",
                            "map", SMOLLM, "Say {}", "--server", url, input="1\n",
                            home=tmp_path, timeout=30)
    assert result.returncode == 1
    assert f"{url} stayed busy (429) for " in error_line(result)
    assert took < 6 and 1 < len(asked) <= 5


def test_ctrl_c_ends_map_with_requests_under_way(hostile, tmp_path: Path):
    """A server that never answers: Ctrl-C ends map at once, its requests too."""
    url, asked = hostile(lambda h: time.sleep(30))
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "map", SMOLLM, "Say {}",
                             "--server", url, "--parallel", "2"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "LOCALINFER_HOME": str(tmp_path)})
    try:
        proc.stdin.write(b"1\n2\n3\n")
        proc.stdin.close()
        deadline = time.monotonic() + 20
        while len(asked) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        assert time.monotonic() - started < 3
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _serving(respond: Respond):
    """A hostile server for a test that is not given the fixture (its own, short-lived)."""
    handler = type("Handler", (_Handler,), {"respond": staticmethod(respond), "asked": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(POLL_S,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
