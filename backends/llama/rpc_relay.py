"""A relay between ggml's RPC client and each worker: ggml never talks to a worker directly.

ggml's client (ggml-rpc.cpp) aborts the process on a refused connection, a failed greeting, a
short read or a reply of another size; it waits without end for a reply that does not come, inside
C, where Python's Ctrl-C handler cannot run; and it believes what a worker says: 2^32-1 devices
become 2^32-1 device objects, an alignment of 0 or a buffer smaller than asked an assertion. Our
probe (rpc.probe) asks a worker first, but a worker may answer the probe well and ggml badly.

So ggml connects to a loopback port of ours, one per worker, and each of its connections is
carried to the worker over one of ours: bytes pass unchanged, framed as the protocol frames them,
and each reply the worker owes is checked before ggml reads a byte of it: its size, the values ggml
would trust (`check`), and that it comes in time. A failure is one line naming the worker:

- while rpc.connect adds the worker (ggml_backend_rpc_add_server sends HELLO, then DEVICE_COUNT)
  the relay answers ggml itself, a well-formed greeting and zero devices, so ggml returns "no
  device" and connect raises a WorkerError with the reason;
- later nothing ggml could be told leaves it unharmed, so the relay writes the line and ends the
  process (exit 1), as a worker lost mid-run always did; ggml never reads the bad reply.

Ctrl-C: Python runs its SIGINT handler only once the main thread is back from C, and ggml waits for
a reply inside C; if a press still waits GRACE_SECONDS later while a worker owes ggml a reply,
the relay ends the process (exit 130; rpc_interrupts.py says how a press is seen).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from localinfer.backends.llama.rpc_interrupts import end_process, interrupt_pending

# ggml-rpc.h of the llama.cpp that llama-cpp-python 0.3.36 vendors: a worker must speak the same
# major version and no newer minor one (ggml's own rule in negotiate_hello).
PROTOCOL_MAJOR, PROTOCOL_MINOR = 7, 0
# enum rpc_cmd (ggml-rpc.cpp, protocol 7).
(ALLOC_BUFFER, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR,
 SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GRAPH_COMPUTE, GET_DEVICE_MEMORY, INIT_TENSOR,
 GET_ALLOC_SIZE, HELLO, DEVICE_COUNT, GRAPH_RECOMPUTE, MEMSET_TENSOR) = range(18)
NAMES = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER",
         "BUFFER_CLEAR", "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR",
         "GRAPH_COMPUTE", "GET_DEVICE_MEMORY", "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO",
         "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR")
# The size of each reply, as rpc_serve_client sends it (commands without one are absent);
# GET_TENSOR's is the size its request asks for (the request's last 8 bytes).
REPLY_SIZE = {ALLOC_BUFFER: 16, GET_ALIGNMENT: 8, GET_MAX_SIZE: 8, BUFFER_GET_BASE: 8,
              SET_TENSOR_HASH: 1, COPY_TENSOR: 1, GET_DEVICE_MEMORY: 16, GET_ALLOC_SIZE: 8,
              DEVICE_COUNT: 4, HELLO: 28}
# Commands after which a worker may compute or copy for long before its next reply.
HEAVY = frozenset({SET_TENSOR, SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GRAPH_COMPUTE,
                   GRAPH_RECOMPUTE, BUFFER_CLEAR, MEMSET_TENSOR})
CAPS_SIZE = 24
MAX_ALIGNMENT = 1 << 20
MAX_ALLOC_SIZE = 1 << 48          # one tensor; sums of these stay far from 2^64
ANSWER_SECONDS = 10.0             # a reply that follows no computation (as rpc.probe waits)
COMPUTE_SECONDS = 300.0           # a reply that may wait for batches computed before it
CONNECT_SECONDS = 5.0
GRACE_SECONDS = 2.0               # for Python to take a Ctrl-C before the relay ends the process
_TICK = 0.1
_SMALL = 1 << 16                  # requests and replies read whole; larger ones stream
_CHUNK = 1 << 20


class Refused(Exception):
    """What the worker did wrong, as the line that names it."""


class Interrupted(Exception):
    """Ctrl-C while the worker owed a reply."""


class Relay:
    """A loopback port that ggml's client takes for `endpoint`'s worker."""

    def __init__(self, endpoint: str, devices: int) -> None:
        self.endpoint = endpoint
        self.devices = devices              # as the probe found them; ggml must hear the same
        self.connecting = False             # rpc.connect is adding the worker: refuse gracefully
        self.failure: str | None = None     # why it was refused then
        self.interrupted = False            # Ctrl-C came then
        self.live: set[_Conversation] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.local = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"rpc-relay {endpoint}", daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def connections(self) -> int:
        """Connections to the worker open now."""
        return sum(c.up is not None for c in list(self.live))

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            conversation = _Conversation(self, down)
            threading.Thread(target=conversation.run, daemon=True).start()


class _Conversation:
    """One connection of ggml's, carried to the worker over one of ours."""

    def __init__(self, relay: Relay, down: socket.socket) -> None:
        self.relay, self.down = relay, down
        self.inbox = _Inbox(down)
        self.outbox = bytearray()           # commands for the worker, sent together
        self.graceful = relay.connecting
        self.up: socket.socket | None = None
        self.owed: int | None = None        # the command whose reply ggml waits for
        self.since = 0.0                    # since when ggml waits
        self.pending_work = False           # the worker may still be computing
        self.buffers: dict[int, int] = {}   # remote buffer -> its size (ALLOC_BUFFER)
        down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self) -> None:
        self.relay.live.add(self)
        try:
            while (head := self.inbox.take(9)) is not None:   # ggml may idle for long
                command, size = struct.unpack("<BQ", head)
                self.owed = command if command in REPLY_SIZE or command == GET_TENSOR else None
                self.since = time.monotonic()
                self._one(command, size, head)
                self.owed = None
        except (Refused, Interrupted) as e:
            self._refuse(e)
        except OSError:
            pass                            # ggml closed its side: the conversation is over
        finally:
            self.relay.live.discard(self)
            for sock in (self.down, self.up):
                if sock is not None:
                    sock.close()

    def _one(self, command: int, size: int, head: bytes) -> None:
        if command == HELLO:
            self.inbox.take(size)           # ggml's transport caps: plain TCP through here
            self.down.sendall(struct.pack("<Q", 28) + self._hello() + bytes(CAPS_SIZE))
            return
        if command >= len(NAMES) or self.up is None:
            raise Refused(f"ggml sent RPC command {command} out of turn")   # never: ggml's own
        request = self._pass_request(head, size)
        expected = REPLY_SIZE.get(command)
        if command == GET_TENSOR:
            expected = struct.unpack_from("<Q", request, len(request) - 8)[0]
        if expected is None:
            self.pending_work |= command in HEAVY
            if not self.inbox.holds_command():   # else more of ggml's follow: one send for all
                self._flush()
            return
        self._flush()
        heavy = self.pending_work or command in HEAVY
        small = expected <= _SMALL
        head = self._recv_up(8, heavy, more=expected if small else 0)   # mostly one read
        (got,) = struct.unpack_from("<Q", head)
        if got != expected:
            raise Refused(f"worker {self.relay.endpoint} answered {got} bytes to "
                          f"{NAMES[command]} where the protocol has {expected}: not a llama.cpp "
                          "RPC server of this version")
        if small:
            body = head[8:] + self._recv_up(expected + 8 - len(head), heavy)
            reply = check(self.relay, command, request, body, self.buffers)
            self.down.sendall(struct.pack("<Q", expected) + reply)
        else:
            self.down.sendall(struct.pack("<Q", expected))
            self._stream(expected, heavy)
        self.pending_work = False

    def _hello(self) -> bytes:
        """Open the connection to the worker and greet it; its version, checked."""
        endpoint = self.relay.endpoint
        try:
            self.up = socket.create_connection(split_endpoint(endpoint), timeout=CONNECT_SECONDS)
        except ConnectionRefusedError:
            raise Refused(f"nothing listens at {endpoint} any more: start `localinfer worker` "
                          "there again (see docs/distributed.md)") from None
        except OSError as e:
            raise Refused(f"cannot reach the worker {endpoint}: "
                          f"{e.strerror or type(e).__name__}") from None
        _harden(self.up)
        self.up.settimeout(_TICK)           # waits in ticks: a deadline and Ctrl-C between them
        self._send_up(struct.pack("<BQ", HELLO, CAPS_SIZE) + bytes(CAPS_SIZE))
        (size,) = struct.unpack("<Q", self._recv_up(8, False))
        if size != REPLY_SIZE[HELLO]:
            raise Refused(f"worker {endpoint} answered {size} bytes to HELLO where the protocol "
                          f"has {REPLY_SIZE[HELLO]}: not a llama.cpp RPC server of this version")
        version = self._recv_up(size, False)[:3]
        if problem := version_problem(endpoint, *version):
            raise Refused(problem)
        return version + b"\0"

    # -- bytes through -----------------------------------------------------------------------
    def _pass_request(self, head: bytes, size: int) -> bytes:
        """Queue a command for the worker; its payload when small (the reply's checks read it)."""
        if size <= _SMALL:
            payload = self.inbox.take(size)
            if payload is None:
                raise OSError("ggml closed mid-command")
            self.outbox += head + payload
            return payload
        self.outbox += head
        self._flush()
        for piece in self.inbox.pieces(size):
            self._send_up(piece)
        return b""

    def _flush(self) -> None:
        if self.outbox:
            self._send_up(self.outbox)
            self.outbox = bytearray()

    def _stream(self, size: int, heavy: bool) -> None:
        left = size
        while left:
            chunk = self._recv_up(min(left, _CHUNK), heavy)
            self.down.sendall(chunk)
            left -= len(chunk)

    def _send_up(self, data) -> None:
        view, last = memoryview(data), time.monotonic()
        assert self.up is not None
        while view:
            try:
                n = self.up.send(view)
            except TimeoutError:             # the worker reads no more: busy, or stopped
                last = self._waited(last, heavy=True)
                continue
            except OSError:
                raise Refused(self._lost()) from None
            view, last = view[n:], time.monotonic()

    def _recv_up(self, size: int, heavy: bool, more: int = 0) -> bytes:
        """`size` bytes from the worker, or up to `more` beyond them if they are there."""
        data, last = bytearray(), time.monotonic()
        assert self.up is not None
        while len(data) < size:
            try:
                chunk = self.up.recv(size + more - len(data))
            except TimeoutError:
                last = self._waited(last, heavy)
                continue
            except OSError:
                raise Refused(self._lost()) from None
            if not chunk:
                raise Refused(self._lost())
            data += chunk
            last = time.monotonic()
        return bytes(data)

    def _waited(self, last: float, heavy: bool) -> float:
        """A tick without a byte: the deadline, then Ctrl-C; returns `last` unchanged."""
        now = time.monotonic()
        limit = COMPUTE_SECONDS if heavy and not self.graceful else ANSWER_SECONDS
        if now - last > limit:
            what = "mid-run " if not self.graceful else ""
            raise Refused(f"worker {self.relay.endpoint} did not answer within {limit:g} s "
                          f"{what}(it may be serving another client, stopped, or not a "
                          "localinfer/llama.cpp worker); check it and rerun")
        if interrupt_pending(0.0 if self.graceful else GRACE_SECONDS, self.since):
            raise Interrupted(now - last)
        return last

    def _lost(self) -> str:
        if self.graceful:
            return f"worker {self.relay.endpoint} closed the connection after answering the probe"
        return (f"lost the worker {self.relay.endpoint} mid-run (it stopped or its machine left "
                "the network); start it again and rerun")

    # -- failure -------------------------------------------------------------------------------
    def _refuse(self, why: Exception) -> None:
        endpoint = self.relay.endpoint
        if isinstance(why, Interrupted):
            line = (f"localinfer: interrupted while the worker {endpoint} had not answered for "
                    f"{why.args[0]:.0f} s")
            if not self.graceful:
                end_process(line, 130)
            self.relay.failure = f"interrupted while waiting for the worker {endpoint}"
            self.relay.interrupted = True
        elif not self.graceful:
            end_process(f"localinfer: error: {why}", 1)
        else:
            self.relay.failure = str(why)
        self._answer_no_device()

    def _answer_no_device(self) -> None:
        """What ggml_backend_rpc_add_server asks (HELLO, then DEVICE_COUNT), answered so that
        it returns no device: a greeting of our own version, then zero devices; the command
        under way first."""
        hello = bytes([PROTOCOL_MAJOR, PROTOCOL_MINOR, 0, 0]) + bytes(CAPS_SIZE)
        answers = {HELLO: hello, DEVICE_COUNT: struct.pack("<I", 0)}
        owed = self.owed
        try:
            while True:
                if owed in answers:
                    self.down.sendall(struct.pack("<Q", len(answers[owed])) + answers[owed])
                head = self.inbox.take(9)
                if head is None:
                    return
                owed, size = struct.unpack("<BQ", head)
                if size > _SMALL or self.inbox.take(size) is None:
                    return
        except OSError:
            return


