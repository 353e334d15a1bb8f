"""Ctrl-C while ggml waits in C for a worker, and the end of the process from a relay thread.

Python runs a SIGINT handler only when its main thread is back from C, so a press while ggml
waits there for a worker's reply would wait as long. The press is noticed twice: as the signal
arrives (signal.set_wakeup_fd, whose byte a thread of ours reads) and as Python's handler runs
(a wrapper around it); the relay (rpc_relay.py) asks `interrupt_pending` while it waits for a
worker, and ends the process when a press has waited too long. While workers are in use SIGINT
restarts the calls it interrupts (SA_RESTART), since ggml takes an interrupted connect, send or
recv for a lost worker and aborts.
"""

from __future__ import annotations

import os
import signal
import threading
import time

_ending = threading.Lock()


def end_process(line: str, code: int) -> None:
    """One line on stderr and the end, from a relay thread while ggml waits in C (it cannot be
    unwound: the reply it waits for will not come). Written with os.write: no lock of Python's
    streams, which a blocked thread might hold."""
    _ending.acquire()                      # never released: one line, once
    try:
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(code)


class _Presses:
    pressed = 0.0                          # the last Ctrl-C the process got
    handled = 0.0                          # the last one Python's handler ran for


_presses = _Presses()
_watching = False


def interrupt_pending(grace: float, waiting_since: float) -> bool:
    """Whether a Ctrl-C came `grace` seconds ago or more and still waits for ggml: Python has not
    handled it (its main thread is in C), or handled it inside a callback that ggml made while
    waiting since before the press (a KeyboardInterrupt there is printed and dropped)."""
    pressed = _presses.pressed
    return bool(pressed) and time.monotonic() - pressed >= grace and (
        pressed > _presses.handled or waiting_since < pressed)


def watch_interrupts() -> None:
    """Note each Ctrl-C as the signal arrives (set_wakeup_fd, passed on to any fd set before)
    and as Python handles it (a wrapper around the SIGINT handler there is). Main thread only;
    once; only when workers are asked for (it changes how SIGINT interrupts calls)."""
    global _watching
    if _watching or threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        before = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except (ValueError, OSError):          # not a main interpreter, or a platform without it
        os.close(read_end), os.close(write_end)
        return
    _watching = True
    previous = signal.getsignal(signal.SIGINT)
    if callable(previous):                 # else SIGINT is ignored or not Python's: left so

        def on_sigint(signum, frame):
            _presses.handled = time.monotonic()
            return previous(signum, frame)
        signal.signal(signal.SIGINT, on_sigint)
        # Calls interrupted by SIGINT restart (SA_RESTART): ggml's connect, send and recv fail on
        # EINTR and abort the process, and the main thread makes them when it opens a connection.
        # Python's own waits (select, sleep, locks) still end at once.
        if hasattr(signal, "siginterrupt"):
            signal.siginterrupt(signal.SIGINT, False)

    def watch() -> None:
        while data := os.read(read_end, 64):
            if before >= 0:
                try:
                    os.write(before, data)
                except OSError:
                    pass
            if signal.SIGINT in data:
                _presses.pressed = time.monotonic()
    threading.Thread(target=watch, name="ctrl-c watch", daemon=True).start()
