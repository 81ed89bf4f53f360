"""A SLURM job's output file: read it as it grows, label each line with its node (srun
--label), and follow it until the job ends."""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..runs import RunDir
from ..watch import TAIL_LINES, Console, LineSplitter

if TYPE_CHECKING:
    from .slurm import JobInfo, SlurmBackend

_LABELLED = re.compile(rb"^\s*(\d+): ?(.*)$", re.S)
# What templates/sbatch.sh.j2 prints just before `scontrol requeue`. From then on the job may
# leave squeue, and even read as finished, for a moment before it is pending again.
REQUEUE_MARK = b"cluster: requeueing job"
REQUEUE_WAIT = 60.0
ATTEMPT_MARK = b"cluster: run "               # the batch script's first line, every attempt
END_MARK = b"cluster: job "                  # its last line: the step has ended
TICK = 0.5                                    # how often the output file is read


def remember_nodes(run: RunDir, info: "JobInfo") -> None:
    """Record the nodes SLURM gave the job (known once it starts) for `cluster logs --node`."""
    nodes = [{"rank": i, "name": n, "address": n} for i, n in enumerate(info.nodes)]
    if nodes and run.meta().get("nodes") != nodes:
        run.update(nodes=nodes)


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


def follow(backend: "SlurmBackend", run: RunDir, job_id: str, output: Path,
           console: Console) -> tuple["JobInfo", list[str]]:
    """Print the job's output, prefixed by node, until squeue no longer lists the job; then
    its final state and the last lines printed.

    The output file is read every TICK; squeue is asked every `backend.poll` seconds at first,
    less often (up to `backend.max_poll`) while nothing changes, so that many users following
    jobs do not load the controller; the batch script's last line brings the next look at once."""
    reader, labeller = OutputReader(output), Labeller()
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    last_state = ""
    requeued_at: float | None = None
    look_now = False

    def emit(lines: list[bytes]) -> None:
        nonlocal requeued_at, look_now
        for raw in lines:
            label, text = labeller.split(raw)
            if label == "batch" and text.startswith(REQUEUE_MARK):
                requeued_at = backend.clock()
            elif label == "batch" and text.startswith(ATTEMPT_MARK):
                requeued_at = None              # the next attempt has started: follow it
            elif label == "batch" and text.startswith(END_MARK):
                look_now = True
            for shown in LineSplitter().feed(text + b"\n"):
                tail.append(f"[{label}] {shown}")
                console.node_line(label, labeller.index(label), shown)

    interval, next_look = backend.poll, 0.0
    while True:
        if look_now or backend.clock() >= next_look:
            look_now = False
            info = backend.queued(job_id)
            changed = info is not None and info.state != last_state
            if info is not None and info.nodes and list(info.nodes) != labeller.names:
                labeller.names = list(info.nodes)
                remember_nodes(run, info)
            if changed:
                last_state = info.state
                console.info(f"job {job_id}: {info.state}" + (f" ({info.reason})" if info.reason else ""))
            emit(reader.lines())
            if info is not None and info.state == "PENDING":
                requeued_at = None              # the next attempt is queued: follow it
            if info is None:
                info = backend.coming_back(job_id)
            waiting = requeued_at is not None and backend.clock() - requeued_at < REQUEUE_WAIT
            if info is None and not waiting:
                break
            interval = backend.poll if changed else min(backend.max_poll, interval * 1.5)
            next_look = backend.clock() + interval
        else:
            emit(reader.lines())
        backend.sleep(min(TICK, max(0.0, next_look - backend.clock())))
    emit(reader.rest())
    return backend.finished(job_id), list(tail)
