"""`cluster up/status/down --backend slurm` against a real SLURM 22.05 (two slurmd, one per
network namespace, started by the SlurmCluster fixture). The real CLI runs as a subprocess with
the fixture's environment (SLURM_CONF), in tmp_path: every node sees the same filesystem and
jobs run as root, so the job's output file and working directory are shared.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import make_venv
    from tests.integration.fixtures import SlurmCluster, processes_with_env
except ImportError:  # run with tests/integration on sys.path
    from conftest import make_venv  # type: ignore
    from fixtures import SlurmCluster, processes_with_env  # type: ignore

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "integration" / "programs" / "slurm_allreduce.py"
PYTHON = os.environ.get("CLUSTER_TEST_PYTHON", "/opt/cluster-venv/bin/python")
TRAIN_PY = PYTHON if os.path.exists(PYTHON) else sys.executable


def _have(*names: str) -> bool:
    return all(shutil.which(n) or os.path.exists(f"/usr/sbin/{n}") for n in names)


pytestmark = [
    pytest.mark.integration,
    pytest.mark.slurm,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not _have("ip", "unshare", "nsenter", "slurmctld", "slurmd", "sbatch",
                                 "munged", "munge"), reason="needs iproute2, slurm-wlm, munge"),
]


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster(2) as sc:
        yield sc


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "inventory.yaml").write_text(
        "backend: slurm\n"
        f"defaults: {{python: {TRAIN_PY}, nproc_per_node: 1}}\n"
        "hosts: []                  # SLURM chooses the nodes\n"
        "slurm: {nodes: 2, time: '00:05:00'}\n")
    return tmp_path


def cluster(slurm, cwd: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(slurm.env, NO_COLOR="1", CLUSTER_RUNS_DIR=str(cwd / "runs"))
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def up(slurm, cwd: Path, *command: str, extra: tuple[str, ...] = (), timeout: float = 150):
    return cluster(slurm, cwd, "up", "-i", "inventory.yaml", *extra, "--", *command,
                   timeout=timeout)


def reports(stdout: str) -> list[dict]:
    """The JSON line each rank printed, from '[node1 0] {...}' lines."""
    return [json.loads(m.group(1)) for m in re.finditer(r"^\[\S+ \d+\] (\{.*\})$", stdout, re.M)]


def job_id(cwd: Path) -> str:
    (run,) = [p for p in (cwd / "runs").iterdir() if (p / "run.json").is_file()]
    return json.loads((run / "run.json").read_text())["slurm"]["job_id"]


def test_two_node_allreduce(slurm, workdir: Path, record_property) -> None:
    t0 = time.monotonic()
    r = up(slurm, workdir, str(PROGRAM))
    seconds = time.monotonic() - t0
    record_property("slurm_2_node_up_s", round(seconds, 2))
    print(f"\n[timing] 2-node cluster up --backend slurm (all_reduce): {seconds:.1f} s", file=sys.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    got = sorted(reports(r.stdout), key=lambda d: d["rank"])
    assert [d["rank"] for d in got] == [0, 1]
    assert {d["world"] for d in got} == {2} and {d["sum"] for d in got} == {3}
    assert sorted(d["hostname"] for d in got) == ["node1", "node2"]
    # per-node values expanded on each node, not once in the batch shell
    assert sorted(d["slurm_nodeid"] for d in got) == ["0", "1"]
    assert sorted(d["cluster_node_rank"] for d in got) == ["0", "1"]
    assert {d["gloo_ifname"] for d in got} == {"eth0"}        # detected per node
    assert {d["nccl_ifname"] for d in got} == {"=eth0"}       # NCCL's exact match, not a prefix
    assert re.search(r"^\[node1 0\] ", r.stdout, re.M) and re.search(r"^\[node2 1\] ", r.stdout, re.M)
    # each line's label names the host the rank ran on and the group rank torch gave it
    for m in re.finditer(r"^\[(\S+) (\d+)\] (\{.*\})$", r.stdout, re.M):
        d = json.loads(m.group(3))
        assert (m.group(1), int(m.group(2))) == (d["hostname"], d["rank"]), m.group(0)
        assert d["cluster_node_rank"] == str(d["rank"])
    assert "COMPLETED" in r.stderr
    status = cluster(slurm, workdir, "status")
    assert status.returncode == 0 and status.stdout.count("completed") == 2, status.stdout


def test_two_node_train(slurm, workdir: Path, record_property) -> None:
    t0 = time.monotonic()
    r = up(slurm, workdir, str(ROOT / "train" / "train.py"), "--epochs", "1", "--no-resume",
           timeout=200)
    record_property("slurm_2_node_train_s", round(time.monotonic() - t0, 2))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    final = [line for line in r.stdout.splitlines() if "FINAL" in line]
    assert final and '"world_size": 2' in final[0], r.stdout[-3000:]


def test_failing_rank_ends_failed_with_exit_code(slurm, workdir: Path) -> None:
    r = up(slurm, workdir, str(PROGRAM), "--fail-rank", "1")
    assert r.returncode == 4, r.stdout + r.stderr
    assert re.search(r"job \d+ FAILED, exit code [1-9]\d*", r.stderr), r.stderr
    assert "[node2 1] rank 1: failing on purpose" in r.stdout
    assert "line(s):\n  | [" in r.stderr                          # the tail, as evidence
    status = cluster(slurm, workdir, "status")
    assert status.returncode == 0
    # The table's rows (the note under it also says the run failed, and why)
    rows = [line for line in status.stdout.splitlines() if line.startswith("│") and "failed" in line]
    assert "ended with exit code 4: node [job" in status.stdout, status.stdout
    assert len(rows) == 2 and all(re.search(r"failed\s*\S\s*[1-9]\d*", row) for row in rows), status.stdout


def test_down_cancels_a_running_job_and_leaves_no_process(slurm, workdir: Path) -> None:
    """... and removes the detached job's secrets file, which the job needed until then."""
    env = dict(slurm.env, NO_COLOR="1", CLUSTER_RUNS_DIR=str(workdir / "runs"), TOKEN="down-me")
    r = subprocess.run([sys.executable, "-m", "cluster", "up", "-i", "inventory.yaml", "--detach",
                        "--secret-env", "TOKEN", "--", str(PROGRAM), "--sleep", "300"],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    jid = job_id(workdir)
    run_id = next((workdir / "runs").iterdir()).name
    secrets = workdir / "slurm-logs" / f".{run_id}.secrets" / "env"
    assert secrets.read_bytes() == b"TOKEN=down-me\0" and secrets.stat().st_mode & 0o777 == 0o600
    out = workdir / "slurm-logs" / f"{run_id}.out"          # created when the job starts
    deadline = time.monotonic() + 90
    while not out.exists() or out.read_text().count('"world": 2') < 2:   # both ranks run
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.5)
    assert processes_with_env("SLURM_JOB_ID", jid)
    st = cluster(slurm, workdir, "status")
    assert st.stdout.count("running") == 2, st.stdout
    t0 = time.monotonic()
    down = cluster(slurm, workdir, "down")
    print(f"\n[timing] cluster down of a 2-node job: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert down.returncode == 0, down.stderr
    assert f"[job {jid}] CANCELLED" in down.stderr
    assert slurm.run(["squeue", "-h", "-j", jid]).stdout.strip() == ""
    assert not secrets.parent.exists()
    deadline = time.monotonic() + 10
    while processes_with_env("SLURM_JOB_ID", jid):
        assert time.monotonic() < deadline, processes_with_env("SLURM_JOB_ID", jid)
        time.sleep(0.2)
    st = cluster(slurm, workdir, "status")
    assert st.stdout.count("cancelled") == 2, st.stdout


def test_preemption_signal_requeues_and_the_job_completes(slurm, workdir: Path) -> None:
    """B:USR2 to the batch shell (what SLURM sends before the time limit or on preemption):
    the step gets SIGTERM, the job is requeued, its second attempt completes (with the secret,
    read again from the file the first attempt left), and both `cluster up` and a `cluster logs
    -f` started meanwhile follow it to the end. SLURM holds a requeued job for about two
    minutes (BeginTime); the test releases it as soon as it may."""
    secret = f"requeued-{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "-i", "inventory.yaml", "--secret-env", "TOKEN",
         "--", str(PROGRAM), "--sleep-first", "300", "--env-hash", "TOKEN"], cwd=workdir,
        env=dict(slurm.env, NO_COLOR="1", TOKEN=secret),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    follower: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "job did not start"
            outs = list((workdir / "slurm-logs").glob("*.out")) if (workdir / "slurm-logs").is_dir() else []
            if outs and outs[0].read_text().count('"world": 2') >= 2:
                break
            time.sleep(0.5)
        jid = job_id(workdir)
        follower = subprocess.Popen(        # a second terminal following the same run
            [sys.executable, "-m", "cluster", "logs", "-f"], cwd=workdir,
            env=dict(slurm.env, NO_COLOR="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert slurm.run(["scancel", "--signal=USR2", "--batch", jid]).returncode == 0
        while slurm.run(["squeue", "-h", "-j", jid, "-o", "%T|%r"]).stdout.strip() != "PENDING|BeginTime":
            assert time.monotonic() < deadline + 60, "job was not requeued"
            time.sleep(0.3)
        # The requeue revoked the first attempt's credential on each slurmd, which then refuses
        # any credential of the job issued in that same second ("Job credential revoked", the
        # second attempt FAILED). The revocation is over once the job is PENDING again: release
        # it in a later second than that (SLURM's own BeginTime hold is there for this).
        time.sleep(1.05 - time.time() % 1)
        slurm.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"])
        stdout, stderr = proc.communicate(timeout=120)
        followed, follow_err = follower.communicate(timeout=60)
    finally:
        for p in (proc, follower):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr
    assert follower is not None and follower.returncode == 0, followed[-3000:] + follow_err
    assert sorted(d["restart"] for d in reports(followed)) == [0, 0, 1, 1], followed[-3000:]
    assert "requeueing job" in stdout and "on SIGUSR2" in stdout
    assert "SignalException" in stdout                  # torchrun got SIGTERM, not SIGKILL
    restarts = sorted(d["restart"] for d in reports(stdout))
    assert restarts == [0, 0, 1, 1], stdout[-3000:]
    want = hashlib.sha256(secret.encode()).hexdigest()
    assert [d["env_hash"] for d in reports(stdout)] == [want] * 4, stdout[-3000:]
    assert _files_holding(Path(slurm.dir), secret.encode()) == []
    assert not list((workdir / "slurm-logs").glob(".*.secrets"))
    # What the follower reads to know a finished job is the requeued attempt (JobInfo.restarts).
    assert " Restarts=1 " in slurm.run(["scontrol", "-o", "show", "job", jid]).stdout


def _files_holding(root: Path, value: bytes) -> list[str]:
    """Every file under root whose bytes hold value."""
    found = []
    for f in root.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink() and value in f.read_bytes():
                found.append(str(f))
        except OSError:
            pass
    return found


def test_secret_env_and_a_nasty_job_name_through_real_sbatch(slurm, workdir: Path, canary: Path) -> None:
    """The secret reaches every rank, yet the controller never gets it: not in the job's saved
    environment (the state save location), the batch script, the slurmd spools, `scontrol show
    job -dd`, the run's records or the output; the private file that carried it is gone once
    the job ends. A job name with quotes, '#' and a backslash reaches SLURM as written (sbatch's
    own parser)."""
    secret = f"tok_{os.getpid()}_$(touch {canary})'\"#"
    name = "it's \"my\" #1 job\\x"
    inv = workdir / "inventory.yaml"
    inv.write_text(inv.read_text().replace(
        "slurm: {nodes: 2", f"slurm: {{job_name: {json.dumps(name)}, nodes: 2"))
    env = dict(slurm.env, NO_COLOR="1", CLUSTER_RUNS_DIR=str(workdir / "runs"), SLURM_TOKEN=secret)
    r = subprocess.run([sys.executable, "-m", "cluster", "up", "-i", "inventory.yaml",
                        "--secret-env", "SLURM_TOKEN", "--", str(PROGRAM), "--env-hash", "SLURM_TOKEN"],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    want = hashlib.sha256(secret.encode()).hexdigest()
    assert [d["env_hash"] for d in reports(r.stdout)] == [want, want]
    jid = job_id(workdir)
    shown = slurm.run(["scontrol", "-o", "show", "job", jid]).stdout
    assert f"JobName={name} " in shown, shown
    # What the controller keeps of the job (it keeps it MinJobAge=300 s after the end).
    detail = slurm.run(["scontrol", "show", "job", "-dd", jid])
    script = slurm.run(["scontrol", "write", "batch_script", jid, "-"])
    assert detail.returncode == 0 and script.returncode == 0 and "srun" in script.stdout, script
    for said in (detail.stdout, script.stdout, r.stdout, r.stderr):
        assert secret not in said, said
    value = secret.encode()
    state = Path(slurm.dir) / "state"
    assert list(state.glob(f"hash.*/job.{jid}/environment")), "the controller saved no job"
    assert _files_holding(Path(slurm.dir), value) == []      # state, spools, logs, slurm.conf
    assert _files_holding(workdir, value) == []              # runs/, slurm-logs/, the folder
    assert not list(workdir.rglob("*secret*")), list(workdir.rglob("*secret*"))
    assert not canary.exists()


def test_setup_auto_python_torchrun_args_and_extra_options_under_real_slurm(slurm, workdir: Path) -> None:
    """The setup lines run inside the step on each node (a venv activated by `source`, a
    value set per node), python: auto takes the venv's interpreter, torchrun takes the extra
    option, and a slurm.extra option reaches the job as SLURM sees it."""
    venv = make_venv(workdir / "venv")
    (workdir / "inventory.yaml").write_text(
        "backend: slurm\n"
        "defaults:\n  python: auto\n  nproc_per_node: 1\n"
        f"  setup: ['source {venv}/bin/activate', 'export FROM_SETUP=\"on $(hostname)\"']\n"
        "  torchrun_args: [--log-dir=torchrun-logs]\n"
        "hosts: []\n"
        "slurm: {nodes: 2, time: '00:05:00', extra: {comment: 'from extra #1', contiguous: true}}\n")
    r = up(slurm, workdir, str(PROGRAM))
    assert r.returncode == 0, r.stdout + r.stderr
    got = reports(r.stdout)
    assert len(got) == 2
    for d in got:
        assert Path(d["python"]).parent == venv / "bin", d
        assert d["from_setup"] == f"on {d['hostname']}", d
    assert (workdir / "torchrun-logs").is_dir()
    shown = slurm.run(["scontrol", "-o", "show", "job", job_id(workdir)]).stdout
    assert "Comment=from extra #1 " in shown and " Contiguous=1 " in shown, shown
