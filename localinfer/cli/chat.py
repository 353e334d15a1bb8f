"""Interactive multi-turn chat: line editing and history from readline, replies streamed.

The whole conversation is re-rendered through the chat template each turn; the KV cache keeps the
common prefix, so only the new message and the template tokens around it are evaluated. When the
conversation outgrows the context, the context grows first (the model is loaded again with a
larger one, and the prompt cache restores the conversation so far); only when it cannot grow do
the oldest turns go.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from localinfer import settings
from localinfer.cache import prompt_cache
from localinfer.cli import chat_input, console
from localinfer.engine import chat_window
from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.prompt import (chat_media_tokens, chat_tokens, raw_tokens, reply_reserve,
                                      reply_room)
from localinfer.engine.sampling import Sampler, SamplingParams, make_sampler
from localinfer.engine.structured import OutputFormat, answer_limit, incomplete
from localinfer.errors import ContextOverflow, UsageError
from localinfer.models import safe_files
from localinfer.thinking import setup
from localinfer.thinking.style import Think

# A history is for recalling recent lines, not an archive: this many, from at most this many bytes.
HISTORY_ENTRIES = 1000
HISTORY_BYTES = 1 << 20
# The model loaded again with a context for this many tokens, or None when it cannot grow.
Grow = Callable[[LoadedModel, int], "LoadedModel | None"]


@dataclass
class _Chat:
    """The conversation, and the model and KV cache it runs on (both change when the context
    grows)."""

    loaded: LoadedModel
    cache: KVCache
    use_cache: bool
    grow: Grow | None
    system: str | None
    messages: list[dict[str, str]] = field(default_factory=list)
    raw: bool = False          # --raw: each message sent as is, without the chat template
    think: Think = Think()     # a thinking model's --think and --think-budget
    pending: list = field(default_factory=list)    # /image, /audio: Media for the next message

    def tokens_for(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's prompt through the template, with --think's variables; a message
        that came with media (/image) keeps them, its placeholders matching the earlier turn's
        cells, so they are not encoded or evaluated again."""
        session = self.loaded.session
        extra = setup.template_vars(session.chat_template, self.think.think)
        media = [m for message in messages for m in message.get("media", ())]
        conversation = _conversation(self.system, [{k: v for k, v in m.items() if k != "media"}
                                                   for m in messages])
        tokens = chat_media_tokens(session, conversation, extra, media) if media \
            else chat_tokens(session, conversation, extra)
        return tokens + setup.empty_trace_tokens(session, tokens, self.think.think)

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
         output: OutputFormat | None = None, raw: bool = False, think: Think = Think(),
         show_trace: bool = True) -> None:
    """The chat loop; `grow` (None: the context is fixed) reloads the model with a larger one;
    `output` constrains every reply (each starts its grammar afresh); `raw` sends each message
    as is, as a model without a chat template gets it. A thinking model's trace goes to stderr
    when `show_trace`, and never into the conversation."""
    session = loaded.session
    if not session.chat_template and not raw:       # the rule the API keeps (docs/apis.md)
        raise UsageError(f"{loaded.ref.display} has no chat template, so a chat cannot tell its "
                         "turns apart; --raw sends each message as text for it to continue, "
                         "or `run` continues one prompt")
    if not raw:     # a damaged template: said before the first message rather than after it
        from localinfer.engine.templates import check_decoded
        check_decoded(session.chat_template)
    history_file = _setup_readline()
    chat = _Chat(loaded, KVCache(session, prompt_cache.open_for(session, enabled=use_cache)),
                 use_cache, grow, system, raw=raw, think=think)
    turn = _Turn(make_sampler(params), params, limits, output, verbose,   # one random stream
                 show_trace)
    console.note(f"{loaded.ref.display} ready · /help lists the commands; /bye or Ctrl-D leaves")
    if verbose:
        from localinfer.cli.gpu import say_offload
        say_offload(loaded)
    chat_input.converse(console.interactive(sys.stdin), lambda line: _command(chat, line),
                        lambda text: turn.take(chat, text), chat)
    _save_history(history_file)


def _command(chat: _Chat, line: str) -> bool:
    """Obey a /command; False when it ends the chat."""
    command, *rest = line.split(None, 1)
    if command == "/clear":
        chat.cache.clear()
    elif command in ("/image", "/audio"):
        _attach(chat, command[1:], rest[0].strip() if rest else "")
        return True
    return obey(chat, command, rest[0] if rest else "")


