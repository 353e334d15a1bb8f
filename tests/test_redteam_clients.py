"""The clients we ship (`ps`, `stop`, `map --server`) against hostile servers, and what reaches a
terminal from outside (a server, a GGUF file): one line and the right exit code for whatever a
server does, and no control character from outside printed raw.

The hostile servers are small HTTP servers on 127.0.0.1 in threads of the test process; each
answer is a function of the request, and every one of them ends within a bounded time.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest
from gguf_patch import add_value, set_value
from helpers import SMOLLM, error_line, run_cli
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


@pytest.fixture
def hostile():
    """serve(respond, host) -> (url, asked): a server answering every request with `respond`."""
    servers = []

    def serve(respond: Respond, host: str = "127.0.0.1") -> tuple[str, list]:
        asked: list = []
        handler = type("Handler", (_Handler,), {"respond": staticmethod(respond), "asked": asked})
        server = ThreadingHTTPServer((host, 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
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


@pytest.mark.parametrize("command", [["ps"], ["stop", "elsewhere:Q4_0"], ["map"]])
@pytest.mark.parametrize("status", [302, 307])
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
