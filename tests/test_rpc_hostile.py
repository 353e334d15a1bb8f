"""What a worker may do to us (issue 41, items 10-14): the probe and ggml's connection are two
conversations, and a worker may answer the first correctly and then say anything, or nothing, on
the second. Whatever it does, the client ends in one line naming it, in bounded time and memory,
Ctrl-C ends it, and nothing aborts.

The workers here are small sockets that answer the probe as llama.cpp's server does and then
misbehave (llama.cpp's own server never does); the commands run as users run them and load no
model (`devices --rpc` connects the workers and reads their memory), so each takes seconds. What a
worker may do mid-run is shown by a proxy in front of a real `localinfer worker` that turns
hostile once the model answers (`Turning`, the slow tests at the end).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from localinfer.backends.llama import rpc, rpc_relay
from helpers import ERROR, MODELS_HOME, run_cli

pytestmark = pytest.mark.skipif(
    not rpc.supported() and os.environ.get("CI") != "true",
    reason="this llama.cpp build has no RPC backend (-DGGML_RPC=on)")

HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY, GET_ALIGNMENT, GET_MAX_SIZE = 14, 15, 11, 1, 2
VERSION = bytes([7, 0, 0, 0])


def read_command(conn: socket.socket) -> tuple[int, bytes] | None:
    head = conn.recv(9, socket.MSG_WAITALL)
    if len(head) < 9:
        return None
    command, size = struct.unpack("<BQ", head)
    return command, conn.recv(size, socket.MSG_WAITALL) if size else b""


def reply(conn: socket.socket, payload: bytes) -> None:
    conn.sendall(struct.pack("<Q", len(payload)) + payload)


def honest(conn: socket.socket, devices: int = 1, before_memory=lambda: None) -> None:
    """A conversation as llama.cpp's rpc-server holds it, for the commands a probe and `devices`
    send: a CPU device offering 1 GB of 2."""
    answers = {DEVICE_COUNT: lambda _: struct.pack("<I", devices),
               GET_DEVICE_MEMORY: lambda _: struct.pack("<QQ", 10**9, 2 * 10**9),
               GET_ALIGNMENT: lambda _: struct.pack("<Q", 32),
               GET_MAX_SIZE: lambda _: struct.pack("<Q", 2**63)}
    while (command := read_command(conn)) is not None:
        if command[0] == HELLO:
            reply(conn, VERSION + bytes(24))
        elif command[0] in answers:
            if command[0] == GET_DEVICE_MEMORY:
                before_memory()
            reply(conn, answers[command[0]](command[1]))
        else:
            return


class Worker:
    """A worker that holds its first conversation (our probe) honestly and every later one (ggml's
    own connection) with `later`; `vanish` closes its port as the probe ends."""

    def __init__(self, later: Callable[[socket.socket], None] = honest, *,
                 vanish: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.later, self.vanish = later, vanish
        self.conversations = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with self.listener:
            while True:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    return
                self.conversations += 1
                first = self.conversations == 1
                threading.Thread(target=self._talk, args=(conn, first), daemon=True).start()

    def _talk(self, conn: socket.socket, first: bool) -> None:
        with conn:
            try:
                if first:    # the probe's last answer comes after the port closed
                    honest(conn, before_memory=self.listener.close if self.vanish else lambda: None)
                else:
                    self.later(conn)
            except OSError:
                pass


def greet_then(answer: Callable[[socket.socket, tuple[int, bytes]], None]):
    """A later conversation that answers HELLO honestly and hands the next command to `answer`."""
    def talk(conn: socket.socket) -> None:
        read_command(conn)
        reply(conn, VERSION + bytes(24))
        command = read_command(conn)
        if command is not None:
            answer(conn, command)
            time.sleep(30)
    return talk


def many_devices(conn, command):
    reply(conn, struct.pack("<I", 2**32 - 1))


def silent(conn: socket.socket) -> None:
    time.sleep(60)


def another_version(conn: socket.socket) -> None:
    read_command(conn)
    reply(conn, bytes([6, 1, 2, 0]) + bytes(24))
    time.sleep(30)


def hangs_up(conn: socket.socket) -> None:
    pass


def devices_of(worker: Worker, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_cli("devices", "--rpc", worker.address, timeout=timeout)


def assert_one_line_naming(result: subprocess.CompletedProcess, worker: Worker, says: str):
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(ERROR) and worker.address in lines[0], lines
    assert says in lines[0], lines[0]


@pytest.mark.parametrize("later,says", [
    (greet_then(many_devices), "4294967295 devices"),
    (greet_then(lambda conn, command: reply(conn, struct.pack("<I", 2))),
     "reported 1 device to the first question and 2"),
    (greet_then(lambda conn, command: reply(conn, struct.pack("<Q", 1))),
     "answered 8 bytes"),
    (another_version, "speaks RPC protocol 6.1.2"),
    (hangs_up, "closed the connection"),
], ids=["2^32-1 devices", "another count", "wrong size", "another version", "hangs up"])
def test_a_worker_that_says_one_thing_to_the_probe_and_another_to_ggml(later, says):
    worker = Worker(later)
    start = time.monotonic()
    result = devices_of(worker)
    assert time.monotonic() - start < 20
    assert_one_line_naming(result, worker, says)


def test_a_worker_gone_between_the_probe_and_ggml_is_one_line_not_an_abort():
    worker = Worker(vanish=True)
    result = devices_of(worker)
    assert result.returncode != -signal.SIGABRT and "ggml" not in result.stderr
    assert_one_line_naming(result, worker, "nothing listens at")


def test_a_worker_that_never_answers_ggml_is_given_up_on():
    """The relay's deadline made 2 s in this run: the same giving up, sooner. (Its default is
    10 s, as the probe's, whose whole wait test_rpc_workers'
    test_serve_answers_with_layers_on_a_worker sits out on a busy real worker.)"""
    worker = Worker(silent)
    code = ("import localinfer.backends.llama.rpc_relay as relay; relay.ANSWER_SECONDS = 2\n"
            "import sys; from localinfer.cli.app import main\n"
            f"sys.argv = ['localinfer', 'devices', '--rpc', {worker.address!r}]; main()")
    start = time.monotonic()
    env = {**os.environ, "LOCALINFER_HOME": str(MODELS_HOME), "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=60, env=env)
    assert time.monotonic() - start < 15
    assert_one_line_naming(result, worker, "did not answer within 2 s")


def _own_session() -> None:
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)     # not ignored, as a background job has it


def interrupt_after(args: list[str], seconds: float) -> tuple[int, str, float]:
    """Run the CLI in a session of its own (SIGINT as the terminal sends it, not ignored as in a
    background job), press Ctrl-C after `seconds`; its exit code, stderr and how long it took
    to end after the Ctrl-C."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "localinfer", *args], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_own_session,
        env={**os.environ, "LOCALINFER_HOME": str(MODELS_HOME), "NO_COLOR": "1"})
    try:
        time.sleep(seconds)
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        return proc.returncode, err, time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_ends_a_wait_for_a_silent_worker():
    worker = Worker(silent)
    code, err, took = interrupt_after(["devices", "--rpc", worker.address], 4)
    assert code == 130, err
    assert took < 5
    assert "Traceback" not in err


