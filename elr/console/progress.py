"""A one-line progress counter for long work (data preparation, evaluation, the study), no dependency.

On a terminal the line is redrawn in place ("evaluate: 12/40 batches | 0m31s | eta 1m12s"); into a
file or pipe it prints at most one line per tenth of the work, so logs stay short.
"""

from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s: short enough for a console line."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def size(n_bytes: float) -> str:
    """512 B, 43.1 MiB, 7.6 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return ""


class Progress:
    """`with Progress("evaluate", total, "batches") as p: ... p.update()`; total may be None (unknown)."""

    def __init__(self, label: str, total: int | None = None, unit: str = "", stream=None):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.done = 0
        self.start = time.perf_counter()
        self._printed = -1  # the tenth of the work last printed (not a terminal)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        count = f"{self.done:,}/{self.total:,}" if self.total else f"{self.done:,}"
        text = f"{self.label}: {count}{' ' + self.unit if self.unit else ''} | {duration(elapsed)}"
        if self.total and 0 < self.done < self.total:
            text += f" | eta {duration(elapsed / self.done * (self.total - self.done))}"
        return text

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.tty:
            self.stream.write("\r" + self.line() + "\033[K")
            self.stream.flush()
        elif self.total:
            tenth = 10 * self.done // self.total
            if tenth > self._printed:
                self._printed = tenth
                print(self.line(), file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the line (a terminal) or print the final count (a file), once."""
        if self.tty:
            self.stream.write("\n")
        elif not self.total or self._printed < 10:
            print(self.line(), file=self.stream, flush=True)
