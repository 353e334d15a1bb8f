"""`localinfer launch claude|codex|opencode [MODEL]` (issue 43, item 7): the settings each agent
gets (--print), the one-line refusals, and a whole run with a fake agent on PATH (the boundary:
a script standing in for the npm binary) that records its environment and arguments and makes
one real request to the `serve` that launch started, which stops when the agent exits."""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import sys
from pathlib import Path

import pytest
from helpers import ERROR, SMOLLM, error_line, free_port, run_cli

from localinfer.cli import launch


def cli(capsys, *args: str, env: dict | None = None) -> tuple[int, str, str]:
    """The CLI in-process: (exit code, stdout, stderr)."""
    from localinfer.cli.app import main
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with pytest.raises(SystemExit) as end:
            main(list(args))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = capsys.readouterr()
    return end.value.code or 0, out, err


def exports(text: str) -> dict[str, str]:
    """The variables a --print snippet exports, as a shell would read them."""
    found = {}
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            found[name] = shlex.split(value)[0] if value else ""
    return found


def test_print_claude_sets_the_anthropic_variables_for_one_run(capsys):
    port = free_port()          # nothing listens: the snippet says to start the server
    code, out, err = cli(capsys, "launch", "claude", "qwen2.5-1.5b", "--port", str(port),
                         "--print", env={"LOCALINFER_API_KEY": ""})
    assert code == 0 and err == "", err
    assert f"localinfer serve qwen2.5-1.5b --port {port}" in out.splitlines()[0]
    env = exports(out)
    assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"       # no /v1: it adds it
    assert env["ANTHROPIC_API_KEY"] == "" and env["ANTHROPIC_AUTH_TOKEN"]
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "qwen2.5-1.5b"
    # without it each request's system prompt starts with a new hash: no prefix is reused
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert out.splitlines()[-1] == "claude"


