"""Worker addresses and the protocol's greeting (issue 30, items 1, 2 and 4), before ggml sees any.

ggml aborts the process on an address it cannot parse, a refused connection or a failed greeting,
so these are checked here first. The servers that misbehave (silent, another protocol version,
nonsense) are small sockets in this test: llama.cpp's own server never does those things, and a
real worker answers in tests/test_rpc_workers.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from localinfer.backends.llama import rpc
from localinfer.errors import UsageError
from helpers import error_line, free_port, run_cli


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:50052", ("127.0.0.1:50052",)),
    ("gpu-box:50052, 10.0.0.3:50053", ("gpu-box:50052", "10.0.0.3:50053")),
    ("host.lan:0050052", ("host.lan:50052",)),
])
def test_worker_addresses_are_read(text, expected):
    assert rpc.parse_endpoints(text) == expected


@pytest.mark.parametrize("text,says", [
    ("", "HOST:PORT"), ("a:1,,b:2", "HOST:PORT"), ("gpu-box", "not HOST:PORT"),
    (":50052", "not HOST:PORT"), ("[::1]:50052", "IPv4 only"), ("fe80::1:50052", "IPv4 only"),
    ("host:0", "1 to 65535"), ("host:70000", "1 to 65535"), ("host:5x", "1 to 65535"),
    ("bad host:1", "not a host name"), ("a:1,a:1", "twice"),
    # what the resolver's IDNA codec refuses with a UnicodeError (issue 41, item 14)
    ("a..b:1", "not a host name"), (f"{'a' * 64}.lan:1", "not a host name"),
    (f"{'a' * 63}.{'b' * 63}.{'c' * 63}.{'d' * 63}:1", "not a host name"),
    ("ab-.lan:1", "not a host name"), ("host.lan.:1", "not a host name"),
    (",".join(f"h{i}:1" for i in range(17)), "at most 16"),
])
def test_bad_worker_addresses_are_refused(text, says):
    with pytest.raises(UsageError, match=says):
        rpc.parse_endpoints(text)


def serve_once(answer) -> int:
    """A one-connection TCP server on a free port that hands the connection to `answer`."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def run():
        with listener:
            conn, _ = listener.accept()
            with conn:
                answer(conn)
    threading.Thread(target=run, daemon=True).start()
    return port


def read_command(conn) -> tuple[int, bytes]:
    command, size = struct.unpack("<BQ", conn.recv(9, socket.MSG_WAITALL))
    return command, conn.recv(size, socket.MSG_WAITALL) if size else b""


def test_nothing_listening_is_one_line_at_once():
    start = time.monotonic()
    with pytest.raises(rpc.WorkerError, match="nothing listens at 127.0.0.1"):
        rpc.probe(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - start < 2


def test_a_worker_that_never_answers_is_given_up_on():
    port = serve_once(lambda conn: time.sleep(5))
    start = time.monotonic()
    with pytest.raises(rpc.WorkerError, match="did not answer within 1 s.*another client"):
        rpc.probe(f"127.0.0.1:{port}", answer_s=1.0)
    assert time.monotonic() - start < 3


def test_a_worker_of_another_protocol_version_is_named():
    def answer(conn):
        command, payload = read_command(conn)
        assert command == 14 and len(payload) == 24          # HELLO with the connection caps
        conn.sendall(struct.pack("<Q", 28) + bytes([6, 1, 2, 0]) + bytes(24))
    port = serve_once(answer)
    with pytest.raises(rpc.WorkerError, match=r"speaks RPC protocol 6\.1\.2.*speaks 7\.0"):
        rpc.probe(f"127.0.0.1:{port}")


def test_a_server_that_is_no_worker_is_refused():
    port = serve_once(lambda conn: (read_command(conn), conn.sendall(b"HTTP/1.1 400 Bad\r\n\r\n")))
    with pytest.raises(rpc.WorkerError, match="not a llama.cpp RPC server"):
        rpc.probe(f"127.0.0.1:{port}")


def test_a_worker_claiming_absurd_devices_is_refused():
    def answer(conn):
        read_command(conn)
        conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))
        assert read_command(conn)[0] == 15                    # DEVICE_COUNT
        conn.sendall(struct.pack("<QI", 4, 100_000))
    port = serve_once(answer)
    with pytest.raises(rpc.WorkerError, match="reports 100000 devices"):
        rpc.probe(f"127.0.0.1:{port}")


def test_the_worker_command_refuses_a_remote_address_without_the_flag():
    result = run_cli("worker", "--host", "0.0.0.0")
    assert result.returncode == 2
    assert "--allow-remote" in error_line(result) and "SSH tunnel" in error_line(result)


@pytest.mark.parametrize("args,code,says", [
    (["--host", "not-a-host.invalid"], 2, "not an IPv4 address"),
    (["--host", "a..b"], 2, "not an IPv4 address"),
    (["--device", "NPU7"], 2, "not a device of this llama.cpp build (it has: CPU"),
    (["--memory", "lots"], 2, "--memory"),
])
def test_the_worker_command_refuses_bad_values(args, code, says):
    result = run_cli("worker", "--port", str(free_port()), *args)
    assert result.returncode == code, result.stderr
    assert says in error_line(result)


def test_run_refuses_bad_rpc_values_in_one_line():
    result = run_cli("run", "smollm2", "hi", "--rpc", "[::1]:50052")
    assert result.returncode == 2 and "IPv4 only" in error_line(result)
    result = run_cli("run", "smollm2", "hi", env={"LOCALINFER_RPC": "gpu-box"})
    assert result.returncode == 2 and "LOCALINFER_RPC" in error_line(result)
    result = run_cli("devices", env={"LOCALINFER_RPC": "a..b:1"})
    assert result.returncode == 2 and "LOCALINFER_RPC: 'a..b' is not a host name" in \
        error_line(result)
