"""Claude Code and OpenCode, installed from npm, each run non-interactively with its DEFAULT tools
against `localinfer serve smollm2` (issue 43, items 2 to 5): a two-turn session with one tool call
and its result must complete. Opt-in (`pytest -m agents`): it installs the agents into
~/.cache/localinfer-tests/agents-npm and runs for minutes (Claude Code's first request is about
19k tokens); skipped with the reason when npm or the registry cannot be reached.

SmolLM2 is tiny, so what is judged is the protocol, not the answers. The agent talks to the
server through a recording proxy (this file), which keeps the run deterministic: it caps each
request's max_tokens; on the first request that carries tools it names a read-only tool in
`tool_choice` (the model must then call it), and on a request that carries a tool's result it
sends `tool_choice` none and stops at the first sentence (the model must then answer, and within
max_tokens, which Claude Code would otherwise ask to continue), so that the session is two turns. SmolLM2
left to choose kept calling tools (31 turns of Claude Code in 14 minutes). Everything else
reaches the server as the agent sent it; past MAX_REQUESTS the proxy answers a 500, so that a
looping agent ends the test quickly with what it sent. With LOCALINFER_CAPTURE_AGENTS=1 the
first request with tools is written to tests/data/agents/, which tests/test_agent_schemas.py
replays without npm."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from agent_proxy import Forwarding
from test_serve_thinking import _stop

from helpers import start_server

pytestmark = pytest.mark.agents

NPM_DIR = Path.home() / ".cache" / "localinfer-tests" / "agents-npm"
AGENTS = Path(__file__).parent / "data" / "agents"
PACKAGES = ("@anthropic-ai/claude-code", "opencode-ai")
READ_ONLY = ("Read", "read", "Glob", "LS", "glob", "list")
MAX_TOKENS = 160
MAX_REQUESTS = 12
CTX = "32768"


def _installed() -> Path:
    """The agents' bin directory, installed once (npm's own client); a skip when it cannot be."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the real agents cannot be fetched")
    bin_dir = NPM_DIR / "node_modules" / ".bin"
    if not all((bin_dir / b).exists() for b in ("claude", "opencode")):
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix",
                               str(NPM_DIR), *PACKAGES], capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            pytest.skip(f"npm could not install {', '.join(PACKAGES)} (registry unreachable?): "
                        f"{done.stderr.strip().splitlines()[-1:]}")
    return bin_dir


class _Recorder(Forwarding):
    """Forwards to the server, streaming the reply through; records each JSON body."""

    seen: list[tuple[str, dict]]
    forced: list[bool]

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if len(self.seen) >= MAX_REQUESTS:
            self.send_error(500, "the test's proxy: too many requests")
            return
        if isinstance(body, dict):
            self.seen.append((self.path, json.loads(raw)))
            body = self._steered(body)
            raw = json.dumps(body).encode()
        self._forward("POST", raw)

    def do_GET(self):
        self._forward("GET", None)

    def do_HEAD(self):
        self._forward("HEAD", None)

    def _steered(self, body: dict) -> dict:
        if isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], MAX_TOKENS)
        tools = body.get("tools") or []
        names = [t.get("name") or t.get("function", {}).get("name") for t in tools]
        pick = next((n for n in READ_ONLY if n in names), None)
        anthropic = "input_schema" in json.dumps(tools)
        if pick and _has_result(body):
            body["tool_choice"] = {"type": "none"} if anthropic else "none"
            # its first sentence: an answer cut by max_tokens makes Claude Code ask again
            body["stop_sequences" if anthropic else "stop"] = [".", "\n"]
        elif pick and not self.forced:
            self.forced.append(True)
            body["tool_choice"] = {"type": "tool", "name": pick} if anthropic else \
                {"type": "function", "function": {"name": pick}}
        return body


def _has_result(body: dict) -> bool:
    text = json.dumps(body.get("messages", []))
    return '"tool_result"' in text or '"role": "tool"' in text


@pytest.fixture(scope="module")
def served(models_home):
    proc, url = start_server("smollm2", "--ctx", CTX, "--rope-scaling", "yarn",
                             "--parallel", "1")
    try:
        yield url
    finally:
        _stop(proc)


def _proxy(url: str):
    host, port = url.removeprefix("http://").split(":")
    seen: list[tuple[str, dict]] = []
    handler = type("Recorder", (_Recorder,), {"upstream": (host, int(port)), "seen": seen,
                                              "forced": [], "replies": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.replies = handler.replies
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", seen


def _judge(seen: list[tuple[str, dict]], name: str, result: subprocess.CompletedProcess,
           replies: list[str]) -> None:
    """The session completed: the agent exited 0 after a request that carried the tool's
    result; the first request with tools is kept as a fixture when asked."""
    with_tools = [b for _, b in seen if b.get("tools")]
    said = (result.stdout[-1500:], result.stderr[-1500:], [r[-300:] for r in replies[-4:]])
    assert with_tools, said
    if os.environ.get("LOCALINFER_CAPTURE_AGENTS"):
        AGENTS.mkdir(parents=True, exist_ok=True)
        (AGENTS / f"{name}.json").write_text(json.dumps(with_tools[0], indent=1) + "\n")
    assert len(seen) < MAX_REQUESTS and result.returncode == 0, said
    assert any(_has_result(b) for b in with_tools), said


def test_claude_code_completes_a_session_with_a_tool_call(served, tmp_path):
    bin_dir = _installed()
    server, url, seen = _proxy(served)
    env = {**os.environ, "HOME": str(tmp_path), "PWD": str(tmp_path), "ANTHROPIC_BASE_URL": url,
           "ANTHROPIC_API_KEY": "x", "ANTHROPIC_MODEL": "smollm2",
           "ANTHROPIC_SMALL_FAST_MODEL": "smollm2", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "IS_SANDBOX": "1", "API_TIMEOUT_MS": "900000"}
    (tmp_path / "notes.txt").write_text("The answer is 42.\n")
    try:
        result = subprocess.run([str(bin_dir / "claude"), "-p", "Read notes.txt.",
                                 "--output-format", "json"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=900)
    finally:
        server.shutdown()
    _judge(seen, "claude-code", result, server.replies)


def test_opencode_completes_a_session_with_a_tool_call(served, tmp_path):
    bin_dir = _installed()
    server, url, seen = _proxy(served)
    config = {"$schema": "https://opencode.ai/config.json", "model": "localinfer/smollm2",
              "provider": {"localinfer": {"npm": "@ai-sdk/openai-compatible",
                                          "name": "localinfer",
                                          "options": {"baseURL": url + "/v1", "apiKey": "x"},
                                          "models": {"smollm2": {"name": "smollm2"}}}}}
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    (tmp_path / "notes.txt").write_text("The answer is 42.\n")
    # PWD too: OpenCode takes its workspace from it, not from the process's directory
    env = {**os.environ, "HOME": str(tmp_path), "PWD": str(tmp_path),
           "OPENCODE_CONFIG": str(tmp_path / "opencode.json"), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    try:
        result = subprocess.run([str(bin_dir / "opencode"), "run", "Read notes.txt."],
                                cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=900)
    finally:
        server.shutdown()
    _judge(seen, "opencode", result, server.replies)
