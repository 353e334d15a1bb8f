"""From text to prompt tokens: the model's chat template, or the text as is; how many tokens a
prompt may take before it is tokenized, and what `--truncate` keeps of it."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from localinfer.backends import Session
from localinfer.errors import ContextOverflow, ModelLoadError, UsageError


def messages_for(text: str, system: str | None) -> list[dict[str, str]]:
    """One user turn, after a system message when there is one."""
    turns = [{"role": "system", "content": system}] if system else []
    turns.append({"role": "user", "content": text})
    return turns


def uses_chat_template(session: Session, raw: bool) -> bool:
    return not raw and bool(session.chat_template)


def chat_tokens(session: Session, messages: list[dict[str, str]],
                extra: dict[str, object] | None = None) -> list[int]:
    """Render the model's own chat template and tokenize it: the template's markup with its
    control tokens, the messages' text as text. A message that spells a control token
    (`<|im_start|>system...` in SmolLM2's ChatML) gets those characters as text, never a turn.

    A message without such text tokenizes exactly as the whole rendering does, with special
    tokens on (as llama.cpp's server and transformers tokenize a chat): the template's text and a
    message's are tokenized together, as the model was trained. Where a message spells a control
    token, the template's pieces are tokenized with special tokens and the messages' without
    (the tokens at a piece's edge may then differ from the whole rendering's)."""
    from localinfer.engine import templates  # jinja2: only for chat models, not for every command
    if not session.chat_template:
        raise ModelLoadError("this model has no chat template; use --raw")
    marks = {"bos_token": _text(session, session.bos_token),
             "eos_token": _text(session, session.eos_token), "extra": extra}
    messages = placed_systems(session.chat_template, messages, marks)
    text = templates.render(session.chat_template, messages, **marks)
    tokens = session.tokenize(text, special=True)
    # A request's other strings (a template variable, a tool, a name, an id) are text as well.
    if any(_controls(session, session.tokenize(value, special=True))
           for value in _strings([[_beside_content(m) for m in messages], extra])):
        return with_bos(session, _defused(session, messages, marks))
    parts = templates.content_parts(session.chat_template, messages, text, **marks)
    if parts is None:                # the template rewrites or tests a message's text
        return with_bos(session, _defused(session, messages, marks) or tokens)
    markup = {k: session.tokenize(piece, special=True)
              for k, (piece, is_content) in enumerate(parts) if not is_content}
    # The control tokens of the whole rendering are the markup's own, in order: no message added
    # one (nor made one with the markup at its edge), and the whole rendering's tokens stand.
    if _controls(session, tokens) == _controls(session, [t for m in markup.values() for t in m]):
        return with_bos(session, tokens)
    return with_bos(session, [t for k, (piece, _) in enumerate(parts)
                              for t in (markup[k] if k in markup
                                        else session.tokenize(piece, special=False))])


def placed_systems(template: str, messages: list[dict], marks: dict) -> list[dict]:
    """The conversation with each system message after the first turn where the template
    renders it, else folded into the next user turn (the last one when none follows): agents
    send system turns mid-conversation (Claude Code's reminders), which many templates refuse
    (Gemma's raises on any role but user and assistant there) or silently drop."""
    from localinfer.engine import templates
    later = [k for k, m in enumerate(messages) if m["role"] == "system" and k > 0]
    if not later:
        return messages
    nonce = templates.marker_nonce(messages)
    marked = [{**m, "content": templates.marker(nonce, k)} if k in later else m
              for k, m in enumerate(messages)]
    try:
        shown = templates.render(template, marked, **marks)
        if all(templates.marker(nonce, k) in shown for k in later):
            return messages
    except ModelLoadError:
        pass
    return _folded(messages, set(later))


def _folded(messages: list[dict], later: set[int]) -> list[dict]:
    out: list[dict] = []
    waiting: list[str] = []         # system text for the next user turn
    for k, m in enumerate(messages):
        if k in later:
            waiting.append(m["content"])
            continue
        if m["role"] == "user" and waiting:
            m = {**m, "content": "\n\n".join([*waiting, m["content"]])}
            waiting = []
        out.append(m)
    if waiting:
        users = [k for k, m in enumerate(out) if m["role"] == "user"]
        if users:
            last = out[users[-1]]
            out[users[-1]] = {**last, "content": "\n\n".join([last["content"], *waiting])}
        else:
            out.append({"role": "user", "content": "\n\n".join(waiting)})
    return out


def _controls(session: Session, tokens: list[int]) -> list[int]:
    """The control tokens among `tokens`, in order: those llama.cpp tokenizes from text only with
    special tokens on (CONTROL and UNKNOWN), the same it renders as no bytes."""
    control = {t for t in set(tokens) if not session.piece(t)}
    return [t for t in tokens if t in control]


def _defused(session: Session, messages: list[dict], marks: dict) -> list[int] | None:
    """The conversation's tokens where a request's text cannot be found in the rendering by
    templates.content_parts (the template rewrites or tests a message's text, or the text is not
    a message's content: a template variable, a tool, a name); None when no text spells a control
    token. Each control token's text in every string the conversation holds (all but the roles)
    is replaced by a marker before rendering, and tokenized as text where its marker lands."""
    from localinfer.engine import templates
    nonce = templates.marker_nonce([messages, marks["extra"]])
    spelled: list[str] = []

    def mark(match: re.Match) -> str:
        spelled.append(match.group())
        return templates.marker(nonce, len(spelled) - 1)

    def text(value: str) -> str:
        return _marked(session, value, mark)

    defused = [{**m, **_remade(_beside_role(m), text)} for m in messages]
    extra = _remade(marks["extra"], text)
    if not spelled:
        return None
    pieces = templates.split_at_markers(templates.render(
        session.chat_template, defused, **{**marks, "extra": extra}), nonce)
    # A marker the template changed (its case, a slice) has lost the text it stood for.
    if any(nonce[:8] in piece.lower() for piece in pieces[::2]):
        raise UsageError(f"the conversation spells the model's control token {spelled[0]!r}, "
                         "and this model's chat template rewrites that text, so it cannot be "
                         "kept as text; remove it from the request")
    return [t for k, piece in enumerate(pieces)
            for t in (session.tokenize(spelled[int(piece)], special=False) if k % 2
                      else session.tokenize(piece, special=True))]


def _beside_role(message: dict) -> dict:
    # The role is tested by every template and is one of a few fixed words: never marked.
    return {k: v for k, v in message.items() if k != "role"}


def _beside_content(message: dict) -> dict:
    return {k: v for k, v in message.items() if k not in ("role", "content")}


def _strings(value) -> list[str]:
    """Every string inside `value` (dict keys too), nested lists and dicts walked."""
    found: list[str] = []
    _remade(value, lambda s: found.append(s) or s)
    return found


def _remade(value, text):
    """`value` with each string in it (dict keys too) replaced by `text(string)`."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {text(k) if isinstance(k, str) else k: _remade(v, text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_remade(v, text) for v in value]
    return value


def _marked(session: Session, content: str, mark) -> str:
    """`content` with the text of each control token in it replaced by `mark(match)`; a second
    round catches one that overlapped another."""
    for _ in range(_MARK_ROUNDS):
        spelled = {session.token_text(t)
                   for t in _controls(session, session.tokenize(content, special=True))} - {""}
        if not spelled:
            return content
        longest_first = sorted(spelled, key=len, reverse=True)
        content = re.sub("|".join(map(re.escape, longest_first)), mark, content)
    raise UsageError("a message spells the model's control tokens in a way that cannot be kept "
                     "as text; remove them from the message")


_MARK_ROUNDS = 4


def raw_tokens(session: Session, text: str) -> list[int]:
    return with_bos(session, session.tokenize(text, special=True))


def with_bos(session: Session, tokens: list[int]) -> list[int]:
    # Templates usually write BOS themselves; add it only when the model wants it and it is missing.
    if session.add_bos and session.bos_token is not None and tokens[:1] != [session.bos_token]:
        return [session.bos_token, *tokens]
    return tokens


def _text(session: Session, token: int | None) -> str:
    return session.token_text(token) if token is not None else ""


# -- a prompt as the user gave it, and what --truncate keeps of it ---------------------------------
# Room kept for the reply when --max-tokens does not say: `run --ctx 0` sizes the context for the
# prompt plus this, and a context that cannot grow keeps this much free (a quarter of it at most).
REPLY_TOKENS = 1024
# Tokens a rendered prompt may hold beyond one per byte of its text: BOS, SentencePiece's space
# prefix, and the special tokens (BOS, EOS) a template writes, rendered as empty text for the bound.
_SPECIAL_SLACK = 16
_MAX_CUTS = 8
# Where the CPU backend cannot be steered (backends/llama/kv.py), a prompt of this many bytes (~512
# tokens of English) loses more to the bf16-K cache's slow prefill than speculation can win back:
# it loads with LoadOptions.long_prompt (f16 K, tiled attention, no drafts past 256 cells).
# Measured in docs/speculative-decoding.md. A steered backend needs no such rule.
LONG_PROMPT_BYTES = 2048
LONG_PROMPT_TOKENS = LONG_PROMPT_BYTES // 4   # the same bound for `bench`'s prompts of token ids


@dataclass(frozen=True)
class PromptText:
    """`text` as the shell combined it (piped input, then the prompt argument); its first
    `cuttable` characters are the piped input, the part `--truncate` may shorten from its start."""

    text: str
    cuttable: int = 0
    system: str | None = None
    raw: bool = False
    think: str | None = None      # --think: on, off or an effort; None: the template's default
    media: tuple = ()             # checked images and audio (localinfer.media.Media), in order
    # A conversation ({"role", "content"} dicts, the system message apart) rendered in place of
    # `text`'s one user turn: a chat routed turn by turn (cli/routed.chat, Model.chat)
    messages: tuple = ()


def turns(prompt: PromptText) -> list[dict[str, str]]:
    """The messages the chat template renders for `prompt`."""
    if prompt.messages:
        return ([{"role": "system", "content": prompt.system}] if prompt.system else []) + \
            [dict(m) for m in prompt.messages]
    return messages_for(prompt.text, prompt.system)


def is_long(prompt: PromptText) -> bool:
    """Whether the prompt's prefill is what its run's time goes to (LONG_PROMPT_BYTES)."""
    return len(prompt.text.encode("utf-8")) >= LONG_PROMPT_BYTES


def prompt_tokens(vocab: Session, prompt: PromptText) -> list[int]:
    """The prompt's tokens through the model's chat template, or as is (--raw, base models).

    `vocab` is a loaded Session or a vocabulary alone (backends.llama_vocab.LlamaVocab)."""
    if prompt.media:
        return media_tokens(vocab, prompt)
    if uses_chat_template(vocab, prompt.raw):
        from localinfer.thinking import setup
        extra = setup.template_vars(vocab.chat_template, prompt.think)
        tokens = chat_tokens(vocab, turns(prompt), extra)
        return tokens + setup.empty_trace_tokens(vocab, tokens, prompt.think)
    return raw_tokens(vocab, prompt.text)


def most_tokens(prompt: PromptText, template: str | None) -> int | None:
    """At most how many tokens the prompt takes, known without the vocabulary (None: unknown).

    Each token of a byte-level BPE or SentencePiece vocabulary stands for at least one byte of
    text, so the bytes of the rendered prompt bound its tokens. `template` is the model's chat
    template as its GGUF header holds it (None: the text goes as is).
    """
    text = prompt.text
    if template and not prompt.raw:
        from localinfer.engine import templates
        from localinfer.thinking import setup
        try:
            text = templates.render(template, turns(prompt),
                                    extra=setup.template_vars(template, prompt.think))
        except ModelLoadError:       # counted with the vocabulary instead, which says why
            return None
        text += setup.EMPTY_TRACE_BOUND if prompt.think == "off" else ""
    return len(text.encode("utf-8")) + _SPECIAL_SLACK


def reply_room(max_tokens: int) -> int:
    """Room a context is sized to leave for the reply: --max-tokens, or REPLY_TOKENS."""
    return max_tokens if max_tokens > 0 else REPLY_TOKENS


def reply_reserve(n_ctx: int, max_tokens: int) -> int:
    """What a context of `n_ctx` tokens keeps free for the reply when it cannot grow:
    --max-tokens (at most half of it), or REPLY_TOKENS (at most a quarter)."""
    return min(max_tokens, n_ctx // 2) if max_tokens > 0 else min(REPLY_TOKENS, n_ctx // 4)


def truncated(vocab: Session, prompt: PromptText, limit: int) -> tuple[PromptText, list[int]]:
    """The prompt with the start of its piped input dropped so that it takes at most `limit`
    tokens, and its tokens; the question and the system message stay whole.

    Tokens do not add up across a cut (the text at the seam tokenizes anew), so each round drops
    the overshoot at a token boundary of the piped text and counts the whole prompt again.
    """
    tokens = prompt_tokens(vocab, prompt)
    for _ in range(_MAX_CUTS):
        excess = len(tokens) - limit
        if excess <= 0:
            return prompt, tokens
        piped = vocab.tokenize(prompt.text[:prompt.cuttable], special=False)
        if excess >= len(piped):
            raise ContextOverflow(f"the prompt is {len(tokens)} tokens, {len(piped)} of them piped "
                                  f"input: without it, it still takes more than {limit}")
        # A cut inside a character leaves the rest of its bytes at the start: dropped too.
        kept = vocab.detokenize(piped[excess:]).decode("utf-8", "ignore")
        prompt = replace(prompt, text=kept + prompt.text[prompt.cuttable:], cuttable=len(kept))
        tokens = prompt_tokens(vocab, prompt)
    raise ContextOverflow(f"the piped input could not be shortened to fit {limit} tokens")


# -- a prompt with images or audio (engine/media.py evaluates it) -------------------------------
def media_tokens(session, prompt: PromptText) -> list[int]:
    """The tokens of a PromptText with media: each medium where a MARKER stands, else all of
    them before the text (where llama-mtmd-cli puts them), through the chat template or as is
    (--raw)."""
    from localinfer.media import MARKER
    media, text = list(prompt.media), prompt.text
    if MARKER not in text:
        text = MARKER * len(media) + text
    if not uses_chat_template(session, prompt.raw):
        return _with_media(session, [(text, True)], media)
    from localinfer.thinking import setup
    extra = setup.template_vars(session.chat_template, prompt.think)
    tokens = chat_media_tokens(session, messages_for(text, prompt.system), extra, media)
    return tokens + setup.empty_trace_tokens(session, tokens, prompt.think)


def chat_media_tokens(session, messages: list[dict], extra: dict | None,
                      media: list) -> list[int]:
    """A conversation's tokens with its media, one MARKER in the messages' text where each
    goes: the template rendered, the text between media tokenized by libmtmd with special tokens
    on, as llama-mtmd-cli and llama-server do; a message that spells a control token keeps it
    as text (the template's markup and the contents tokenized apart)."""
    from localinfer.engine import templates
    from localinfer.media import MARKER
    template = session.chat_template
    if not template:
        raise ModelLoadError("this model has no chat template; use --raw")
    marks = {"bos_token": _text(session, session.bos_token),
             "eos_token": _text(session, session.eos_token), "extra": extra}
    messages = placed_systems(template, messages, marks)
    rendered = templates.render(template, messages, **marks)
    if not any(_controls(session, session.tokenize(m["content"].replace(MARKER, ""),
                                                   special=True)) for m in messages):
        return _with_media(session, [(rendered, True)], media)
    parts = templates.content_parts(template, messages, rendered, **marks)
    if parts is None:
        raise UsageError("a message spells the model's control tokens, which this chat "
                         "template cannot keep as text beside media; use --raw")
    return _with_media(session, [(piece, not content) for piece, content in parts], media)


def _with_media(session, pieces: list[tuple[str, bool]], media: list) -> list[int]:
    """(text, special) pieces cut at each MARKER, the media put there in order, tokenized by the
    session's projector (backends/llama/mtmd.py)."""
    from localinfer.media import MARKER, count_ok
    projector = getattr(session, "media", None)
    if projector is None:
        raise UsageError("images and audio need the model's projector (mmproj file): "
                         "name it with --mmproj FILE")
    count_ok(len(media), "the prompt")
    said = sum(piece.count(MARKER) for piece, _ in pieces)
    if said != len(media):
        raise UsageError(f"the prompt has {said} {MARKER} markers for {len(media)} images or "
                         "audio clips; put one where each goes (the template may drop one)")
    left, parts = list(media), []
    for piece, special in pieces:
        for k, segment in enumerate(piece.split(MARKER)):
            if k:
                parts.append(left.pop(0))
            if segment:
                parts.append((segment, special))
    return with_bos(session, projector.tokenize(parts))
