"""Chat templates: the Jinja2 template stored in a GGUF, rendered the way Hugging Face renders it.

The template comes from a downloaded file, so it runs in a bounded sandbox (template_sandbox.py):
it can format messages but cannot reach Python objects, change its inputs, or spend more than a
bounded amount of memory and CPU time. Whatever goes wrong in it ends as one ModelLoadError.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2

from localinfer.engine import template_bounds as bounds
from localinfer.engine.template_sandbox import BoundedSandbox
from localinfer.errors import ModelLoadError

_SKIP = "use --raw to skip it"


def render(template: str, messages: list[dict[str, str]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """Render a conversation into the prompt text the model was trained on."""
    budget = bounds.Budget(bounds.limits_for(messages))
    token = bounds.begin(budget)
    try:
        text = _render(_compile(template), budget, messages=messages, bos_token=bos_token,
                       eos_token=eos_token, add_generation_prompt=add_generation_prompt)
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
                         extensions=["jinja2.ext.loopcontrols"], filters={"tojson": _tojson})
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template is invalid: {e}; {_SKIP}") from e
    except (ValueError, RecursionError, MemoryError) as e:   # e.g. a 5000-digit number literal
        reason = str(e).split(";")[0] or type(e).__name__   # not Python's advice on raising limits
        raise ModelLoadError(f"the model's chat template cannot be compiled: {reason}; {_SKIP}") from e


def _tojson(value, indent=None, ensure_ascii=False):
    # Jinja's own tojson escapes <, > and & for HTML; chat templates want the plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise(message: str):
    raise jinja2.TemplateError(message)