def version_problem(endpoint: str, major: int, minor: int, patch: int) -> str | None:
    """Why a worker of this protocol version cannot serve ggml here, if it cannot."""
    if major == PROTOCOL_MAJOR and minor <= PROTOCOL_MINOR:
        return None
    return (f"worker {endpoint} speaks RPC protocol {major}.{minor}.{patch}; this llama.cpp "
            f"speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}: run the same llama.cpp (localinfer and "
            "llama-cpp-python versions) on both machines")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def check(relay: Relay, command: int, request: bytes, reply: bytes,
          buffers: dict[int, int]) -> bytes:
    """A reply of the right size, checked for the values ggml would believe unchecked (each
    ends in an allocation, an assertion or an abort there); returns what ggml reads."""
    endpoint = relay.endpoint
    if command == DEVICE_COUNT:
        (count,) = struct.unpack("<I", reply)
        if not 1 <= count <= 16:
            raise Refused(f"worker {endpoint} reports {count} devices")
        if count != relay.devices:
            said = f"{relay.devices} device{'s' * (relay.devices != 1)}"
            raise Refused(f"worker {endpoint} reported {said} to the first question and "
                          f"{count} to the second")
    elif command == GET_DEVICE_MEMORY:
        free, total = struct.unpack("<QQ", reply)
        return struct.pack("<QQ", min(free, total), total)
    elif command == GET_ALIGNMENT:
        (alignment,) = struct.unpack("<Q", reply)
        if not alignment or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
            raise Refused(f"worker {endpoint} reports an alignment of {alignment} bytes")
    elif command == GET_MAX_SIZE:
        if not struct.unpack("<Q", reply)[0]:
            raise Refused(f"worker {endpoint} reports a largest buffer of 0 bytes")
    elif command == GET_ALLOC_SIZE:
        (size,) = struct.unpack("<Q", reply)
        if size > MAX_ALLOC_SIZE:
            raise Refused(f"worker {endpoint} reports {size} bytes for one tensor")
    elif command == ALLOC_BUFFER:
        (asked,) = struct.unpack_from("<Q", request, 4)
        remote, size = struct.unpack("<QQ", reply)
        if remote and not asked <= size < 1 << 62:
            raise Refused(f"worker {endpoint} answered a request for {asked} bytes with a "
                          f"buffer of {size}")
        if remote:
            buffers[remote] = size
    elif command == BUFFER_GET_BASE:
        (remote,) = struct.unpack("<Q", request)
        (base,) = struct.unpack("<Q", reply)
        if not base or base + buffers.get(remote, 0) >= 1 << 64:
            raise Refused(f"worker {endpoint} reports a buffer at address {base:#x}")
    elif command in (SET_TENSOR_HASH, COPY_TENSOR) and reply[0] > 1:
        raise Refused(f"worker {endpoint} answered {reply[0]} to {NAMES[command]}, a yes or no")
    return reply


