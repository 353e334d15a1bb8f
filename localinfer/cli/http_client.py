"""The requests the clients we ship make (`ps`, `stop`, `map --server`): to the address the user
gave and no other. The API key (LOCALINFER_API_KEY) and the prompts go to that origin alone, so a
redirect is followed only within it (a few hops); one to another origin ends the command in one
line, for a server that sends its clients elsewhere is not the one the user named.
"""

from __future__ import annotations

import json
import os
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


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_NoRedirects())


def exchange(base: str, path: str, body: dict | None = None, *, timeout: float) -> Reply:
    """One request (GET, or POST with a JSON body) to `base` + `path` and the server's reply,
    whatever its status; a redirect is followed within `base`'s origin. A server that does not
    answer, or sends us elsewhere, is one LocalinferError line."""
    url, data = base + path, None if body is None else json.dumps(body).encode()
    for _ in range(MAX_REDIRECTS + 1):
        reply = _send(base, url, data, timeout)
        if reply.status not in REDIRECTS:
            return reply
        url = _hop(base, path, url, reply)
        if reply.status == 303:         # "see other": a GET of that address, as HTTP says
            data = None
    raise LocalinferError(f"{base}{path} redirected more than {MAX_REDIRECTS} times")


def _send(base: str, url: str, data: bytes | None, timeout: float) -> Reply:
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    if key := os.environ.get(KEY_ENV):
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with _opener().open(request, timeout=timeout) as reply:
            return Reply(reply.status, reply.reason, reply.headers, reply.read())
    except urllib.error.HTTPError as e:
        with e:
            body = b"" if e.code in REDIRECTS else e.read()
            return Reply(e.code, str(e.reason), e.headers, body)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise LocalinferError(f"no server answered at {base} ({reason}); is `localinfer serve` "
                              "running there?") from None


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
