"""Interactive multi-turn chat: line editing and history from readline, replies streamed.

The whole conversation is re-rendered through the chat template each turn; the KV cache keeps the
common prefix, so only the new message and the template tokens around it are evaluated. When the
conversation outgrows the context, the context grows first (the model is loaded again with a
larger one, and the prompt cache restores the conversation so far); only when it cannot grow do
the oldest turns go.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localinfer import settings
from localinfer.cache import prompt_cache
from localinfer.cli import console, shell
from localinfer.engine import chat_window
from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.prompt import chat_tokens, raw_tokens, reply_reserve, reply_room
from localinfer.engine.sampling import Sampler, SamplingParams, make_sampler
from localinfer.engine.structured import OutputFormat, incomplete
from localinfer.errors import ContextOverflow, UsageError
from localinfer.models import safe_files

# A history is for recalling recent lines, not an archive: this many, from at most this many bytes.
HISTORY_ENTRIES = 1000
HISTORY_BYTES = 1 << 20
HELP = "commands: /exit, /clear (forget the conversation), /system TEXT (set the system message)"
# The model loaded again with a context for this many tokens, or None when it cannot grow.
Grow = Callable[[LoadedModel, int], "LoadedModel | None"]


@dataclass
class _Chat:
    """The model and KV cache a conversation runs on; both change when the context grows."""

    loaded: LoadedModel
    cache: KVCache
    use_cache: bool
    grow: Grow | None

    def grow_to(self, need: int) -> None:
        before = self.loaded.session.n_ctx
        grown = self.grow(self.loaded, need) if self.grow else None
        if grown is None:
            return
        self.loaded = grown
        self.cache = KVCache(grown.session, prompt_cache.open_for(grown.session,
                                                                  enabled=self.use_cache))
        console.note(f"the conversation outgrew the context: grown from {before:,} to "
                     f"{grown.session.n_ctx:,} tokens")


def repl(loaded: LoadedModel, params: SamplingParams, *, system: str | None, limits: Limits,
         verbose: bool = False, use_cache: bool = True, grow: Grow | None = None,
         output: OutputFormat | None = None) -> None:
    """The chat loop; `grow` (None: the context is fixed) reloads the model with a larger one;
    `output` constrains every reply (each starts its grammar afresh)."""
    sampler = make_sampler(params)      # one random stream for the whole conversation
    session = loaded.session
    if not session.chat_template:
        console.warn("this model has no chat template; chat sends each message as raw text")
    history_file = _setup_readline()
    chat = _Chat(loaded, KVCache(session, prompt_cache.open_for(session, enabled=use_cache)),
                 use_cache, grow)
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
            chat.cache.clear()
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
            tokens = _fitted_tokens(chat, system, messages, limits)
            constrained = _constrained(sampler, params, output, chat.loaded)
            reply, finish = _reply(chat.cache, tokens, constrained, limits, chat.loaded, verbose)
            problem = incomplete(output, reply, finish) if output else None
            if problem:
                console.error(problem)
        except ContextOverflow as e:
            messages.pop()      # the chat goes on; the user can /clear or ask something shorter
            console.error(f"{e}; /clear starts a new conversation")
            continue
        except UsageError as e:     # a message the template cannot keep as text: this one only
            messages.pop()
            console.error(str(e))
            continue
        except KeyboardInterrupt:   # Ctrl-C before the reply began: as if it was never asked
            sys.stderr.write("\n")
            messages.pop()
            continue
        if finish == "interrupted" and not reply:
            messages.pop()      # nothing came: no empty answer in the conversation
            continue
        # An interrupted reply stays as far as it went (as Ollama keeps it): the model sees it.
        messages.append({"role": "assistant", "content": reply})
    _save_history(history_file)


def _conversation(system: str | None, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def _fitted_tokens(chat: _Chat, system: str | None, messages: list[dict[str, str]],
                   limits: Limits) -> list[int]:
    """The prompt for the next reply. When the history outgrows the context, the context grows
    (to hold it and the reply's room) where it can; then the oldest turns go (in place, from
    `messages`) and the rest is evaluated again."""
    session = chat.loaded.session
    if not session.chat_template:
        return raw_tokens(session, messages[-1]["content"])
    if chat.grow is not None:
        need = len(chat_tokens(session, _conversation(system, messages)))
        if need + reply_room(limits.max_tokens) > session.n_ctx:
            chat.grow_to(need + reply_room(limits.max_tokens))
            session = chat.loaded.session
    limit = session.n_ctx - reply_reserve(session.n_ctx, limits.max_tokens)
    tokens, dropped = chat_window.fit(
        messages, lambda kept: chat_tokens(session, _conversation(system, kept)), limit)
    if dropped:
        del messages[:dropped]
        console.note(f"the conversation outgrew the context: dropped the {dropped} oldest "
                     f"message{'s' if dropped > 1 else ''}" + (" (the system message stays)" if system else ""))
    return tokens


def growing(*, ctx: int, kv_type: str | None, memory_budget: str | None,
            gpu_layers: int | None, options) -> Grow | None:
    """How a chat's context grows: by loading the model again with a larger one that fits the
    budget (fit.request.grown); None when --ctx fixed it."""
    if ctx:
        return None

    def grow(loaded: LoadedModel, need: int) -> LoadedModel | None:
        from dataclasses import replace

        from localinfer.engine.load import load_model
        from localinfer.fit.request import grown
        placement = grown(loaded.path, n_ctx=loaded.session.n_ctx, need=need, kv_type=kv_type,
                          memory_budget=memory_budget, gpu_layers=gpu_layers)
        if placement is None:
            return None
        loaded.session.close()
        return load_model(loaded.ref, loaded.path, backend=loaded.backend, options=replace(
            options, n_ctx=placement.n_ctx, kv_type=placement.kv_type,
            gpu_layers=placement.gpu_layers))
    return grow


def _constrained(sampler: Sampler, params: SamplingParams, output: OutputFormat | None,
                 loaded: LoadedModel) -> Sampler:
    if output is None:
        return sampler
    return ConstrainedSampler(params, loaded.session.grammar(output.gbnf))


def _reply(cache: KVCache, tokens: list[int], sampler: Sampler, limits: Limits,
           loaded: LoadedModel, verbose: bool) -> tuple[str, str]:
    """Stream one reply; returns its text and why it ended."""
    generation = Generation(cache, tokens, sampler, limits)
    pieces = []
    try:
        for piece in generation:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        generation.stats.finish_reason = "interrupted"   # Ctrl-C ends the reply, not the chat
    reply = "".join(pieces).strip(), generation.stats.finish_reason
    try:
        sys.stdout.write("\n")
        prompt_cache.persist(cache, notify=console.note if verbose else None)
        if verbose:
            from localinfer.cli.shell import format_stats
            console.note(format_stats(generation.stats, loaded))
            if cache.store is not None:
                console.note(prompt_cache.describe(cache.last_event))
    except KeyboardInterrupt:   # a second Ctrl-C skips the cache write (atomic) and the figures
        sys.stderr.write("\n")
    return reply


def _setup_readline() -> Path | None:
    """Line editing, and the history of earlier chats: read as the store reads its files (never
    through a link, never a pipe, at most HISTORY_BYTES); None when there is none to keep."""
    try:
        import readline
    except ImportError:   # Windows without pyreadline: plain input() still works
        return None
    path = settings.load().chat_history
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = safe_files.read_last_lines(path, max_bytes=HISTORY_BYTES)
    except safe_files.NotAFile as e:
        console.warn(f"{e}; chat history is neither read nor kept")
        return None
    except OSError:
        return None
    for line in lines[-HISTORY_ENTRIES:]:
        # Not libedit's header, when it wrote the file, nor a NUL, which readline cannot hold.
        if line and line != "_HiStOrY_V2_" and "\0" not in line:
            readline.add_history(line)
    return path


def _save_history(path: Path | None) -> None:
    """The newest entries, written beside the file and renamed over it: a link or anything else
    that took the file's place is left as it is, and so is what a link points to."""
    if path is None:
        return
    import readline
    n = readline.get_current_history_length()
    first = max(1, n - HISTORY_ENTRIES + 1)
    entries = [readline.get_history_item(i) or "" for i in range(first, n + 1)]
    kept, size = [], 0
    for entry in reversed(entries):          # newest first, until the byte bound
        size += len(entry.encode("utf-8", "replace")) + 1
        if size > HISTORY_BYTES:
            break
        kept.append(entry)
    data = "".join(f"{entry}\n" for entry in reversed(kept) if entry)
    try:
        safe_files.replace(path, data.encode("utf-8", "replace"))
    except safe_files.NotAFile as e:
        console.warn(f"{e}; the chat history was not saved")
    except OSError:
        pass
