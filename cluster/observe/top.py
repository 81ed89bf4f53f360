"""`cluster top`: a run's nodes at a glance, refreshed: state, uptime, each GPU's utilisation
and memory, and the reference trainer's latest step, loss and images/s.

Over SSH and locally, one round trip per node per refresh, every node at once: the node-side
program cluster/remote/status.py (status_args) asks the node's supervisor for its status,
nvidia-smi for its GPUs (when it has one: a CPU node shows "-"), and, on rank 0's node, reads
the last lines of the trainer's metrics.jsonl (under its recorded `--out`), and every node's
ranks' own step reports beside its heartbeat file (`<heartbeat>.steps.<RANK>`, the protocol of
docs/failures.md): the node's step rate and work per step. The answers are parsed by pure
functions into Rows,
which render() turns into a table. Under SLURM the rows come from the scheduler (squeue) and the
metrics from the job's output folder here (shared with the nodes); GPU figures are not read
there (a job step of our own inside the user's allocation would compete with it), nor are the
step reports (they lie in each node's run folder, which only a job step could read).
"""
from __future__ import annotations


import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..nodes import NodeStatus, end_code, read_answer
from ..runs import RunDir
from ..torchrun_options import last_value
from . import metrics as mx

if TYPE_CHECKING:
    from rich.table import Table

METRICS_LINES = 20
# A node whose newest step report is older than this (or than 3 of its own report intervals,
# for steps slower than that) has stalled: the job ended, is stuck, or is between attempts.
STALE_S = 10.0
# States after which a node shows nothing new: top stops refreshing when every node is in one.
# An unreachable node is not among them (it may answer at the next refresh).
ENDED = frozenset({"exited", "stopped", "gone", "lost", "unknown", "not submitted", "completed",
                   "failed", "cancelled", "timeout", "node_fail", "out_of_memory", "boot_fail",
                   "deadline", "revoked", "special_exit"})


@dataclass(frozen=True)
class Gpu:
    index: int
    util: float | None              # percent
    used: float | None              # MiB
    total: float | None             # MiB


@dataclass(frozen=True)
class Metrics:
    step: int | None = None
    loss: float | None = None
    images_per_s: float | None = None


@dataclass(frozen=True)
class Pace:
    """A node's steps, from its ranks' own reports: the slowest rank's."""
    rate: float | None              # steps/s, the lowest of its ranks'; None: no rank said
    work: float | None              # s per step of its own work (compute + data), the highest
    age: float                      # seconds since its newest report
    every: float | None = None      # the longest of its ranks' report intervals (s)
    compute: float | None = None    # s per step of its own compute, the highest of its ranks'
    data: float | None = None       # ... and of waiting for data

    @property
    def stale(self) -> bool:
        return self.age > max(STALE_S, 3 * (self.every or 0))


@dataclass(frozen=True)
class Row:
    rank: int
    node: str
    state: str
    uptime: float | None = None
    gpus: tuple[Gpu, ...] | None = None       # None: no nvidia-smi there (or not asked)
    metrics: Metrics | None = None            # rank 0's node, when the trainer wrote some
    detail: str = ""
    pace: Pace | None = None                  # None: no rank of the node reported (or not asked)
    code: int | None = None                   # its exit code, once it has ended


# --- what to ask a node, and what its answer means (pure) ---------------------------------------


def metrics_file(args: Sequence[str], workdir: str) -> str | None:
    """The reference trainer's metrics.jsonl from the run's recorded script arguments: under
    `--out DIR` (relative to the node's workdir, where the script ran); None without --out."""
    out = last_value(args, "--out")
    if not out:
        return None
    path = out if out.startswith(("/", "~")) else f"{workdir.rstrip('/')}/{out}"
    return f"{path.rstrip('/')}/metrics.jsonl"


