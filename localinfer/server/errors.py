"""OpenAI's error shape: the reply every refused or failed request gets, and the exception a
request's checks raise to give one (server/requests.py, server/reasoning.py)."""

from __future__ import annotations

from starlette.responses import JSONResponse


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code, headers

    def response(self) -> JSONResponse:
        return error(str(self), self.status, param=self.param, code=self.code,
                     headers=self.headers)


def error(message: str, status: int, *, param=None, code=None, headers=None) -> JSONResponse:
    kind = "server_error" if status >= 500 else {
        401: "authentication_error", 403: "permission_error",
        429: "rate_limit_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)