def test_print_codex_and_opencode_name_an_openai_compatible_provider(capsys):
    port = free_port()
    code, out, _ = cli(capsys, "launch", "codex", "m1", "--port", str(port), "--print", "--",
                       "exec", "say hi", env={"LOCALINFER_API_KEY": ""})
    assert code == 0
    words = shlex.split(out.splitlines()[-1])
    overrides = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-c")
    assert words[0] == "codex" and words[-2:] == ["exec", "say hi"]     # after --: the agent's
    assert json.loads(overrides["model_providers.localinfer.wire_api"]) == "responses"
    assert json.loads(overrides["model_providers.localinfer.base_url"]) == \
        f"http://127.0.0.1:{port}/v1"
    assert json.loads(overrides["model"]) == "m1"
    code, out, _ = cli(capsys, "launch", "opencode", "m1", "--port", str(port), "--print")
    config = json.loads(exports(out)["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["localinfer"]
    assert provider["options"]["baseURL"] == f"http://127.0.0.1:{port}/v1"
    assert config["model"] == "localinfer/m1" and "m1" in provider["models"]
    assert out.splitlines()[-1] == "opencode"


def test_dashes_keep_the_agents_arguments_out_of_model(capsys):
    # --debug after -- is the agent's (Claude Code has one), not taken by localinfer
    code, out, _ = cli(capsys, "launch", "claude", "m1", "--port", str(free_port()), "--print",
                       "--", "-p", "hello there", "--debug")
    assert code == 0 and exports(out)["ANTHROPIC_MODEL"] == "m1"
    assert out.splitlines()[-1] == "claude -p 'hello there' --debug"


@pytest.mark.parametrize("args, code, words", [
    (("launch", "cursor", "m1"), 2, "unknown agent 'cursor'; choose one of: claude, codex, "
                                    "opencode"),
    (("launch", "claude", "--print"), 2, "name a MODEL (no server answers on"),
])
def test_usage_errors_are_one_line(capsys, args, code, words):
    got, out, err = cli(capsys, *args, "--port", str(free_port()))
    assert got == code and out == ""
    assert err.startswith(ERROR) and err.count("\n") == 1 and words in err, err


def test_a_missing_agent_says_how_to_install_it(capsys, tmp_path: Path):
    got, out, err = cli(capsys, "launch", "codex", "m1", "--port", str(free_port()),
                        env={"PATH": str(tmp_path)})
    assert got == 1 and out == ""
    assert err == f"{ERROR}codex (Codex CLI) is not installed: install it with " \
                  "`npm install -g @openai/codex`\n"


def test_a_port_held_by_something_else_is_one_line(tmp_path: Path):
    # Something that speaks no HTTP holds the port: launch does not take it for a server, and the
    # serve it starts says the port is in use (no model is looked at before that).
    fake = _fake_agent(tmp_path, "claude")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("launch", "claude", "m1", "--port", str(port), home=tmp_path,
                         env={"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in error_line(result)
    assert not (tmp_path / "record.json").exists()       # the agent never ran


FAKE_AGENT = r'''#!{python}
"""A stand-in for an agent's binary: records its environment and arguments, then makes one
request to the server it was pointed at, as the agent's first would be."""
import json, os, sys, urllib.request
record = {{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
                                       if k.startswith(("ANTHROPIC", "OPENCODE", "CLAUDE"))}}}}
base = os.environ["ANTHROPIC_BASE_URL"]
body = {{"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 4, "temperature": 0,
        "messages": [{{"role": "user", "content": "Say hi."}}]}}
request = urllib.request.Request(base + "/v1/messages", json.dumps(body).encode(),
                                 {{"Content-Type": "application/json",
                                  "Authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"]}})
with urllib.request.urlopen(request, timeout=120) as reply:
    record["reply"] = json.loads(reply.read())
open({out!r}, "w").write(json.dumps(record))
sys.exit(3)
'''


def _fake_agent(directory: Path, name: str) -> Path:
    path = directory / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(FAKE_AGENT.format(python=sys.executable, out=str(directory / "record.json")))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_launch_starts_serve_runs_the_agent_and_stops_serve(models_home, tmp_path: Path):
    fake = _fake_agent(tmp_path, "claude")
    port = free_port()
    result = run_cli("launch", "claude", SMOLLM, "--port", str(port), "--", "-p", "hi",
                     env={"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"},
                     home=models_home)
    assert result.returncode == 3, result.stderr          # the agent's own exit code
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["argv"] == ["-p", "hi"]
    assert record["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert record["reply"]["type"] == "message" and record["reply"]["content"]
    # serve says what it chose, and SmolLM2's context is too short for Claude Code: a warning
    assert "8,192 tokens of context" in result.stderr
    assert f"has a context of 8,192 tokens; Claude Code's first request" in result.stderr
    with socket.socket() as probe:        # the server it started is gone with the agent
        assert probe.connect_ex(("127.0.0.1", port)) != 0


SLEEPING_AGENT = r'''#!{python}
import pathlib, time
pathlib.Path({out!r}).write_text("started")
time.sleep(600)
'''


def test_sigterm_stops_the_agent_and_the_serve_launch_started(models_home, tmp_path: Path):
    import signal
    import subprocess
    import time
    agent = tmp_path / "bin" / "claude"
    agent.parent.mkdir()
    agent.write_text(SLEEPING_AGENT.format(python=sys.executable, out=str(tmp_path / "started")))
    agent.chmod(agent.stat().st_mode | stat.S_IXUSR)
    port = free_port()
    env = {**os.environ, "LOCALINFER_HOME": str(models_home), "NO_COLOR": "1",
           "PATH": f"{agent.parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "launch", "claude", SMOLLM,
                             "--port", str(port)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    with socket.socket() as probe:        # the server it started is gone too
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_agent_table_names_the_npm_packages():
    assert {a: v.package for a, v in launch.AGENTS.items()} == {
        "claude": "@anthropic-ai/claude-code", "codex": "@openai/codex",
        "opencode": "opencode-ai"}
