"""`launch AGENT [MODEL]`: a coding agent (Claude Code, Codex CLI, OpenCode) run against `serve`,
as `ollama launch` runs one against Ollama.

It finds a server on the port that serves the model, or starts `serve MODEL` there, then runs
the agent with its settings for that run alone: environment variables and command-line overrides
(Codex's `-c`, OpenCode's OPENCODE_CONFIG_CONTENT), so no file of the user's or ours is written.
The server it started stops when the agent exits, and on Ctrl-C. `--print` shows the settings
instead, for people who start the agent themselves.

The agent has the terminal while it runs: Ctrl-C is its own (Claude Code interrupts a turn with
it), so the server runs in a session of its own that the terminal's signals do not reach, and
this process ignores SIGINT until the agent is gone.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import typer
import typer.core

from localinfer.cli import console, http_client
from localinfer.errors import EXIT_INTERRUPTED, LocalinferError, UsageError

# A server already up answers at once; one we start answers /health only once its model is in.
PROBE = http_client.Limits(wait_s=3.0, reply_s=10.0, max_bytes=4 << 20)
POLL_S = 0.2
STOP_S = 15.0           # for the server we started to finish once asked to stop
TOKEN = "localinfer"    # what the agents send as their key when serve has none (they need one)
EXTRA = "localinfer.agent_args"     # where the arguments after -- wait in click's context


@dataclass(frozen=True)
class Agent:
    title: str
    binary: str
    package: str            # its npm package
    prompt_tokens: int      # about what its first request holds with its default tools


AGENTS = {
    "claude": Agent("Claude Code", "claude", "@anthropic-ai/claude-code", 19_000),
    "codex": Agent("Codex CLI", "codex", "@openai/codex", 6_500),
    "opencode": Agent("OpenCode", "opencode", "opencode-ai", 12_000),
}


@dataclass(frozen=True)
class Setup:
    """What the agent is started with: environment variables and arguments before the user's."""

    env: dict[str, str]
    args: tuple[str, ...] = ()


def register(app: typer.Typer) -> None:
    app.command(cls=_SplitAtDashes)(launch)


def launch(
    context: typer.Context,
    agent: str = typer.Argument(..., metavar="AGENT", show_default=False,
                                help="claude (Claude Code), codex (Codex CLI) or opencode."),
    model: Optional[str] = typer.Argument(
        None, metavar="[MODEL]", show_default=False,
        help="The model to serve (as `serve MODEL` takes it); default: the one model a server "
             "on --port has loaded."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, metavar="PORT",
                             help="Port of the server to use, or to start one on (1-65535)."),
    ctx: int = typer.Option(0, "--ctx", min=0, metavar="N",
                            help="Context of the server it starts (0: serve's default, the "
                                 "trained context as far as memory allows)."),
    show: bool = typer.Option(False, "--print", help="Print the environment and command that "
                              "run the agent against the server, and start nothing."),
) -> None:
    """Run a coding agent against a local model: finds or starts `serve MODEL`, runs the agent
    with settings for this run only (nothing is written), stops the server it started when the
    agent exits. Arguments after -- go to the agent.

    \b
    Examples:
      localinfer launch claude qwen2.5-1.5b
      localinfer launch codex qwen2.5-1.5b -- exec "explain this repository"
      localinfer launch opencode qwen2.5-1.5b --print
    """
    chosen = AGENTS.get(agent)
    if chosen is None:
        raise UsageError(f"unknown agent '{console.clean(agent[:40])}'; choose one of: "
                         f"{', '.join(AGENTS)}")
    extra = tuple(context.meta.get(EXTRA, ()))
    base = f"http://127.0.0.1:{port}"
    running = _server_at(base)
    if model is None:
        model = _only_model(base, running)
    if show:            # the settings alone: a server that cannot serve MODEL is no refusal
        try:
            ctx_now = _context_of(base, model) if running else 0
        except LocalinferError:
            ctx_now, running = 0, False
        sys.stdout.write(shell_text(chosen, setup_for(agent, base, model, ctx_now), extra,
                                    base, model, running))
        return
    binary = shutil.which(chosen.binary)
    if binary is None:
        raise LocalinferError(f"{chosen.binary} ({chosen.title}) is not installed: install it "
                              f"with `npm install -g {chosen.package}`")
    signal.signal(signal.SIGTERM, _terminated)     # so that the finally below stops serve
    server = None if running else _start(model, port, ctx, base)
    try:
        n_ctx = _context_of(base, model)
        if n_ctx and n_ctx < chosen.prompt_tokens:
            console.warn(f"{model} has a context of {n_ctx:,} tokens; {chosen.title}'s first "
                         f"request is about {chosen.prompt_tokens:,}: use a model trained for "
                         "32k tokens or more (docs/agents.md)")
        setup = setup_for(agent, base, model, n_ctx)
        code = _run_agent([binary, *setup.args, *extra], setup.env)
    finally:
        if server is not None:
            _stop(server)
    raise typer.Exit(code)



