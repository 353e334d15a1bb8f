"""Interactive multi-turn chat: line editing and history from readline, replies streamed.

The whole conversation is re-rendered through the chat template each turn; the KV cache keeps the
common prefix, so only the new message and the template tokens around it are evaluated.
"""

from __future__ import annotations

import sys

from localinfer import console, runner, settings
from localinfer.decode import Generation, KVCache, Limits
from localinfer.errors import ContextOverflow
from localinfer.sampling import Sampler

HELP = "commands: /exit, /clear (forget the conversation), /system TEXT (set the system message)"


def repl(loaded: runner.LoadedModel, sampler: Sampler, *, system: str | None, limits: Limits,
         verbose: bool = False) -> None:
    session = loaded.session
    if not session.chat_template:
        console.warn("this model has no chat template; chat sends each message as raw text")
    history_file = _setup_readline()
    cache = KVCache(session)
    messages: list[dict[str, str]] = []
    console.note(f"{loaded.ref.display} ready · {HELP}")
    prompt = ">>> " if console.interactive(sys.stdin) else ""   # no prompts mixed into piped output
    while True:
        try:
            line = input(prompt)
        except EOFError:
            sys.stderr.write("\n")
            break
        except KeyboardInterrupt:
            sys.stderr.write("\n")
            continue
        command, _, arg = line.strip().partition(" ")
        if command in ("/exit", "/quit", "/bye"):
            break
        if command == "/clear":
            messages.clear()
            cache.clear()
            console.note("conversation cleared")
            continue
        if command == "/system":
            system = arg.strip() or None
            messages.clear()
            console.note("system message set; conversation restarted" if system
                         else "system message removed; conversation restarted")
            continue
        if command.startswith("/"):
            console.note(f"unknown command {command}; {HELP}")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _reply(cache, _conversation(system, messages), sampler, limits, loaded, verbose)
        except ContextOverflow as e:
            messages.pop()      # the chat goes on; the user can /clear or ask something shorter
            console.error(f"{e}; /clear starts a new conversation")
            continue
        messages.append({"role": "assistant", "content": reply})
    _save_history(history_file)


def _conversation(system: str | None, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def _reply(cache: KVCache, messages: list[dict[str, str]], sampler: Sampler, limits: Limits,
           loaded: runner.LoadedModel, verbose: bool) -> str:
    session = cache.session
    if session.chat_template:
        tokens = runner.chat_tokens(session, messages)
    else:
        tokens = runner.raw_tokens(session, messages[-1]["content"])
    generation = Generation(cache, tokens, sampler, limits)
    pieces = []
    try:
        for piece in generation:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        generation.stats.finish_reason = "interrupted"   # Ctrl-C ends the reply, not the chat
    sys.stdout.write("\n")
    if verbose:
        from localinfer.cli import format_stats
        console.note(format_stats(generation.stats, loaded))
    return "".join(pieces).strip()


def _setup_readline():
    try:
        import readline
    except ImportError:   # Windows without pyreadline: plain input() still works
        return None
    path = settings.load().chat_history
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            readline.read_history_file(path)
    except OSError:
        return None
    readline.set_history_length(1000)
    return path


def _save_history(path) -> None:
    if path is None:
        return
    import readline
    try:
        readline.write_history_file(path)
    except OSError:
        pass
