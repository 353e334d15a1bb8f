"""What Ollama's clients ask about the models: GET /api/tags (the models there are), POST
/api/show (one model's facts), GET /api/ps (the models loaded) and GET /api/version.

Tags lists every model the server can load without a download (server/hosting.py), ps the ones
loaded now with their memory and keep-alive, each under the name it answers with (Ollama's `:latest`
tag added where the name has no tag of its own); show describes a model without loading it (a
loaded one as it runs; another with the context its fit would give it). The facts
come from the GGUF header (gguf/), never from loading anything again: `details` (format gguf,
family = general.architecture, parameter_size counted from the tensors, quantization_level from
general.file_type), `model_info` (the header's entries: general.architecture,
{arch}.context_length, ...; the vocabulary's long arrays named with null, with or without
`verbose`), `template` (the model's chat template, Jinja here, not Ollama's Go template),
`parameters` (serve's sampling defaults, which requests that set none get) and `capabilities`.
`digest` is the file's sha256, computed once, on the first question that needs it.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.server import requests
from localinfer.server.errors import BadRequest, ollama_error

# The Ollama release whose API this server speaks (think levels, tool calls, format schemas):
# clients compare it to gate features.
VERSION = "0.12.0"
TEMPLATE_KEY = "tokenizer.chat_template"
# A model with no end: Ollama's expires_at for keep_alive -1 (now plus the longest Go duration)
FOREVER = "2318-01-01T00:00:00Z"


def listed_name(names: tuple[str, ...]) -> str:
    """The name tags and ps give: the first served name, tagged `:latest` if it has no tag."""
    return names[0] if ":" in names[0] else f"{names[0]}:latest"


def served_name(body: dict, names: tuple[str, ...], key: str = "model") -> str:
    """The model a request names, as it named it (Ollama echoes it back); a served name, or one
    with `:latest` after it. Anything else is a 404, as Ollama answers a model it does not have."""
    model = body.get(key)
    if not isinstance(model, str) or not model:
        raise BadRequest(f"'{key}' is required and must be a string")
    if model not in names and model.removesuffix(":latest") not in names:
        raise BadRequest(f"model '{model[:200]}' not found; this server has "
                         f"'{listed_name(names)}'", status=404)
    return model


@dataclass(frozen=True)
class _File:
    """The model file's facts, read once."""

    size: int                       # bytes of every part
    modified_at: str
    digest: str                     # sha256 of the (first) file
    metadata: dict                  # the header's entries, as gguf.header reads them
    parameters: int                 # elements of every tensor


def routes(served) -> list[Route]:
    files = _Files()

    async def tags(request: Request):
        listed = await asyncio.to_thread(served.models.files)
        return JSONResponse({"models": [
            _entry((name,), await files.facts(path)) for name, path in listed]})

    async def ps(request: Request):
        shown = []
        for status in served.models.status():
            model = served.models.loaded(status.name)
            if model is not None:
                shown.append(_loaded(model, status, await files.facts(model.path)))
        return JSONResponse({"models": shown})

    async def show(request: Request):
        try:
            raw = await requests.read_body(request, seconds=served.body_seconds)
            body = await asyncio.to_thread(requests.parse, raw)
            name = body.get("model" if "model" in body else "name")
            if not isinstance(body.get("verbose", False), bool):
                raise BadRequest("'verbose' must be true or false")
            bare = name.removesuffix(":latest") if isinstance(name, str) else name
            about = await served.models.about(bare or name)
        except BadRequest as e:
            return e.response(ollama_error)
        return JSONResponse(_shown(about, served.defaults, await files.facts(about.path)))

    async def version(request: Request):
        return JSONResponse({"version": VERSION})

    return [Route("/api/tags", tags), Route("/api/ps", ps),
            Route("/api/show", show, methods=["POST"]), Route("/api/version", version)]


class _Files:
    """Each model file's facts, read once (the digest reads the whole file)."""

    def __init__(self) -> None:
        self._known: dict[Path | None, _File] = {}
        self._lock = asyncio.Lock()

    async def facts(self, path: Path | None) -> _File:
        async with self._lock:
            if path not in self._known:
                self._known[path] = await asyncio.to_thread(_read, path)
            return self._known[path]


def _read(path: Path | None) -> _File:
    """The facts of the file at `path` (a whole file or a split model's first part)."""
    from localinfer.gguf.header import read_header
    from localinfer.gguf.split import whole_model
    from localinfer.models.fetch import sha256_of
    if path is None:            # a server made without a file (tests of the app alone)
        return _File(0, _rfc3339(0), "", {}, 0)
    header, size = whole_model(path, read_header(path))
    return _File(size, _rfc3339(os.stat(path).st_mtime), sha256_of(path), header.metadata,
                 sum(t.n_elements for t in header.tensors))


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _details(f: _File) -> dict:
    family = str(f.metadata.get("general.architecture", ""))
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameter_size(f.parameters),
            "quantization_level": _quantization(f.metadata.get("general.file_type"))}