class _Inbox:
    """ggml's side, read in as large pieces as are there: ggml sends a command in three writes and
    a token's commands back to back, which arrive here in one or two reads (blocking: ggml may
    idle for long)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, bytearray()

    def take(self, size: int) -> bytes | None:
        """`size` bytes; None when ggml closed."""
        wait_all = 0
        while len(self.data) < size:       # what is there, then (one call) the rest
            want = size - len(self.data)
            chunk = self.sock.recv(want if wait_all else max(want, _SMALL), wait_all)
            if not chunk:
                return None
            self.data += chunk
            wait_all = socket.MSG_WAITALL
        taken = bytes(self.data[:size])
        del self.data[:size]
        return taken

    def holds_command(self) -> bool:
        return len(self.data) >= 9

    def pieces(self, size: int):
        """A large payload in pieces of at most _CHUNK bytes, what was read ahead first."""
        ahead = bytes(self.data[:size])
        del self.data[:size]
        if ahead:
            yield ahead
        left, buffer = size - len(ahead), memoryview(bytearray(_CHUNK))
        while left:
            n = self.sock.recv_into(buffer, min(left, _CHUNK))
            if not n:
                raise OSError("ggml closed mid-command")
            yield buffer[:n]
            left -= n


def _harden(sock: socket.socket) -> None:
    """Keepalive and a user timeout: a worker whose machine vanishes (no FIN, no RST) fails the
    next send or wait within about 15 s instead of never (Linux; elsewhere keepalive alone)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3),
                          ("TCP_USER_TIMEOUT", 15_000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
