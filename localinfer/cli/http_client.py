"""The requests the clients we ship make (`ps`, `stop`, `map --server`): to the address the user
gave and no other, within a deadline, and a bounded reply. Whatever a server does ends in a Reply
or in one LocalinferError line.

The API key (LOCALINFER_API_KEY) and the prompts go to that origin alone, so a redirect is
followed only within it (a few hops); one to another origin ends the command, for a server that
sends its clients elsewhere is not the one the user named. A socket's timeout bounds each read
alone, and a server sending a byte now and then resets it for ever: a watchdog ends the
connection once the request's time is up (Limits), so every request ends in bounded time.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from urllib.parse import urljoin, urlsplit

from localinfer.cli import console
from localinfer.errors import LocalinferError

KEY_ENV = "LOCALINFER_API_KEY"
MAX_REDIRECTS = 5           # same-origin hops: a proxy's path fix-up takes one or two
REDIRECTS = (301, 302, 303, 307, 308)
ERROR_BYTES = 1 << 16       # of an error reply: its message is cut at 500 characters anyway
CHUNK = 1 << 16
HALT_POLL_S = 0.1           # how soon a request under way sees `halt` set


@dataclass(frozen=True)
class Limits:
    """How long a request may take, and how much of its reply is read."""

    wait_s: float           # to its reply's first byte: the server's work and its queue
    reply_s: float          # from that first byte to the reply's last
    max_bytes: int          # of the reply's body

    def said(self) -> str:
        return f"{self.wait_s:g} s to begin, {self.reply_s:g} s to finish"


@dataclass(frozen=True)
class Reply:
    """A server's answer: its status, headers and body."""

    status: int
    reason: str
    headers: Message
    body: bytes

    def json(self) -> object:
        """The body's JSON value; ValueError when it is not JSON."""
        try:
            return json.loads(self.body)
        except RecursionError:      # nested deeper than the parser goes: not an API's answer
            raise ValueError("JSON nested too deeply") from None

    def error(self) -> tuple[str, object]:
        """The server's own message in an error reply (OpenAI's or Ollama's shape), its control
        characters escaped and cut short, and its code where the reply has one."""
        try:
            said = self.json()
        except ValueError:
            said = None
        said = said.get("error") if isinstance(said, dict) else None
        code = None
        if isinstance(said, dict):
            said, code = said.get("message"), said.get("code")
        text = said if isinstance(said, str) and said else self.reason
        return console.clean(text[:500]), code if isinstance(code, str) else None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx comes back as an HTTPError, unread: `exchange` decides where it may go."""

    def redirect_request(self, *args) -> None:
        return None


def exchange(base: str, path: str, body: dict | None = None, *, limits: Limits,
             halt: threading.Event | None = None) -> Reply:
    """One request (GET, or POST with a JSON body) to `base` + `path` and the server's reply,
    whatever its status; a redirect is followed within `base`'s origin. `halt` set ends it at
    once (its caller is going). A server that does not answer in time, sends us elsewhere, or
    answers with too much or with something else than HTTP is one LocalinferError line."""
    deadline = _Deadline(limits, halt)
    failure: BaseException | None = None
    try:
        reply = _exchange(base, path, body, limits, deadline)
    except LocalinferError:
        raise
    # ValueError: http.client's own, of a chunk size that is not a number, or a Location it
    # cannot send; HTTPException: a status line or headers that are not HTTP.
    except (OSError, http.client.HTTPException, ValueError) as e:
        failure = e
    finally:
        deadline.close()
    # What a cut connection raised, or the reply it cut short; or a socket's own timeout.
    if deadline.expired or isinstance(getattr(failure, "reason", failure), TimeoutError):
        raise LocalinferError(f"{base}{path}: no complete answer in the time allowed "
                              f"({limits.said()})")
    if failure is not None:
        raise LocalinferError(_failure(base, path, failure)) from None
    return reply


def _exchange(base: str, path: str, body: dict | None, limits: Limits,
              deadline: _Deadline) -> Reply:
    url, data = base + path, None if body is None else json.dumps(body).encode()
    opener = urllib.request.build_opener(_NoRedirects(), _HTTP(deadline), _HTTPS(deadline))
    for _ in range(MAX_REDIRECTS + 1):
        reply = _send(opener, url, data, limits)
        if reply.status not in REDIRECTS:
            return reply
        url = _hop(base, path, url, reply)
        if reply.status == 303:         # "see other": a GET of that address, as HTTP says
            data = None
    raise LocalinferError(f"{base}{path} redirected more than {MAX_REDIRECTS} times")


def _send(opener, url: str, data: bytes | None, limits: Limits) -> Reply:
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    if key := os.environ.get(KEY_ENV):
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with opener.open(request, timeout=limits.wait_s) as reply:
            return Reply(reply.status, reply.reason, reply.headers,
                         _body(url, reply, limits.max_bytes))
    except urllib.error.HTTPError as e:
        with e:     # an error's body is only read for its message; a redirect's not at all
            body = b"" if e.code in REDIRECTS else e.read(ERROR_BYTES)
            return Reply(e.code, str(e.reason), e.headers, body)


def _body(url: str, reply, limit: int) -> bytes:
    """The reply's body, refused once it would pass `limit` bytes: read no further."""
    declared = reply.length or 0        # its Content-Length, as http.client read it
    data = bytearray()
    while declared <= limit and len(data) <= limit and \
            (chunk := reply.read(min(CHUNK, limit + 1 - len(data)))):
        data += chunk
    if declared > limit or len(data) > limit:
        from localinfer.units import human_size
        raise LocalinferError(f"{url} answered with more than {human_size(limit)}; not read")
    return bytes(data)


