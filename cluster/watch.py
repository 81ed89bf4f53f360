"""One watcher for every backend: stream each node's output with a prefix, save it per node,
and react to the first failure (or Ctrl-C) at once by stopping every other node.

Each node has a thread that copies its output and then puts its exit on one queue; the main
thread blocks on that queue, so a failure is seen the moment it happens, not on a timer.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from .errors import signum_of
from .nodes import NodeExit, signal_name

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


class Watched(Protocol):
    """What the watcher needs of a running node (backends.NodeProcess has this shape)."""
    node: Any                        # has .label

    def output(self) -> Iterator[bytes | dict[str, Any]]: ...

    def wait(self) -> NodeExit: ...

    def stop(self) -> dict[str, Any]: ...

    def request_stacks(self) -> None: ...


@dataclass
class Hang:
    """What the watchdog found: no progress on any node for `seconds`, and each worker's stack."""
    seconds: float
    stacks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)   # label -> records


@dataclass
class WatchResult:
    exits: dict[str, NodeExit] = field(default_factory=dict)        # label -> exit
    first_failure: tuple[str, NodeExit] | None = None
    interrupted: bool = False
    signum: int = 2                                                  # what interrupted it
    stops: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> stop report
    tails: dict[str, list[str]] = field(default_factory=dict)
    joined: set[str] = field(default_factory=set)    # nodes whose workers started (rendezvous done)
    group_ranks: dict[str, int] = field(default_factory=dict)       # label -> torch's group rank
    hang: Hang | None = None
    started: float = 0.0                              # monotonic time the watch began

    @property
    def ok(self) -> bool:
        return self.first_failure is None and not self.interrupted and self.hang is None

    def leftovers(self) -> dict[str, list[int]]:
        return {k: v["left"] for k, v in self.stops.items() if v.get("left")}