def status_args(run_dir: str, metrics: str | None) -> list[str]:
    """What to ask one node's status program (cluster/remote/status.py): the supervisor's
    status, the GPUs, the ranks' step reports beside the heartbeat file the supervisor gives
    the run (`<run dir>/heartbeat`), the metrics' tail."""
    args = ["--dir", run_dir, "--gpus", "--steps", f"{run_dir.rstrip('/')}/heartbeat"]
    if metrics:
        args += ["--metrics", metrics, "--lines", str(METRICS_LINES)]
    return args


def split_answer(data: bytes) -> dict[str, Any] | None:
    """A node's answer (nodes.read_answer: framed, so that a setup line's or the shell's output
    before it is never taken for it), a JSON object with a "status"; None when it is not one."""
    said = read_answer(data)
    if said is None or not isinstance(said.get("status"), dict):
        return None
    return said


def parse_gpus(lines: Sequence[str] | None) -> tuple[Gpu, ...] | None:
    """nvidia-smi's CSV (index, utilization %, memory used, total in MiB); '[N/A]' -> None."""
    if not lines:
        return None
    gpus = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        gpus.append(Gpu(int(cells[0]), _num(cells[1]), _num(cells[2]), _num(cells[3])))
    return tuple(gpus) or None


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_metrics(lines: Sequence[str] | None) -> Metrics | None:
    """The newest step, loss and images/s in the trainer's last records (step records carry
    `loss`, epoch summaries `train_loss`); a line cut by a write in progress is skipped."""
    if not lines:
        return None
    step = loss = ips = None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get("step"), int):
            step = rec["step"]
        value = rec.get("loss", rec.get("train_loss"))
        if isinstance(value, (int, float)):
            loss = float(value)
        if isinstance(rec.get("images_per_s"), (int, float)):
            ips = float(rec["images_per_s"])
    if step is None and loss is None and ips is None:
        return None
    return Metrics(step, loss, ips)


def parse_steps(reports: Any) -> Pace | None:
    """A node's pace from its ranks' step reports (status.py's "steps"): the slowest rank's
    rate and work, the newest report's age; a report that is not one is skipped."""
    if not isinstance(reports, list):
        return None
    rates, works, ages, everies, parts = [], [], [], [], []
    for r in reports:
        if not isinstance(r, dict) or not _number(r.get("age")):
            continue
        ages.append(float(r["age"]))
        if _number(r.get("rate")):
            rates.append(float(r["rate"]))
        if _number(r.get("compute")) and _number(r.get("data")):
            works.append(float(r["compute"]) + float(r["data"]))
            parts.append((float(r["compute"]), float(r["data"])))
        if _number(r.get("seconds")):
            everies.append(float(r["seconds"]))
    if not ages:
        return None
    return Pace(min(rates) if rates else None, max(works) if works else None, min(ages),
                max(everies) if everies else None,
                max(c for c, _ in parts) if parts else None,
                max(d for _, d in parts) if parts else None)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def row_from(rec: dict[str, Any], answer: Any) -> Row:
    """One node's row from its answer (a transport Result) or the exception it raised."""
    if isinstance(answer, Exception):
        return Row(rec["rank"], rec["name"], "unreachable", detail=str(answer).splitlines()[0])
    if answer.code is None:
        return Row(rec["rank"], rec["name"], "unreachable", detail=answer.text()[-200:] or "no answer")
    said = split_answer(answer.stdout) or {}
    status = said.get("status") or {"state": "unknown", "reason": answer.text()[-200:]}
    detail = status.get("reason") or ""
    code = end_code(status)            # a stop's code, as `cluster status` says it
    if code is not None and status.get("state") in ("exited", "stopped"):
        detail = f"exit code {code}" + (f"; {detail}" if detail else "")
    return Row(rec["rank"], rec["name"], status.get("state", "unknown"), status.get("uptime"),
               parse_gpus(said.get("gpus")), parse_metrics(said.get("metrics")), detail,
               parse_steps(said.get("steps")), code)


# --- collecting -------------------------------------------------------------------------------


