"""The batch script's failure requeue (--max-restarts under SLURM, templates/slurm_requeue.sh.j2):
the node whose task failed first, read from srun's real lines (tests/unit/srun_failures/, each
file's first line says where it came from and which node is the culprit); the stop code read
from torchrun's real report; and the decision (exclude and requeue, requeue only, or stop), by
the rendered script itself run under fake `srun`, `scontrol` and `sinfo` that record their calls.
The real thing: tests/integration/test_slurm_requeue.py."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cluster.plan import Job, Templates
from cluster.errors import STOP_CODE
from cluster.sbatch import render_sbatch
from cluster.spec import Host, Inventory, SlurmSettings

HERE = Path(__file__).parent
SRUN_FAILURES = sorted((HERE / "srun_failures").glob("*.txt"))
TORCHRUN_REPORT = HERE / "torchrun_failures" / "worker_exit_code.log"


def rendered(tmp_path: Path, restarts: int = 2, exclude: str | None = "node9") -> str:
    inventory = Inventory(hosts=(Host(name="slurm", address="slurm", python=str(tmp_path / "python")),),
                          backend="slurm", restarts=restarts)
    settings = SlurmSettings(nodes=2, max_requeues=1, exclude=exclude,
                             output_dir=str(tmp_path / "logs"))
    return render_sbatch(inventory, Job(run_id="r1", script="train.py"), Templates(), settings,
                         cwd=str(tmp_path)).script


def functions(tmp_path: Path) -> str:
    """The script's failure block alone (its variables and functions)."""
    text = rendered(tmp_path)
    return text[text.index("# --- A failed step"):text.index("# Preemption or the time limit")]


def shell(tmp_path: Path, call: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", functions(tmp_path) + call], input=stdin,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("path", SRUN_FAILURES, ids=lambda p: p.stem)
def test_the_culprit_is_the_node_whose_task_failed_first(path: Path, tmp_path: Path) -> None:
    source, *lines = path.read_text().splitlines()
    want = re.search(r"culprit: (\S+)", source).group(1)
    got = shell(tmp_path, "cluster_culprit", "\n".join(lines) + "\n")
    assert got.returncode == 0, got.stderr
    node = got.stdout.split(" ", 1)[0] if got.stdout else "none"
    assert node == want, got.stdout


def test_the_culprit_says_how_its_task_failed(tmp_path: Path) -> None:
    got = shell(tmp_path, "cluster_culprit",
                (HERE / "srun_failures" / "exit_then_terminated.txt").read_text())
    assert got.stdout == "node2 task 1: Exited with exit code 3\n"


def labelled(text: str, task: int = 1) -> str:
    return "".join(f"{task}: {line}\n" for line in text.splitlines())


def test_the_stop_code_is_read_from_torchruns_report_in_a_tasks_lines(tmp_path: Path) -> None:
    report = TORCHRUN_REPORT.read_text()                   # a real report: the worker's 7
    assert "exitcode  : 7 (pid" in report and "(exitcode: 7)" in report
    stopped = report.replace("exitcode: 7)", f"exitcode: {STOP_CODE})").replace(
        "exitcode  : 7 (", f"exitcode  : {STOP_CODE} (")
    assert shell(tmp_path, "cluster_stop_code", labelled(report)).returncode == 1
    assert shell(tmp_path, "cluster_stop_code", labelled(stopped)).returncode == 0
    assert shell(tmp_path, "cluster_stop_code", stopped).returncode == 1     # not a task's line
    code_930 = stopped.replace(f": {STOP_CODE} (", f": {STOP_CODE}0 (").replace(
        f": {STOP_CODE})", f": {STOP_CODE}0)")
    assert shell(tmp_path, "cluster_stop_code", labelled(code_930)).returncode == 1


# --- the decision, by the whole script under fake SLURM programs ---------------------------

FAKE_SRUN = r"""#!/bin/bash
# fake srun: the attempt's task lines (labelled) and srun's own lines, then srun's exit code
cat "$FAKE_DIR/tasks.txt"
cat "$FAKE_DIR/srun.txt" >&2
exit "${FAKE_RC:-1}"
"""
FAKE_SCONTROL = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/scontrol.log"
case "$*" in
  "-o show job"*) echo "JobId=42 JobState=RUNNING ReqNodeList=${FAKE_REQ:-(null)} ExcNodeList=${FAKE_EXC:-(null)} Restarts=0" ;;
  "show hostnames"*) tr , '\n' <<< "$3" ;;
  "show hostlist"*) echo "$3" ;;
esac
"""
FAKE_SINFO = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/sinfo.log"
tr ' ' '\n' <<< "$FAKE_NODES"
"""


