"""The listening socket and the uvicorn server on it.

The socket is bound before the model loads, so that a port in use is one line and exit 1 at once,
not after a minute of loading; uvicorn is then handed that very socket, so nothing can take the
port in between. On a stop asked for (SIGINT, SIGTERM) `on_exit` runs in the event loop before
uvicorn waits for the open connections: the answers under way end there (server/api.py says how)
and every response is complete when uvicorn closes its connection.
"""

from __future__ import annotations

import errno
import signal
import socket
from typing import Callable

from localinfer.errors import LocalinferError

GRACE_SECONDS = 10       # for the open responses to end after a stop; they end at once (on_exit)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR, so that a port
    whose last connections linger in TIME_WAIT is free); a refusal is a LocalinferError."""
    name = host.strip("[]")
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((name, port))
    except OSError as e:
        sock.close()
        raise LocalinferError(_why(e, host, port)) from None
    return sock


def _why(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use; stop what listens there or choose another "
                f"with --port")
    if e.errno == errno.EACCES:
        return f"port {port} on {host} needs privileges this process lacks; choose one above 1023"
    if isinstance(e, socket.gaierror):
        return f"cannot listen on {host}: the name does not resolve to an address"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: it is not an address of this machine"
    return f"cannot listen on {host} port {port}: {e.strerror or e}"


def run(app, sock: socket.socket, *, protocol, on_exit: Callable[[], None]) -> None:
    """Serve `app` on `sock` until SIGINT or SIGTERM; a stop asked for returns normally."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            on_exit()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="warning", access_log=False, http=protocol,
                            timeout_graceful_shutdown=GRACE_SECONDS, lifespan="off")
    # uvicorn raises the stop signal again once it is done, for the handler it found: a no-op
    # one makes that a normal return (exit 0, as a stop asked for is an end, not a failure).
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        Server(config).run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