def obey(chat, command: str, rest: str) -> bool:
    """The commands every chat (one model's, a router's) obeys the same way, on its `messages`
    and `system`; False when the command ends the chat."""
    if command in ("/exit", "/quit", "/bye"):
        return False
    if command in ("/help", "/?"):
        console.notes(chat_input.HELP)
    elif command == "/clear":
        chat.messages.clear()
        console.note("conversation cleared")
    elif command == "/system":
        chat.system = rest.strip() or None
        chat.messages.clear()
        console.note("system message set; conversation restarted" if chat.system
                     else "system message removed; conversation restarted")
    else:
        console.note(f"unknown command {command}; /help lists the commands")
    return True


def _attach(chat: _Chat, kind: str, path: str) -> None:
    """/image PATH, /audio PATH: the medium checked now, sent with the next message."""
    from localinfer import media
    projector = getattr(chat.loaded.session, "media", None)
    able = projector is not None and (projector.vision if kind == "image" else projector.audio)
    if not path:
        console.note(f"/{kind} takes a file: /{kind} PATH")
    elif chat.raw or not able:
        console.error(f"{chat.loaded.ref.display} takes no {'images' if kind == 'image' else kind}"
                      + (" with --raw" if chat.raw else
                         " (no projector for them: name one with --mmproj FILE)"))
    else:
        try:
            chat.pending.append(media.read_path(path, "image" if kind == "image" else "audio"))
        except UsageError as e:
            console.error(str(e))
            return
        console.note(f"{path}: {chat.pending[-1].describe()}, sent with your next message")


_DROPPED = re.compile(r"(?:[\w.~-]*/)*[\w.~-]+?\.(?:png|jpe?g|gif|bmp|wav|mp3|flac)\b",
                      re.IGNORECASE)     # a path without spaces, ending in a media extension


def _dropped(chat: _Chat, text: str) -> str:
    """A path to an existing image or clip written in the message (dropped into the terminal),
    as Ollama takes it: checked, sent with the message, and taken out of its text."""
    from localinfer import media
    projector = getattr(chat.loaded.session, "media", None)
    if projector is None or chat.raw:
        return text
    for found in _DROPPED.findall(text)[:media.MAX_ITEMS]:
        path = Path(found.strip()).expanduser()
        if not path.is_file():
            continue
        kind = "audio" if path.suffix.lower() in (".wav", ".mp3", ".flac") else "image"
        try:
            chat.pending.append(media.read_path(path, kind))
        except UsageError as e:
            console.error(str(e))
            continue
        console.note(f"{path}: {chat.pending[-1].describe()}")
        text = text.replace(found, "", 1)
    return text.strip() or text


@dataclass
class _Turn:
    """How each reply is made: the sampler (one random stream for the whole conversation), the
    limits and the output format."""

    sampler: Sampler
    params: SamplingParams
    limits: Limits
    output: OutputFormat | None
    verbose: bool
    show_trace: bool = True

    def take(self, chat: _Chat, text: str) -> None:
        """Answer the user's `text`; the exchange joins the conversation as far as it went."""
        messages = chat.messages
        text = _dropped(chat, text)
        sent, chat.pending = chat.pending, []
        if sent:
            from localinfer.media import MARKER
            text = text if MARKER in text else MARKER * len(sent) + text
        messages.append({"role": "user", "content": text})
        if sent:
            messages[-1]["media"] = tuple(sent)
        try:
            with chat_input.keys_held(sys.stdin):   # keys typed during the reply stay out of it
                tokens = _fitted_tokens(chat, self.limits)
                style = setup.style_of(chat.loaded.session, tokens, chat.raw)
                constrained = _constrained(self.sampler, self.params, self.output, chat.loaded,
                                           style, chat.think)
                limits = replace(self.limits, max_tokens=answer_limit(
                    self.output, self.limits.max_tokens, thinks=style is not None))
                reply, finish = _reply(chat.cache, tokens, constrained, limits, chat.loaded,
                                       self.verbose, style, self.show_trace)
            problem = incomplete(self.output, reply, finish) if self.output else None
            if problem:
                console.error(problem)
        except ContextOverflow as e:
            messages.pop()      # the chat goes on; the user can /clear or ask something shorter
            console.error(f"{e}; /clear starts a new conversation")
            return
        except UsageError as e:     # a message the template cannot keep as text: this one only
            messages.pop()
            console.error(str(e))
            return
        if finish == "interrupted" and not reply:
            messages.pop()      # nothing came: no empty answer in the conversation
            return
        # An interrupted reply stays as far as it went (as Ollama keeps it): the model sees it.
        messages.append({"role": "assistant", "content": reply})