def _entry(names: tuple[str, ...], f: _File) -> dict:
    name = listed_name(names)
    return {"name": name, "model": name, "modified_at": f.modified_at, "size": f.size,
            "digest": f.digest, "details": _details(f)}


def _loaded(model, status, f: _File) -> dict:
    """/api/ps's entry: the memory the model holds as the fit estimated it (RAM and GPU memory,
    Ollama's size and size_vram), and when its keep-alive runs out."""
    need = status.need
    expires = FOREVER if status.expires_in is None else \
        _rfc3339(datetime.now(timezone.utc).timestamp() + status.expires_in)
    return {**_entry(model.names, f), "size": need.ram + need.vram, "size_vram": need.vram,
            "expires_at": expires, "context_length": model.n_ctx}


def _parameter_size(n: int) -> str:
    """As Ollama writes it: 7.6B, 135M (its figure is rounded the same way)."""
    if n >= 10**9:
        return f"{n / 10**9:.1f}B"
    return f"{n / 10**6:.0f}M" if n >= 10**6 else str(n)


def _quantization(file_type) -> str:
    from localinfer.quant.quantize import QUANT_TYPES
    names = {number: name for name, number in QUANT_TYPES.items()}
    return names.get(file_type, "unknown") if isinstance(file_type, int) else "unknown"


def _shown(about, defaults, f: _File) -> dict:
    """/api/show's reply for a model (hosting.About), loaded or not."""
    template = f.metadata.get(TEMPLATE_KEY)
    if not isinstance(template, str):           # a template the engine supplies, if loaded
        template = (about.session.chat_template if about.session is not None else None) or ""
    parameters = _parameters(defaults, about.n_ctx)
    return {"modelfile": _modelfile(about.path, defaults, template, parameters),
            "parameters": parameters, "template": template, "details": _details(f),
            "model_info": _model_info(f.metadata),
            "capabilities": _capabilities(about.session, template),
            "modified_at": f.modified_at}


def _parameters(defaults, n_ctx: int) -> str:
    """serve's sampling defaults, one `name value` a line, as Ollama lists a model's PARAMETERs."""
    p = defaults.params
    pairs = [("temperature", p.temperature), ("top_k", p.top_k), ("top_p", p.top_p),
             ("min_p", p.min_p), ("repeat_penalty", p.repeat_penalty),
             ("repeat_last_n", p.repeat_last_n), ("num_ctx", n_ctx)]
    if p.seed is not None:
        pairs.append(("seed", p.seed))
    return "\n".join(f"{name:<15}{value}" for name, value in pairs)


def _modelfile(path, defaults, template: str, parameters: str) -> str:
    """A Modelfile that says what this server runs: the file, serve's parameters and --system.
    The template is the model's Jinja chat template, quoted for reading, not for `ollama
    create` (which wants a Go template)."""
    lines = ["# Modelfile of the model localinfer serves", f"FROM {path or ''}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    if defaults.system is not None:
        lines.append(f'SYSTEM """{defaults.system}"""')
    lines += [f"PARAMETER {line}" for line in parameters.splitlines()]
    return "\n".join(lines) + "\n"


def _model_info(metadata: dict) -> dict:
    """The header's entries but the chat template: numbers, text, true/false and short arrays
    as they are; a long array (the vocabulary), which the header reader counts but does not
    keep, is named with null, as Ollama names it without `verbose`."""
    from localinfer.gguf.header import ArrayInfo, TextInfo
    return {key: None if isinstance(value, (ArrayInfo, TextInfo)) else _plain(value)
            for key, value in metadata.items() if key != TEMPLATE_KEY}


def _plain(value):
    """A header value as JSON can say it: a float that is not finite (no JSON number) as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _capabilities(session, template: str) -> list[str]:
    """completion always; tools for a model with a chat template (its own call format, or the
    generic one); thinking where the template writes a trace. A model not loaded is judged by
    its template alone (a trace its vocabulary alone would show is not seen)."""
    from localinfer.engine.prompt import uses_chat_template
    from localinfer.thinking import setup, style
    found = ["completion"]
    if session is None:
        if template:
            found.append("tools")
            if style.detect(template, "", lambda text: False) is not None:
                found.append("thinking")
        return found
    if uses_chat_template(session, False):
        found.append("tools")
        if setup.style_of(session, [], raw=False) is not None:
            found.append("thinking")
    return found