def _failure(base: str, path: str, error: BaseException) -> str:
    """The line for a request that got no usable reply."""
    if isinstance(error, urllib.error.URLError):    # before the request went: no connection
        return (f"no server answered at {base} ({console.clean(error.reason)}); is "
                "`localinfer serve` running there?")
    if isinstance(error, (http.client.HTTPException, ValueError)):
        return (f"{base}{path} did not answer as an HTTP server does "
                f"({type(error).__name__}: {console.clean(str(error)[:200])})")
    return f"{base}{path}: the connection broke off ({console.clean(error)})"


def _hop(base: str, path: str, url: str, reply: Reply) -> str:
    """Where a redirect leads, if it stays within `base`'s origin (scheme, host and port)."""
    target = reply.headers.get("Location")
    if not target:
        raise LocalinferError(f"{base}{path} answered {reply.status} without saying where to")
    target = urljoin(url, target.strip())
    if _origin(target) != _origin(base):
        raise LocalinferError(f"{base}{path} redirects to {console.clean(target[:200])}, another "
                              "address: not followed, the API key and the requests go only to "
                              "the address given (give that one if it is the server)")
    return target


def _origin(url: str) -> tuple[str, str, int] | None:
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:          # a port that is not a number: no origin at all
        return None
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


# -- the watchdog ---------------------------------------------------------------------------------
class _Deadline:
    """Shuts a request's connections once its time is up (or `halt` is set): a read blocked on
    them returns at once, whatever the socket's own timeout says."""

    def __init__(self, limits: Limits, halt: threading.Event | None) -> None:
        self.limits, self.halt = limits, halt
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._at = time.monotonic() + limits.wait_s
        self._open = True
        self._lock = threading.Condition()
        threading.Thread(target=self._watch, name="http-deadline", daemon=True).start()

    def connected(self, sock: socket.socket) -> socket.socket:
        """A new connection (a redirect's, the TLS one over it) waits anew for its first byte."""
        with self._lock:
            self._sockets.append(sock)
            self._at = time.monotonic() + self.limits.wait_s
            if self.expired:
                _shut(sock)
            self._lock.notify()
        return sock

    def replying(self) -> None:
        """The reply's first byte came: the rest within reply_s."""
        with self._lock:
            self._at = time.monotonic() + self.limits.reply_s
            self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._open = False
            self._lock.notify()

    def _watch(self) -> None:
        with self._lock:
            while self._open:
                left = self._at - time.monotonic()
                if left <= 0 or (self.halt is not None and self.halt.is_set()):
                    self.expired = True
                    for sock in self._sockets:
                        _shut(sock)
                    return
                self._lock.wait(left if self.halt is None else min(left, HALT_POLL_S))


def _shut(sock: socket.socket) -> None:
    try:    # the plain socket's shutdown, also under TLS: the peer's bytes stop, no TLS goodbye
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:         # closed already, or handed over to the TLS socket that wraps it
        pass


class _Response(http.client.HTTPResponse):
    def __init__(self, sock, *args, deadline: _Deadline, **kwargs) -> None:
        super().__init__(sock, *args, **kwargs)
        self._deadline = deadline

    def begin(self) -> None:
        self.fp.peek(1)         # the wait for the first byte: the server's work and its queue
        self._deadline.replying()
        super().begin()


class _Connection(http.client.HTTPConnection):
    def __init__(self, *args, deadline: _Deadline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.response_class = functools.partial(_Response, deadline=deadline)
        connect = self._create_connection       # watched from its TCP connect on (a proxy too)
        self._create_connection = lambda *a, **k: deadline.connected(connect(*a, **k))


class _TLSConnection(_Connection, http.client.HTTPSConnection):
    def connect(self) -> None:
        """HTTPSConnection's own, with the TLS socket watched before its handshake starts."""
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(
            self.sock, server_hostname=self._tunnel_host or self.host,
            do_handshake_on_connect=False)
        self.deadline.connected(self.sock).do_handshake()


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_Connection, deadline=self.deadline), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(functools.partial(_TLSConnection, deadline=self.deadline), req,
                            context=self._context)
