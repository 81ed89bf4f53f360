"""The local run directory: runs/<run-id>/ records what was launched, and keeps each node's log.

Everything here may hold a secret (an env value in a script, a token a program printed): the
directory is 0700 and every file 0600, whatever the umask. Secret environment values
(secret_env) are never written: the record keeps their names only.

    runs/<run-id>/run.json          run id, backend, nodes, command line, git commit, times;
                                    written when the directory is made, completed as it goes
    runs/<run-id>/inventory.yaml    the inventory as loaded (every default applied)
    runs/<run-id>/inventory.source  the inventory file as read, when there was one
    runs/<run-id>/env.json          per node: the environment cluster decided
    runs/<run-id>/scripts/<rank>-<host>.sh   each rendered script
    runs/<run-id>/logs/<rank>-<host>.log     each node's output, as streamed
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import spec, texts
from .errors import InputError

RUNS_ENV = "CLUSTER_RUNS_DIR"
DOCTOR_PREFIX = "doctor-"     # `cluster doctor --deep`'s collectives: found by id, never as the newest


def runs_root() -> Path:
    return Path(os.environ.get(RUNS_ENV, "runs"))


def write_private(path: Path, text: str | bytes) -> None:
    """Write a file only its owner can read (0600), replacing it atomically."""
    data = text.encode() if isinstance(text, str) else text
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)
    tmp.replace(path)


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """~/.cache/cluster ($XDG_CACHE_HOME/cluster): what cluster keeps between runs here."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "cluster"


def state_root(environ: Mapping[str, str] = os.environ) -> Path:
    """~/.local/state/cluster ($XDG_STATE_HOME/cluster): what cluster must not lose between
    runs (a cache may be removed at will; this may not: the node ledger)."""
    base = (environ.get("XDG_STATE_HOME")
            or str(Path(environ.get("HOME") or Path.home()) / ".local" / "state"))
    return Path(base) / "cluster"


def new_run_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{secrets.token_hex(2)}"