def collect(run: RunDir, backend: Any) -> list[Row]:
    """One refresh of a supervised run (local, SSH): every node at once, one round trip each."""
    meta = run.meta()
    hosts = {h.name: h for h in run.hosts()}
    args = meta.get("args") or []
    nodes = meta.get("nodes") or []

    def ask(rec: dict[str, Any]) -> Any:
        host = hosts[rec["name"]]
        metrics = metrics_file(args, host.workdir) if rec["rank"] == 0 else None
        return backend.run_program(host, "status", *status_args(rec.get("dir") or rec["run_dir"],
                                                                metrics), timeout=20)
    return marked([row_from(rec, answer) for rec, answer in backend.each(nodes, ask)],
                  meta.get("slow_nodes") or [])


def marked(rows: list[Row], slow: list[dict[str, Any]]) -> list[Row]:
    """The rows of nodes named slow (run.json's slow_nodes) with the mark in their detail."""
    by_node = {str(s.get("node", "")).split(" ")[0]: s for s in slow}
    out = []
    for row in rows:
        s = by_node.get(row.node)
        if s is not None:
            mark = f"slow: {s.get('ratio')}x ({s.get('part')})"
            row = replace(row, detail=f"{mark}; {row.detail}" if row.detail else mark)
        out.append(row)
    return out


def collect_slurm(run: RunDir, backend: Any) -> list[Row]:
    """One refresh of a SLURM run: the job's state per node (squeue, else sacct), and rank 0's
    metrics from the output folder here, which the nodes share."""
    meta = run.meta()
    statuses: list[NodeStatus] = backend.status(run)
    path = metrics_file(meta.get("args") or [], meta.get("cwd") or ".")
    metrics = parse_metrics(tail(Path(path), METRICS_LINES)) if path else None
    return [Row(s.rank, s.name, s.state, s.uptime, None, metrics if s.rank == 0 else None,
                s.detail, code=s.code) for s in statuses]


def tail(path: Path, n: int) -> list[str] | None:
    """The last n lines of a file (read from its end), or None when it is not there."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.seek(max(0, f.tell() - 65536))
            data = f.read()
    except OSError:
        return None
    lines = data.decode(errors="replace").splitlines()
    return lines[1:][-n:] if size and len(lines) > 1 else lines[-n:]


def ended(rows: Sequence[Row]) -> bool:
    return bool(rows) and all(r.state in ENDED for r in rows)


# --- as metrics (cluster status --metrics-textfile) -------------------------------------------


# A node's state as the live metrics name it (a scheduler's words too); any other: unknown.
STATES = {"running": mx.RUNNING, "pending": mx.STARTING, "configuring": mx.STARTING,
          "stopped": mx.STOPPED, "cancelled": mx.STOPPED, "completed": mx.EXITED,
          "failed": mx.FAILED, "timeout": mx.FAILED, "node_fail": mx.FAILED,
          "out_of_memory": mx.FAILED, "boot_fail": mx.FAILED, "deadline": mx.FAILED}


def metrics_view(run_id: str, rows: Sequence[Row], meta: dict[str, Any]) -> mx.RunView:
    """The rows as the live metrics' view: what the nodes say now (state, their ranks' step
    reports, rank 0's trainer step) and the record (attempts, slow nodes). No goodput nor
    checkpoint: those are the launcher's events, which a detached run does not have."""
    slow = {str(s.get("node")) for s in meta.get("slow_nodes") or []}
    attempts = meta.get("attempts") or []
    attempt = len(attempts) - 1 if attempts else 0
    return mx.RunView(run_id, [_node_view(r, slow) for r in sorted(rows, key=lambda r: r.rank)],
                      attempt=attempt, restarts=attempt)


def _node_view(row: Row, slow: set[str]) -> mx.NodeView:
    label, pace = f"{row.node} {row.rank}", row.pace
    state = (mx.EXITED if row.code == 0 else mx.FAILED) if row.state == "exited" \
        else STATES.get(row.state, mx.UNKNOWN)
    return mx.NodeView(label, state, row.metrics.step if row.metrics else None,
                       pace.rate if pace else None, pace.compute if pace else None,
                       pace.data if pace else None, pace.age if pace else None, label in slow)