def _conversation(system: str | None, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def _fitted_tokens(chat: _Chat, limits: Limits) -> list[int]:
    """The prompt for the next reply. When the history outgrows the context, the context grows
    (to hold it and the reply's room) where it can; then the oldest turns go (in place, from
    the conversation) and the rest is evaluated again."""
    session, system, messages = chat.loaded.session, chat.system, chat.messages
    if chat.raw or not session.chat_template:
        return raw_tokens(session, messages[-1]["content"])
    if chat.grow is not None:
        need = len(chat.tokens_for(messages))
        if need + reply_room(limits.max_tokens) > session.n_ctx:
            chat.grow_to(need + reply_room(limits.max_tokens))
            session = chat.loaded.session
    limit = session.n_ctx - reply_reserve(session.n_ctx, limits.max_tokens)
    tokens, dropped = chat_window.fit(messages, chat.tokens_for, limit)
    if dropped:
        del messages[:dropped]
        console.note(f"the conversation outgrew the context: dropped the {dropped} oldest "
                     f"message{'s' if dropped > 1 else ''}" + (" (the system message stays)" if system else ""))
    return tokens


def growing(*, ctx: int, kv_type: str | None, memory_budget: str | None,
            gpu_layers: int | None, options, cpu_moe: int | None = None) -> Grow | None:
    """How a chat's context grows: by loading the model again with a larger one that fits the
    budget (fit.request.grown); None when --ctx fixed it."""
    if ctx:
        return None

    def grow(loaded: LoadedModel, need: int) -> LoadedModel | None:
        from dataclasses import replace

        from localinfer.engine.load import load_model
        from localinfer.fit.request import grown
        placement = grown(loaded.path, n_ctx=loaded.session.n_ctx, need=need, kv_type=kv_type,
                          memory_budget=memory_budget, gpu_layers=gpu_layers, cpu_moe=cpu_moe)
        if placement is None:
            return None
        loaded.session.close()
        return load_model(loaded.ref, loaded.path, backend=loaded.backend, options=replace(
            options, n_ctx=placement.n_ctx, kv_type=placement.kv_type,
            gpu_layers=placement.gpu_layers, cpu_moe=placement.cpu_moe))
    return grow


def _constrained(sampler: Sampler, params: SamplingParams, output: OutputFormat | None,
                 loaded: LoadedModel, style, think: Think) -> Sampler:
    """The reply's sampler: the chat's own, or one that keeps to the answer's grammar and the
    thinking budget (setup.gate_for)."""
    session = loaded.session
    grammar = session.grammar(output.gbnf) if output is not None else None
    grammar = setup.gate_for(session, style, think, grammar) or grammar
    return sampler if grammar is None else ConstrainedSampler(params, grammar)


def _reply(cache: KVCache, tokens: list[int], sampler: Sampler, limits: Limits,
           loaded: LoadedModel, verbose: bool, style=None,
           show_trace: bool = True) -> tuple[str, str]:
    """Stream one reply; returns its answer (the trace apart) and why it ended."""
    from localinfer.cli.thinking import Output
    from localinfer.thinking.setup import no_answer
    shown = setup.shown_markers(loaded.session, style)
    generation = Generation(cache, tokens, sampler, replace(limits, shown=shown) if shown else limits)
    out = Output(style, show_trace=show_trace)
    try:
        for piece in generation:
            out.feed(piece)
    except KeyboardInterrupt:
        generation.stats.finish_reason = "interrupted"   # Ctrl-C ends the reply, not the chat
    out.flush()
    finish = generation.stats.finish_reason
    reply = out.answer.strip(), finish
    try:
        sys.stdout.write("\n")
        sys.stdout.flush()
        cut = _cut_marker(finish, limits, loaded.session.n_ctx)
        unanswered = no_answer(out.still_thinking(), finish, limits.max_tokens,
                               loaded.session.n_ctx)
        if unanswered:
            console.error(unanswered)
        elif cut:
            console.note(cut)
        prompt_cache.persist(cache, notify=console.note if verbose else None)
        if verbose:
            from localinfer.cli.shell import format_stats
            console.notes(format_stats(generation.stats, loaded))
            if cache.store is not None:
                console.note(prompt_cache.describe(cache.last_event))
    except KeyboardInterrupt:   # a second Ctrl-C skips the cache write (atomic) and the figures
        sys.stderr.write("\n")
    return reply


def _cut_marker(finish: str, limits: Limits, n_ctx: int) -> str | None:
    """A line for stderr when a limit, not the model, ended the reply: stdout shows only text,
    so without it a cut answer looks like a finished one."""
    if finish == "length":
        return f"[answer cut at -n {limits.max_tokens} tokens]"
    if finish == "context":
        return f"[answer cut: the context of {n_ctx:,} tokens is full]"
    return None


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
