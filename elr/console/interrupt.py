"""Ctrl-C and SIGTERM as one line: from the first line of a command's main, either signal raises
`Interrupted` wherever the program is (startup, a checkpoint save), the command says in one line what
was kept and exits 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a
process a signal ended. The training loop gives the first signal another meaning, "stop after this
step" (elr/train/stop.py); a second one is then raised here again: it stops at once.

Raised as an exception, the signal unwinds through the program's own cleanup (a save removes its
partial folder, the run lock is released), which the default action (the kernel ending the process)
would skip. A third signal while that cleanup runs gets the default action.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, as KeyboardInterrupt is, so that no `except Exception`
    of the code it interrupts swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupt_now(signum: int, frame) -> None:
    """The handler that stops at once: raise Interrupted; a further signal ends the process outright."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    raise Interrupted(signum)


def stop_at_once() -> None:
    """From now on SIGINT and SIGTERM raise Interrupted (main thread only, where Python runs handlers)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, interrupt_now)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise Interrupted; the previous handlers come back after (a
    command's main called in-process, by a test or elr/cli.py, leaves its caller's handlers as they were)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    stop_at_once()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