@pytest.mark.parametrize("command,request_,answer,says", [
    (rpc_relay.DEVICE_COUNT, b"", struct.pack("<I", 0), "reports 0 devices"),
    (rpc_relay.GET_ALIGNMENT, b"", struct.pack("<Q", 0), "an alignment of 0 bytes"),
    (rpc_relay.GET_ALIGNMENT, b"", struct.pack("<Q", 48), "an alignment of 48 bytes"),
    (rpc_relay.GET_ALIGNMENT, b"", struct.pack("<Q", 1 << 21), "an alignment of 2097152"),
    (rpc_relay.GET_MAX_SIZE, b"", struct.pack("<Q", 0), "a largest buffer of 0 bytes"),
    (rpc_relay.GET_ALLOC_SIZE, b"", struct.pack("<Q", 2**64 - 1), "bytes for one tensor"),
    (rpc_relay.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096), struct.pack("<QQ", 0x1000, 4095),
     "a request for 4096 bytes with a buffer of 4095"),
    (rpc_relay.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096), struct.pack("<QQ", 0x1000, 2**63),
     "with a buffer of 9223372036854775808"),
    (rpc_relay.BUFFER_GET_BASE, struct.pack("<Q", 7), struct.pack("<Q", 0), "at address 0x0"),
    (rpc_relay.BUFFER_GET_BASE, struct.pack("<Q", 7), struct.pack("<Q", 2**64 - 4096),
     "at address 0xfffffffffffff000"),
    (rpc_relay.SET_TENSOR_HASH, b"", b"\x07", "answered 7 to SET_TENSOR_HASH, a yes or no"),
    (rpc_relay.COPY_TENSOR, b"", b"\x02", "answered 2 to COPY_TENSOR"),
])
def test_what_ggml_would_believe_is_checked_first(command, request_, answer, says):
    """Each of these ends in an allocation, an assertion or an abort inside ggml."""
    relay = rpc_relay.Relay("worker-box:50052", devices=1)
    try:
        with pytest.raises(rpc_relay.Refused, match=f"^worker worker-box:50052 .*{says}"):
            rpc_relay.check(relay, command, request_, answer, {7: 8192})
    finally:
        relay.close()


