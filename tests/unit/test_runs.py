"""The local run directory: private whatever the umask, and the newest run by creation."""
from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.cli import run_cli
from cluster.errors import InputError
from cluster.runs import RunDir


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    return tmp_path


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_run_directory_is_private_whatever_the_umask(in_tmp: Path, capsys, umask: int) -> None:
    old = os.umask(umask)
    try:
        assert run_cli(["up", "--hosts", "gpu[1-2]", "--env", "HF_TOKEN=hf_abc", "--dry-run",
                        "--", "t.py"]) == 0
    finally:
        os.umask(old)
    runs = in_tmp / "runs"
    run = RunDir.find(None, runs, dry_runs=True).path
    for p in [runs, run, *run.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        if p.is_dir():
            assert mode == 0o700, f"{p} is {oct(mode)}"
        else:
            assert mode == 0o600, f"{p} is {oct(mode)}"
    assert {p.name for p in run.iterdir()} >= {"run.json", "env.json", "inventory.yaml", "scripts", "logs"}


def test_the_simulated_nodes_folder_is_private_whatever_the_umask(tmp_path: Path) -> None:
    run = RunDir.create("20261201-100000-aaaa", tmp_path)
    old = os.umask(0o022)
    try:
        root = run.node_root()
    finally:
        os.umask(old)
    assert root == str((run.path / "nodes").resolve())
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_newest_run_is_by_creation_not_by_last_change(tmp_path: Path) -> None:
    old = RunDir.create("20261201-100000-aaaa", tmp_path)
    old.write_meta({"run_id": old.run_id, "created": time.time() - 60, "nodes": []})
    new = RunDir.create("20261201-100100-bbbb", tmp_path)
    new.write_meta({"run_id": new.run_id, "created": time.time(), "nodes": []})
    # `cluster status` of the old run rewrites its record: it must not become "the newest"
    time.sleep(0.01)
    old.update(status_checked=True)
    os.utime(old.path / "run.json")
    assert RunDir.find(None, tmp_path).path == new.path


def test_a_doctor_collective_is_never_the_newest_run(tmp_path: Path) -> None:
    mine = RunDir.create("20261201-100000-aaaa", tmp_path)
    mine.write_meta({"run_id": mine.run_id, "created": time.time() - 60, "nodes": []})
    check = RunDir.create("doctor-20261201-100100-bbbb", tmp_path)
    check.write_meta({"run_id": check.run_id, "created": time.time(), "nodes": []})
    assert RunDir.find(None, tmp_path).path == mine.path
    assert RunDir.find("doctor-20261201", tmp_path).path == check.path, "named, it is found"
    shutil.rmtree(mine.path)
    with pytest.raises(InputError, match="cluster doctor's and dry runs are named by id only"):
        RunDir.find(None, tmp_path)


def test_newest_falls_back_to_the_time_in_the_run_id(tmp_path: Path) -> None:
    for name in ("20261201-100100-bbbb", "20261201-100000-aaaa"):
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"run_id": name}))
    assert RunDir.find(None, tmp_path).path.name == "20261201-100100-bbbb"


def test_a_run_that_matches_none_or_several_lists_the_newest_first(in_tmp: Path, capsys) -> None:
    root = in_tmp / "runs"
    now = time.time()
    for i, name in enumerate(["20261201-1200-c", "20261201-1000-a", "20261202-0900-x",
                              "20261201-1100-b", "20261201-1300-d", "20261201-1400-e",
                              "20261201-1500-f"]):
        run = RunDir.create(name, root)        # creation order, not name order, decides
        run.write_meta({"run_id": name, "created": now - 100 + i, "nodes": []})
    with pytest.raises(InputError) as info:
        RunDir.find("20261201", root)
    assert str(info.value).endswith("(6 run(s), newest first: 20261201-1500-f, 20261201-1400-e, "
                                    "20261201-1300-d, 20261201-1100-b, 20261201-1000-a and 1 more)")
    assert run_cli(["status", "nothing-like-it"]) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "(7 run(s), newest first: 20261201-1500-f, 20261201-1400-e, 20261201-1300-d, "
        "20261201-1100-b, 20261202-0900-x and 2 more)")