class _SplitAtDashes(typer.core.TyperCommand):
    """Everything after `--` goes to the agent, never to MODEL (click would fill MODEL from it)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta[EXTRA], args = args[at + 1:], args[:at]
        return super().parse_args(ctx, args)


def setup_for(agent: str, base: str, model: str, n_ctx: int) -> Setup:
    """The agent's settings for a server at `base` serving `model` with `n_ctx` tokens of
    context (0: unknown)."""
    key = os.environ.get(http_client.KEY_ENV) or ""
    if agent == "claude":
        # Every model Claude Code may pick (its main one, the small one, sub-agents) is ours;
        # ANTHROPIC_API_KEY emptied, or a key of the user's would be sent and preferred.
        names = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL",
                 "CLAUDE_CODE_SUBAGENT_MODEL")
        # Its attribution header is a system block whose hash changes with every request: at
        # the prompt's start, it would make each turn evaluate the whole prompt again.
        return Setup({"ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": key or TOKEN,
                      "ANTHROPIC_API_KEY": "", **{name: model for name in names},
                      "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
                      "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    if agent == "codex":
        provider = {"name": "localinfer", "base_url": f"{base}/v1", "wire_api": "responses"}
        if key:
            provider["env_key"] = http_client.KEY_ENV
        pairs = [("model_provider", "localinfer"), ("model", model),
                 *((f"model_providers.localinfer.{k}", v) for k, v in provider.items())]
        if n_ctx:
            pairs.append(("model_context_window", n_ctx))
        args = [arg for k, v in pairs for arg in ("-c", f"{k}={json.dumps(v)}")]
        return Setup({}, tuple(args))
    entry: dict = {"name": model, "tool_call": True}
    if n_ctx:
        entry["limit"] = {"context": n_ctx, "output": min(8192, n_ctx // 4)}
    options = {"baseURL": f"{base}/v1", "apiKey": key or TOKEN}
    config = {"provider": {"localinfer": {"npm": "@ai-sdk/openai-compatible", "name": "localinfer",
                                          "options": options, "models": {model: entry}}},
              "model": f"localinfer/{model}", "small_model": f"localinfer/{model}"}
    return Setup({"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


def shell_text(agent: Agent, setup: Setup, extra: tuple[str, ...], base: str, model: str,
               running: bool) -> str:
    """--print's text: a shell snippet that runs the agent against the server."""
    port = base.rsplit(":", 1)[1]
    server = (f"# {agent.title} against the server on {base}" if running else
              f"# {agent.title} against `localinfer serve {shlex.quote(model)} --port {port}` "
              "(start it first)")
    lines = [server, *(f"export {name}={shlex.quote(value)}" for name, value in setup.env.items())]
    lines.append(" ".join(shlex.quote(arg) for arg in (agent.binary, *setup.args, *extra)))
    return "\n".join(lines) + "\n"


def _server_at(base: str) -> bool:
    """Whether a server answers on `base` (any HTTP answer: what it serves is asked next)."""
    try:
        http_client.exchange(base, "/health", limits=PROBE)
    except LocalinferError:
        return False
    return True


def _only_model(base: str, running: bool) -> str:
    """MODEL when it is not given: the one model the server on `base` has loaded."""
    loaded = []
    if running:
        reply = http_client.exchange(base, "/api/ps", limits=PROBE)
        answer = reply.json() if reply.status == 200 else {}
        models = answer.get("models") if isinstance(answer, dict) else None
        loaded = [m["name"] for m in models or () if isinstance(m, dict)
                  and isinstance(m.get("name"), str)]
    if len(loaded) == 1:
        return loaded[0]
    said = f"the server on {base} has {len(loaded)} models loaded" if running else \
        f"no server answers on {base}"
    raise UsageError(f"name a MODEL ({said}), e.g. `localinfer launch claude qwen2.5-1.5b`")


def _context_of(base: str, model: str) -> int:
    """The context the server gives `model` (its num_ctx in /api/show), after checking the
    server serves it; 0 when it does not say."""
    reply = http_client.exchange(base, "/api/show", {"model": model}, limits=PROBE)
    try:
        answer = reply.json()
    except ValueError:
        answer = None
    if reply.status != 200 or not isinstance(answer, dict):
        said = reply.error()[0] if reply.status != 200 else "not a localinfer or Ollama server"
        raise LocalinferError(f"the server on {base} does not serve {console.clean(model)}: "
                              f"{said}; stop it, or give --port for another")
    for line in str(answer.get("parameters") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "num_ctx" and value.strip().isdigit():
            return int(value.strip())
    return 0


def _start(model: str, port: int, ctx: int, base: str) -> subprocess.Popen:
    """`serve MODEL` on `port`, once it answers; its notes and errors on our stderr. A server
    that ends before it answers has said why: this command ends with its exit code."""
    command = [sys.executable, "-m", "localinfer", "serve", model, "--port", str(port)]
    if ctx:
        command += ["--ctx", str(ctx)]
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while not _server_at(base):
            if server.poll() is not None:
                raise typer.Exit(server.returncode or 1)
            time.sleep(POLL_S)
    except BaseException:
        _stop(server)
        raise
    return server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(STOP_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _terminated(signum: int, _frame) -> None:
    """SIGTERM (a process manager, `kill`): leave as after an error, stopping what we started
    (by default Python would end at once and leave the serve it started running)."""
    raise typer.Exit(128 + signum)


def _run_agent(command: list[str], env: dict[str, str]) -> int:
    """The agent's exit code (130 when Ctrl-C ended it). A Ctrl-C reaches the agent, which
    decides what it means; here it only interrupts the wait, which goes on. (Not SIG_IGN: an
    ignored signal stays ignored in the program it starts.) A SIGTERM is passed on to it."""
    agent = subprocess.Popen(command, env={**os.environ, **env})
    while True:
        try:
            code = agent.wait()
            break
        except KeyboardInterrupt:
            continue
        except BaseException:
            _stop(agent)
            raise
    return EXIT_INTERRUPTED if code == -signal.SIGINT else (code if code >= 0 else 1)