def _open_log(path: Path) -> IO[bytes]:
    """Append to a node's log, created private (0600): a program may print a secret."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


class Watcher:
    """hang_timeout: seconds with no progress on any node (no output line, no heartbeat from
    the reference trainer) after which every worker's stack is collected and the run stopped;
    0 turns the watchdog off."""

    def __init__(self, procs: Sequence[Watched], console: Console,
                 log_paths: dict[str, Path], settle: float = 30.0, hang_timeout: float = 0.0,
                 clock: Any = time.monotonic) -> None:
        self.procs = list(procs)
        self.console = console
        self.log_paths = log_paths
        self.settle = settle                   # how long to wait for stopped nodes to report
        self.hang_timeout = hang_timeout
        self.clock = clock
        self.events: queue.Queue[tuple[Watched, NodeExit]] = queue.Queue()
        self.tails: dict[str, deque[str]] = {p.node.label: deque(maxlen=TAIL_LINES) for p in procs}
        # Nodes we are stopping print their shutdown tracebacks; those go to the log files only.
        self.muted: set[str] = set()
        self.progress = clock()
        self.result = WatchResult(started=self.progress)
        self.stacks: dict[str, list[dict[str, Any]]] = {}
        self.dumped: set[str] = set()
        self.lock = threading.Lock()

    def run(self) -> WatchResult:
        result = self.result
        for index, proc in enumerate(self.procs):
            threading.Thread(target=self._pump, args=(proc, index), daemon=True,
                             name=f"pump-{proc.node.label}").start()
        pending = {p.node.label for p in self.procs}
        try:
            while pending:
                event = self._next_event()
                if event is None:                       # the watchdog fired
                    result.hang = self._collect_stacks(pending)
                    result.stops = self.stop_all(pending)
                    break
                proc, ex = event
                pending.discard(proc.node.label)
                result.exits[proc.node.label] = ex
                if not ex.ok and result.first_failure is None:
                    result.first_failure = (proc.node.label, ex)
                    self._report_failure(proc.node.label, ex)
                    result.stops = self.stop_all(pending)
                    break
        except KeyboardInterrupt as exc:
            result.interrupted = True
            result.signum = signum_of(exc)
            self.console.info(f"interrupted ({signal_name(result.signum)}): "
                              f"stopping {len(pending)} node(s)")
            result.stops = self.stop_all(pending)
        self._collect(pending, result)
        result.tails = {k: list(v) for k, v in self.tails.items()}
        return result

    def _next_event(self) -> tuple[Watched, NodeExit] | None:
        """The next node to end, or None when no node has made progress for hang_timeout.
        A timeout keeps the main thread responsive to Ctrl-C while it waits."""
        while True:
            try:
                return self.events.get(timeout=0.5)
            except queue.Empty:
                if self.hang_timeout and self.clock() - self.progress >= self.hang_timeout:
                    return None

    def _collect_stacks(self, pending: set[str]) -> Hang:
        quiet = self.clock() - self.progress
        self.console.info(f"no progress on any node for {quiet:.0f} s (--hang-timeout): "
                          f"collecting every worker's stack before stopping")
        targets = [p for p in self.procs if p.node.label in pending]
        self.muted.update(pending)               # the dumps go to the logs and to hang/
        for p in targets:
            try:
                p.request_stacks()
            except Exception as exc:  # a node that cannot be asked is reported, not fatal
                self.console.info(f"[{p.node.label}] stacks not collected: {exc}")
        deadline = self.clock() + 30
        while self.clock() < deadline:
            with self.lock:
                if all(p.node.label in self.dumped for p in targets):
                    break
            time.sleep(0.1)
        with self.lock:
            return Hang(seconds=quiet, stacks={k: list(v) for k, v in self.stacks.items()})

    def _control(self, label: str, record: dict[str, Any]) -> None:
        with self.lock:
            if record.get("joined"):
                self.result.joined.add(label)
                self.result.group_ranks[label] = int(record.get("group_rank", -1))
                self.progress = self.clock()
            elif "beat" in record:
                self.progress = self.clock()
            elif "stack" in record:
                self.stacks.setdefault(label, []).append(record["stack"])
            elif "dumped" in record:
                self.dumped.add(label)

    def _collect(self, pending: set[str], result: WatchResult) -> None:
        deadline = time.monotonic() + self.settle
        while pending and time.monotonic() < deadline:
            try:
                proc, ex = self.events.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                break
            except KeyboardInterrupt:
                continue
            pending.discard(proc.node.label)
            result.exits.setdefault(proc.node.label, ex)
        for label in pending:
            result.exits.setdefault(label, NodeExit(lost=True, reason="did not report after stop"))

    def stop_all(self, labels: set[str]) -> dict[str, dict[str, Any]]:
        targets = [p for p in self.procs if p.node.label in labels]
        if not targets:
            return {}
        self.muted.update(labels)
        self.console.info("output of the stopped node(s) continues in their log files only")
        while True:
            try:
                with ThreadPoolExecutor(max_workers=len(targets)) as pool:
                    reports = list(pool.map(lambda p: p.stop(), targets))
                break
            except KeyboardInterrupt:
                self.console.info("still stopping every node; please wait")
        out = {p.node.label: r for p, r in zip(targets, reports)}
        for label, rep in out.items():
            if rep.get("left"):
                self.console.info(f"[{label}] processes still alive after SIGKILL: {rep['left']}")
            elif rep.get("error"):
                self.console.info(f"[{label}] stop failed: {rep['error']}")
        return out

    def _report_failure(self, label: str, ex: NodeExit) -> None:
        tail = list(self.tails[label])
        self.console.info(f"node [{label}] failed first: {ex.describe()}")
        if tail:
            self.console.info(f"last {len(tail)} line(s) of [{label}]:")
            for line in tail:
                self.console.info(f"  | {line}")
        others = len(self.procs) - 1
        if others:
            self.console.info(f"stopping the other {others} node(s)")

    def _pump(self, proc: NodeProcess, index: int) -> None:
        label = proc.node.label
        splitter = LineSplitter()
        path = self.log_paths.get(label)
        log = _open_log(path) if path else None
        try:
            for chunk in proc.output():
                if isinstance(chunk, dict):
                    self._control(label, chunk)
                    continue
                if log:
                    log.write(chunk)
                    log.flush()
                for line in splitter.feed(chunk):
                    self._emit(label, index, line)
            for line in splitter.flush():
                self._emit(label, index, line)
        except Exception as exc:  # a broken stream is reported through wait()
            self.console.info(f"[{label}] output stream broke: {exc}")
        finally:
            if log:
                log.close()
        try:
            ex = proc.wait()
        except Exception as exc:
            ex = NodeExit(lost=True, reason=str(exc))
        self.events.put((proc, ex))

    def _emit(self, label: str, index: int, line: str) -> None:
        self.progress = self.clock()
        self.tails[label].append(line)
        if label not in self.muted:
            self.console.node_line(label, index, line)