# --- showing ----------------------------------------------------------------------------------


COLUMNS = ("rank", "node", "state", "uptime", "GPU %", "GPU mem", "step", "loss", "img/s",
           "step/s", "work s", "detail")
NUMERIC = frozenset({"rank", "step", "loss", "img/s", "step/s", "work s"})
# Shown only when some row has something in them (cells() says '-' / '' otherwise).
OPTIONAL: dict[str, Callable[[Row], bool]] = {
    "step/s": lambda r: r.pace is not None, "work s": lambda r: r.pace is not None,
    "detail": lambda r: bool(r.detail)}
UNBOUNDED = 100_000      # the width a table is measured in when nothing bounds it


def cells(row: Row) -> list[str]:
    """A row as table cells (pure); '-' where there is nothing to show."""
    gpus = row.gpus
    util = " ".join(_pct(g.util) for g in gpus) if gpus else "-"
    memory = " ".join(_mem(g) for g in gpus) if gpus else "-"
    m = row.metrics
    return [str(row.rank), row.node, row.state, _uptime(row.uptime), util, memory,
            "-" if not m or m.step is None else str(m.step),
            "-" if not m or m.loss is None else f"{m.loss:.4f}",
            "-" if not m or m.images_per_s is None else f"{m.images_per_s:,.0f}",
            _rate(row.pace), _work(row.pace), row.detail]


def _rate(pace: Pace | None) -> str:
    """The node's steps/s; a stalled node says how long since its last report instead."""
    if pace is None:
        return "-"
    if pace.stale:
        return f"stalled {_ago(pace.age)}"
    if pace.rate is None:
        return "-"
    return f"{pace.rate:.2f}" if pace.rate < 100 else f"{pace.rate:,.0f}"


def _work(pace: Pace | None) -> str:
    return "-" if pace is None or pace.work is None else f"{pace.work:.3f}"


def _ago(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    return f"{s // 60} min" if s < 7200 else f"{s // 3600} h"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}%"


def _mem(g: Gpu) -> str:
    if g.used is None or g.total is None:
        return "?"
    return f"{g.used / 1024:.1f}/{g.total / 1024:.0f}G"


def _uptime(seconds: float | None) -> str:
    if not seconds:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render(rows: Sequence[Row], title: str) -> Table:
    """A rich Table of the rows; the step/s, work and detail columns only when a row has
    something in them."""
    from rich.table import Table
    table = Table(title=title, title_justify="left")
    shown = [i for i, c in enumerate(COLUMNS)
             if c not in OPTIONAL or any(OPTIONAL[c](r) for r in rows)]
    for i in shown:
        col = COLUMNS[i]
        table.add_column(col, justify="right" if col in NUMERIC else "left",
                         no_wrap=col in ("node", "state", "uptime", "step/s"))
    for row in sorted(rows, key=lambda r: r.rank):
        row_cells = cells(row)
        table.add_row(*(row_cells[i] for i in shown))
    return table


def fit(console: Any, table: Any) -> None:
    """Draw at the terminal's real width (rich reads it at every refresh, so a resize is
    followed; TERM=dumb, where rich assumes 80, reads it here); anywhere else (a pipe, a file,
    a CI log) as wide as the table needs, never cut at 80 columns."""
    if console.is_terminal and not console.is_dumb_terminal:
        return
    if console.is_terminal:
        console.size = tuple(shutil.get_terminal_size())
        return
    from rich.measure import Measurement
    console.width = Measurement.get(console, console.options.update_width(UNBOUNDED), table).maximum


def title(run_id: str, backend: str, when: float | None = None) -> str:
    return f"run {run_id} ({backend})  {time.strftime('%H:%M:%S', time.localtime(when))}"
