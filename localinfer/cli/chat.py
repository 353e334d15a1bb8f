"""Interactive multi-turn chat: line editing and history from readline, replies streamed.

The whole conversation is re-rendered through the chat template each turn; the KV cache keeps the
common prefix, so only the new message and the template tokens around it are evaluated.
"""

from __future__ import annotations

import sys

from localinfer import settings
from localinfer.cache import prompt_cache
from localinfer.cli import console, shell
from localinfer.engine import chat_window
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.prompt import chat_tokens, raw_tokens
from localinfer.engine.sampling import Sampler
from localinfer.errors import ContextOverflow

HELP = "commands: /exit, /clear (forget the conversation), /system TEXT (set the system message)"


def repl(loaded: LoadedModel, sampler: Sampler, *, system: str | None, limits: Limits,
         verbose: bool = False, use_cache: bool = True) -> None:
    session = loaded.session
    if not session.chat_template:
        console.warn("this model has no chat template; chat sends each message as raw text")
    history_file = _setup_readline()
    cache = KVCache(session, prompt_cache.open_for(session, enabled=use_cache))
    messages: list[dict[str, str]] = []
    console.note(f"{loaded.ref.display} ready · {HELP}")
    if verbose:
        from localinfer.cli.gpu import say_offload
        say_offload(loaded)
    prompt = ">>> " if console.interactive(sys.stdin) else ""   # no prompts mixed into piped output
    while True:
        try:
            line = shell.chat_line(lambda: input(prompt))
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
            tokens = _fitted_tokens(session, system, messages, limits)
            reply = _reply(cache, tokens, sampler, limits, loaded, verbose)
        except ContextOverflow as e:
            messages.pop()      # the chat goes on; the user can /clear or ask something shorter
            console.error(f"{e}; /clear starts a new conversation")
            continue
        messages.append({"role": "assistant", "content": reply})
    _save_history(history_file)


def _conversation(system: str | None, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def _fitted_tokens(session, system: str | None, messages: list[dict[str, str]],
                   limits: Limits) -> list[int]:
    """The prompt for the next reply; when the history outgrows the context, the oldest turns go
    (in place, from `messages`) and the rest is evaluated again."""
    if not session.chat_template:
        return raw_tokens(session, messages[-1]["content"])
    limit = session.n_ctx - chat_window.reserve(session.n_ctx, limits.max_tokens)
    tokens, dropped = chat_window.fit(
        messages, lambda kept: chat_tokens(session, _conversation(system, kept)), limit)
    if dropped:
        del messages[:dropped]
        console.note(f"the conversation outgrew the context: dropped the {dropped} oldest "
                     f"message{'s' if dropped > 1 else ''}" + (" (the system message stays)" if system else ""))
    return tokens


def _reply(cache: KVCache, tokens: list[int], sampler: Sampler, limits: Limits,
           loaded: LoadedModel, verbose: bool) -> str:
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
    prompt_cache.persist(cache, notify=console.note if verbose else None)
    if verbose:
        from localinfer.cli.shell import format_stats
        console.note(format_stats(generation.stats, loaded))
        if cache.store is not None:
            console.note(prompt_cache.describe(cache.last_event))
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
