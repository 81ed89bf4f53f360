"""What the user sees: lines prefixed by node from many threads, and the launcher's own notes.

Below every other layer but the model, so that the watcher and the backends alike can print.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, Any

COLORS = ("36", "33", "35", "32", "34", "31", "96", "93", "95", "92", "94", "91")
TAIL_LINES = 20


class Console:
    """Prefixed, optionally coloured lines from many threads, never interleaved mid-line."""

    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None,
                 color: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        if color is None:
            color = self.out.isatty() and "NO_COLOR" not in os.environ
        self.color = color
        self.lock = threading.Lock()

    def node_line(self, label: str, index: int, text: str) -> None:
        prefix = f"[{label}]"
        if self.color:
            prefix = f"\x1b[{COLORS[index % len(COLORS)]}m{prefix}\x1b[0m"
        with self.lock:
            self.out.write(f"{prefix} {text}\n")
            self.out.flush()

    def info(self, text: str) -> None:
        with self.lock:
            self.err.write(f"cluster: {text}\n")
            self.err.flush()

    def raw(self, text: str) -> None:
        with self.lock:
            self.out.write(text)
            self.out.flush()


class LineSplitter:
    """Bytes in, display lines out. A line rewritten with \\r (a progress bar) shows its last
    state, at most once a second until its newline comes."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.buf = b""
        self.clock = clock
        self.last_progress = float("-inf")

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        out: list[str] = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(self._last_state(line))
        if b"\r" in self.buf:
            now = self.clock()
            if now - self.last_progress >= 1.0:
                state = self._last_state(self.buf)
                if state:
                    out.append(state)
                self.last_progress = now
            self.buf = self.buf[self.buf.rfind(b"\r") + 1:]
        return out

    def flush(self) -> list[str]:
        rest, self.buf = self.buf, b""
        return [self._last_state(rest)] if rest.strip(b"\r") else []

    @staticmethod
    def _last_state(line: bytes) -> str:
        parts = [p for p in line.rstrip(b"\r").split(b"\r") if p]
        return (parts[-1] if parts else b"").decode(errors="replace")