def test_what_a_worker_may_say_passes_unchanged_or_made_consistent():
    relay = rpc_relay.Relay("worker-box:50052", devices=2)
    try:
        buffers: dict[int, int] = {}
        fine = [(rpc_relay.DEVICE_COUNT, b"", struct.pack("<I", 2)),
                (rpc_relay.GET_ALIGNMENT, b"", struct.pack("<Q", 128)),
                (rpc_relay.GET_MAX_SIZE, b"", struct.pack("<Q", 2**64 - 1)),
                (rpc_relay.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096), struct.pack("<QQ", 0, 0)),
                (rpc_relay.ALLOC_BUFFER, struct.pack("<IQ", 0, 100), struct.pack("<QQ", 9, 512)),
                (rpc_relay.BUFFER_GET_BASE, struct.pack("<Q", 9), struct.pack("<Q", 2**63))]
        for command, request_, answer in fine:
            assert rpc_relay.check(relay, command, request_, answer, buffers) == answer
        more_free_than_total = struct.pack("<QQ", 10**12, 10**9)
        assert rpc_relay.check(relay, rpc_relay.GET_DEVICE_MEMORY, b"", more_free_than_total,
                               buffers) == struct.pack("<QQ", 10**9, 10**9)
    finally:
        relay.close()


@pytest.mark.slow
def test_serve_with_a_worker_gone_before_ggml_connects_is_one_line(models_home):
    worker = Worker(vanish=True)
    result = run_cli("serve", "smollm2", "--rpc", worker.address, "--offline", timeout=120)
    assert result.returncode != -signal.SIGABRT
    assert_one_line_naming(result, worker, "nothing listens at")


# -- mid-run: a real worker behind a proxy that turns hostile once the model is loaded -------------
REPLY_SIZE = {0: 16, 1: 8, 2: 8, 3: 8, 7: 1, 9: 1, 11: 16, 13: 8, 14: 28, 15: 4}
ALLOC_BUFFER, GET_TENSOR = 0, 8


class Turning:
    """A proxy to a real `localinfer worker` that passes every conversation through as it is,
    until the `after`-th GET_TENSOR reply (the model is loaded and answering by then); from there
    `turn(client, reply)` answers the client instead. `alloc` rewrites ALLOC_BUFFER replies."""

    def __init__(self, worker: str, turn=None, *, after: int = 10, alloc=None) -> None:
        self.worker, self.turn, self.after, self.alloc = worker, turn, after, alloc
        self.replies = 0
        self.turned = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            client, _ = self.listener.accept()
            threading.Thread(target=self._carry, args=(client,), daemon=True).start()

    def _carry(self, client: socket.socket) -> None:
        host, port = self.worker.rsplit(":", 1)
        with client, socket.create_connection((host, int(port))) as worker:
            while (command := read_command(client)) is not None:
                worker.sendall(struct.pack("<BQ", command[0], len(command[1])) + command[1])
                size = struct.unpack("<Q", command[1][-8:])[0] if command[0] == GET_TENSOR \
                    else REPLY_SIZE.get(command[0])
                if size is None:
                    continue
                answer = worker.recv(8 + size, socket.MSG_WAITALL)
                if command[0] == ALLOC_BUFFER and self.alloc:
                    answer = answer[:8] + self.alloc(answer[8:])
                if command[0] == GET_TENSOR and self.turn:
                    self.replies += 1
                    if self.replies >= self.after:
                        worker.close()          # the real worker is free for the next test
                        self.turned.set()
                        self.turn(client, answer)
                        return
                client.sendall(answer)