def run_script(tmp_path: Path, srun_lines: str, tasks: str = "", before: str = "",
               **env: str) -> tuple[int, str, list[str]]:
    """The rendered script run as SLURM would run it (its output appended to the job's
    output file): its exit code, that file, and the scontrol calls."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for prog, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sinfo", FAKE_SINFO)):
        (bindir / prog).write_text(text)
        (bindir / prog).chmod(0o755)
    (tmp_path / "srun.txt").write_text(srun_lines)
    (tmp_path / "tasks.txt").write_text(tasks)
    script = tmp_path / "job.sh"
    script.write_text(rendered(tmp_path))
    out = tmp_path / "logs" / "r1.out"
    out.parent.mkdir(exist_ok=True)
    out.write_text(before)
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node1,node2", "SLURM_JOB_ID": "42", "HOME": str(tmp_path),
            "SLURM_JOB_PARTITION": "debug", "FAKE_NODES": "node1 node2 node3"}
    with open(out, "a") as f:
        done = subprocess.run(["bash", str(script)], env={**base, **env}, stdout=f,
                              stderr=subprocess.STDOUT, timeout=60)
    log = tmp_path / "scontrol.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, out.read_text(), [c for c in calls if not c.startswith("show host")]


FAILED = (HERE / "srun_failures" / "exit_then_terminated.txt").read_text().split("\n", 1)[1]


def test_a_failed_step_holds_the_job_excludes_the_culprit_then_releases_it(tmp_path: Path) -> None:
    code, out, calls = run_script(tmp_path, FAILED)
    assert calls == ["-o show job 42", "requeuehold 42", "update JobId=42 ExcNodeList=node2",
                     "release 42"]
    assert ("cluster: excluding node2 from job 42's next attempts: its task failed first (task 1: "
            "Exited with exit code 3); excluded nodes now node2") in out
    assert ("cluster: requeueing job 42 (restart 1 of 3) after a failed step (exit code 1; "
            "failure restart 1 of 2)") in out
    assert code == 1


def test_the_excluded_nodes_so_far_are_kept(tmp_path: Path) -> None:
    _, out, calls = run_script(tmp_path, FAILED, FAKE_EXC="node9", FAKE_NODES="n1 node1 node2 node3 node9")
    assert "update JobId=42 ExcNodeList=node9,node2" in calls, calls


def test_no_exclusion_that_would_leave_too_few_nodes_but_still_a_requeue(tmp_path: Path) -> None:
    _, out, calls = run_script(tmp_path, FAILED, FAKE_NODES="node1 node2")
    assert calls == ["-o show job 42", "requeue 42"], calls
    assert ("cluster: not excluding node2 (its task failed first: task 1: Exited with exit code 3): "
            "without node2 the partition debug has 1 node(s) up, fewer than the job's 2") in out


def test_no_exclusion_of_a_node_the_job_asks_for_by_name(tmp_path: Path) -> None:
    _, out, calls = run_script(tmp_path, FAILED, FAKE_REQ="node1,node2")
    assert calls == ["-o show job 42", "requeue 42"], calls
    assert "it is one the job asks for by name (--nodelist node1,node2)" in out


def test_no_requeue_once_the_failure_restarts_are_spent(tmp_path: Path) -> None:
    before = "".join(f"cluster: requeueing job 42 (restart {i} of 3) after a failed step (exit code 1; "
                     f"failure restart {i} of 2)\n" for i in (1, 2))
    code, out, calls = run_script(tmp_path, FAILED, before=before, SLURM_RESTART_COUNT="2")
    assert calls == [] and code == 1
    assert "not requeueing: 2 of 2 failure restart(s) spent" in out


def test_a_signal_requeue_spends_max_requeues_not_the_failure_restarts(tmp_path: Path) -> None:
    """SLURM_RESTART_COUNT 2, one of them a failure's: one signal requeue so far, of 1."""
    before = ("cluster: requeueing job 42 (restart 1 of 3) after a failed step (exit code 1; "
              "failure restart 1 of 2)\n")
    _, out, calls = run_script(tmp_path, FAILED, before=before, SLURM_RESTART_COUNT="2")
    assert "failure restart 2 of 2" in out and "requeuehold 42" in calls
    text = rendered(tmp_path)
    assert 'CLUSTER_REQUEUES=$(( ${SLURM_RESTART_COUNT:-0} - CLUSTER_FAILURES ))' in text
    assert 'if [ "$CLUSTER_REQUEUES" -lt 1 ]; then' in text


def test_the_stop_code_ends_the_job_with_it_and_no_requeue(tmp_path: Path) -> None:
    report = TORCHRUN_REPORT.read_text().replace("exitcode  : 7 (", f"exitcode  : {STOP_CODE} (")
    code, out, calls = run_script(tmp_path, FAILED, tasks=labelled(report))
    assert calls == [] and code == STOP_CODE
    assert f"cluster: job 42: a rank exited with {STOP_CODE}, the stop code; not requeueing" in out


def test_the_stop_code_of_an_earlier_attempt_is_not_read_again(tmp_path: Path) -> None:
    report = TORCHRUN_REPORT.read_text().replace("exitcode  : 7 (", f"exitcode  : {STOP_CODE} (")
    _, out, calls = run_script(tmp_path, FAILED, before=labelled(report))
    assert "requeuehold 42" in calls


def test_without_restarts_a_failed_step_is_not_requeued(tmp_path: Path) -> None:
    text = rendered(tmp_path, restarts=0)
    assert "cluster_after_failure" not in text and "CLUSTER_SIGNALLED" not in text
