"""Failure requeues under a real SLURM 22.05 with three slurmd (one per network namespace):
`cluster up --backend slurm --max-restarts N` requeues a job whose step failed, with the node
whose task failed first in the job's excluded nodes, so the next attempt runs elsewhere; a rank
that exits with the stop code (93) ends the job at once. The CLI runs as a subprocess with the
fixture's environment, in tmp_path (jobs run as root; the nodes share the filesystem)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from tests.integration.fixtures import SlurmCluster
    from tests.integration.test_slurm_backend import (PROGRAM, TRAIN_PY, job_id, pytestmark,
                                                      reports, up)
except ImportError:  # run with tests/integration on sys.path
    from fixtures import SlurmCluster  # type: ignore
    from test_slurm_backend import PROGRAM, TRAIN_PY, job_id, pytestmark, reports, up  # type: ignore

__all__ = ["pytestmark"]


@pytest.fixture(scope="module")
def slurm3():
    with SlurmCluster(3) as sc:
        yield sc


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "inventory.yaml").write_text(
        "backend: slurm\n"
        f"defaults: {{python: {TRAIN_PY}, nproc_per_node: 1}}\n"
        "hosts: []                  # SLURM chooses the nodes\n"
        "slurm: {nodes: 2, time: '00:05:00'}\n")
    return tmp_path


def _shown(slurm, jid: str) -> str:
    return slurm.run(["scontrol", "-o", "show", "job", jid]).stdout


def _release_when_requeued(slurm, workdir: Path, proc: subprocess.Popen, timeout: float) -> str:
    """Wait for the failure requeue (the job pending again, its start held back by SLURM's
    BeginTime of about two minutes), then let it start now. Returns its ExcNodeList then."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, "the job was not requeued"
        runs = workdir / "runs"
        if runs.is_dir() and any((p / "run.json").is_file() for p in runs.iterdir()):
            try:
                jid = job_id(workdir)
            except (KeyError, ValueError):
                jid = ""
            if jid:
                shown = _shown(slurm, jid)
                if " JobState=PENDING " in shown and " Reason=BeginTime " in shown:
                    break
        time.sleep(0.3)
    # As in the preemption test: a credential of the job issued in the second of the requeue
    # is refused by the slurmds, so release it in a later second.
    time.sleep(1.05 - time.time() % 1)
    slurm.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"])
    return re.search(r" ExcNodeList=(\S+)", shown).group(1)


def test_a_failed_step_requeues_the_job_without_the_node_that_failed(slurm3, workdir: Path,
                                                                     record_property) -> None:
    """Rank 1 (node rank 1) fails in the first attempt only: the job is requeued with that
    node excluded, its second attempt runs on the other two nodes and completes."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "-i", "inventory.yaml", "--max-restarts", "2",
         "--", str(PROGRAM), "--fail-rank", "1", "--fail-first"], cwd=workdir,
        env=dict(slurm3.env, NO_COLOR="1", CLUSTER_RUNS_DIR=str(workdir / "runs")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        excluded = _release_when_requeued(slurm3, workdir, proc, 120)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    record_property("slurm_failure_requeue_s", round(time.monotonic() - t0, 2))
    print(f"\n[timing] failure requeue, second attempt released at once: "
          f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert proc.returncode == 0, stdout[-4000:] + stderr
    got = reports(stdout)
    first = {d["rank"]: d["hostname"] for d in got if d["restart"] == 0}
    second = {d["rank"]: d["hostname"] for d in got if d["restart"] == 1}
    assert sorted(first) == [0, 1] and sorted(second) == [0, 1], stdout[-4000:]
    culprit = first[1]
    assert culprit not in second.values(), (first, second)
    assert excluded == culprit, excluded
    print(f"[requeue] first attempt {first}, excluded {excluded}, second attempt {second}",
          file=sys.stderr)
    assert re.search(rf"excluding {culprit} from job \d+'s next attempts: its task failed first "
                     r"\(task 1: Exited with exit code 1\)", stdout), stdout[-4000:]
    assert "after a failed step (exit code" in stdout and "failure restart 1 of 2" in stdout
    jid = job_id(workdir)
    shown = _shown(slurm3, jid)
    assert " Restarts=1 " in shown and f" ExcNodeList={culprit} " in shown, shown
    assert "COMPLETED" in stderr
    status = subprocess.run([sys.executable, "-m", "cluster", "status"], cwd=workdir,
                            env=dict(slurm3.env, NO_COLOR="1",
                                     CLUSTER_RUNS_DIR=str(workdir / "runs")),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and status.stdout.count("completed") == 2, status.stdout
    assert culprit not in status.stdout, status.stdout           # the nodes of the last attempt


def test_the_stop_code_ends_the_job_without_a_requeue(slurm3, workdir: Path) -> None:
    """A rank exits 93: torchrun exits 1, yet the batch script reads torchrun's report of the
    93 and does not requeue, though restarts are left; the job ends FAILED with exit code 93."""
    r = up(slurm3, workdir, str(PROGRAM), "--fail-rank", "1", "--fail-code", "93",
           extra=("--max-restarts", "2"))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "a rank exited with 93, the stop code; not requeueing" in r.stdout, r.stdout[-4000:]
    assert "requeueing job" not in r.stdout, r.stdout[:6000]      # the first attempt's output
    assert re.search(r"job \d+ FAILED, exit code 93", r.stderr), r.stderr
    shown = _shown(slurm3, job_id(workdir))
    assert " Restarts=0 " in shown and " JobState=FAILED " in shown, shown
    assert [d["restart"] for d in reports(r.stdout)] == [0, 0]