def stall(client: socket.socket, answer: bytes) -> None:
    time.sleep(120)


def one_byte_more(client: socket.socket, answer: bytes) -> None:
    size = struct.unpack("<Q", answer[:8])[0]
    client.sendall(struct.pack("<Q", size + 1) + answer[8:] + b"\0")
    time.sleep(60)


def half_the_buffer(answer: bytes) -> bytes:
    remote, size = struct.unpack("<QQ", answer)
    return struct.pack("<QQ", remote, size // 2)


@pytest.fixture(scope="module")
def real_worker(models_home):
    port = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "localinfer", "worker", "--port", address.rsplit(":", 1)[1]],
        env={**os.environ, "LOCALINFER_HOME": str(models_home), "NO_COLOR": "1"},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready = proc.stderr.readline()
    assert ready.startswith("worker ready on"), ready
    yield address
    proc.kill()
    proc.wait(10)


STORY = ["run", "smollm2", "Write a long story about a lighthouse.", "-n", "2000", "--temp", "0",
         "--offline", "--rpc"]


def run_with(address: str, patch: str = "", **popen) -> subprocess.Popen:
    """`localinfer run` over the worker at `address` in a session of its own, after `patch`."""
    code = (f"{patch}\nimport sys; from localinfer.cli.app import main\n"
            f"sys.argv = ['localinfer', *{[*STORY, address]!r}]; main()")
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=_own_session,
        env={**os.environ, "LOCALINFER_HOME": str(MODELS_HOME), "NO_COLOR": "1"}, **popen)


def ended(proc: subprocess.Popen, timeout: float) -> tuple[int, list[str]]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err.strip().splitlines()


@pytest.mark.slow
def test_a_worker_silent_mid_run_is_given_up_on_in_one_line(real_worker):
    proxy = Turning(real_worker, stall)
    proc = run_with(proxy.address, "import localinfer.backends.llama.rpc_relay as relay; "
                                   "relay.COMPUTE_SECONDS = 3")
    assert proxy.turned.wait(120)
    code, lines = ended(proc, 20)
    assert code == 1 and lines[-1] == (
        f"{ERROR}worker {proxy.address} did not answer within 3 s mid-run (it may be serving "
        "another client, stopped, or not a localinfer/llama.cpp worker); check it and rerun")
    assert not any("ggml" in line or "Traceback" in line for line in lines), lines


@pytest.mark.slow
def test_ctrl_c_ends_a_run_whose_worker_went_silent(real_worker):
    proxy = Turning(real_worker, stall)
    proc = run_with(proxy.address)
    assert proxy.turned.wait(120)
    time.sleep(0.5)
    pressed = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    code, lines = ended(proc, 20)
    assert code == 130 and time.monotonic() - pressed < 5
    assert lines[-1].startswith(f"localinfer: interrupted while the worker {proxy.address}")


@pytest.mark.slow
@pytest.mark.parametrize("proxy_args,says", [
    ({"turn": one_byte_more}, "bytes to GET_TENSOR where the protocol has"),
    ({"alloc": half_the_buffer}, "answered a request for"),
], ids=["reply too long", "buffer too small"])
def test_a_worker_that_answers_ggml_wrongly_mid_run_is_one_line(real_worker, proxy_args, says):
    proxy = Turning(real_worker, **proxy_args)
    code, lines = ended(run_with(proxy.address), 120)
    assert code == 1 and lines[-1].startswith(f"{ERROR}worker {proxy.address} "), lines
    assert says in lines[-1]
    assert not any("ggml" in line or "Traceback" in line for line in lines), lines
