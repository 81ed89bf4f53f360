"""One watcher for every backend: stream each node's output with a prefix, save it per node,
and react to the first failure (or Ctrl-C) at once by stopping every other node.

One thread copies every node's output (a selector over their channels), and each node's exit
goes on one queue; the main thread blocks on that queue, so a failure is seen the moment it
happens, not on a timer.
"""
from __future__ import annotations

import math

import itertools
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from ..console import TAIL_LINES, Console, LineSplitter
from ..errors import StopRequested, signum_of
from .hang_timeout import FixedTimeout, LearnedTimeout
from .slow import SlowNodes
from ..backends import AsksStop, Finishes, NodeProcess, Selectable
from ..readers import Waiters, read_all
from ..nodes import NodeExit, signal_name
from . import timeline as tl
from .worker_errors import TORCHRUN_FAILED, WorkerErrors
from .watch_result import Hang, WatchResult

__all__ = ["Console", "Hang", "LineSplitter", "TAIL_LINES", "TORCHRUN_FAILED", "WatchResult",
           "Watcher", "WorkerErrors"]

# Threads that wait for the stopped nodes' reports. A node asked already (AsksStop) stops on
# its own meanwhile, so a few threads wait for all of them in about the slowest one's time.
STOP_THREADS = 32


def _open_log(path: Path) -> IO[bytes]:
    """Append to a node's log, created private (0600): a program may print a secret."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


class PlannedStop(Exception):
    """The launcher stops a healthy attempt to start the next one (a grow at a checkpoint)."""


class Watcher:
    """hang_timeout: seconds with no progress on any node (no output line, no heartbeat from
    the reference trainer) after which every worker's stack is collected and the run stopped;
    0 turns the watchdog off. Or a timeout learned from the heartbeats (cluster.observe.hang_timeout)."""

    def __init__(self, procs: Sequence[NodeProcess], console: Console,
                 log_paths: dict[str, Path], settle: float = 30.0,
                 hang_timeout: float | FixedTimeout | LearnedTimeout = 0.0,
                 clock: Callable[[], float] = time.monotonic, stop: threading.Event | None = None,
                 poll: float = 0.5, timeline: tl.Recorder | None = None,
                 slow: SlowNodes | None = None,
                 on_slow: Callable[[list[dict[str, Any]]], None] | None = None,
                 planned: Callable[[], str | None] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None) -> None:
        self.procs = list(procs)
        self.planned = planned                 # asked at every look: why to stop for a restart
        self.on_checkpoint = on_checkpoint     # told each newer checkpoint step, at once
        self.timeline = timeline or tl.Recorder()     # what happened, for runs/<id>/timeline
        self.slow = slow or SlowNodes()        # names a node whose ranks' own work is slower
        self.on_slow = on_slow                 # told every slow node named so far, at once
        self.console = console
        self.log_paths = log_paths
        self.settle = settle                   # how long to wait for stopped nodes to report
        self.timeout = FixedTimeout(hang_timeout) if isinstance(hang_timeout, (int, float)) \
            else hang_timeout
        self.clock = clock
        self.stop = stop                       # set by another thread: stop all, as Ctrl-C does
        self.poll = poll                       # how often a quiet watch looks at stop and silence
        # (node, its exit); (node, None) when its torchrun reported a failed worker; (node,
        # words) when its supervisor saw a worker die ("rank 1 (pid 123) died: signal 9")
        self.events: queue.Queue[tuple[NodeProcess, NodeExit | str | None]] = queue.Queue()
        # A node that failed first by a worker's death -> what its workers had printed then
        self.died: dict[str, str | None] = {}
        self.tails: dict[str, deque[str]] = {p.node.label: deque(maxlen=TAIL_LINES) for p in procs}
        said = itertools.count().__next__         # one order for every node's errors
        self.errors: dict[str, WorkerErrors] = {p.node.label: WorkerErrors(said) for p in procs}
        # Nodes we are stopping print their shutdown tracebacks; those go to the log files only.
        self.muted: set[str] = set()
        self.progress = clock()
        self.result = WatchResult(started=self.progress)
        self.stacks: dict[str, list[dict[str, Any]]] = {}
        self.dumped: set[str] = set()
        self.lock = threading.Lock()
        self.waits = Waiters()
        self.done: set[str] = set()            # the nodes whose every worker exited 0

    def run(self) -> WatchResult:
        result = self.result
        pending = {p.node.label for p in self.procs}
        try:                  # from the first moment: a Ctrl-C while the pumps start stops all too
            self._start_pumps()
            while pending:
                event = self._next_event()
                if event is None:                       # the watchdog fired
                    result.hang = self._collect_stacks(pending)
                    result.stops = self.stop_all(pending)
                    break
                proc, ex = event
                if isinstance(ex, str):                 # its supervisor saw a worker die
                    if self._worker_died(proc.node.label, ex, pending, result):
                        break
                    continue
                if ex is None:                          # its torchrun said a worker failed
                    if self._fail_early(proc.node.label, pending, result):
                        break
                    continue
                pending.discard(proc.node.label)
                result.exits[proc.node.label] = ex
                if not ex.ok and result.first_failure is None:
                    result.first_failure = (proc.node.label, ex)
                    self._report_failure(proc.node.label, ex.describe(), len(self.procs) - 1)
                    result.stops = self.stop_all(pending)
                    break
        except PlannedStop as why:
            result.planned = str(why)
            result.stops = self.stop_all(pending)
        except KeyboardInterrupt as exc:
            result.interrupted = True
            result.signum = signum_of(exc)
            self.timeline.event(tl.INTERRUPTED, signal=signal_name(result.signum))
            self.console.info(f"interrupted ({signal_name(result.signum)}): "
                              f"stopping {len(pending)} node(s)")
            result.stops = self.stop_all(pending)
        self._collect(pending, result)
        result.tails = {k: list(v) for k, v in self.tails.items()}
        # A node whose worker's death was its failure: only what was printed before it leads
        # (the dying worker's own traceback), not what the stop made torchrun say after it.
        result.causes = {k: c for k, e in self.errors.items()
                         if (c := self.died[k] if k in self.died else e.cause())}
        result.tracebacks = {k: (e.cause_rank(), t) for k, e in self.errors.items()
                             if (t := e.traceback())}
        result.then = self._other_errors(result)
        return result

    def _other_errors(self, result: WatchResult) -> list[str]:
        """Every rank's error but the first failure's own, each once, its node named, in the
        order they arrived."""
        first = result.first_failure[0] if result.first_failure else None
        said = []
        for label, errors in self.errors.items():
            but = errors.cause_rank() if label == first else None
            said += [(at, f"[{label}] rank {r}: {text}") for at, r, text in errors.others(but)]
        return [line for _, line in sorted(said)]

    def _worker_died(self, label: str, what: str, pending: set[str], result: WatchResult) -> bool:
        """A node's supervisor saw one of its workers die (killed, or exited non-zero): that
        node's failure, the first, on which every node is stopped at once, that one too (its
        torchrun has yet to notice)."""
        if result.first_failure is not None or label not in pending:
            return False
        errors = self.errors.get(label)
        self.died[label] = errors.cause(printed_only=True) if errors else None
        result.had_workers.add(label)
        result.first_failure = (label, NodeExit(detail=what))
        result.exits[label] = result.first_failure[1]
        self._report_failure(label, what, len(pending) - 1, early=True)
        result.stops = self.stop_all(pending)
        return True

    def _fail_early(self, label: str, pending: set[str], result: WatchResult) -> bool:
        """Stop every other node now; then wait for this node's own exit (its torchrun is
        ending by itself), and stop it too if that does not come within `settle`."""
        others = pending - {label}
        if result.first_failure is not None or label not in pending or not others:
            return False
        self._report_failure(label, "its torchrun reported a failed worker", len(others),
                             early=True)
        result.stops = self.stop_all(others)
        ex = self._exit_of(label, pending, result)
        if ex is None:
            result.stops.update(self.stop_all({label}))
            ex = self._exit_of(label, pending, result) or NodeExit(lost=True, reason="did not report after stop")
        pending.discard(label)
        result.exits[label] = ex
        result.first_failure = (label, ex)
        return True

    def _exit_of(self, label: str, pending: set[str], result: WatchResult) -> NodeExit | None:
        """This node's exit, recording the others' as they come, within `settle`."""
        deadline = time.monotonic() + self.settle
        while (got := self._next_exit(deadline)) is not None:
            proc, ex = got
            if proc.node.label == label:
                return ex
            pending.discard(proc.node.label)
            result.exits.setdefault(proc.node.label, ex)
        return None

    def _next_exit(self, deadline: float) -> tuple[NodeProcess, NodeExit] | None:
        """The next node to end before `deadline` (a torchrun's failure report is not an end);
        Ctrl-C while nodes are being stopped changes nothing."""
        while time.monotonic() < deadline:
            try:
                proc, ex = self.events.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                return None
            except KeyboardInterrupt:
                continue
            if isinstance(ex, NodeExit):
                return proc, ex
        return None

    def _next_event(self) -> tuple[NodeProcess, NodeExit | str | None] | None:
        """The next node to end, or None when no node has made progress for hang_timeout.
        A timeout keeps the main thread responsive to Ctrl-C while it waits."""
        while True:
            if self.stop is not None and self.stop.is_set():
                raise StopRequested(signal.SIGTERM)
            why = self.planned() if self.planned is not None else None
            if why:
                raise PlannedStop(why)
            try:
                return self.events.get(timeout=self.poll)
            except queue.Empty:
                limit = self.timeout.seconds()
                if limit and self.clock() - self.progress >= limit:
                    return None

    def _collect_stacks(self, pending: set[str]) -> Hang:
        quiet = self.clock() - self.progress
        self.timeline.event(tl.HANG, quiet=round(quiet, 3))
        self.console.info(f"no progress on any node for {quiet:.0f} s ({self.timeout.why()}): "
                          f"collecting every worker's stack before stopping")
        targets = [p for p in self.procs if p.node.label in pending]
        with self.lock:
            last = {k: list(v) for k, v in self.tails.items()}
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
            return Hang(seconds=quiet, stacks={k: list(v) for k, v in self.stacks.items()},
                        last_lines=last)

    def _control(self, label: str, record: dict[str, Any]) -> None:
        named: list[str] = []
        with self.lock:
            if record.get("joined"):
                self.result.joined.add(label)
                self.result.group_ranks[label] = int(record.get("group_rank", -1))
                self.progress = self.clock()
                self.timeline.event(tl.JOINED, label, group_rank=record.get("group_rank"))
            elif "beat" in record:
                self.progress = self.clock()
                section, pace = record.get("section"), record.get("pace")
                self.timeout.beat(label, self.progress, section if isinstance(section, str) else None,
                                  float(pace) if isinstance(pace, (int, float)) else None)
                self.timeline.beat(label, **beat_detail(record))
                if isinstance(record.get("at"), dict):
                    self._reached(record["at"])
                if record.get("steps"):
                    named = self._step_times(label, record["steps"])
            elif "done" in record:
                self._worker_done(label)
            elif record.get("workers"):
                self.result.had_workers.add(label)
            elif "stack" in record:
                self.stacks.setdefault(label, []).append(record["stack"])
            elif "dumped" in record:
                self.dumped.add(label)
            elif "nodes" in record:
                self.result.nodes = list(record["nodes"])
            elif isinstance(record.get("progress"), dict):   # read by the node after its end
                self._reached(record["progress"])
        for line in named:
            self.console.info(line)
        if named and self.on_slow is not None:
            self.on_slow(list(self.result.slow))
        if "info" in record:
            self.console.info(record["info"])
        if "said" in record:                    # a node's supervisor about itself
            self.console.info(f"[{label}] {record['said']}")

    def _worker_done(self, label: str) -> None:
        """A node's workers have all exited 0. Once every node's have, the job is done: each
        node is told to end its torchrun now (Finishes), rather than after torchrun's exit
        barrier. Under self.lock (O(1) a node; the words, O(N) once, from a thread of their own)."""
        self.done.add(label)
        self.result.had_workers.add(label)
        if len(self.done) == len(self.procs):
            threading.Thread(target=self._finish_all, daemon=True, name="finish").start()

    def _finish_all(self) -> None:
        finishing = [p for p in self.procs if isinstance(p, Finishes)]
        if len(finishing) == len(self.procs):
            for p in finishing:
                p.request_finish()

    def _reached(self, at: dict[str, Any]) -> None:
        """The furthest step and newest checkpoint reported (a node's counts only grow); a
        newer checkpoint is told to on_checkpoint. Under self.lock."""
        step, ckpt = at.get("step"), at.get("checkpoint")
        r = self.result
        if isinstance(step, int) and (r.step is None or step > r.step):
            r.step = step
        if isinstance(ckpt, int) and (r.checkpoint is None or ckpt > r.checkpoint):
            r.checkpoint = ckpt
            saving = at.get("saving")
            self.timeline.checkpoint(ckpt, **({"saving": round(float(saving), 3)}
                                              if isinstance(saving, (int, float)) else {}))
            if self.on_checkpoint is not None:
                self.on_checkpoint(ckpt)

    def _step_times(self, label: str, steps: Any) -> list[str]:
        """A node's ranks' own step times ({rank: [compute, data]}, from its supervisor): to
        the slow-node comparison. The lines naming a slow node (once each; kept for run.json)."""
        try:
            times = {int(r): (float(cd[0]), float(cd[1])) for r, cd in steps.items()}
        except (AttributeError, TypeError, ValueError, IndexError):
            return []                       # a program's malformed report: no comparison
        self.slow.report(label, times, self.progress)
        verdicts = self.slow.check(self.progress)
        self.result.slow += [v.record() for v in verdicts]
        for v in verdicts:
            self.timeline.event(tl.SLOW, v.node, **{k: x for k, x in v.record().items() if k != "node"})
        return [v.line() for v in verdicts]

    def _collect(self, pending: set[str], result: WatchResult) -> None:
        deadline = time.monotonic() + self.settle
        while pending and (got := self._next_exit(deadline)) is not None:
            proc, ex = got
            pending.discard(proc.node.label)
            result.exits.setdefault(proc.node.label, ex)
        for label in pending:
            result.exits.setdefault(label, NodeExit(lost=True, reason="did not report after stop"))

    def stop_all(self, labels: set[str]) -> dict[str, dict[str, Any]]:
        targets = [p for p in self.procs if p.node.label in labels]
        if not targets:
            return {}
        self.muted.update(labels)
        self.timeline.event(tl.STOP, nodes=sorted(labels))
        self.console.info("output of the stopped node(s) continues in their log files only")
        while True:
            try:
                with ThreadPoolExecutor(max_workers=min(len(targets), STOP_THREADS)) as pool:
                    # every node asked before any report is waited for, from the pool: each word
                    # waits for the interpreter's lock among every connection's reader (one
                    # after another, 40-55 s at 1,000 nodes); asked once, however often
                    asking = [p for p in targets if isinstance(p, AsksStop)]
                    list(pool.map(lambda p: p.request_stop(), asking))
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

    def _report_failure(self, label: str, what: str, others: int, early: bool = False) -> None:
        """Said at once, with the worker's own error when it said one before; its last lines
        come with the final error (cluster.launch). Early (on torchrun's banner), the same
        words whenever the rest of its report arrives: only what preceded the banner."""
        errors = self.errors.get(label)
        cause = errors.cause(printed_only=early) if errors else None
        self.timeline.event(tl.FAILED, label, what=cause or what)
        self.console.info(f"node [{label}] failed first: {what}" + (f": {cause}" if cause else ""))
        if others:
            self.console.info(f"stopping the other {others} node(s)")

    def _start_pumps(self) -> None:
        """Every node's output: one thread selects over those whose process can be selected
        (local and SSH nodes: O(1) threads at any node count); a thread of its own for the
        others (a scheduler's job, which speaks for all its nodes)."""
        selected = []
        for index, proc in enumerate(self.procs):
            pump = Pump(self, proc, index)
            if (fd := selectable_fd(proc)) is not None:
                selected.append((fd, pump))
            else:
                threading.Thread(target=pump.run, daemon=True,
                                 name=f"pump-{proc.node.label}").start()
        if selected:
            threading.Thread(target=read_all, args=(selected, self._ended), daemon=True,
                             name="pump-nodes").start()

    def _ended(self, proc: NodeProcess) -> None:
        """A node's output has ended: its exit (the exit status follows the end of its
        output within moments) to the queue, from one of a few shared threads."""
        def wait() -> None:
            try:
                ex = proc.wait()
            except Exception as exc:
                ex = NodeExit(lost=True, reason=str(exc))
            self.timeline.event(tl.EXIT, proc.node.label, ok=ex.ok, how=ex.describe())
            self.events.put((proc, ex))
        self.waits.submit(wait)

    def _emit(self, label: str, index: int, line: str, sub: str | None = None) -> None:
        """One line of node `label` (shown under `sub`, a node of a job, when that differs)."""
        sub = sub or label
        self.progress = self.clock()
        self.timeline.output(label)
        self.tails[label].append(line if sub == label else f"[{sub}] {line}")
        self.errors[label].feed(line)
        if label not in self.muted:
            self.console.node_line(sub, index, line)


class Pump:
    """One node's stream as it comes: bytes are its output (to its log file and the console,
    prefixed); (label, bytes) pairs are the output of a job that speaks for several nodes
    (SLURM's, labelled by srun); dicts are records."""

    def __init__(self, watcher: Watcher, proc: NodeProcess, index: int) -> None:
        self.watcher, self.proc, self.index = watcher, proc, index
        self.label = proc.node.label
        self.splitters: dict[str, LineSplitter] = {}
        self.colours: dict[str, int] = {}
        path = watcher.log_paths.get(self.label)
        self.log = _open_log(path) if path else None

    def run(self) -> None:
        """The whole stream on this thread (a process that cannot be selected)."""
        try:
            for chunk in self.proc.output():
                self.feed(chunk)
        except Exception as exc:  # a broken stream is reported through wait()
            self.broke(exc)
        self.end()
        self.watcher._ended(self.proc)

    def feed(self, chunk: Any) -> None:
        if isinstance(chunk, dict):
            if isinstance(chunk.get("died"), str):     # a worker's death: this node's failure
                self.watcher.events.put((self.proc, chunk["died"]))
            self.watcher._control(self.label, chunk)
            return
        sub, data = chunk if isinstance(chunk, tuple) else (self.label, chunk)
        if self.log:
            self.log.write(data)
            self.log.flush()
        self.show(sub, self.splitters.setdefault(sub, LineSplitter()).feed(data))

    def show(self, sub: str, lines: list[str]) -> None:
        w = self.watcher
        for line in lines:
            shown = self.colours.setdefault(sub, self.index + len(self.colours))
            w._emit(self.label, shown, line, sub)
            if line.startswith(TORCHRUN_FAILED):       # it had workers, and one failed
                with w.lock:
                    w.result.had_workers.add(self.label)
                w.events.put((self.proc, None))

    def broke(self, exc: Exception) -> None:
        self.watcher.console.info(f"[{self.label}] output stream broke: {exc}")

    def end(self) -> None:
        try:
            for sub, splitter in self.splitters.items():
                self.show(sub, splitter.flush())
        finally:
            if self.log:
                self.log.close()


def selectable_fd(proc: NodeProcess) -> int | None:
    """The file descriptor one thread can select this node's output on, if it has one."""
    if not isinstance(proc, Selectable):
        return None
    try:
        return proc.fileno()
    except (AttributeError, OSError, ValueError):   # a channel without one
        return None


def beat_detail(record: dict[str, Any]) -> dict[str, Any]:
    """What a beat's record said of the node's progress, for its timeline event: the furthest
    step its ranks named, and its slowest rank's own work and data seconds per step (the
    slow-node rule's times), where the program reports them."""
    out: dict[str, Any] = {}
    at = record.get("at")
    if isinstance(at, dict) and isinstance(at.get("step"), int):
        out["step"] = at["step"]
    try:
        times = [(float(cd[0]), float(cd[1])) for cd in (record.get("steps") or {}).values()]
    except (AttributeError, TypeError, ValueError, IndexError):
        times = []
    times = [t for t in times if math.isfinite(t[0]) and math.isfinite(t[1])]
    if times:
        out["work"] = round(max(c for c, _ in times), 4)
        out["data"] = round(max(d for _, d in times), 4)
    return out
