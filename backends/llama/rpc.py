"""Workers on other machines as llama.cpp devices: ggml's RPC backend, client side.

`localinfer worker` (or llama.cpp's own `rpc-server`) offers a machine's devices over TCP;
`connect` makes each worker's devices part of ggml's backend registry, where llama.cpp's default
device selection finds them (at the front of the list: llama_model_load_from_file) and where
`devices.read_registry` and the fit see their memory.

ggml aborts the whole process on any RPC failure (a refused connection, a failed greeting, a
reply of another size), waits for ever for a reply that does not come, and believes what a worker
says. So nothing reaches it unchecked: `probe` speaks the protocol's first messages itself, with
timeouts, and ggml then talks to each worker only through a relay of ours on loopback
(rpc_relay.py), which checks every reply the worker owes ggml, with deadlines, and turns what goes
wrong into one line naming the worker. The abort callback (`_install_abort_line`) stays as a last
net for an abort the relay did not prevent.

llama-cpp-python binds none of this: the functions are looked up through libllama's own handle
(engine.engine_ggml), the RPC ones through the registry's proc address, as llama.cpp's tools find
them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import socket
import struct
import sys
import threading
from dataclasses import dataclass

from localinfer.backends.llama import rpc_interrupts, rpc_relay
from localinfer.backends.llama.rpc_relay import (PROTOCOL_MAJOR, PROTOCOL_MINOR,  # noqa: F401
                                                 split_endpoint as _split, version_problem)
from localinfer.errors import LocalinferError, UsageError

DEFAULT_PORT = 50052
MAX_WORKERS = 16                  # GGML_RPC_MAX_SERVERS
MAX_DEVICES = 16                  # devices one worker may claim before we call it hostile
CONNECT_SECONDS = 5.0
ANSWER_SECONDS = 10.0
# The protocol's commands (enum rpc_cmd) and sizes this probe uses.
_GET_DEVICE_MEMORY, _HELLO, _DEVICE_COUNT = 11, 14, 15
_CAPS_SIZE = 24                   # RPC_CONN_CAPS_SIZE: zeros ask for plain TCP
# One label of a host name (RFC 1123): what the resolver's IDNA step takes without an error.
_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


class WorkerError(LocalinferError):
    """A worker that cannot be reached, does not answer, or speaks another protocol."""


@dataclass(frozen=True)
class Worker:
    endpoint: str                           # host:port, as given
    version: tuple[int, int, int]
    memory: tuple[tuple[int, int], ...]     # (free, total) bytes of each of its devices


# -- addresses -----------------------------------------------------------------------------------
def parse_endpoints(text: str, option: str = "--rpc") -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...] checked before ggml sees it: ggml aborts on an address it cannot
    parse, and splits host from port at the first colon (so no IPv6 literal)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"{option} takes HOST:PORT[,HOST:PORT...], not {text!r}")
    if len(parts) > MAX_WORKERS:
        raise UsageError(f"{option} names {len(parts)} workers; llama.cpp takes at most "
                         f"{MAX_WORKERS}")
    if len(set(parts)) != len(parts):
        raise UsageError(f"{option} names a worker twice: {text!r}")
    return tuple(_endpoint(p, option) for p in parts)


def _endpoint(part: str, option: str) -> str:
    host, sep, port = part.rpartition(":")
    if not sep or not host:
        raise UsageError(f"{option}: {part!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
    if ":" in host or host.startswith("["):
        raise UsageError(f"{option}: {part!r}: llama.cpp's RPC speaks IPv4 only; give an IPv4 "
                         "address or a host name")
    if not _is_host_name(host):
        raise UsageError(f"{option}: {host!r} is not a host name or IPv4 address")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{option}: {part!r}: the port must be 1 to 65535")
    return f"{host}:{int(port)}"


def _is_host_name(host: str) -> bool:
    """A host name or IPv4 address: labels of 1 to 63 letters, digits and inner hyphens, 253
    characters in all; `a..b` or a 64-character label would fail in the resolver's IDNA codec."""
    return len(host) <= 253 and all(_LABEL.match(label) for label in host.split("."))


