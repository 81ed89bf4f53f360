"""`cluster exec`: one command on every node at once, what users use pdsh for.

Each node runs cluster/remote/execute.py with its python, the command as an argv (in the
program's bundle, backends/shipping.py; executed without a shell there), in a session of its own tagged with this exec's
id. Output comes back line by line, prefixed `[node]`, as it arrives; the exit code of every
node is summed up at the end. Ctrl-C (or SIGTERM, SIGHUP) asks every node to stop its command
(TERM, grace, KILL, verified by identity there) and reports what, if anything, is left; if
the launcher dies instead, each node sees its input close and stops the command itself.
"""
from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .backends.supervised import SupervisedBackend
from .backends.transport import Channel
from .console import Console, LineSplitter
from .errors import ClusterError, Interrupted, NodeLost, PreflightError, RunFailed, signum_of
from .nodes import Demux, signal_name
from .spec import Host

GRACE = 5.0                       # seconds from TERM to KILL for a stopped command
STOP_WAIT = GRACE + 10.0          # how long Ctrl-C waits for the nodes' reports


@dataclass
class NodeResult:
    """How the command went on one node."""
    name: str
    code: int | None = None       # exit status; None: it never ran, or the connection broke
    error: str = ""               # why it could not be started there (the SSH error)
    lost: bool = False            # the connection broke while it ran
    stop: dict[str, Any] = field(default_factory=dict)   # the node's stop/leftover report

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.error and not self.lost

    def describe(self) -> str:
        if self.error:
            return f"unreachable: {self.error}"
        if self.lost:
            return "connection lost while the command ran"
        if self.code is not None and self.code > 128 and self.code - 128 < 65:
            return f"exit code {self.code} ({signal_name(self.code - 128)})"
        return f"exit code {self.code}"


def new_exec_id() -> str:
    return f"exec-{int(time.time())}-{secrets.token_hex(4)}"


def exec_args(host: Host, exec_id: str, argv: Sequence[str], keepalive: float) -> list[str]:
    """execute.py's arguments on one node (pure): the command after `--`, each argument one."""
    return ["--id", exec_id, "--node", host.name, "--cwd", host.workdir, "--grace", f"{GRACE:g}",
            "--keepalive", f"{keepalive:g}", "--", *argv]


def run(hosts: Sequence[Host], backend: SupervisedBackend, argv: Sequence[str],
        console: Console) -> dict[str, NodeResult]:
    """Run argv on every host at once, streaming; raises per the worst outcome (see outcome())."""
    exec_id = new_exec_id()
    keepalive = getattr(backend, "keepalive", 0.0) or 0.0
    results = {h.name: NodeResult(h.name) for h in hosts}
    started = backend.each(hosts, lambda h: backend.spawn_program(
        h, "execute", *exec_args(h, exec_id, argv, keepalive)))
    channels: dict[str, Channel] = {}
    for host, ch in started:
        if isinstance(ch, Exception):
            results[host.name].error = str(ch).replace("\n", "\n    ")
        else:
            channels[host.name] = ch
    index = {h.name: i for i, h in enumerate(hosts)}
    stream = Streams(channels, results, console, index)
    stream.start(keepalive)
    try:
        stream.drain()
    except KeyboardInterrupt as exc:
        signum = signum_of(exc)
        console.info(f"{signal_name(signum)}: stopping the command on {len(channels)} node(s)")
        stream.stop_all()
        raise Interrupted(f"interrupted ({signal_name(signum)}); {stopped_summary(results)}",
                          signum=signum, details=left_details(results)) from None
    finally:
        stream.close()
    outcome(results, console)
    return results


