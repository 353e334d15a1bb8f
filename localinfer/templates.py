"""Chat templates: the Jinja2 template stored in a GGUF, rendered the way Hugging Face renders it.

The template comes from a downloaded file, so it runs in Jinja2's immutable sandbox: it can format
messages but cannot reach Python objects or change its inputs.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localinfer.errors import ModelLoadError


def render(template: str, messages: list[dict[str, str]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """Render a conversation into the prompt text the model was trained on."""
    try:
        return _compile(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"the model's chat template failed: {e}; use --raw to skip it") from e


def messages_for(prompt: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The same settings as transformers' apply_chat_template, so templates behave as their authors saw.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template is invalid: {e}; use --raw to skip it") from e


def _tojson(value, indent=None, ensure_ascii=False):
    # Jinja's own tojson escapes <, > and & for HTML; chat templates want the plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise(message: str):
    raise jinja2.TemplateError(message)