# -- the protocol's first messages, spoken here with timeouts ------------------------------------
def probe(endpoint: str, *, connect_s: float = CONNECT_SECONDS,
          answer_s: float = ANSWER_SECONDS) -> Worker:
    """Ask a worker its protocol version and its devices' memory; a WorkerError saying why when
    it cannot. A worker serves one client at a time, so one busy with another does not answer."""
    host, port = _split(endpoint)
    try:
        with socket.create_connection((host, port), timeout=connect_s) as sock:
            sock.settimeout(answer_s)
            call = functools.partial(_call, endpoint, sock)
            major, minor, patch = call(_HELLO, bytes(_CAPS_SIZE), 4 + _CAPS_SIZE)[:3]
            if problem := version_problem(endpoint, major, minor, patch):
                raise WorkerError(problem)
            (count,) = struct.unpack("<I", call(_DEVICE_COUNT, b"", 4))
            if not 1 <= count <= MAX_DEVICES:
                raise WorkerError(f"worker {endpoint} reports {count} devices")
            memory = tuple(struct.unpack("<QQ", call(_GET_DEVICE_MEMORY,
                                                     struct.pack("<I", i), 16))
                           for i in range(count))
    except TimeoutError:
        raise WorkerError(f"worker {endpoint} did not answer within {answer_s:g} s: it may be "
                          "serving another client (a worker takes one at a time), or it is not "
                          "a localinfer/llama.cpp worker") from None
    except ConnectionRefusedError:
        raise WorkerError(f"nothing listens at {endpoint}: start `localinfer worker` there "
                          f"(see docs/distributed.md)") from None
    except socket.gaierror as e:
        raise WorkerError(f"cannot resolve the worker {host!r}: {e.strerror}") from None
    except OSError as e:
        raise WorkerError(f"cannot reach the worker {endpoint}: "
                          f"{e.strerror or type(e).__name__}") from None
    return Worker(endpoint, (major, minor, patch), tuple((min(f, t), t) for f, t in memory))