def test_unusable_runs_directory_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "runs").write_text("a file where the runs directory should be")
    monkeypatch.setenv("CLUSTER_RUNS_DIR", str(tmp_path / "runs"))
    assert run_cli(["up", "--hosts", "a", "--dry-run", "--", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the run directory" in err and "CLUSTER_RUNS_DIR" in err


def test_a_detached_runs_end_is_read_from_its_nodes_final_states() -> None:
    from cluster.api import detached_error
    from cluster.nodes import NodeStatus

    def rows(*states: tuple[str, int | None]) -> list[NodeStatus]:
        return [NodeStatus(i, f"n{i}", s, code=c) for i, (s, c) in enumerate(states)]
    assert detached_error(rows(("exited", 0), ("exited", 0)), "r") is None
    assert detached_error(rows(("completed", 0)), "r") is None                   # SLURM's word
    failed = detached_error(rows(("exited", 0), ("exited", 3), ("stopped", None)), "r")
    assert failed.exit_code == 4 and str(failed).startswith("node [n1 1] exited with code 3")
    assert detached_error(rows(("exited", None), ("exited", 0)), "r").exit_code == 4  # a signal
    assert detached_error(rows(("lost", None), ("stopped", None)), "r").exit_code == 5
    assert detached_error(rows(("stopped", None), ("exited", 0)), "r").exit_code == 143
    assert detached_error(rows(("failed", 1)), "r").exit_code == 4                # SLURM's word


def test_a_run_stopped_by_its_owner_reads_as_that_not_as_someone_elses_signal() -> None:
    """The Python API stops an attached run whose program exited: status says why, once, not
    also "interrupted (SIGTERM)" as if someone had signalled it; a real failure still shows."""
    from cluster.cli.runs import run_notes
    owner = "the program that started it exited (pid 42)"
    assert run_notes({"stopped_because": owner, "error": "interrupted (SIGTERM); 2 node(s) stopped",
                      "exit_code": 143}, started=True) == [f"stopped because {owner} (exit code 143)"]
    assert run_notes({"error": "interrupted (SIGTERM); 2 node(s) stopped", "exit_code": 143},
                     started=True) == ["ended with exit code 143: interrupted (SIGTERM); 2 node(s) stopped"]
    assert run_notes({"stopped_because": owner, "error": "node [a 0] failed: exit code 1",
                      "exit_code": 4}, started=True)[1] == "ended with exit code 4: node [a 0] failed: exit code 1"


def test_a_run_whose_launcher_was_killed_says_so_with_its_nodes_one_outcome(tmp_path: Path) -> None:
    """An attached run every node has stopped while its launcher recorded no end (SIGKILLed):
    status says so, and logs -f exits as the stop's code on the nodes says (as run.wait())."""
    from cluster.cli.runs import launcher_gone, report_outcome
    from cluster.console import Console
    from cluster.errors import Interrupted
    from cluster.nodes import NodeStatus
    why = "SIGTERM: ended within the 30 s grace; the launcher's connection closed"
    rows = [NodeStatus(i, f"n{i}", "stopped", code=143, detail=why) for i in range(2)]
    assert launcher_gone({"detached": False}, rows) == [
        "the launcher ended without recording how the run ended (it was killed, or its machine "
        f"went down); the nodes say: every node (2): stopped 143 ({why})"]
    assert launcher_gone({"exits": {"n0": {}}}, rows) == []           # it recorded the end
    assert launcher_gone({"detached": True}, rows) == []              # no launcher by design
    assert launcher_gone({}, rows[:1] + [NodeStatus(1, "n1", "running")]) == []
    run = RunDir.create("20261201-100000-aaaa", tmp_path)
    with pytest.raises(Interrupted) as stopped:
        report_outcome(run, rows, Console())
    assert stopped.value.exit_code == 143
    assert str(stopped.value) == f"run {run.run_id} was stopped: every node (2): stopped 143 ({why})"
    past_grace = [NodeStatus(0, "n0", "stopped", code=137), NodeStatus(1, "n1", "exited", code=0)]
    with pytest.raises(Interrupted) as killed:
        report_outcome(run, past_grace, Console())
    assert killed.value.exit_code == 137


def test_logs_and_down_of_a_run_whose_check_failed_say_so(tmp_path: Path, monkeypatch, capsys) -> None:
    """Its nodes were recorded, then its check failed (their run folders removed): logs and
    down say the error, not a node's traceback for a folder that is gone."""
    error = "2 check(s) failed on a, b (2 node(s) checked); nothing was started"
    run = RunDir.create("20261201-100000-aaaa", tmp_path / "runs",
                        meta={"backend": "local", "error": error, "exit_code": 3,
                              "timings": {"check": 0.5}})
    (run.path / "inventory.yaml").write_text("hosts: []\n")
    monkeypatch.setenv("CLUSTER_RUNS_DIR", str(tmp_path / "runs"))
    for verb in ("logs", "down"):
        assert run_cli([verb]) == 2
        assert capsys.readouterr().err.strip() == \
            f"cluster: error: run {run.run_id} was refused before start: {error}"
    run.update(timings={"check": 0.5, "start": 0.1})      # a restart's check: the run had started
    assert run.started()["error"] == error


def test_a_dry_run_is_never_the_newest_run(tmp_path: Path) -> None:
    real = RunDir.create("20261201-100000-aaaa", tmp_path, meta={"backend": "ssh", "dry_run": False})
    dry = RunDir.create("20261201-100100-bbbb", tmp_path, meta={"backend": "ssh", "dry_run": True})
    assert RunDir.find(None, tmp_path).path == real.path
    assert RunDir.find(None, tmp_path, dry_runs=True).path == dry.path
    assert RunDir.find("20261201-1001", tmp_path).path == dry.path, "named, it is found"
    with pytest.raises(InputError, match="is a dry run: nothing of it was started"):
        dry.launched()


def _cluster(*args: str, cwd: Path, nofile: int | None = None) -> subprocess.CompletedProcess:
    """`python -m cluster ARGS` in cwd, with at most `nofile` open files when given."""
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_RUNS_DIR"}
    # this checkout first; what the path held (a machine's packages put there) after it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)


def test_a_launch_refused_before_its_first_record_reads_as_that(tmp_path: Path) -> None:
    """300 nodes need more open files than a hard limit of 200 allows: refused once its
    run.json exists, before its inventory is recorded. status, logs and down say why."""
    up = _cluster("up", "--hosts", "n[1-300]", "--", "t.py", cwd=tmp_path, nofile=200)
    assert up.returncode == 2 and "open files" in up.stderr, up.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "inventory.yaml").exists()
    for verb in (["status"], ["logs"], ["down"], ["logs", "-f", run.name]):
        said = _cluster(*verb, cwd=tmp_path)
        assert said.returncode == 2, (verb, said.stderr)
        assert f"run {run.name} was refused before start: " in said.stderr, (verb, said.stderr)
        assert "open files" in said.stderr and "Traceback" not in said.stderr, (verb, said.stderr)


def test_a_damaged_record_is_a_message_naming_its_file(in_tmp: Path, capsys) -> None:
    run = RunDir.create("20261201-100000-aaaa", Path("runs"), meta={"backend": "ssh"})
    (run.path / "run.json").write_text('{"backend": "ssh", ')
    for verb in ("status", "logs", "down"):
        assert run_cli([verb, run.run_id]) == 2
        err = capsys.readouterr().err
        assert f"{run.path / 'run.json'} is not valid JSON" in err and "Traceback" not in err, err
    run.write_meta({"backend": "ssh", "run_id": run.run_id, "nodes": []})
    (run.path / "inventory.yaml").write_text("hosts: [a\n")
    assert run_cli(["status", run.run_id]) == 2
    assert f"{run.path / 'inventory.yaml'} is not valid YAML" in capsys.readouterr().err


def test_a_detached_failure_is_the_first_node_to_fail_with_its_workers_error() -> None:
    """Rank 2 raised and its node ended first; the others failed after it (their collective
    lost a peer). The first is named, with its worker's own error read from its output as
    the attached watcher reads it; not the lowest rank that failed."""
    from cluster.api import LogErrors, detached_error
    from cluster.nodes import NodeStatus
    rows = [NodeStatus(0, "node1", "exited", code=1, ended=102.0),
            NodeStatus(1, "node2", "exited", code=1, ended=101.5),
            NodeStatus(2, "node3", "exited", code=1, ended=100.0)]
    errors = LogErrors()
    errors.feed("node1 0", b"[rank0]: Traceback (most recent call last):\n[rank0]:   File \"a.py\"\n"
                           b"[rank0]: RuntimeError: Connection closed by peer\n")
    errors.feed("node3 2", b"[rank2]: Traceback (most recent call last):\n[rank2]:   File \"a.py\"\n")
    errors.feed("node3 2", b"[rank2]: RuntimeError: rank 2 gave up")     # no newline yet: flushed
    causes = errors.causes()
    assert causes == {"node1": "RuntimeError: Connection closed by peer",
                      "node3": "RuntimeError: rank 2 gave up"}
    error = detached_error(rows, "r", causes)
    assert error is not None and error.exit_code == 4
    assert str(error).startswith("node [node3 2] failed: RuntimeError: rank 2 gave up "
                                 "(exited with code 1)"), error
