"""An http(s) URL's medium, for `serve --allow-remote-media` only: off by default, since it makes
the server fetch whatever address a client names (its own network included). Bounded: MAX_BYTES
(Content-Length refused before the body, the body cut past it), REMOTE_SECONDS for the whole
fetch, redirects to http(s) only, at most a few."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from localinfer.media.check import check
from localinfer.media.value import MAX_BYTES, Kind, Media, MediaError

REMOTE_SECONDS = 10.0
_CHUNK = 64 << 10
_MAX_REDIRECTS = 3


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = _MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not is_remote(newurl):
            raise urllib.error.HTTPError(newurl, code, "redirected away from http(s)", headers,
                                         fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def is_remote(url) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def fetch(url: str, what: str, expect: Kind | None = None, *,
          seconds: float = REMOTE_SECONDS) -> Media:
    """The medium at `url`, or a MediaError naming `what` and why."""
    deadline = time.monotonic() + seconds
    opener = urllib.request.build_opener(_Redirects)
    request = urllib.request.Request(url, headers={"User-Agent": "localinfer"})
    chunks, total = [], 0
    try:
        with opener.open(request, timeout=seconds) as reply:
            size = reply.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > MAX_BYTES:
                raise _too_big(what)
            while chunk := reply.read1(_CHUNK):      # what has come, not a whole chunk
                total += len(chunk)
                if total > MAX_BYTES:
                    raise _too_big(what)
                if time.monotonic() > deadline:
                    raise MediaError(f"{what}: {url[:200]} did not arrive within {seconds:g} s")
                chunks.append(chunk)
    except urllib.error.HTTPError as e:
        raise MediaError(f"{what}: {url[:200]} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise MediaError(f"{what}: cannot fetch {url[:200]}: {reason}") from None
    return check(b"".join(chunks), what, expect)


def _too_big(what: str) -> MediaError:
    return MediaError(f"{what}: the remote file is over {MAX_BYTES >> 20} MB, the most a medium "
                      "may have")
