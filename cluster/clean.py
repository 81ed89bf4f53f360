"""`cluster clean`: remove old run folders on the nodes (<workdir>/.cluster/<run-id>: scripts
with environment values, logs, metrics) and old run records here (runs/<run-id>), listing what
goes and what stays. A running run is never touched; when in doubt, a run is kept.

On a node, cluster/remote/clean.py decides with the supervisor's own status and the run's
process identity. Here, a record is removed only when it is older than the cutoff and it never
started, or every one of its recorded nodes says it has ended (its recorded backend's status:
exited or stopped; its folder gone; a SLURM job in a final state). A node that cannot be asked,
a lost supervisor, a state not known: the record stays, and the listing says why.

Under SLURM a run may also leave its job's secret values in a private folder beside the job's
output (.<run-id>.secrets); clean_secrets removes it, whatever the run's age, once the job is
over for good (the backend's ended_for_good), and a record stays while its folder is there.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends.supervised import SupervisedBackend
from .console import human_bytes
from .errors import InputError
from .nodes import NodeStatus, read_answer
from .runs import RunDir
from .spec import Host

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
FRESH = 600.0       # a record or node folder this young may belong to a launch under way
# What a recorded node says once its run has ended for good.
ENDED = frozenset({"exited", "stopped", "gone", "not submitted", "completed", "failed",
                   "cancelled", "timeout", "node_fail", "out_of_memory", "boot_fail",
                   "deadline", "revoked", "special_exit"})


def parse_duration(text: str, option: str = "--older-than") -> float:
    """'7d', '12h', '30m', '45s', '2w' (or 0) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not m or (not m.group(2) and float(m.group(1)) != 0):
        raise InputError(f"Invalid value for {option}: {text!r} (a number and a unit: "
                         f"7d, 12h, 30m, 45s, 2w)")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


@dataclass(frozen=True)
class Decision:
    """One run folder or record: what became of it and why."""
    where: str                      # a node's name, or "local"
    path: str                       # .cluster/<id> on a node, runs/<id> here
    action: str                     # removed | would remove | kept
    why: str = ""
    age: float | None = None        # seconds since it was last active
    size: int | None = None         # bytes, for what is (or would be) removed

    def line(self) -> str:
        extra = [x for x in (human_bytes(self.size) if self.size is not None else "",
                             f"last active {ago(self.age)} ago" if self.age is not None and
                             self.action != "kept" else "") if x]
        text = f"{self.where}: {self.action} {self.path}"
        if extra:
            text += f" ({', '.join(extra)})"
        return text + (f": {self.why}" if self.why else "")


def ago(seconds: float | None) -> str:
    seconds = max(seconds or 0.0, 0.0)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


# --- on the nodes ------------------------------------------------------------------------------


def node_args(host: Host, older_than: float, dry_run: bool) -> list[str]:
    return ["--workdir", host.workdir, "--older-than", f"{older_than:g}", "--fresh", f"{FRESH:g}",
            *(["--dry-run"] if dry_run else [])]


def clean_nodes(hosts: Sequence[Host], backend: SupervisedBackend, older_than: float,
                dry_run: bool) -> tuple[list[Decision], dict[str, str]]:
    """Every node at once: (decisions, {node: why it could not be cleaned})."""
    answers = backend.each(hosts, lambda h: backend.run_program(
        h, "clean", *node_args(h, older_than, dry_run), timeout=600))
    decisions: list[Decision] = []
    failed: dict[str, str] = {}
    for host, res in answers:
        if isinstance(res, Exception):
            failed[host.name] = str(res)
            continue
        report = read_answer(res.stdout)
        if report is None:
            failed[host.name] = (f"python {host.python!r} could not run the clean there: "
                                 f"{res.text()[-300:] or f'exit code {res.code}'}")
            continue
        decisions += node_decisions(host.name, report)
    return decisions, failed


def node_decisions(node: str, report: dict[str, Any]) -> list[Decision]:
    """clean.py's JSON -> decisions (pure)."""
    return [Decision(node, f".cluster/{r['id']}", r["action"], r.get("why") or "", r.get("age"),
                     r.get("bytes")) for r in report.get("runs", [])]


# --- secret values left behind -------------------------------------------------------------------

# A run's secrets' folder still on disk: None when it is not; "" when it may go; else why not.
SecretsOf = Callable[[RunDir], "str | None"]
Forget = Callable[[RunDir], str]            # removes them; what went wrong, or ""