@dataclass
class RunDir:
    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, run_id: str, root: Path | None = None,
               meta: dict[str, Any] | None = None) -> "RunDir":
        """The run's directory with its run.json from the first moment (its id, when it was
        made, and `meta`), so that status, logs and clean see the run while it is checked."""
        root = root or runs_root()
        if not root.exists():
            make_private_dir(root)
        path = root / run_id
        try:
            path.mkdir(mode=0o700, exist_ok=False)
        except OSError as exc:
            raise InputError(f"cannot create the run directory {path}: {exc.strerror} "
                             f"(set {RUNS_ENV} to a writable place)") from None
        os.chmod(path, 0o700)
        for sub in ("scripts", "logs"):
            make_private_dir(path / sub)
        run = cls(path)
        run.write_meta({"run_id": run_id, "created": time.time(), **(meta or {})})
        return run

    @classmethod
    def find(cls, run: str | None, root: Path | None = None, dry_runs: bool = False) -> "RunDir":
        """A run by id (or unique prefix), or the newest one when run is None: newest by when
        it was created, never by when its record last changed (status rewrites it), and never
        a collective of `cluster doctor` (a check, not the user's run) nor a dry run (nothing
        of it ran; dry_runs=True counts them)."""
        root = root or runs_root()
        runs = sorted(p for p in root.glob("*") if (p / "run.json").is_file()) if root.is_dir() else []
        if run is None:
            own = [p for p in runs if not p.name.startswith(DOCTOR_PREFIX)
                   and (dry_runs or not _record_of(p).get("dry_run"))]
            if not own:
                raise InputError(f"no runs in {root}/ (start one with `cluster up`)"
                                 + ("; cluster doctor's and dry runs are named by id only"
                                    if runs else ""))
            return cls(max(own, key=_created))
        if not runs:
            raise InputError(f"no runs in {root}/ (start one with `cluster up`)")
        exact = root / run
        if (exact / "run.json").is_file():
            return cls(exact)
        matches = [p for p in runs if p.name.startswith(run)]
        if len(matches) == 1:
            return cls(matches[0])
        raise InputError(f"no single run matches {run!r} in {root}/ ({_choices(matches or runs)})")

    def launched(self) -> dict[str, Any]:
        """The record of a run that was launched, for status, logs and down; InputError, in
        words, for a dry run (nothing ran), a launch refused before its nodes were recorded
        (its error), or a record without its inventory."""
        meta = self.meta()
        if meta.get("dry_run"):
            raise InputError(f"run {self.run_id} is a dry run: nothing of it was started "
                             f"(its scripts are in {self.path / 'scripts'})")
        if not (self.path / "inventory.yaml").is_file():
            if meta.get("error"):
                raise InputError(f"run {self.run_id} was refused before start: {meta['error']}")
            raise InputError(f"run {self.run_id} has no {self.path / 'inventory.yaml'} (yet): its "
                             f"launch has not recorded its nodes, ended before it did, or the "
                             f"file was removed")
        return meta

    def started(self) -> dict[str, Any]:
        """The record of a run whose nodes were started, for logs and down; as launched(), and
        InputError for a launch that failed before its start (its check failed: the run
        folders it made on the nodes are removed, nothing has output or is to stop)."""
        meta = self.launched()
        if meta.get("error") and "start" not in (meta.get("timings") or {}):
            raise InputError(f"run {self.run_id} was refused before start: {meta['error']}")
        return meta

    # -- writing --

    def record(self, plan: Any, inventory: spec.Inventory, backend: str,
               argv: list[str], extra: dict[str, Any] | None = None) -> None:
        """The plan (a LaunchPlan, an SbatchPlan: anything with recording()), the inventory
        as loaded and as read, and what the command line was."""
        rec = plan.recording()
        self.write_inventory(inventory)
        for name, text in rec.scripts.items():
            write_private(self.path / "scripts" / name, text)
        for name in rec.logs:
            write_private(self.path / "logs" / name, b"")
        write_private(self.path / "env.json", json.dumps(rec.env, indent=2) + "\n")
        try:          # a launch records twice (before the check, then with each node's
            known = self.meta()      # interface): git is asked for the commit once, not twice
        except InputError:
            known = {}
        commit = known["git_commit"] if "git_commit" in known else git_commit()
        meta = {"run_id": plan.run_id, "backend": backend, "created": self._created_at(),
                "command": argv, "cwd": os.getcwd(), "git_commit": commit, **rec.meta}
        meta.update(extra or {})
        self.write_meta(meta)

    def node_root(self) -> str:
        """Where simulated nodes on this machine keep their run folders: runs/<id>/nodes,
        private like the rest of the run (each node's own folder is made by its supervisor)."""
        make_private_dir(self.path / "nodes")
        return str((self.path / "nodes").resolve())

    def script_path(self, name: str) -> Path:
        return self.path / "scripts" / name

    def write_inventory(self, inventory: spec.Inventory) -> None:
        write_private(self.path / "inventory.yaml", spec.dump(inventory))
        if inventory.text:        # as read, but for notify's URLs: a webhook's path is a token
            urls = tuple({u for h in inventory.hosts for u in h.notify})
            write_private(self.path / "inventory.source",
                          texts.redacted_words([inventory.text], urls)[0])

    def write_meta(self, meta: dict[str, Any]) -> None:
        write_private(self.path / "run.json", json.dumps(meta, indent=2) + "\n")

    def _created_at(self) -> float:
        """When the directory was made (its first record), else now."""
        try:
            return float(self.meta().get("created") or time.time())
        except (InputError, ValueError, TypeError):
            return time.time()

    def update(self, **fields: Any) -> None:
        meta = self.meta()
        meta.update(fields)
        self.write_meta(meta)

    # -- reading --

    def meta(self) -> dict[str, Any]:
        """run.json; InputError naming the file when it cannot be read or is no JSON object."""
        path = self.path / "run.json"
        try:
            meta = json.loads(path.read_text())
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise InputError(f"{path} is not valid JSON ({exc}); the run's record is damaged") from None
        if not isinstance(meta, dict):
            raise InputError(f"{path} is not a JSON object; the run's record is damaged")
        return meta

    def hosts(self) -> list[spec.Host]:
        return [spec.host_from_dict(h) for h in self._inventory_record()["hosts"]]

    def inventory(self) -> spec.Inventory:
        data = self._inventory_record()
        return spec.Inventory(
            hosts=tuple(spec.host_from_dict(h) for h in data["hosts"]),
            source=data.get("source"), backend=data.get("backend", "ssh"),
            ssh=spec.ssh_from_dict(data.get("ssh") or {}),
            slurm=spec.slurm_from_dict(data.get("slurm") or {}),
            stop_grace=float(data.get("stop_grace") or spec.DEFAULT_STOP_GRACE),
            gate=spec.Gate(**data.get("gate") or {}))

    def _inventory_record(self) -> dict[str, Any]:
        path = self.path / "inventory.yaml"
        try:
            text = path.read_text()
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from None
        try:
            data = spec.record_yaml(text)
        except yaml.YAMLError as exc:
            raise InputError(f"{path} is not valid YAML ({exc}); the run's record is damaged") from None
        if not isinstance(data, dict) or not isinstance(data.get("hosts"), list):
            raise InputError(f"{path} has no list of hosts; the run's record is damaged")
        return data


SHOWN_RUNS = 5          # run ids a RUN that matches none, or several, lists


def _choices(runs: list[Path]) -> str:
    """The runs to choose from, newest first, the first few of them and how many more."""
    newest = sorted(runs, key=_created, reverse=True)
    more = len(newest) - SHOWN_RUNS
    return (f"{len(newest)} run(s), newest first: " + ", ".join(p.name for p in newest[:SHOWN_RUNS])
            + (f" and {more} more" if more > 0 else ""))


def _record_of(path: Path) -> dict[str, Any]:
    """A run's run.json, {} when it cannot be read (a damaged record is said when it is used)."""
    try:
        meta = json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _created(path: Path) -> tuple[float, str]:
    """When a run was created: its record's 'created' time, else the time in its id."""
    try:
        created = float(_record_of(path).get("created") or 0)
    except (ValueError, TypeError):
        created = 0.0
    if not created:
        try:
            created = time.mktime(time.strptime(path.name[:15], "%Y%m%d-%H%M%S"))
        except ValueError:
            created = 0.0
    return created, path.name


def git_commit(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    # Changed tracked files make a tree dirty; untracked ones (runs/ itself) do not.
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                           capture_output=True, text=True, timeout=5).stdout.strip()
    return commit + ("-dirty" if dirty else "")
