"""`cluster clean`: durations, the node-side decision (cluster/remote/clean.py run for real
through the local transport, with a real supervisor running), and the records' verdicts with a
fake status (the recorded backend's, injected)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.backends.local import LocalTransport, local_inventory
from cluster.backends.shipping import SUPERVISOR, SUPERVISOR_FILES
from cluster.backends.supervised import SupervisedBackend, SupervisedNode
from cluster.clean import clean_nodes, clean_records, parse_duration, verdict
from cluster.errors import InputError
from cluster.nodes import NodeStatus, read_answer
from cluster.runs import RunDir

from .test_supervisor import wait_for

DAY = 86400.0


@pytest.mark.parametrize("text,seconds", [("7d", 7 * DAY), ("12h", 43200), ("30m", 1800),
                                          ("45s", 45), ("2w", 14 * DAY), ("0", 0), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["7", "7x", "d", "-1d", "", "7 days"])
def test_bad_durations_name_the_option(text: str) -> None:
    with pytest.raises(InputError, match=r"Invalid value for --older-than: .*7d, 12h, 30m"):
        parse_duration(text)


def make_old(path: Path, seconds: float) -> None:
    """Every entry under path (and path) last modified `seconds` ago."""
    when = time.time() - seconds
    for p in sorted(path.rglob("*"), reverse=True) + [path]:
        os.utime(p, (when, when), follow_symlinks=False)


def node_folder(workdir: Path, run_id: str, files: dict[str, str]) -> Path:
    d = workdir / ".cluster" / run_id / "n1"
    d.mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def run_supervisor(d: Path, run_id: str) -> subprocess.Popen:
    (d / "launch.sh").write_text("sleep 300\n")
    p = subprocess.Popen([sys.executable, str(SUPERVISOR), "run", str(d), "--run-id", run_id,
                          "--node", "n1", "--grace", "1"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, start_new_session=True)
    p.stdin.write(b"{}\n")
    p.stdin.flush()
    assert wait_for(lambda: (d / "started").exists())
    return p


@pytest.fixture
def backend():
    b = SupervisedBackend(lambda host: LocalTransport())
    yield b
    b.close()


def sweep(backend, workdir: Path, older_than: float, dry_run: bool = False) -> dict[str, tuple]:
    host = local_inventory(1, gpus=[]).hosts[0].replace(workdir=str(workdir))
    decisions, failed = clean_nodes([host], backend, older_than, dry_run)
    assert failed == {}
    return {d.path.split("/")[1]: (d.action, d.why) for d in decisions}


def test_nodes_keep_what_runs_and_remove_what_ended(tmp_path: Path, backend) -> None:
    ended = node_folder(tmp_path, "20250101-000000-aaaa",
                        {"tag": "{}", "supervisor.pid": "999999999", "exit": "{}"})
    (ended.parent / "train").mkdir()
    running = node_folder(tmp_path, "20250101-000000-bbbb", {})
    lost = node_folder(tmp_path, "20250101-000000-cccc",
                       {"tag": json.dumps({"run_id": "clean-cccc", "node": "n1"}),
                        "supervisor.pid": "999999999"})
    checking = node_folder(tmp_path, "20250101-000000-dddd", {})     # a launch's check, now
    (tmp_path / ".cluster" / "tools").mkdir()
    make_old(tmp_path / ".cluster", 30 * DAY)
    os.utime(checking.parent)
    sup = run_supervisor(running, "clean-bbbb")
    # A supervisor that died hard leaves its workers: they carry the run's identity.
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True,
                              env=dict(os.environ, CLUSTER_RUN_ID="clean-cccc", CLUSTER_NODE="n1"))
    try:
        got = sweep(backend, tmp_path, older_than=0)
    finally:
        orphan.kill()
        os.killpg(sup.pid, signal.SIGKILL)
        sup.wait()
        # the run's script is in a session of its own: it outlives a supervisor killed hard
        os.killpg(int((running / "pgid").read_text()), signal.SIGKILL)
    assert got["20250101-000000-aaaa"][0] == "removed"
    assert got["20250101-000000-bbbb"][0] == "kept" and "running in n1" in got["20250101-000000-bbbb"][1]
    assert got["20250101-000000-cccc"] == ("kept", f"processes of the run still alive in n1: {orphan.pid}")
    assert got["20250101-000000-dddd"][0] == "kept" and "never started" in got["20250101-000000-dddd"][1]
    assert "tools" not in got and (tmp_path / ".cluster" / "tools").is_dir()
    assert not ended.parent.exists() and running.exists() and lost.exists() and checking.exists()


def test_nodes_keep_what_is_younger_than_the_cutoff_and_dry_run_removes_nothing(
        tmp_path: Path, backend) -> None:
    old = node_folder(tmp_path, "20250101-000000-aaaa", {"exit": "{}"})
    node_folder(tmp_path, "20250101-000000-bbbb", {"exit": "{}"})
    make_old(old.parent, 8 * DAY)
    got = sweep(backend, tmp_path, older_than=7 * DAY, dry_run=True)
    assert got["20250101-000000-aaaa"] == ("would remove", "")
    assert got["20250101-000000-bbbb"][0] == "kept"
    assert got["20250101-000000-bbbb"][1].startswith("active") and "s ago" in got["20250101-000000-bbbb"][1]
    assert old.exists()
    got = sweep(backend, tmp_path, older_than=7 * DAY)
    assert got["20250101-000000-aaaa"][0] == "removed" and not old.exists()


def test_a_node_without_the_folder_is_fine(tmp_path: Path, backend) -> None:
    assert sweep(backend, tmp_path / "nowhere", older_than=0) == {}


# --- the records here ----------------------------------------------------------------------


def record(root: Path, run_id: str, age: float, **meta) -> Path:
    run = RunDir.create(run_id, root)
    run.write_meta({"run_id": run_id, "backend": "ssh", "created": time.time() - age, **meta})
    make_old(run.path, age)
    return run.path


def rows(*states: str) -> list[NodeStatus]:
    return [NodeStatus(i, f"node{i + 1}", s) for i, s in enumerate(states)]


def test_records_removed_only_when_old_and_ended_on_every_node(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    said = {"20250101-000000-0001": rows("exited", "stopped"),
            "20250101-000000-0002": rows("exited", "running"),
            "20250101-000000-0003": rows("exited", "unreachable"),
            "20250101-000000-0004": rows("lost"),
            "20250101-000000-0005": rows("gone", "gone")}
    for run_id in said:
        record(root, run_id, 10 * DAY, pgids={"node1": 1})
    record(root, "20250101-000000-0006", 10 * DAY)                       # its check failed
    record(root, "20250101-000000-0007", 10 * DAY, dry_run=True)
    record(root, "20250101-000000-0008", 1 * DAY, pgids={"node1": 1})    # too young
    asked: list[str] = []

    def status_of(run: RunDir) -> list[NodeStatus]:
        asked.append(run.run_id)
        return said[run.run_id]
    got = {d.path: (d.action, d.why) for d in clean_records(root, 7 * DAY, False, status_of)}
    assert got["runs/20250101-000000-0001"][0] == "removed"
    assert got["runs/20250101-000000-0002"] == ("kept", "node2: running")
    assert got["runs/20250101-000000-0003"] == ("kept", "node2: unreachable")
    assert got["runs/20250101-000000-0004"] == ("kept", "node1: lost")
    assert got["runs/20250101-000000-0005"][0] == "removed"
    assert got["runs/20250101-000000-0006"] == (
        "removed", "never started (its check failed or it was interrupted)")
    assert got["runs/20250101-000000-0007"] == ("removed", "a dry run: nothing ran")
    assert got["runs/20250101-000000-0008"] == ("kept", "active 1d ago")
    assert sorted(asked) == [f"20250101-000000-000{i}" for i in range(1, 6)], \
        "only old records that started are asked about"
    assert sorted(p.name for p in root.iterdir()) == [f"20250101-000000-000{i}" for i in (2, 3, 4, 8)]


def test_a_record_whose_nodes_cannot_be_asked_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    record(root, "20250101-000000-0001", 10 * DAY, pgids={"node1": 1})

    def broken(run: RunDir) -> list[NodeStatus]:
        raise OSError("no route to host")
    (d,) = clean_records(root, 0, False, broken)
    assert (d.action, d.why) == ("kept", "its nodes could not be asked: no route to host")
    assert (root / "20250101-000000-0001").is_dir()


def test_dry_run_keeps_every_record(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    record(root, "20250101-000000-0001", 10 * DAY, dry_run=True)
    (d,) = clean_records(root, 0, True, lambda run: [])
    assert d.action == "would remove" and (root / "20250101-000000-0001").is_dir()


def test_verdict_needs_every_node_ended() -> None:
    assert verdict(rows("exited", "completed"))[0] is True
    assert verdict(rows("exited", "pending"))[0] is False
    assert verdict([])[0] is False


# --- what the supervisor says about an ended or removed run --------------------------------


def test_stop_of_a_lost_run_records_its_end(tmp_path: Path) -> None:
    d = tmp_path / "n1"
    d.mkdir()
    sup = run_supervisor(d, f"clean-lost-{os.getpid()}")
    os.killpg(sup.pid, signal.SIGKILL)              # the supervisor and its run, gone hard
    sup.wait()

    def status() -> dict:
        out = subprocess.run([sys.executable, str(SUPERVISOR), "status", str(d)],
                             capture_output=True)
        return read_answer(out.stdout) or {}
    assert status()["state"] == "lost"
    subprocess.run([sys.executable, str(SUPERVISOR), "stop", str(d), "--grace", "1"],
                   capture_output=True, check=True)
    assert status()["state"] == "stopped"


def test_status_of_a_removed_folder_is_gone(tmp_path: Path) -> None:
    node = SupervisedNode(LocalTransport(), sys.executable, str(tmp_path / "removed"))
    assert node.status()["state"] == "gone"


def test_status_and_logs_write_nothing_into_the_run_folder(tmp_path: Path, monkeypatch) -> None:
    """They run the supervisor the run's start left in its folder; Python must not cache
    its modules' bytecode there (a node keeps only its code cache), even where the node's
    environment would let it."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    d = node_folder(tmp_path, "20250101-000000-aaaa", {"exit": "{}"})
    for name in SUPERVISOR_FILES:       # as a run's start leaves them
        (d / f"{name}.py").write_text(SUPERVISOR.with_name(f"{name}.py").read_text())
    before = sorted(p.name for p in d.iterdir())
    node = SupervisedNode(LocalTransport(), sys.executable, str(d))
    assert node.status()["state"] == "exited"
    logs = node.logs(follow=False)
    while logs.read():
        pass
    logs.wait()
    assert sorted(p.name for p in d.iterdir()) == before


def test_reading_a_runs_status_is_no_activity(tmp_path: Path, backend) -> None:
    """`cluster status` (and the records' check) runs the supervisor in the node folder, and
    Python caches its helper there: an old run must stay old."""
    d = node_folder(tmp_path, "20250101-000000-aaaa", {"exit": "{}"})
    for name in SUPERVISOR_FILES:       # as a run's start leaves them
        (d / f"{name}.py").write_text(SUPERVISOR.with_name(f"{name}.py").read_text())
    make_old(d.parent, 8 * DAY)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, str(d / "supervisor.py"), "status", str(d)], check=True,
                   capture_output=True, env=env)
    assert (d / "__pycache__").is_dir()
    assert sweep(backend, tmp_path, older_than=7 * DAY)["20250101-000000-aaaa"][0] == "removed"