def clean_secrets(root: Path, dry_run: bool, left_of: SecretsOf, forget: Forget) -> list[Decision]:
    """The secret values a job's run left on disk (SLURM: <output dir>/.<run-id>.secrets),
    for every record under root whatever its age: removed once the job is over for good. Only
    the folder's path is listed, never what it holds."""
    if not root.is_dir():
        return []
    decisions = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        run = RunDir(path)
        folder = secrets_folder(run)
        if not folder:
            continue
        try:
            why = left_of(run)
        except Exception as exc:  # noqa: BLE001 - any doubt keeps the secrets
            why = f"its job could not be asked: {(str(exc) or repr(exc)).splitlines()[0]}"
        if why is None:
            continue
        if why:
            decisions.append(Decision("local", folder, "kept", f"secrets of run {path.name}: {why}"))
        elif dry_run:
            decisions.append(Decision("local", folder, "would remove",
                                      f"secrets of run {path.name}, whose job has ended"))
        else:
            problem = forget(run)
            decisions.append(Decision("local", folder, "kept" if problem else "removed",
                                      problem or f"secrets of run {path.name}, whose job has ended"))
    return decisions


def secrets_folder(run: RunDir) -> str:
    """The folder of the secrets' file the run's record names, or "" (none, or no record)."""
    try:
        meta = run.meta()
    except InputError:
        return ""
    path = (meta.get("slurm") or {}).get("secrets_file") if isinstance(meta, dict) else None
    return str(Path(path).parent) if isinstance(path, str) and path else ""


# --- the records here --------------------------------------------------------------------------


StatusOf = Callable[[RunDir], list[NodeStatus]]


def clean_records(root: Path, older_than: float, dry_run: bool, status_of: StatusOf,
                  now: float | None = None, workers: int = 4,
                  secrets_going: Collection[str] = ()) -> list[Decision]:
    """Each run record under root: removed when old and ended (see record_verdict).
    secrets_going: the secrets' folders clean_secrets removed (or would remove)."""
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    with ThreadPoolExecutor(max_workers=workers) as pool:
        verdicts = list(pool.map(lambda p: record_verdict(p, older_than, now, status_of,
                                                          secrets_going), folders))
    decisions = []
    for path, (removable, why, age) in zip(folders, verdicts):
        rel = f"{root.name}/{path.name}"
        if not removable:
            decisions.append(Decision("local", rel, "kept", why, age))
            continue
        size = folder_size(path)
        if dry_run:
            decisions.append(Decision("local", rel, "would remove", why, age, size))
            continue
        try:
            shutil.rmtree(path)
            decisions.append(Decision("local", rel, "removed", why, age, size))
        except OSError as exc:
            decisions.append(Decision("local", rel, "kept", f"cannot remove: {exc.strerror}", age))
    return decisions


def record_verdict(path: Path, older_than: float, now: float, status_of: StatusOf,
                   secrets_going: Collection[str] = ()) -> tuple[bool, str, float]:
    """(removable, why, age) of one record. Its nodes are asked only when it is old enough."""
    age = now - last_active(path)
    if age < older_than:
        return False, f"active {ago(age)} ago", age
    try:
        meta = json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        if age < FRESH:
            return False, "no run.json yet: a launch may be writing it", age
        return True, "an incomplete record (no run.json)", age
    if meta.get("dry_run"):
        return True, "a dry run: nothing ran", age
    if not started(meta):
        return True, "never started (its check failed or it was interrupted)", age
    try:
        rows = status_of(RunDir(path))
    except Exception as exc:  # noqa: BLE001 - any doubt keeps the record
        return False, f"its nodes could not be asked: {str(exc).splitlines()[0]}", age
    folder = secrets_folder(RunDir(path))
    if folder and folder not in secrets_going and Path(folder).exists():
        # the record is what says where they are and when they may go
        return False, f"its job's secrets' folder {folder} is still there", age
    return verdict(rows) + (age,)


def started(meta: dict[str, Any]) -> bool:
    """Whether anything of the run was ever started (a process group, an exit, a job id)."""
    return bool(meta.get("pgids") or meta.get("exits") or (meta.get("slurm") or {}).get("job_id"))


def verdict(rows: Sequence[NodeStatus]) -> tuple[bool, str]:
    """Removable only when every node says its run has ended (pure)."""
    open_rows = [r for r in rows if r.state not in ENDED]
    if not rows:
        return False, "no node answered"
    if open_rows:
        return False, "; ".join(f"{r.name}: {r.state}" + (f" ({r.detail})" if r.detail else "")
                                for r in open_rows[:4])
    return True, "ended on every node (" + ", ".join(sorted({r.state for r in rows})) + ")"


def last_active(path: Path) -> float:
    """The newest modification time of the record, its run.json and its logs."""
    newest = 0.0
    for p in [path, path / "run.json", *sorted((path / "logs").glob("*"))]:
        try:
            newest = max(newest, p.lstat().st_mtime)
        except OSError:
            pass
    return newest


def folder_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.lstat().st_size
        except OSError:
            pass
    return total
