"""`python -m localinfer ARGS` without paying Python's start and the CLI's imports each time.

A zygote process imports the CLI once; each command is a fork of it that takes the caller's stdin,
stdout and stderr (passed over a Unix socket), environment and working directory, runs
`localinfer`'s __main__ and exits with its status. The command still runs in a process of its own
(its own fds, exit code, signals, os._exit), as a user's would; only the start is shared, which
is half a second of the ~0.6 s an error-path command costs.

What a fork cannot give a command is read at import time: an environment variable that a module
reads when it is imported (llama_cpp's LLAMA_CPP_LIB_PATH, huggingface_hub's HF_*). run_cli
therefore uses the zygote only when the environment differs from the test process's in
IMPORT_FREE names, and starts a real process otherwise.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Variables the CLI reads only when a command runs, never at import.
IMPORT_FREE = ("LOCALINFER_", "NO_COLOR", "COLUMNS", "LINES", "TERM")

_ZYGOTE = r"""
import json, os, select, signal, socket, sys
import localinfer.cli.app, llama_cpp            # what every command imports: paid once here
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)   # a request is one message
listener.bind(sys.argv[1]); listener.listen(64)
print("ready", flush=True)
children = {}                                   # pid -> the connection its status goes back on

def run_child(conn, request, fds):
    listener.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target); os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"]); os.environ.clear(); os.environ.update(request["env"])
    sys.stdin, sys.stdout, sys.stderr = (reopen(0, "r", sys.__stdin__), reopen(1, "w", sys.__stdout__),
                                         reopen(2, "w", sys.__stderr__, buffering=1))
    sys.argv = [sys.executable, *request["args"]]
    code = 1
    try:
        import runpy
        runpy.run_module("localinfer", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:                   # as Python ends: killed by the signal
        code = -signal.SIGINT
    except BaseException:
        import traceback; traceback.print_exc()
    finally:
        import atexit, threading
        threading._shutdown()                   # non-daemon threads are waited for, as at exit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try: stream.flush()
            except Exception: pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL); os.kill(os.getpid(), -code)
        os._exit(code)

def reopen(fd, mode, like, buffering=-1):     # a standard stream as Python opens it at start
    return open(fd, mode, buffering, encoding=like.encoding, errors=like.errors, newline="\n",
                closefd=False)

while True:
    ready, _, _ = select.select([listener], [], [], 0.02)
    if ready:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        pid = os.fork()
        if pid == 0:
            run_child(conn, json.loads(message), fds)
        for fd in fds: os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        children[pid] = conn
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0: break
        conn = children.pop(pid, None)
        if conn:
            try:                                # the caller may have timed out and gone
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()
"""


class Zygote:
    """One per test process, started on first use; ends with it."""

    def __init__(self) -> None:
        self.env = dict(os.environ)         # what its imports saw
        self.dir = tempfile.mkdtemp(prefix="localinfer-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, self.path],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the CLI zygote did not start")

    def run(self, args: list[str], env: dict, input: str | None,
            timeout: float) -> subprocess.CompletedProcess:
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        stdin_read, stdin_write = os.pipe() if input is not None else (os.open(os.devnull,
                                                                               os.O_RDONLY), None)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(self.path)
            request = json.dumps({"args": args, "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [request], [stdin_read, out.fileno(), err.fileno()])
            os.close(stdin_read)
            if stdin_write is not None:
                threading.Thread(target=_feed, args=(stdin_write, input), daemon=True).start()
            pid = int(conn.recv(64))
            conn.settimeout(timeout)
            try:
                code = int(conn.recv(64))
            except (TimeoutError, socket.timeout):
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
        return subprocess.CompletedProcess([sys.executable, *args], code, _read(out), _read(err))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self.dir)


def _feed(fd: int, text: str) -> None:
    try:
        with open(fd, "w", encoding="utf-8") as pipe:
            pipe.write(text)
    except BrokenPipeError:         # the command stopped reading: as a pipe from a shell would
        pass


def _read(file) -> str:
    """As subprocess's text mode reads a pipe: UTF-8, universal newlines."""
    file.seek(0)
    return file.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


_zygote: Zygote | None = None
_lock = threading.Lock()


def zygote_for(env: dict) -> Zygote | None:
    """The zygote, if a command with this environment may be forked from it: the environment
    differs from what the zygote's imports saw only where the CLI reads it late."""
    global _zygote
    with _lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        zygote = _zygote
    changed = {k for k in env.keys() | zygote.env.keys() if env.get(k) != zygote.env.get(k)}
    return zygote if all(k.startswith(IMPORT_FREE) for k in changed) else None
