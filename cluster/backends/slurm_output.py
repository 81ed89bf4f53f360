"""A SLURM job as the launcher follows it: what SLURM says about it (JobInfo), its output file
read as it grows with each line labelled by its node (srun --label), and the job followed until
it ends (JobProcess, what the watcher watches). It asks the scheduler through `Scheduler`, which
backends/slurm.py's SlurmBackend is; this module imports nothing of that one."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import hostlist

from ..nodes import NodeExit
from ..runs import RunDir

# States after which a job never runs again (REQUEUED and PREEMPTED may come back).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str                       # SLURM's word: PENDING, RUNNING, COMPLETED, FAILED, ...
    exit_code: int | None = None
    signal: int | None = None        # the signal that ended the batch script, if one did
    nodes: tuple[str, ...] = ()
    reason: str = ""
    source: str = ""                 # squeue | sacct | sacct -c | jobcomp | scontrol | none
    restarts: int | None = None      # how often it was requeued (scontrol's Restarts=)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def describe(self) -> str:
        text = f"job {self.job_id} {self.state}"
        if self.exit_code is not None:
            text += f", exit code {self.exit_code}"
        if self.signal:
            text += f", signal {self.signal}"
        return text



class Scheduler(Protocol):
    """What a followed job asks of SLURM (backends/slurm.py's SlurmBackend)."""
    poll: float                      # first interval between squeue calls while following
    max_poll: float                  # ... growing to this while nothing changes
    stop_timeout: float
    clock: Callable[[], float]
    sleep: Callable[[float], None]

    def queued(self, job_id: str) -> JobInfo | None: ...

    def controller(self, job_id: str) -> JobInfo | None: ...

    def finished(self, job_id: str) -> JobInfo: ...

    def cancel(self, job_id: str) -> None: ...

    def wait_gone(self, job_id: str, timeout: float) -> JobInfo | None: ...


_LABELLED = re.compile(rb"^\s*(\d+): ?(.*)$", re.S)
# What templates/sbatch.sh.j2 prints just before `scontrol requeue`. From then on the job may
# leave squeue, and even read as finished, for a moment before it is pending again: waited
# through for up to REQUEUE_WAIT, unless the controller says the announced restart has ended.
REQUEUE_MARK = b"cluster: requeueing job"
_RESTART = re.compile(rb"[(]restart (\d+) of")
REQUEUE_WAIT = 60.0
ATTEMPT_MARK = b"cluster: run "               # the batch script's first line, every attempt
_ATTEMPT_NODES = re.compile(rb"^cluster: run \S+ job \S+ on (\S+) [(]restart")
END_MARK = b"cluster: job "                  # its last line: the step has ended
TICK = 0.5                                    # how often the output file is read


def unsettled_requeue(path: Path) -> int:
    """The restart that a requeue announced in the job's output (the batch script's line) is
    still to make, read as a follower reads it: the last announcement with no attempt started
    after it. 0 when there is none (or no output to read)."""
    marks, labeller = _Marks(), Labeller()
    try:
        with open(path, "rb") as f:
            for raw in f:
                for item in JobProcess._lines([raw.rstrip(b"\n")], labeller):
                    if isinstance(item, dict):
                        marks._note(item, 0.0)
    except OSError:
        return 0
    return marks.announced if marks.requeued_at is not None else 0


def remember_nodes(run: RunDir, info: JobInfo) -> None:
    """Record the nodes SLURM gave the job (known once it starts) for `cluster logs --node`."""
    nodes = [{"rank": i, "name": n, "address": n} for i, n in enumerate(info.nodes)]
    if nodes and run.meta().get("nodes") != nodes:
        run.update(nodes=nodes)


def node_names(expr: str) -> tuple[str, ...]:
    """SLURM's node list (node[1-2], as squeue or $SLURM_JOB_NODELIST give it) one name each."""
    expr = expr.strip()
    if not expr or expr in ("(null)", "None assigned"):
        return ()
    try:
        return tuple(hostlist.expand_hostlist(expr))
    except hostlist.BadHostlist:
        return (expr,)


class OutputReader:
    """New complete lines of a growing file (the job's output), remembering the offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.buf = b""

    def lines(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return done

    def rest(self) -> list[bytes]:
        out = self.lines()
        if self.buf.strip():
            out.append(self.buf)
        self.buf = b""
        return out


class Labeller:
    """'1: text' (srun --label, task 1 = the second node) -> ('node2 1', b'text'); lines of the
    batch shell itself (no task prefix) -> ('batch', line)."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = list(names)

    def split(self, line: bytes) -> tuple[str, bytes]:
        m = _LABELLED.match(line)
        if not m:
            return "batch", line
        task = int(m.group(1))
        name = self.names[task] if task < len(self.names) else "task"
        return f"{name} {task}", m.group(2)

    def index(self, label: str) -> int:
        return 0 if label == "batch" else int(label.rsplit(" ", 1)[1]) + 1


class Job:
    """The node-like label of a submitted job, for the watcher."""

    def __init__(self, job_id: str) -> None:
        self.label = f"job {job_id}"


class JobProcess:
    """A submitted SLURM job as the watcher sees a node (backends.NodeProcess): its output
    file labelled by node, the scheduler's news as control records, its end as a NodeExit.

    The output file is read every TICK; squeue is asked every `backend.poll` seconds at first,
    less often (up to `backend.max_poll`) while nothing changes, so that many users following
    jobs do not load the controller; the batch script's last line brings the next look at once.
    A requeue the batch script announced is waited through: the job may leave squeue, and even
    read as finished, for a moment before it is pending again."""

    def __init__(self, backend: Scheduler, job_id: str, output: Path, run_id: str,
                 nodes: Sequence[str] = ()) -> None:
        self.backend = backend
        self.job_id = job_id
        self.path = output
        self.run_id = run_id
        self.node = Job(job_id)
        self.final: JobInfo | None = None
        self.nodes = list(nodes)                 # known once it starts (squeue)

    def output(self) -> Iterator[tuple[str, bytes] | dict[str, Any]]:
        reader, labeller, marks = OutputReader(self.path), Labeller(self.nodes), _Marks()
        last_state = ""
        interval, next_look = self.backend.poll, 0.0
        clock = self.backend.clock
        while True:
            if marks.look_now or clock() >= next_look:
                marks.look_now = False
                info = self.backend.queued(self.job_id)
                changed = info is not None and info.state != last_state
                if info is not None and info.nodes and list(info.nodes) != labeller.names:
                    labeller.names = self.nodes = list(info.nodes)
                    yield {"nodes": self.nodes}
                if info is not None and changed:
                    last_state = info.state
                    yield {"info": f"job {self.job_id}: {info.state}"
                                   + (f" ({info.reason})" if info.reason else "")}
                yield from self._read(reader, labeller, marks)
                if info is not None and info.state == "PENDING":
                    marks.requeued_at = None        # the next attempt is queued: follow it
                if info is None:
                    info = self._unlisted(marks)
                waiting = marks.requeued_at is not None and clock() - marks.requeued_at < REQUEUE_WAIT
                if info is None and not waiting:
                    break
                interval = self.backend.poll if changed else min(self.backend.max_poll, interval * 1.5)
                next_look = clock() + interval
            else:
                yield from self._read(reader, labeller, marks)
            self.backend.sleep(min(TICK, max(0.0, next_look - clock())))
        yield from (i for i in self._lines(reader.rest(), labeller) if not isinstance(i, dict))
        self.final = self.backend.finished(self.job_id)
        yield {"info": f"run {self.run_id}: {self.final.describe()} ({self.final.source})"}

    def _read(self, reader: OutputReader, labeller: Labeller,
              marks: _Marks) -> Iterator[tuple[str, bytes] | dict[str, Any]]:
        """The new lines, by node. The names may come from the batch script's first line
        (its $SLURM_JOB_NODELIST) before squeue is next asked: the record says so once the
        lines are out, so that `logs --node` finds them too."""
        yield from marks.read(self._lines(reader.lines(), labeller), self.backend.clock())
        if labeller.names and labeller.names != self.nodes:
            self.nodes = list(labeller.names)
            yield {"nodes": self.nodes}

    def _unlisted(self, marks: _Marks) -> JobInfo | None:
        """squeue no longer lists the job. The controller may still know it in a state that is
        not final (requeued, coming back): follow that. If it reads the job as finished after
        the restart the batch script announced, that attempt has ended: stop waiting for it."""
        known = self.backend.controller(self.job_id)
        if known is None or not known.state:
            return None
        if not known.done:
            return known
        if marks.requeued_at is not None and known.restarts is not None \
                and known.restarts >= marks.announced:
            marks.requeued_at = None
        return None

    @staticmethod
    def _lines(lines: list[bytes], labeller: Labeller) -> Iterator[tuple[str, bytes] | dict[str, Any]]:
        for raw in lines:
            label, text = labeller.split(raw)
            if label == "batch":
                for mark, name in ((REQUEUE_MARK, "requeue"), (ATTEMPT_MARK, "attempt"),
                                   (END_MARK, "end")):
                    if text.startswith(mark):
                        yield {"mark": name, "text": text}
                        break
                found = _ATTEMPT_NODES.match(text)
                if found:              # every task line of this attempt comes after this one
                    labeller.names = list(node_names(found.group(1).decode(errors="replace")))
            yield label, text + b"\n"

    def wait(self) -> NodeExit:
        info = self.final or self.backend.finished(self.job_id)
        self.final = info
        ok = info.state == "COMPLETED" and not info.exit_code
        return NodeExit(code=0 if ok else (info.exit_code or 1),
                        detail="" if ok else f"{info.describe()} ({info.source})")

    def stop(self) -> dict[str, Any]:
        """Cancel the job and wait until squeue no longer lists it."""
        self.backend.cancel(self.job_id)
        left = self.backend.wait_gone(self.job_id, self.backend.stop_timeout)
        summary = (f"job {self.job_id} of run {self.run_id} was cancelled"
                   + (f" but squeue still lists it as {left.state}" if left else ""))
        report: dict[str, Any] = {"signalled": [self.job_id], "summary": summary}
        if left is not None:
            report["error"] = f"still listed by squeue as {left.state}"
        return report

    def request_stacks(self) -> None:
        """Not offered under SLURM (the launcher refuses --hang-timeout there)."""


class _Marks:
    """What the batch script's own lines have told the follower so far."""

    def __init__(self) -> None:
        self.requeued_at: float | None = None   # when it announced a requeue not yet seen through
        self.announced = 0                      # ... and the restart that requeue makes
        self.look_now = False                   # the step ended: ask squeue at once

    def read(self, items: Iterator[tuple[str, bytes] | dict[str, Any]],
             now: float) -> Iterator[tuple[str, bytes]]:
        """The lines to show; the marks among them are taken note of."""
        for item in items:
            if isinstance(item, dict):
                self._note(item, now)
            else:
                yield item

    def _note(self, mark: dict[str, Any], now: float) -> None:
        name = mark.get("mark")
        if name == "requeue":
            self.requeued_at = now
            found = _RESTART.search(mark.get("text", b""))
            self.announced = int(found.group(1)) if found else self.announced + 1
        elif name == "attempt":
            self.requeued_at = None             # the next attempt has started: follow it
        elif name == "end":
            self.look_now = True
