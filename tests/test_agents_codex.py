"""Codex CLI (`@openai/codex` from npm) run as a user runs it, non-interactively (`codex exec`),
against `localinfer serve` on SmolLM2 with its context raised for Codex's prompt: a two-turn
session (the second turn `exec resume`) in which the model calls Codex's default shell tool and
gets its result back, through /v1/responses; and Codex's Ollama mode (`--oss`), which asks the
Ollama API's version first. What is judged is the protocol, not SmolLM2's answers. Skipped, with
the reason, where npm cannot install Codex.

Codex talks to the server through a recording proxy (this file) that keeps the tiny model's part
deterministic, as tests/test_agents_claude_opencode.py does: greedy sampling and a bounded
answer on every request; on the first request that asks for a command it names Codex's shell tool in
`tool_choice` (SmolLM2 left to choose called Codex's `create_goal` three times); on every other
request it sends `tool_choice` none and stops at the first sentence, so that the answer ends on
its own (a cut one is `response.incomplete`, which Codex takes as a failed turn).
Everything else reaches the server as Codex sent it, and each request body is kept in the
test's tmp_path for reading after a failure."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from agent_proxy import Forwarding
from helpers import MODELS_HOME, start_server

pytestmark = [pytest.mark.agents, pytest.mark.slow]

CODEX = "@openai/codex@0.171.0"
NPM_DIR = MODELS_HOME.parent / "agents-npm" / "codex"
MODEL = "smollm2-135m-instruct:Q4_1"
SHELL = "exec_command"              # Codex's default shell tool
ASK = ("Use the shell tool to run the command `echo localinfer-was-here`, then tell me what it "
       "printed.")
MAX_OUTPUT = 200
MAX_REQUESTS = 8


@pytest.fixture(scope="module")
def codex() -> Path:
    """The codex binary, installed once into the test cache (not globally)."""
    binary = NPM_DIR / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed, so Codex CLI cannot be")
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(NPM_DIR), "--no-audit",
                               "--no-fund", CODEX], capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not binary.exists():
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"npm could not install {CODEX}: {reason}")
    return binary


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = start_server("smollm2", "--ctx", "16384", "--rope-scaling", "yarn", "-v")
    yield url, proc
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


class _Steering(Forwarding):
    """Forwards to the server, streaming the reply through; keeps each request body."""

    kept: Path
    seen: list[dict]

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        if len(self.seen) >= MAX_REQUESTS:
            self.send_error(500, "the test's proxy: too many requests")
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            self.seen.append(body)
            (self.kept / f"{len(self.seen)}.json").write_text(json.dumps(body, indent=1))
            raw = json.dumps(_steered(body, first=len(self.seen) == 1)).encode()
        self._forward("POST", raw)

    def do_GET(self):
        self._forward("GET", None)


def _steered(body: dict, *, first: bool) -> dict:
    """Greedy and bounded; the shell tool named on the first request that asks for it, else
    a plain answer that ends at its first sentence."""
    body = {**body, "temperature": 0,
            "max_output_tokens": min(body.get("max_output_tokens") or MAX_OUTPUT, MAX_OUTPUT)}
    names = [t.get("name") for t in body.get("tools") or ()]
    if first and SHELL in names and not _has_result(body) and "echo" in json.dumps(body["input"]):
        body.update(tool_choice={"type": "function", "name": SHELL}, parallel_tool_calls=False)
    else:
        body.update(tool_choice="none", stop=[".", "\n"])
    return body


def _has_result(body: dict) -> bool:
    return any(isinstance(i, dict) and i.get("type") == "function_call_output"
               for i in body.get("input") or ())


@pytest.fixture
def proxy(server, tmp_path):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    kept = tmp_path / "requests"
    kept.mkdir()
    handler = type("Steering", (_Steering,), {"upstream": (host, int(port)), "kept": kept,
                                              "seen": [], "replies": []})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}", handler
    proxy.shutdown()


def _run(codex: Path, home: Path, *args: str, env: dict | None = None,
         timeout: float = 900) -> tuple[list[dict], subprocess.CompletedProcess]:
    """`codex exec --json ARGS` in a scratch directory with its own CODEX_HOME (nothing written
    to the user's): the JSON events it printed, and the process."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    full_env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / "codex"),
                "NO_COLOR": "1", **(env or {})}
    (home / "codex").mkdir(exist_ok=True)
    done = subprocess.run([str(codex), "exec", "--json", "--skip-git-repo-check",
                           "--dangerously-bypass-approvals-and-sandbox", *args],
                          cwd=work, env=full_env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    events = []
    for line in done.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events, done


def _provider(url: str) -> list[str]:
    """Codex's config for a provider that speaks the Responses API at the server."""
    return ["-c", "model_provider=localinfer",
            "-c", f'model_providers.localinfer={{name="localinfer",base_url="{url}/v1",'
                  f'wire_api="responses",request_max_retries=0,stream_max_retries=0}}',
            "-m", MODEL]


def _said(events: list[dict], done: subprocess.CompletedProcess, handler) -> tuple:
    return events, done.stderr[-2000:], [r[-400:] for r in handler.replies[-3:]]


def test_a_two_turn_codex_session_with_a_shell_call(codex, proxy, tmp_path):
    url, handler = proxy
    first, done = _run(codex, tmp_path, *_provider(url), ASK)
    assert done.returncode == 0, _said(first, done, handler)
    kinds = [e.get("type") for e in first]
    assert "thread.started" in kinds and "turn.completed" in kinds, kinds
    commands = [e["item"] for e in first if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert commands, first
    assert any(_has_result(b) for b in handler.seen), first
    second, done = _run(codex, tmp_path, *_provider(url), "resume", "--last",
                        "What did the command print?")
    assert done.returncode == 0, _said(second, done, handler)
    assert "turn.completed" in [e.get("type") for e in second], second
    # the second turn carried the first's call and its result back to the server
    last = handler.seen[-1]
    assert _has_result(last) and "What did the command print?" in json.dumps(last["input"])


def test_codex_s_ollama_mode_accepts_the_server(codex, proxy, tmp_path):
    url, handler = proxy
    events, done = _run(codex, tmp_path, "--oss", "--local-provider", "ollama", "-m", MODEL,
                        "Say hello.", env={"CODEX_OSS_BASE_URL": url + "/v1"})
    assert done.returncode == 0, _said(events, done, handler)
    assert "too old" not in done.stderr
    assert "turn.completed" in [e.get("type") for e in events], events