def _call(endpoint: str, sock: socket.socket, command: int, payload: bytes,
          answer_size: int) -> bytes:
    """One command: | cmd (1 byte) | size (8 bytes) | payload |, answered | size | answer |."""
    sock.sendall(struct.pack("<BQ", command, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _read(endpoint, sock, 8))
    if size != answer_size:
        raise WorkerError(f"worker {endpoint} answered {size} bytes where the protocol has "
                          f"{answer_size}: not a llama.cpp RPC server of this version")
    return _read(endpoint, sock, size)


def _read(endpoint: str, sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise WorkerError(f"worker {endpoint} closed the connection during its greeting")
        data += chunk
    return data


# -- ggml's side ---------------------------------------------------------------------------------
class _Ggml:
    """The registry and abort functions of the libggml beside the libllama that was loaded."""

    def __init__(self) -> None:
        from localinfer.backends.llama.engine import engine_ggml
        ggml = engine_ggml()          # libllama's handle: its libggml and libggml-base
        p = ctypes.c_void_p
        self.reg_by_name = ctypes.CFUNCTYPE(p, ctypes.c_char_p)(("ggml_backend_reg_by_name", ggml))
        self.reg_proc = ctypes.CFUNCTYPE(p, p, ctypes.c_char_p)(
            ("ggml_backend_reg_get_proc_address", ggml))
        self.register = ctypes.CFUNCTYPE(None, p)(("ggml_backend_register", ggml))
        self.set_abort = ctypes.CFUNCTYPE(p, p)(("ggml_set_abort_callback", ggml))

    def rpc_function(self, name: str, prototype):
        reg = self.reg_by_name(b"RPC")
        address = self.reg_proc(reg, name.encode()) if reg else None
        return prototype(address) if address else None


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    global _ggml
    if _ggml is None:
        _ggml = _Ggml()
    return _ggml


def supported() -> bool:
    """Whether the installed llama.cpp was built with the RPC backend (-DGGML_RPC=on)."""
    try:
        return bool(ggml().reg_by_name(b"RPC"))
    except (ImportError, OSError, AttributeError):
        return False


def build_hint() -> str:
    return ("this llama.cpp build has no RPC backend, so it cannot use workers: rebuild "
            "llama-cpp-python with CMAKE_ARGS=\"-DGGML_RPC=on\" (`localinfer devices` prints the "
            "command for this machine)")


# -- the workers of this process -----------------------------------------------------------------
_requested: tuple[str, ...] = ()
_connected: dict[str, Worker] = {}
_relays: dict[str, rpc_relay.Relay] = {}       # by the loopback address ggml was given
_refused: WorkerError | None = None             # once per request: a second ask waits no more
_lock = threading.Lock()
_abort_hook = None                 # the ctypes callback ggml holds: kept alive here


def request(endpoints: tuple[str, ...]) -> None:
    """The workers this process computes on (--rpc / LOCALINFER_RPC); connected on first need."""
    global _requested, _refused
    _requested, _refused = tuple(endpoints), None
    if endpoints:
        rpc_interrupts.watch_interrupts()    # here: the main thread, before ggml can wait in C


def requested() -> tuple[str, ...]:
    return _requested


def in_use() -> bool:
    """Whether workers of this process are in ggml's registry (llama.cpp places layers on them)."""
    return bool(_connected)


def connect() -> list[Worker]:
    """Put the requested workers into ggml's registry (once): each probed first, so a worker that
    is down, busy or of another version is one WorkerError; then given to ggml behind a relay of
    ours (rpc_relay), so that what it tells ggml's own connection is checked as well."""
    global _refused
    with _lock:
        missing = [e for e in _requested if e not in _connected]
        if not missing:
            return [_connected[e] for e in _requested]
        if _refused is not None:
            raise _refused
        if not supported():
            raise WorkerError(build_hint())
        rpc_interrupts.watch_interrupts()
        try:
            for worker in [probe(e) for e in missing]:
                _add(worker)
        except WorkerError as e:
            _refused = e
            raise
        return [_connected[e] for e in _requested]


def _add(worker: Worker) -> None:
    _install_abort_line()
    prototype = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
    add_server = ggml().rpc_function("ggml_backend_rpc_add_server", prototype)
    relay = rpc_relay.Relay(worker.endpoint, devices=len(worker.memory))
    relay.connecting = True
    try:
        reg = add_server(relay.local.encode())
    finally:
        relay.connecting = False
    if not reg:
        relay.close()
        if relay.interrupted:         # Python's handler ran inside a ggml log callback
            raise KeyboardInterrupt
        raise WorkerError(relay.failure or f"worker {worker.endpoint} offers no device")
    ggml().register(reg)
    _relays[relay.local] = relay
    _connected[worker.endpoint] = worker


def shown(description: str) -> str:
    """The worker an RPC device's description (the address ggml was given: a relay) stands for."""
    relay = _relays.get(description)
    return relay.endpoint if relay else description


def _install_abort_line() -> None:
    """A ggml abort while workers are in use is most likely one of them lost: say which in one
    line and exit 1 (ggml would print a file:line and a backtrace, then dump core)."""
    global _abort_hook
    if _abort_hook is not None:
        return

    @ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    def on_abort(message: bytes | None) -> None:
        text = (message or b"").decode("utf-8", "replace")
        if not any(word in text for word in ("RPC", "Remote", "Failed to connect")):
            sys.stderr.write(f"localinfer: error: llama.cpp aborted: {text}\n")
            sys.stderr.flush()
            return                      # ggml goes on to abort()
        sys.stderr.write(f"localinfer: error: {lost_line(tuple(_connected) or _requested)}\n")
        sys.stderr.flush()
        os._exit(1)

    _abort_hook = on_abort
    ggml().set_abort(ctypes.cast(on_abort, ctypes.c_void_p))


def lost_line(endpoints: tuple[str, ...]) -> str:
    """Which worker went away, found by knocking at each (a gone process refuses; a gone machine
    does not answer within a second or two)."""
    gone = [e for e in endpoints if not _knocks(e)]
    if gone:
        names = ", ".join(gone)
        return (f"lost the worker {names} mid-run (it stopped or its machine left the network); "
                "start it again and rerun")
    return (f"a worker stopped answering mid-run ({', '.join(endpoints)}); check them and rerun")


def _knocks(endpoint: str, tries: int = 10) -> bool:
    """Whether the worker's port still takes connections, asked a few times over a second: its
    process may still be closing its sockets when the lost connection is noticed."""
    import time
    for _ in range(tries):
        try:
            with socket.create_connection(_split(endpoint), timeout=2.0):
                pass
        except OSError:
            return False
        time.sleep(0.1)
    return True


def harden_sockets() -> int:
    """How many connections to workers this process holds. Each carries keepalive and a 15 s
    user timeout from its start (rpc_relay._harden): a worker whose machine vanishes (no FIN, no
    RST) fails the next send or wait within about 15-20 s instead of never."""
    return sum(relay.connections() for relay in _relays.values())
