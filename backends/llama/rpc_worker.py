"""`localinfer worker`: llama.cpp's RPC server, run in this process from the same llama.cpp the
bindings load (ggml_backend_rpc_start_server, found through the registry's proc address).

What a worker offers is what ggml reports for its device, and ggml's CPU device reports all of the
machine's RAM as free (ggml-cpu.cpp: "assume that all of it is free"). A client fitting a model to
that would overfill a machine that runs anything else, so the device's memory query is replaced
here by one that answers the RAM available now (or the GPU's free memory), capped at --memory.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from localinfer.backends.llama import devices as llama_devices
from localinfer.backends.llama import rpc
from localinfer.errors import LocalinferError, UsageError

# struct ggml_backend_device begins with its interface, a struct of function pointers whose third
# is get_memory (ggml-backend-impl.h); the device structs are writable statics or heap objects.
_GET_MEMORY_SLOT = 2
_GetMemory = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                              ctypes.POINTER(ctypes.c_size_t))
_kept: list = []                     # callbacks ggml holds pointers to: alive as long as we are


@dataclass(frozen=True)
class Offered:
    name: str            # ggml's device name: CPU, CUDA0, ...
    description: str
    free: int            # bytes offered now
    total: int


def pick_device(name: str | None, found: list[llama_devices.Device]) -> llama_devices.Device:
    """--device, else what llama.cpp's rpc-server takes: the first accelerator, else the CPU."""
    local = [d for d in found if d.backend != "RPC"]
    if name:
        for device in local:
            if device.name.lower() == name.lower():
                return device
        names = ", ".join(d.name for d in local) or "none"
        raise UsageError(f"--device {name!r} is not a device of this llama.cpp build "
                         f"(it has: {names})")
    others = [d for d in local if d.kind != "cpu"]
    return (others or local)[0]


def _device_pointer(name: str) -> int:
    api = llama_devices._registry()
    for i in range(api.count()):
        dev = api.get(i)
        if llama_devices._text(api.name(dev)) == name:
            return dev
    raise LocalinferError(f"device {name} vanished from the registry")


def offer(device: llama_devices.Device, cap: int | None) -> Callable[[], Offered]:
    """Make the device answer memory queries (the worker's GET_DEVICE_MEMORY) with what it can
    really give, at most `cap`; returns a function that reads what it offers now."""
    pointer = _device_pointer(device.name)
    slot = ctypes.c_void_p.from_address(pointer + _GET_MEMORY_SLOT * ctypes.sizeof(ctypes.c_void_p))
    original = _GetMemory(slot.value)
    is_cpu = device.kind == "cpu"

    def now() -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        original(pointer, ctypes.byref(free), ctypes.byref(total))
        if is_cpu:
            from localinfer import machine
            free.value = min(machine.ram()[1], total.value)
        limit = total.value if cap is None else min(cap, total.value)
        return min(free.value, limit), limit

    @_GetMemory
    def get_memory(_dev, free_out, total_out) -> None:
        free_out[0], total_out[0] = now()

    _kept.append(get_memory)
    slot.value = ctypes.cast(get_memory, ctypes.c_void_p).value

    def offered() -> Offered:
        free, total = now()
        return Offered(device.name, device.description, free, total)
    return offered


def _check_free(host: str, port: int) -> None:
    """Bind the address as ggml will (SO_REUSEADDR) and let it go: a port another program holds
    is one line here, where ggml would print to stderr and return, and the readiness check
    would find the other program answering."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe_socket:
        probe_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe_socket.bind((host, port))
        except OSError as e:
            raise LocalinferError(f"cannot listen on {host}:{port}: "
                                  f"{e.strerror or e}") from None


def start(host: str, port: int, *, threads: int, device: llama_devices.Device,
          ready_s: float = 30.0) -> threading.Thread:
    """Start the server in a thread and return once it answers the protocol's greeting; a
    LocalinferError when it cannot listen or does not answer."""
    prototype = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
    serve = rpc.ggml().rpc_function("ggml_backend_rpc_start_server", prototype)
    if serve is None:
        raise LocalinferError(rpc.build_hint())
    _check_free(host, port)
    devices = (ctypes.c_void_p * 1)(_device_pointer(device.name))
    _kept.append(devices)
    endpoint = f"{host}:{port}"
    thread = threading.Thread(target=serve, args=(endpoint.encode(), None, threads, 1, devices),
                              name="rpc-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_s
    while True:
        if not thread.is_alive():      # ggml returned: it could not create or bind the socket
            raise LocalinferError(f"cannot listen on {endpoint}")
        try:
            rpc.probe(endpoint, connect_s=1.0, answer_s=5.0)
            return thread
        except rpc.WorkerError:
            if time.monotonic() > deadline:
                raise LocalinferError(f"the worker on {endpoint} did not start within "
                                      f"{ready_s:g} s") from None
            time.sleep(0.05)
