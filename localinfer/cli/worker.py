"""`worker`: offer this machine's device to another machine's `localinfer --rpc` (llama.cpp's RPC
server, run in the foreground). The protocol has no authentication and no encryption: anyone who
reaches the port can use the device and read what it computes, so only loopback is open without
--allow-remote (docs/distributed.md: a trusted network, or an SSH tunnel)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import typer

from localinfer.cli import console
from localinfer.cli.options import BACKEND, SERVER, threads_option, verbose_option
from localinfer.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command()(worker)


def worker(
    host: str = typer.Option("127.0.0.1", "--host", metavar="IPV4", rich_help_panel=SERVER,
                             help="Address to listen on (IPv4; llama.cpp's RPC has no IPv6). Any "
                             "but loopback needs --allow-remote."),
    port: int = typer.Option(50052, "--port", min=1, max=65535, metavar="PORT",
                             rich_help_panel=SERVER, help="Port to listen on (1-65535)."),
    allow_remote: bool = typer.Option(False, "--allow-remote", rich_help_panel=SERVER,
                                      help="Listen on an address other machines reach. The "
                                      "protocol has no authentication: use it only on a "
                                      "trusted network or through an SSH tunnel."),
    threads: int = threads_option(),
    memory: Optional[str] = typer.Option(None, "--memory", metavar="SIZE",
                                         rich_help_panel=BACKEND, help="Offer at most this much "
                                         "memory (e.g. 6GB); default: the RAM available now, or "
                                         "the GPU's free memory."),
    device: Optional[str] = typer.Option(None, "--device", metavar="NAME",
                                         rich_help_panel=BACKEND, help="The device to offer "
                                         "(CPU, CUDA0, MTL0, ...; `localinfer devices` lists "
                                         "them); default: the first GPU, else the CPU."),
    verbose: int = verbose_option("-v: llama.cpp's server lines (each client connecting and "
                                  "leaving) on stderr."),
) -> None:
    """Offer this machine's CPU or GPU to `--rpc` on another machine: layers of a model too big
    for that one are computed here. Runs until Ctrl-C.

    \b
    Examples:
      localinfer worker                                   (loopback: for an SSH tunnel)
      localinfer worker --host 0.0.0.0 --allow-remote --memory 12GB
      (then, on the other machine: localinfer run BIGMODEL "..." --rpc THIS-HOST:50052)
    """
    from localinfer.server import guard
    from localinfer.units import human_size, parse_size
    address = _ipv4(host)
    if not guard.is_loopback(address) and not allow_remote:
        raise UsageError(f"listening on {host} lets anyone who reaches it use this machine (the "
                         "RPC protocol has no authentication); add --allow-remote on a trusted "
                         "network, or keep loopback and use an SSH tunnel")
    cap = parse_size(memory, "--memory") if memory else None
    from localinfer.backends.llama import devices, rpc, rpc_worker
    from localinfer.backends.llama.engine import init_engine
    from localinfer.machine import default_threads
    init_engine(verbose > 0)
    if not rpc.supported():
        from localinfer.errors import LocalinferError
        raise LocalinferError(rpc.build_hint())
    chosen = rpc_worker.pick_device(device, devices.read_registry())
    offered = rpc_worker.offer(chosen, cap)
    _quiet_engine_stdout(verbose > 0)
    stop = _stop_on_signals()       # before the ready line: a Ctrl-C right after it is a normal end
    server = rpc_worker.start(address, port, threads=threads or default_threads(), device=chosen)
    now = offered()
    console.note(f"worker ready on {address}:{port}: {now.name} ({now.description}), offering "
                 f"{human_size(now.free)}; RPC protocol {rpc.PROTOCOL_MAJOR}."
                 f"{rpc.PROTOCOL_MINOR}, no authentication; Ctrl-C stops it")
    _wait(server, stop)


def _ipv4(host: str) -> str:
    """The address ggml's server binds (inet_addr: an IPv4 literal), from a literal or a name."""
    import ipaddress
    import socket
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):      # UnicodeError: a name IDNA refuses (`a..b`)
        raise UsageError(f"--host {host!r} is not an IPv4 address or a name of one (llama.cpp's "
                         "RPC server listens on IPv4 only)") from None


def _quiet_engine_stdout(verbose: bool) -> None:
    """ggml's server prints its banner and a line per client on stdout (printf): to stderr
    with -v, else nowhere; this command's own stdout carries nothing."""
    target = 2 if verbose else os.open(os.devnull, os.O_WRONLY)
    os.dup2(target, 1)


def _stop_on_signals() -> threading.Event:
    """An event Ctrl-C or SIGTERM sets (a normal end), in place of a KeyboardInterrupt that could
    land anywhere, even before the wait begins. A SIGINT ignored from the start (a shell's
    background job) stays ignored."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda *_: stop.set())
    return stop


def _wait(server: threading.Thread, stop: threading.Event) -> None:
    """Until `stop` (exit 0) or the server's thread ends (exit 1). The server thread sits in
    accept() inside ggml and cannot be joined, hence os._exit."""
    import sys
    while server.is_alive() and not stop.wait(0.5):
        pass
    if not stop.is_set():
        console.error("the worker's server stopped")
    sys.stderr.flush()
    os._exit(0 if stop.is_set() else 1)