class Streams:
    """Every node's channel read by a thread of its own; lines and ends meet on one queue that
    the main thread drains, so output prints as it arrives and a Ctrl-C lands there."""

    def __init__(self, channels: dict[str, Channel], results: dict[str, NodeResult],
                 console: Console, index: dict[str, int]) -> None:
        self.channels = channels
        self.results = results
        self.console = console
        self.index = index
        self.events: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.running = set(channels)     # nodes whose end has not been drained yet
        self.closed = threading.Event()

    def start(self, keepalive: float) -> None:
        for name, ch in self.channels.items():
            threading.Thread(target=self._read, args=(name, ch), daemon=True,
                             name=f"exec-{name}").start()
        if keepalive > 0:
            threading.Thread(target=self._beat, args=(max(0.2, keepalive / 4),), daemon=True,
                             name="exec-heartbeat").start()

    def _read(self, name: str, ch: Channel) -> None:
        splitter, demux = LineSplitter(), Demux()
        try:
            while data := ch.read():
                for piece in demux.feed(data):
                    if isinstance(piece, dict):
                        self._record(name, piece)
                        continue
                    for line in splitter.feed(piece):
                        self.events.put((name, line))
            for line in splitter.feed(demux.flush()) + splitter.flush():
                self.events.put((name, line))
            code = ch.wait()
            self.results[name].code = code
            self.results[name].lost = code is None
        finally:
            self.events.put((name, None))

    def _record(self, name: str, record: dict[str, Any]) -> None:
        if "note" in record:
            self.console.info(f"[{name}] {record['note']}")
        for key in ("stopped", "leftovers"):
            if isinstance(record.get(key), dict):
                self.results[name].stop = {**record[key], "kind": key}

    def _beat(self, interval: float) -> None:
        """Heartbeats: a node cut off from this launcher stops its command by itself."""
        while not self.closed.wait(interval):
            for ch in list(self.channels.values()):
                try:
                    ch.write(b"\n")
                except ClusterError:
                    pass

    def drain(self, until: float | None = None) -> bool:
        """Print lines until every node has ended (True) or `until` passes (False)."""
        while self.running:
            left = 0.5 if until is None else min(0.5, until - time.monotonic())
            if left <= 0:
                return False
            try:
                name, line = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.running.discard(name)
            else:
                self.console.node_line(name, self.index[name], line)
        return True

    def stop_all(self) -> None:
        """Ask every node to stop its command and wait for their reports; a second Ctrl-C
        stops waiting (the nodes then see their input close and stop by themselves)."""
        for ch in self.channels.values():
            try:
                ch.write(b"stop\n")
            except ClusterError:
                pass
        try:
            self.drain(until=time.monotonic() + STOP_WAIT)
        except KeyboardInterrupt:
            self.console.info("not waiting for the nodes' reports; each stops its command "
                              "as its connection closes")

    def close(self) -> None:
        self.closed.set()
        for ch in self.channels.values():
            ch.close()


def stopped_summary(results: dict[str, NodeResult]) -> str:
    left = [n for n, r in results.items() if r.stop.get("left")]
    unknown = [n for n, r in results.items()
               if not r.error and r.code is None and not r.stop]
    text = f"the command was stopped on {sum(1 for r in results.values() if not r.error)} node(s)"
    if left:
        text += f"; processes still alive on {', '.join(left)}"
    if unknown:
        text += f"; no report from {', '.join(unknown)} (each stops its command when its connection closes)"
    return text


def left_details(results: dict[str, NodeResult]) -> str:
    return "\n".join(f"  {n}: still alive after SIGKILL: {r.stop['left']}"
                     for n, r in results.items() if r.stop.get("left"))


def summary_lines(results: dict[str, NodeResult]) -> list[str]:
    """One line per node that did not exit 0 (pure)."""
    return [f"  {r.name}: {r.describe()}" for r in results.values() if not r.ok]


def outcome(results: dict[str, NodeResult], console: Console) -> None:
    """0 when every node exited 0; else the worst: 3 unreachable, 5 lost, 4 non-zero."""
    for r in results.values():
        if r.stop.get("kind") == "leftovers" and r.stop.get("signalled"):
            console.info(f"[{r.name}] stopped {len(r.stop['signalled'])} process(es) the command "
                         f"left running")
        if r.stop.get("left"):
            console.info(f"[{r.name}] still alive after SIGKILL: {r.stop['left']}")
    total, bad = len(results), [r for r in results.values() if not r.ok]
    if not bad:
        console.info(f"exec: all {total} node(s) exited 0")
        return
    head = f"{len(bad)} of {total} node(s) did not exit 0"
    details = "\n".join(summary_lines(results))
    if any(r.error for r in bad):
        raise PreflightError(f"{head} (unreachable: {', '.join(r.name for r in bad if r.error)})",
                             details=details)
    if any(r.lost for r in bad):
        raise NodeLost(head, details=details)
    raise RunFailed(head, details=details)
