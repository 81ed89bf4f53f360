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


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KB' (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


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
        self.gone: set[int] = set()            # streams whose reader went away

    def node_line(self, label: str, index: int, text: str) -> None:
        prefix = f"[{label}]"
        if self.color:
            prefix = f"\x1b[{COLORS[index % len(COLORS)]}m{prefix}\x1b[0m"
        self._write(self.out, f"{prefix} {text}\n")

    def info(self, text: str) -> None:
        self._write(self.err, f"cluster: {text}\n")

    def raw(self, text: str) -> None:
        self._write(self.out, text)

    def _write(self, stream: IO[str], text: str) -> None:
        """Show `text`; a stream whose reader went away (`cluster up | head`) is let go. The
        display is not the work: the nodes are still watched and their logs still written."""
        with self.lock:
            if id(stream) in self.gone:
                return
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):      # EPIPE, or a stream already closed
                self.gone.add(id(stream))
                _silence(stream)


def _silence(stream: IO[str]) -> None:
    """Point a broken stream's file descriptor at /dev/null, so that what is still buffered
    or written later (the final error, the interpreter's flush at exit) goes nowhere instead
    of raising again (the recipe of Python's own signal documentation for SIGPIPE)."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):   # an in-memory stream has no descriptor
        return
    os.dup2(devnull, fd)
    os.close(devnull)


class NodeProgress:
    """A progress line on stderr for a phase that waits on every node ("checked 37/128
    nodes"), drawn with rich while the phase runs and erased when close() is called. It is
    the callable SupervisedBackend.progress takes: progress(phase, done, total), from any
    thread. Silent for fewer than `min_nodes` nodes (the phase is over before a line would
    help) and when stderr is not a terminal (a log file wants no redrawn lines)."""

    VERBS = {"check": "checked", "sync": "synced"}
    UNITS: dict[str, str] = {}            # what a phase counts, when not nodes

    def __init__(self, stream: IO[str] | None = None, min_nodes: int = 8,
                 enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.min_nodes = min_nodes
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.lock = threading.Lock()
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled or total < self.min_nodes:
            return
        with self.lock:
            bar = self._bar or self._start()
            if phase not in self._tasks:
                self._tasks[phase] = bar.add_task(phase, total=total,
                                                  verb=self.VERBS.get(phase, phase),
                                                  unit=self.UNITS.get(phase, "nodes"))
            bar.update(self._tasks[phase], completed=done, total=total)
        if phase == "check" and done >= total:
            self.close()                  # the last phase before the nodes' own lines

    def _start(self) -> Any:
        from rich.console import Console as RichConsole
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        self._bar = Progress(
            TextColumn("cluster: {task.fields[verb]} {task.completed}/{task.total} {task.fields[unit]}"),
            BarColumn(), TimeElapsedColumn(),
            console=RichConsole(file=self.stream, force_terminal=self.enabled),
            transient=True, redirect_stdout=False, redirect_stderr=False)
        self._bar.start()
        return self._bar

    def above(self, line: str) -> bool:
        """Print a whole line above the bar while it is drawn (through its console, so the
        two don't garble each other); False when no bar is drawn."""
        with self.lock:
            if self._bar is None:
                return False
            self._bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return True

    def close(self) -> None:
        with self.lock:
            bar, self._bar = self._bar, None
            self._tasks.clear()
        if bar is not None:
            bar.stop()


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
