"""A run started from Python (cluster.api.up): its handle (Run: status, logs, wait, down)
and how a detached run's end is read from its nodes' records (detached_error, first_failed,
LogErrors), shared with `cluster status` and `cluster logs`."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

from . import backends
from .backends.slurm_output import TERMINAL
from .console import Console, LineSplitter
from .errors import ClusterError, Interrupted, NodeLost, RunFailed
from .nodes import UNREACHABLE, NodeStatus, unreachable_error
from .runs import RunDir
from .observe.worker_errors import WorkerErrors

from .launch import Options
from .plan import Job
from .spec import Inventory


class Prepared(Protocol):
    """What Run starts: cluster.api.Prepared, a checked request."""
    inventory: Inventory
    job: Job
    options: Options

    def run(self, console: Console, argv: list[str],
            created: Callable[[RunDir], object] | None = None) -> int: ...

__all__ = ["Run", "Unanswered", "detached_error", "first_failed", "LogErrors"]


class Run:
    """A run started by up(): status(), logs(), wait(), down(). The launcher's work (the
    check, the start, watching every node, stopping them all when one fails) goes on in a
    thread of this process. When this program ends, an attached run is stopped on every node
    first (its owner is gone; run.json's `stopped_because` says so), and a detached run is
    let finish starting: it runs on without this program."""

    # Seconds between two looks at a detached run's nodes in wait(): such a run has no
    # launcher to tell of its end, so its nodes' recorded state is read again.
    poll_interval: float = 2.0

    def __init__(self, prepared: Prepared, console: Console) -> None:
        self.run_id = prepared.job.run_id
        self.error: ClusterError | None = None
        self.returncode: int | None = None
        self._prepared = prepared
        self._detach = prepared.options.detach
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._created = threading.Event()
        self._dir: RunDir | None = None
        self._sink: IO[str] | None = None        # echo=False's devnull
        self._thread = threading.Thread(target=self._main, args=(console,), daemon=True,
                                        name=f"cluster-run-{self.run_id}")

    @classmethod
    def start(cls, prepared: Prepared, echo: bool = True) -> "Run":
        stop = threading.Event()
        prepared.options = dataclasses.replace(prepared.options, stop=stop)
        sink = None if echo else open(os.devnull, "w")
        run = cls(prepared, Console(out=sink, err=sink, color=False) if sink else Console())
        run._sink = sink                     # closed when the launcher's thread ends
        run._stop = stop
        _owned(run)
        run._thread.start()
        run._created.wait()
        return run

    def _main(self, console: Console) -> None:
        def created(rd: RunDir) -> None:
            self._dir = rd
            self._created.set()
        try:
            self.returncode = self._prepared.run(console, ["cluster.up", self.run_id], created)
        except ClusterError as exc:
            self.error, self.returncode = exc, exc.exit_code
        except BaseException as exc:                    # noqa: BLE001 - reported, never lost
            self.error, self.returncode = ClusterError(f"{type(exc).__name__}: {exc}"), 1
        finally:
            self._record_stop()
            self._created.set()
            _released(self)
            if self._sink is not None:
                self._sink.close()

    def _record_stop(self) -> None:
        """Why a stop was asked for, in run.json and in the error."""
        if self._stop_reason is None or self._dir is None:
            return
        self._dir.update(stopped_because=self._stop_reason)
        if self.error is not None:
            self.error.message = f"stopped because {self._stop_reason}: {self.error.message}"

    def _owner_exits(self) -> None:
        """This program is ending. Attached: stop every node (as down() does), since nobody
        is left to watch them. Detached: nothing to do but let the start finish."""
        if not self._detach and self._thread.is_alive():
            self._stop_reason = f"the program that started it exited (pid {os.getpid()})"
            self._stop.set()

    @property
    def path(self) -> Path | None:
        """The run's directory (run.json, scripts, logs)."""
        return self._dir.path if self._dir else None

    @property
    def done(self) -> bool:
        """Whether the launcher has returned (for a detached run: once every node started)."""
        return not self._thread.is_alive()

    @property
    def _running_detached(self) -> bool:
        return self._detach and self.done and self.returncode == 0 and self._dir is not None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the run has ended (0: every node finished; else self.error
        says why), or None if it is still going after timeout seconds. A detached run has
        ended when every node has (read from the nodes every poll_interval seconds); a node
        of it that has not answered for ssh.keepalive seconds raises NodeLost (naming it,
        and what to do), with or without a timeout, as `cluster logs -f` does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._thread.join(timeout)
        if not self.done:
            return None
        if not self._running_detached:
            return self.returncode
        assert self._dir is not None
        silent = Unanswered(self._dir.inventory().ssh.keepalive)
        while True:
            asked = time.monotonic()
            rows = self._node_rows_within(None if deadline is None else deadline - asked)
            if rows is None:
                return None                     # the nodes did not answer in the time left
            if (code := self._detached_outcome(rows)) is not None:
                return code
            lost = silent.lost(rows, asked)
            if lost:
                raise unreachable_error(self.run_id, [f"{r.name} {r.rank}" for r in lost],
                                        silent.why(lost))
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            time.sleep(self.poll_interval if left is None else min(self.poll_interval, left))

    def _node_rows_within(self, seconds: float | None) -> list[NodeStatus] | None:
        """The nodes' status rows, or None when they have not all answered within seconds
        (a node that cannot be reached takes ssh.connect_timeout to say so). The read goes on
        in its thread then, and closes what it opened when it ends."""
        if seconds is None:
            return self._node_rows()
        got: list[list[NodeStatus]] = []
        failed: list[BaseException] = []

        def read() -> None:
            try:
                got.append(self._node_rows())
            except BaseException as exc:        # noqa: BLE001 - raised again in the caller
                failed.append(exc)
        reader = threading.Thread(target=read, daemon=True, name=f"cluster-wait-{self.run_id}")
        reader.start()
        reader.join(max(0.0, seconds))
        if failed:
            raise failed[0]
        return got[0] if got else None

    def _detached_outcome(self, rows: list[NodeStatus]) -> int | None:
        """None while a node of the detached run has not ended; else its exit code, with
        self.error set as `cluster up` would have said it."""
        if not rows or any(r.state not in _ENDED for r in rows):
            return None
        self.error = detached_error(rows, self.run_id, self._cause_of(first_failed(rows)))
        self.returncode = self.error.exit_code if self.error else 0
        return self.returncode

    def _node_rows(self) -> list[NodeStatus]:
        assert self._dir is not None
        backend = backends.recorded(self._dir)
        try:
            return list(backend.status(self._dir))
        finally:
            backend.close()

    def _cause_of(self, row: NodeStatus | None) -> dict[str, str]:
        """The worker's own error in the failed node's output, read from the node as
        `cluster logs` reads it: {node name: error}, {} when it said none."""
        if row is None or self._dir is None:
            return {}
        backend = backends.recorded(self._dir)
        errors = LogErrors()
        try:
            for label, chunk in backend.logs(self._dir, node=row.name):
                errors.feed(label, chunk)
        except ClusterError:
            return {}                  # no log to read: the failure is said without its cause
        finally:
            backend.close()
        return errors.causes()

    def down(self, timeout: float | None = None) -> int | None:
        """Stop every node (as Ctrl-C does: SIGTERM, then SIGKILL after the stop grace) and
        wait for that to be confirmed; the exit code, as wait()."""
        if self._running_detached:            # no launcher: as `cluster down` does
            assert self._dir is not None
            backend = backends.recorded(self._dir)
            try:
                backend.stop_run(self._dir)
            finally:
                backend.close()
            return self.wait(timeout)
        self._stop.set()
        return self.wait(timeout)

    def status(self) -> dict[str, str]:
        """Each node's state: starting (being checked), then what `cluster status` says
        (running, exited 0, exited N, stopped, lost)."""
        meta = self._dir.meta() if self._dir else {}
        names = [n.name for n in self._prepared.inventory.hosts]
        if "start" not in (meta.get("timings") or {}):
            state = "failed" if self.done and self.returncode else "starting"
            return {name: state for name in names}
        return {row.name: f"{row.state} {row.code}" if row.state == "exited" else row.state
                for row in self._node_rows()}

    def logs(self, node: str | None = None) -> str:
        """The output so far, each line prefixed with its node, as the run's log files hold
        it (a detached run's output is on its nodes: `cluster logs RUN` reads it there)."""
        if self._dir is None:
            return ""
        out = []
        for path in sorted((self._dir.path / "logs").glob("*.log")):
            rank, _, name = path.stem.partition("-")          # <rank>-<host>.log
            if node is None or node == name:
                label = f"{name} {rank}"                      # as `cluster up` prefixes them
                out += [f"[{label}] {line}" for line in path.read_text(errors="replace").splitlines()]
        return "\n".join(out) + ("\n" if out else "")

    def __repr__(self) -> str:
        return f"<cluster.Run {self.run_id} {'ended ' + str(self.returncode) if self.done else 'running'}>"


class Unanswered:
    """How long each node has not answered, over a detached run's status reads: a node that
    has answered nothing for `grace` seconds (ssh.keepalive, the launcher's own rule for a
    silent node) is judged lost. Counted from the start of the first read it did not answer."""

    def __init__(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self.clock = clock
        self.since: dict[str, float] = {}
        self.detail: dict[str, str] = {}

    def lost(self, rows: Sequence[NodeStatus], asked: float) -> list[NodeStatus]:
        """The rows of one read (begun at `asked`) whose node is lost by now."""
        for r in rows:
            if r.state in UNREACHABLE:
                self.since.setdefault(r.name, asked)
                self.detail[r.name] = r.detail or r.state
            else:
                self.since.pop(r.name, None)
        now = self.clock()
        return [r for r in rows if r.name in self.since and now - self.since[r.name] >= self.grace]

    def why(self, lost: Sequence[NodeStatus]) -> str:
        now = self.clock()
        longest = max(now - self.since[r.name] for r in lost)
        return (f"no answer for {longest:.0f} s, ssh.keepalive is {self.grace:g} s: "
                f"{self.detail[lost[0].name]}")


def detached_error(rows: Sequence[NodeStatus], run_id: str,
                   causes: Mapping[str, str] | None = None) -> ClusterError | None:
    """How a detached run ended, from its nodes' final states: None when every node exited 0;
    else the error `cluster up` would have raised (the first node to fail, with its worker's
    own error from `causes` (node name -> error) as an attached run says it; then a lost
    node, then a stop)."""
    lost = [r for r in rows if r.state in _LOST]
    stopped = [r for r in rows if r.state in _STOPPED]
    where = f"(logs: `cluster logs {run_id}`)"
    r = first_failed(rows)
    if r is not None:
        code = f" with code {r.code}" if r.code is not None else ""
        how = f"{r.state}{code}" + (f" ({r.detail})" if r.detail else "")
        cause = (causes or {}).get(r.name)
        return RunFailed(f"node [{r.name} {r.rank}] failed: {cause} ({how}) {where}" if cause
                         else f"node [{r.name} {r.rank}] {how} {where}")
    if lost:
        r = lost[0]
        return NodeLost(f"node [{r.name} {r.rank}] was lost: {r.detail or r.state} {where}")
    if stopped:
        return Interrupted(f"the run was stopped ({stopped[0].detail or 'cluster down'})",
                           signum=signal.SIGTERM)
    return None


def first_failed(rows: Sequence[NodeStatus]) -> NodeStatus | None:
    """The node that failed first (neither finished with 0, stopped nor lost): by when it
    ended where the nodes say (the others' failures often follow from it: their collectives
    lose a peer), else by rank."""
    failed = [r for r in rows if r.state not in _FINISHED | _STOPPED | _LOST
              or (r.state == "exited" and r.code != 0)]
    return min(failed, key=lambda r: (r.ended is None, r.ended or 0.0, r.rank), default=None)


class LogErrors:
    """Each node's output, as `cluster logs` yields it ((label, bytes), label "name rank"),
    read for its workers' own errors as the attached watcher reads them (worker_errors.WorkerErrors)."""

    def __init__(self) -> None:
        self._lines: dict[str, LineSplitter] = {}
        self._errors: dict[str, WorkerErrors] = {}

    def feed(self, label: str, chunk: bytes) -> None:
        for line in self._lines.setdefault(label, LineSplitter()).feed(chunk):
            self.line(label, line)

    def line(self, label: str, line: str) -> None:
        self._errors.setdefault(label, WorkerErrors()).feed(line)

    def causes(self) -> dict[str, str]:
        """node name -> its workers' error, for each node that said one."""
        for label, splitter in self._lines.items():
            for line in splitter.flush():
                self.line(label, line)
        self._lines.clear()
        return {label.rsplit(" ", 1)[0]: cause for label, errors in self._errors.items()
                if (cause := errors.cause())}


# --- the runs this program owns ----------------------------------------------------------------

# A node's state once its run has ended there, in `cluster status`'s words (a SLURM job's
# are its scheduler's, lowercase).
_FINISHED = frozenset({"exited", "completed"})          # with a code: 0 is success
_STOPPED = frozenset({"stopped", "cancelled"})
_LOST = frozenset({"lost", "gone", "node_fail"})
_ENDED = _FINISHED | _STOPPED | _LOST | {state.lower() for state in TERMINAL}

_live: set[Run] = set()
_live_lock = threading.Lock()
_hooked = False


def _owned(run: Run) -> None:
    """Keep the run in this program's list until its launcher returns; at the first, ask to
    hear of this program's end."""
    global _hooked
    with _live_lock:
        if not _hooked:
            # threading's own exit hooks run before the interpreter joins its threads and
            # before concurrent.futures refuses new work (which every stop needs). They run
            # last-registered first, so this one runs before concurrent.futures' own.
            # The ignore: a private function, which typeshed does not declare.
            threading._register_atexit(_program_exits)       # type: ignore[attr-defined]
            _hooked = True
        _live.add(run)


def _released(run: Run) -> None:
    with _live_lock:
        _live.discard(run)


def _program_exits() -> None:
    """Every attached run is stopped (all at once), every detached one finishes starting;
    this program ends only when their launchers have returned."""
    with _live_lock:
        runs = list(_live)
    for run in runs:
        run._owner_exits()
    for run in runs:
        run._thread.join()
