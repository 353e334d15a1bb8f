"""What every connection and request passes before a handler sees it.

- Host names (DNS rebinding): a web page can point a name of its own at 127.0.0.1 and drive a
  loopback server from the browser, so a server answers only the names it is served under: the
  loopback names and --host, each with the port or without, and --allowed-hosts ("*": any). A
  request under another name is a 403 in OpenAI's shape (Anthropic's on /v1/messages*), as
  Ollama refuses it (the request is well formed; this server will not serve it under that name).
  A server off loopback needs an API key, which a rebinding page does not have; its names are
  checked only when --allowed-hosts lists them.
- The API key, compared in constant time, as `Authorization: Bearer KEY` or Anthropic's
  `x-api-key: KEY` (either header, on any path).
- Any exception a handler raises: one line in the log and, when no reply has started, a 500 in
  OpenAI's shape (Anthropic's on its paths); never a traceback, never text/plain.
- Headers in bounded time: uvicorn's h11 protocol times out idle keep-alive connections only, so
  one that sends half a request head and waits would be held for ever; `protocol` closes it.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Callable

from localinfer.server.errors import error_for

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
HEADER_SECONDS = 30.0


def allowed_hosts(host: str, extra: list[str]) -> frozenset[str] | None:
    """The Host names (lowercase, no port) a server bound to `host` answers; None: any."""
    names = {n.strip().lower().strip("[]") for item in extra for n in item.split(",") if n.strip()}
    if "*" in names:
        return None
    if not names and not is_loopback(host):
        return None         # reached under names we cannot know; the API key guards it
    return frozenset({*LOOPBACK_NAMES, host.lower().strip("[]"), *names})


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def guarded(app, *, key: str | None, hosts: frozenset[str] | None, port: int,
            log: Callable[[str], None]):
    """`app` behind the checks above, outermost first: errors, host, key."""
    return _catch_all(_check_host(_check_key(app, key), hosts, port), log)


def _catch_all(app, log: Callable[[str], None]):
    async def guarded_app(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await app(scope, receive, tracked)
        except Exception as e:          # a bug of ours: one line, and a JSON reply if we can
            log(f"{scope['method']} {scope['path']}: internal error: {type(e).__name__}: {e}")
            if not started:
                await _internal(scope["path"])(scope, receive, send)
    return guarded_app


def internal_error(request=None, *_) -> object:
    """The reply to an exception no check foresaw (also Starlette's handler for one)."""
    return _internal(request.url.path if request is not None else "")


def _internal(path: str):
    return error_for(path)("internal error; the server's log says more", 500)


def _check_host(app, hosts: frozenset[str] | None, port: int):
    if hosts is None:
        return app

    async def host_checked(scope, receive, send):
        if scope["type"] == "http":
            value = dict(scope["headers"]).get(b"host")
            if value is not None and not _host_allowed(value.decode("latin-1"), hosts, port):
                await error_for(scope["path"])(
                    "this server does not answer under that Host name (start it with "
                    "--allowed-hosts NAME to allow one)", 403,
                    code="host_not_allowed")(scope, receive, send)
                return
        await app(scope, receive, send)
    return host_checked


def _host_allowed(value: str, hosts: frozenset[str], port: int) -> bool:
    """Host: NAME, NAME:PORT, [V6] or [V6]:PORT, the port (if any) the one served."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        if rest and not rest.startswith(":"):
            return False
        given = rest[1:] if rest else None
    else:
        name, colon, given = value.partition(":")
        given = given if colon else None
    return name in hosts and (given is None or given == str(port))


def _check_key(app, key: str | None):
    """Every endpoint but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY` when a
    key is set."""
    if not key:
        return app
    expected, expected_bare = f"Bearer {key}".encode(), key.encode()

    async def key_checked(scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), expected)
            header = hmac.compare_digest(headers.get(b"x-api-key", b""), expected_bare)
            if not (bearer or header):
                await error_for(scope["path"])(
                    "a valid API key is needed (Authorization: Bearer KEY or x-api-key: KEY)",
                    401, code="invalid_api_key")(scope, receive, send)
                return
        await app(scope, receive, send)
    return key_checked


def protocol(header_seconds: float = HEADER_SECONDS):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within `header_seconds` of connecting or of its previous reply."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadersInTime(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_seconds, self._late)

        def _late(self) -> None:
            # h11 stays IDLE until a request's head is whole; a request under way is not late
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadersInTime
