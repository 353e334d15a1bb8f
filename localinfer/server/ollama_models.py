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
The file's facts are read once per file (server/file_facts.py); `digest` is its sha256, computed
once, in the background: "" until it is known, so that no list waits for a file to be hashed. A
file whose header cannot be read is left out of /api/tags (and logged once).
"""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.errors import LocalinferError
from localinfer.server import requests, routers
from localinfer.server.errors import BadRequest, ollama_error
from localinfer.server.file_facts import NO_FILE, Facts, FileFacts, rfc3339

# The Ollama release whose API this server speaks (think levels, tool calls, format schemas, the
# Responses API at /v1/responses): clients compare it to gate features. Codex's Ollama mode
# (`codex --oss`) refuses a server older than 0.13.4, the first with /v1/responses.
VERSION = "0.13.5"
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


def routes(served) -> list[Route]:
    def facts() -> FileFacts:
        return served.models.facts

    async def tags(request: Request):
        listed = await asyncio.to_thread(_tags, served.models, facts())
        return JSONResponse({"models": listed + routers.ollama_tags(served)})

    async def ps(request: Request):
        return JSONResponse({"models": await asyncio.to_thread(_ps, served.models, facts())})

    async def show(request: Request):
        try:
            raw = await requests.read_body(request, seconds=served.body_seconds)
            body = await asyncio.to_thread(requests.parse, raw)
            name = body.get("model" if "model" in body else "name")
            if not isinstance(body.get("verbose", False), bool):
                raise BadRequest("'verbose' must be true or false")
            if (router := routers.find(served, name)) is not None:
                return JSONResponse(routers.ollama_show(router))
            bare = name.removesuffix(":latest") if isinstance(name, str) else name
            about = await served.models.about(bare or name)
            f = await asyncio.to_thread(facts().read, about.path)
        except BadRequest as e:
            return e.response(ollama_error)
        except LocalinferError as e:       # the file went bad since it was fitted
            return ollama_error(str(e), 500)
        return JSONResponse(_shown(about, served.defaults, f))

    async def version(request: Request):
        return JSONResponse({"version": VERSION})

    return [Route("/api/tags", tags), Route("/api/ps", ps),
            Route("/api/show", show, methods=["POST"]), Route("/api/version", version)]


def _tags(models, facts: FileFacts) -> list[dict]:
    """Every model that can be served without a download, less the files that cannot be read
    (Models.files leaves them out); in a thread, as it reads the store."""
    listed = []
    for name, path in models.files():
        try:
            listed.append(_entry((name,), facts.read(path), facts.digest(path)))
        except LocalinferError:     # went bad since it was listed: left out as well
            continue
    return listed


def _ps(models, facts: FileFacts) -> list[dict]:
    shown = []
    for status in models.status():
        model = models.loaded(status.name)
        if model is None:
            continue
        try:
            f = facts.read(model.path)
        except LocalinferError:         # changed on disk since it was loaded: its memory stays
            f = NO_FILE
        shown.append(_loaded(model, status, f, facts.digest(model.path)))
    return shown


def _details(f: Facts) -> dict:
    family = str(f.metadata.get("general.architecture", ""))
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameter_size(f.parameters),
            "quantization_level": _quantization(f.metadata.get("general.file_type"))}


def _entry(names: tuple[str, ...], f: Facts, digest: str) -> dict:
    name = listed_name(names)
    return {"name": name, "model": name, "modified_at": f.modified_at, "size": f.size,
            "digest": digest, "details": _details(f)}


def _loaded(model, status, f: Facts, digest: str) -> dict:
    """/api/ps's entry: the memory the model holds as the fit estimated it (RAM and GPU memory,
    Ollama's size and size_vram), and when its keep-alive runs out."""
    need = status.need
    expires = FOREVER if status.expires_in is None else \
        rfc3339(datetime.now(timezone.utc).timestamp() + status.expires_in)
    return {**_entry(model.names, f, digest), "size": need.ram + need.vram,
            "size_vram": need.vram,
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


def _shown(about, defaults, f: Facts) -> dict:
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
    pairs += [(name, value) for name, value in (("frequency_penalty", p.frequency_penalty),
                                                ("presence_penalty", p.presence_penalty)) if value]
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
    from localinfer.server.media_parts import capabilities
    return found + capabilities(session)
