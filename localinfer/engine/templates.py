"""Chat templates: the Jinja2 template stored in a GGUF, rendered the way Hugging Face renders it.

The template comes from a downloaded file, so it runs in a bounded sandbox (template_sandbox.py):
it can format messages but cannot reach Python objects, change its inputs, or spend more than a
bounded amount of memory and CPU time. Whatever goes wrong in it ends as one ModelLoadError.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext

from localinfer.engine import template_bounds as bounds
from localinfer.engine.template_sandbox import BoundedSandbox
from localinfer.errors import ModelLoadError
from localinfer.gguf.text import Undecoded

_SKIP = "use --raw to skip it"


def render(template: str, messages: list[dict[str, str]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True,
           extra: dict[str, object] | None = None) -> str:
    """Render a conversation into the prompt text the model was trained on; `extra` holds the
    template's own variables (`enable_thinking`, `reasoning_effort`), as transformers passes
    apply_chat_template's keyword arguments."""
    check_decoded(template)
    budget = bounds.Budget(bounds.limits_for(messages))
    token = bounds.begin(budget)
    try:
        text = _render(_compile(template), budget, **(extra or {}), messages=messages,
                       bos_token=bos_token, eos_token=eos_token,
                       add_generation_prompt=add_generation_prompt)
    except ModelLoadError:
        raise
    except bounds.TemplateBoundExceeded as e:
        raise ModelLoadError(f"the model's chat template was stopped: {e}; {_SKIP}") from e
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"the model's chat template failed: {e}; {_SKIP}") from e
    except RecursionError as e:
        raise ModelLoadError(f"the model's chat template recursed too deeply; {_SKIP}") from e
    except Exception as e:   # the template is foreign code: any error it raises is its own
        raise ModelLoadError(
            f"the model's chat template failed: {type(e).__name__}: {e}; {_SKIP}") from e
    finally:
        bounds.end(token)
    if not text.strip():
        raise ModelLoadError(f"the model's chat template rendered an empty prompt; {_SKIP}")
    return text


def check_decoded(template: str) -> None:
    """ModelLoadError for a template whose bytes in its file were not UTF-8 (gguf/text.py): what
    would run is not what the template's author wrote."""
    if isinstance(template, Undecoded):
        raise ModelLoadError(f"{template.problem}; {_SKIP}")


def marker_nonce(values: object) -> str:
    """A random string no string in `values` (the messages, the template's variables) holds, to
    mark places in a rendering: lower-case hex, so that a template that changes the case of a
    message changes its marker too, and trimming cannot shorten it."""
    held = json.dumps(values, default=str)      # JSON's escapes never hide a run of hex
    while True:
        nonce = "li" + secrets.token_hex(12)
        if nonce not in held:
            return nonce


def marker(nonce: str, index: int) -> str:
    return f"{nonce}x{index}x"


def split_at_markers(text: str, nonce: str) -> list[str]:
    """`text` cut at its markers: [text, index, text, index, ..., text]."""
    return re.split(re.escape(nonce) + r"x(\d+)x", text)


def content_parts(template: str, messages: list[dict[str, str]], rendered: str,
                  **marks: str) -> list[tuple[str, bool]] | None:
    """`rendered`, this template's rendering of `messages`, cut into the template's own text and
    the messages' contents, in order, as (text, is_content) pairs; None where that cannot be told.

    The template is rendered again with each non-empty content replaced by a marker. The cut is
    kept only if putting each content (or the content trimmed, as `| trim` leaves it) back where
    its marker landed gives `rendered` exactly: a template that tests, splits or rewrites a
    content, or takes another branch for the marker, gives None."""
    nonce = marker_nonce(messages)
    marked = [{**m, "content": marker(nonce, i) if m["content"] else ""}
              for i, m in enumerate(messages)]
    try:
        pieces = split_at_markers(render(template, marked, **marks), nonce)
    except ModelLoadError:           # the template refused a marker where it took the content
        return None
    return _put_back(pieces, [m["content"] for m in messages], rendered)


def _put_back(pieces: list[str], contents: list[str],
              rendered: str) -> list[tuple[str, bool]] | None:
    """The (text, is_content) cut of `rendered` that `pieces`, the marked rendering cut at its
    markers, stands for; None where the contents put back do not give `rendered`."""
    parts: list[tuple[str, bool]] = []
    at = 0
    for k, piece in enumerate(pieces):
        if k % 2 == 0:                          # the template's text
            if not rendered.startswith(piece, at):
                return None
            parts.append((piece, False))
            at += len(piece)
            continue
        content, after = contents[int(piece)], pieces[k + 1]
        for shown in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if rendered.startswith(shown, at) and rendered.startswith(after, at + len(shown)):
                break
        else:
            return None
        parts.append((shown, True))
        at += len(shown)
    return parts if at == len(rendered) else None


def _render(compiled: jinja2.Template, budget: bounds.Budget, **variables: object) -> str:
    """Render piece by piece, stopping as soon as the output passes its bound."""
    pieces: list[str] = []
    size = 0
    for piece in compiled.generate(**variables):
        size += len(piece)
        budget.chars(size, "the rendered prompt")
        pieces.append(piece)
    return "".join(pieces)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The same settings as transformers' apply_chat_template, so templates behave as their authors saw.
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
                         filters={"tojson": _tojson})
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template is invalid: {e}; {_SKIP}") from e
    except (ValueError, RecursionError, MemoryError) as e:   # e.g. a 5000-digit number literal
        reason = str(e).split(";")[0] or type(e).__name__   # not Python's advice on raising limits
        raise ModelLoadError(f"the model's chat template cannot be compiled: {reason}; {_SKIP}") from e


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}…{% endgeneration %}` (SmolLM3): it marks the assistant's
    text for training masks and renders its body unchanged, as it does here."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value, indent=None, ensure_ascii=False):
    # Jinja's own tojson escapes <, > and & for HTML; chat templates want the plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise(message: str):
    raise jinja2.TemplateError(message)
