"""OpenAI's error shape: the reply every refused or failed request gets, and the exception a
request's checks raise to give one (server/requests.py, server/reasoning.py)."""

from __future__ import annotations

from starlette.responses import JSONResponse


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code, headers

    def response(self, reply=None) -> JSONResponse:
        """The refusal in OpenAI's shape, or in `reply`'s (anthropic_error, ollama_error)."""
        return (reply or error)(str(self), self.status, param=self.param, code=self.code,
                                headers=self.headers)


def error(message: str, status: int, *, param=None, code=None, headers=None) -> JSONResponse:
    kind = "server_error" if status >= 500 else {
        401: "authentication_error", 403: "permission_error",
        429: "rate_limit_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


# Anthropic's shape, for the Messages API's paths (server/anthropic.py; guard.py and api.py's 404
# and 405 pick it by the path)
ANTHROPIC_PATHS = "/v1/messages"
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(message: str, status: int, *, headers=None, **_) -> JSONResponse:
    """{"type": "error", "error": {"type": ..., "message": ...}}; takes error()'s arguments."""
    kind = _ANTHROPIC_KINDS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=status, headers=headers)


# Ollama's shape, for its paths (/api/*: server/ollama.py, server/embeddings.py)
OLLAMA_PATHS = "/api"


def ollama_error(message: str, status: int, *, headers=None, **_) -> JSONResponse:
    """{"error": "..."}, as Ollama answers; takes error()'s arguments."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def error_for(path: str):
    """The error reply of the API a path belongs to: error(), anthropic_error() or
    ollama_error()."""
    if is_anthropic(path):
        return anthropic_error
    return ollama_error if is_ollama(path) else error


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def is_ollama(path: str) -> bool:
    return path == OLLAMA_PATHS or path.startswith(OLLAMA_PATHS + "/")
