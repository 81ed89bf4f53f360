"""The SLURM backend against a fake command runner that answers by program name."""
from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import pytest

from cluster import launch
from cluster.backends.slurm import (Completed, Labeller, OutputReader, Retry, SlurmBackend,
                                    SlurmCommands, cli_settings)
from cluster.errors import BackendError, InputError, Interrupted, RunFailed
from cluster.spec import Host, Inventory, SlurmSettings
from cluster.plan import Job, Templates
from cluster.runs import RunDir
from cluster.observe.watch import Console

Answer = Completed | Callable[[tuple[str, ...]], Completed]


class FakeCommands:
    """Answers each SLURM program from a script of replies; records every call."""

    def __init__(self, **replies: Sequence[Answer] | Answer) -> None:
        names = {"sacct_c": "sacct -c", "scontrol_config": "scontrol config"}
        self.replies = {names.get(k, k): v for k, v in replies.items()}
        self.calls: list[tuple[str, ...]] = []
        self.hidden: dict[str, frozenset[str]] = {}     # program -> names left out of its environment

    def run(self, argv: Sequence[str], *, without: Collection[str] = ()) -> Completed:
        argv = tuple(argv)
        self.calls.append(argv)
        self.hidden[argv[0]] = frozenset(without)
        key = "sacct -c" if argv[:2] == ("sacct", "-c") else argv[0]
        if key == "scontrol" and argv[1:3] == ("show", "config"):
            key = "scontrol config"
        reply = self.replies.get(key)
        if reply is None:
            return ok("", code=1, err=f"{key}: not expected by this test")
        if isinstance(reply, list):
            reply = reply.pop(0) if len(reply) > 1 else reply[0]
        return reply(argv) if callable(reply) else reply

    def called(self, program: str) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == program]


def ok(out: str = "", *, code: int = 0, err: str = "") -> Completed:
    return Completed((), code, out, err)


GONE = ok("")
INVALID = ok("", code=1, err="slurm_load_jobs error: Invalid job id specified")
NO_ACCOUNTING = ok("", code=1, err="Slurm accounting storage is disabled")


def console() -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(out=out, err=err, color=False), out, err


def inventory(secret_env: tuple[str, ...] = ()) -> Inventory:
    return Inventory(hosts=(Host(name="slurm", address="slurm", python="/venv/bin/python",
                                 secret_env=secret_env),), backend="slurm")


def backend(fake: FakeCommands, cwd: Path | None = None) -> SlurmBackend:
    return SlurmBackend(fake, cwd=str(cwd) if cwd else None, poll=0.0, stop_timeout=1.0,
                        sleep=lambda s: None)


def up(inv: Inventory, job: Job, templates: Templates, settings: SlurmSettings, *, argv: list[str],
       console: Console, backend: SlurmBackend, cwd: str, runs_root: Path,
       dry_run: bool = False, detach: bool = False, environ: dict[str, str] | None = None) -> int:
    """`cluster up --backend slurm` as the CLI runs it: the one launch flow."""
    import dataclasses
    inv = dataclasses.replace(inv, slurm=settings)
    run = RunDir.create(job.run_id, runs_root)
    if dry_run:
        launch.dry_run(inv, job, templates, run, backend, argv, console)
        return 0
    return launch.up(inv, job, templates, backend, run, argv, console,
                     launch.Options(detach=detach), environ=environ or {})


def run_up(tmp_path: Path, fake: FakeCommands, secrets: dict[str, str] | None = None,
           **kw: object) -> tuple[int, RunDir, str, str]:
    c, out, err = console()
    job = Job(run_id="r1", script="train.py", args=("--out", "runs/r1/train"))
    code = up(inventory(tuple(secrets or ())), job, Templates(), SlurmSettings(nodes=2), argv=["cluster", "up"],
              console=c, backend=backend(fake, tmp_path), cwd=str(tmp_path),
              runs_root=tmp_path / "runs", environ=secrets, **kw)  # type: ignore[arg-type]
    return code, RunDir(tmp_path / "runs" / "r1"), out.getvalue(), err.getvalue()


# --- cli_settings ---------------------------------------------------------------------------

def test_cli_settings_override_the_inventory() -> None:
    base = SlurmSettings(partition="gpu", nodes=4, time="01:00:00", max_requeues=3)
    s = cli_settings(base, nodes=2, partition=None, time="00:10:00", account="a", max_requeues=0)
    assert (s.nodes, s.partition, s.time, s.account, s.max_requeues) == (2, "gpu", "00:10:00", "a", 0)
    with pytest.raises(InputError, match="--nodes"):
        cli_settings(base, nodes=0)


# --- up ------------------------------------------------------------------------------------

def test_dry_run_records_and_prints_the_script_and_submits_nothing(tmp_path: Path) -> None:
    fake = FakeCommands()
    code, run, out, err = run_up(tmp_path, fake, dry_run=True)
    assert code == 0 and fake.calls == []
    script = (run.path / "scripts" / "sbatch.sh").read_text()
    assert out == script and "#SBATCH --nodes=2" in script
    meta = run.meta()
    assert meta["backend"] == "slurm" and meta["dry_run"] is True
    assert meta["slurm"]["output"] == str(tmp_path / "slurm-logs" / "r1.out")
    assert "nothing was submitted" in err
    assert json.loads((run.path / "env.json").read_text())["slurm"]["CLUSTER_RUN_ID"] == "r1"


def test_sbatch_error_is_shown_as_is_with_the_script_path(tmp_path: Path) -> None:
    fake = FakeCommands(sbatch=ok(code=1, err="sbatch: error: invalid partition specified: nope"))
    with pytest.raises(BackendError) as exc:
        run_up(tmp_path, fake)
    assert exc.value.exit_code == 6
    script = tmp_path / "runs" / "r1" / "scripts" / "sbatch.sh"
    assert str(script) in str(exc.value)
    assert "sbatch: error: invalid partition specified: nope" in str(exc.value)
    assert fake.called("sbatch") == [("sbatch", "--parsable", str(script))]
    assert (tmp_path / "slurm-logs").is_dir()      # created before submission


def test_detach_submits_records_the_job_id_and_returns(tmp_path: Path) -> None:
    fake = FakeCommands(sbatch=ok("77;cluster-a\n"))
    code, run, out, err = run_up(tmp_path, fake, detach=True)
    assert code == 0 and run.meta()["slurm"]["job_id"] == "77"
    assert "submitted job 77" in err and "cluster down r1" in err
    assert fake.called("squeue") == []


def output_grows(tmp_path: Path, chunks: list[str]) -> Callable[[tuple[str, ...]], Completed]:
    """A fake squeue: each call appends the next chunk to the job's output file; RUNNING
    while chunks remain, then gone."""
    path = tmp_path / "slurm-logs" / "r1.out"

    def squeue(argv: tuple[str, ...]) -> Completed:
        if not chunks:
            return GONE
        with open(path, "a") as f:
            f.write(chunks.pop(0))
        return ok("77|RUNNING|node[1-2]|None\n")
    return squeue


def squeue_steps(path: Path, steps: list[tuple[str | None, str]]) -> Callable[[tuple[str, ...]], Completed]:
    """A fake squeue: each call appends the step's line to the job's output file, then lists
    the job in the step's state (None: not listed)."""
    left = iter(steps)

    def squeue(argv: tuple[str, ...]) -> Completed:
        state, line = next(left, (None, ""))
        with open(path, "a") as f:
            f.write(line)
        return ok(f"77|{state}|node[1-2]|None\n") if state else GONE
    return squeue


def test_follow_prints_lines_by_node_and_ends_completed(tmp_path: Path) -> None:
    chunks = ["cluster: run r1 job 77\n0: hello from", " node1\n1: hello from node2\n", "1: bye\n"]
    fake = FakeCommands(sbatch=ok("77\n"), squeue=output_grows(tmp_path, chunks),
                        sacct=ok("77|COMPLETED|0:0|node[1-2]\n"))
    code, run, out, err = run_up(tmp_path, fake)
    assert code == 0
    assert out.splitlines() == ["[batch] cluster: run r1 job 77", "[node1 0] hello from node1",
                                "[node2 1] hello from node2", "[node2 1] bye"]
    assert "job 77: RUNNING" in err and "COMPLETED" in err
    meta = run.meta()
    assert [n["name"] for n in meta["nodes"]] == ["node1", "node2"]
    assert meta["final"]["state"] == "COMPLETED"


def test_lines_before_squeue_names_the_nodes_are_labelled_from_the_batch_scripts_line(
        tmp_path: Path) -> None:
    # The job ran and printed before squeue was asked again (it backs off): the names come
    # from the batch script's first line ($SLURM_JOB_NODELIST), not from when squeue looked.
    path = tmp_path / "slurm-logs" / "r1.out"
    text = ("cluster: run r1 job 77 on gpu[07,09] (restart 0), master gpu07:29500\n"
            "0: hello\n1: rank 1: failing on purpose\n")
    squeue = [ok("77|PENDING||Resources\n"), lambda argv: (path.write_text(text), GONE)[1]]
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue, sacct=ok("77|COMPLETED|0:0|gpu[07,09]\n"))
    code, run, out, err = run_up(tmp_path, fake)
    assert "[gpu07 0] hello" in out.splitlines(), out
    assert "[gpu09 1] rank 1: failing on purpose" in out.splitlines(), out
    assert [n["name"] for n in run.meta()["nodes"]] == ["gpu07", "gpu09"]


def test_follow_keeps_going_while_a_requeued_job_is_briefly_unlisted(tmp_path: Path) -> None:
    # squeue drops the job for a moment while SLURM requeues it; the controller still knows
    # it as PENDING, so following goes on until the second attempt completes.
    path = tmp_path / "slurm-logs" / "r1.out"
    listings = iter(["first", None, "second", None])

    def squeue(argv: tuple[str, ...]) -> Completed:
        attempt = next(listings, None)
        if attempt is None:
            return GONE
        with open(path, "a") as f:
            f.write(f"0: {attempt} attempt\n")
        return ok("77|RUNNING|node[1-2]|None\n")
    scontrol = [ok("JobId=77 JobState=PENDING Reason=BeginTime ExitCode=0:0 NodeList=(null)\n"),
                ok("JobId=77 JobState=COMPLETED Reason=None ExitCode=0:0 NodeList=node[1-2]\n")]
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue, scontrol=scontrol,
                        sacct=ok("77|COMPLETED|0:0|node[1-2]\n"))
    code, _run, out, _err = run_up(tmp_path, fake)
    assert code == 0
    assert "[node1 0] first attempt" in out and "[node1 0] second attempt" in out


def test_follow_waits_for_an_announced_requeue_even_if_the_job_reads_finished(tmp_path: Path) -> None:
    # After the batch script says it requeues, SLURM may drop the job from squeue and even
    # report the first attempt as FAILED for a moment; following waits for the next attempt.
    path = tmp_path / "slurm-logs" / "r1.out"
    steps = [("RUNNING", "cluster: requeueing job 77 (restart 1 of 3)\n"), (None, ""),
             (None, ""), ("PENDING", ""), ("RUNNING", "0: second attempt\n"), (None, "")]
    squeue = squeue_steps(path, steps)
    failed = ok("JobId=77 JobState=FAILED Reason=None Restarts=0 ExitCode=1:0 NodeList=node[1-2]\n")
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue, scontrol=failed,
                        sacct=ok("77|COMPLETED|0:0|node[1-2]\n"))
    code, _run, out, err = run_up(tmp_path, fake)
    assert code == 0, err
    assert "job 77: PENDING" in err and "[node1 0] second attempt" in out


def test_follow_ends_promptly_when_the_requeued_attempt_failed_before_it_printed(tmp_path: Path) -> None:
    # The next attempt ended before it wrote a line and before squeue showed it pending (a
    # slurmd refusing its credential): the controller's Restarts=1 says the finished job is the
    # announced attempt, so following ends at once with its failure instead of waiting.
    path = tmp_path / "slurm-logs" / "r1.out"
    steps = [("RUNNING", "cluster: requeueing job 77 (restart 1 of 3) on SIGUSR2\n"), (None, "")]
    squeue = squeue_steps(path, steps)
    failed = ok("JobId=77 JobState=FAILED Reason=None Restarts=1 ExitCode=1:0 NodeList=node[1-2]\n")
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue, scontrol=failed, sacct=NO_ACCOUNTING,
                        sacct_c=ok("77|FAILED|1:0|node[1-2]\n"))
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match="job 77 FAILED"):
        run_up(tmp_path, fake)
    assert time.monotonic() - t0 < 5, "following waited for a requeued attempt that had ended"


def test_follow_ends_promptly_once_the_requeued_attempt_has_run(tmp_path: Path) -> None:
    # The next attempt's first line ends the wait for the requeue: once that attempt is done,
    # following ends at once instead of waiting out REQUEUE_WAIT.
    path = tmp_path / "slurm-logs" / "r1.out"
    steps = [("RUNNING", "cluster: requeueing job 77 (restart 1 of 3) on SIGUSR2\n"),
             (None, ""), ("RUNNING", "cluster: run r1 job 77 on node[1-2] (restart 1)\n"),
             ("RUNNING", "0: done\n"), (None, "")]
    squeue = squeue_steps(path, steps)
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue,
                        scontrol=ok("JobId=77 JobState=COMPLETED Reason=None ExitCode=0:0\n"),
                        sacct=ok("77|COMPLETED|0:0|node[1-2]\n"))
    t0 = time.monotonic()
    code, _run, out, _err = run_up(tmp_path, fake)
    assert code == 0 and "[node1 0] done" in out
    assert time.monotonic() - t0 < 5, "following waited for a requeue that had already happened"


def test_failed_job_raises_run_failed_naming_state_exit_code_and_tail(tmp_path: Path) -> None:
    chunks = ["1: rank 1: failing on purpose\n"]
    fake = FakeCommands(sbatch=ok("77\n"), squeue=output_grows(tmp_path, chunks),
                        sacct=NO_ACCOUNTING, sacct_c=ok("77|FAILED|1:0|node[1-2]\n"))
    with pytest.raises(RunFailed) as exc:
        run_up(tmp_path, fake)
    text = str(exc.value)
    assert exc.value.exit_code == 4
    assert "job 77 FAILED, exit code 1 (sacct -c)" in text
    assert "[node2 1] rank 1: failing on purpose" in text


def test_ctrl_c_while_following_cancels_the_job(tmp_path: Path, ctrl_c_raises) -> None:
    import _thread
    calls = {"n": 0}

    def squeue(argv: tuple[str, ...]) -> Completed:
        calls["n"] += 1
        if calls["n"] == 2:
            _thread.interrupt_main()        # Ctrl-C reaches the main thread, as a signal does
            time.sleep(0.5)
        return ok("77|RUNNING|node1|None\n") if calls["n"] < 3 else GONE
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue, scancel=ok())
    with pytest.raises(Interrupted, match="job 77 of run r1 was cancelled"):
        run_up(tmp_path, fake)
    assert fake.called("scancel") == [("scancel", "77")]


# --- status: squeue -> sacct -> sacct -c (+ completion file) -> scontrol ---------------------

def recorded_run(tmp_path: Path, job_id: str | None = "77") -> RunDir:
    run = RunDir.create("r1", tmp_path / "runs")
    slurm = {"output": str(tmp_path / "r1.out")}
    if job_id:
        slurm["job_id"] = job_id
    run.write_meta({"run_id": "r1", "backend": "slurm", "nodes": [], "slurm": slurm})
    return run


def test_status_running_from_squeue_one_row_per_node(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=ok("77|RUNNING|node[1-2]|None\n"))
    rows = backend(fake).status(recorded_run(tmp_path))
    assert [(r.rank, r.name, r.state, r.code) for r in rows] == [
        (0, "node1", "running", None), (1, "node2", "running", None)]
    assert "squeue" in rows[0].detail


def test_status_pending_shows_the_reason(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=ok("77|PENDING||Resources\n"))
    rows = backend(fake).status(recorded_run(tmp_path))
    assert [(r.name, r.state) for r in rows] == [("job 77", "pending")]
    assert "Resources" in rows[0].detail


def test_status_after_the_end_from_sacct(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=INVALID, sacct=ok("77|CANCELLED by 0|0:15|node[1-2]\n"))
    rows = backend(fake).status(recorded_run(tmp_path))
    assert [(r.name, r.state, r.code) for r in rows] == [("node1", "cancelled", 0),
                                                        ("node2", "cancelled", 0)]


def test_status_falls_back_to_sacct_c_without_accounting(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=GONE, sacct=NO_ACCOUNTING,
                        sacct_c=ok("77|REQUEUED|0:15|node1\n77|FAILED|137:0|node[1-2]\n"))
    rows = backend(fake).status(recorded_run(tmp_path))
    assert {(r.state, r.code) for r in rows} == {("failed", 137)}
    assert "(sacct -c)" in rows[0].detail


def test_status_reads_the_completion_file_when_sacct_c_drops_the_state(tmp_path: Path) -> None:
    # SLURM 22.05's sacct -c misreads a line whose JobName has a space: State comes back empty.
    comp = tmp_path / "jobcomp.txt"
    comp.write_text("JobId=76 UserId=root(0) Name=x JobState=COMPLETED ExitCode=0:0\n"
                    "JobId=77 UserId=root(0) Name=my job JobState=FAILED NodeList=node[1-2] ExitCode=1:0\n")
    fake = FakeCommands(squeue=GONE, sacct=NO_ACCOUNTING, sacct_c=ok("77||1:0|node[1-2]\n"),
                        scontrol_config=ok(f"JobCompLoc              = {comp}\n"))
    rows = backend(fake).status(recorded_run(tmp_path))
    assert {(r.state, r.code) for r in rows} == {("failed", 1)}
    assert "jobcomp" in rows[0].detail


def test_status_last_resort_scontrol_show_job(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=GONE, sacct=NO_ACCOUNTING, sacct_c=ok("", code=1),
                        scontrol=ok("JobId=77 JobName=my job JobState=TIMEOUT Reason=TimeLimit "
                                    "ExitCode=0:15 NodeList=node[1-3]\n"))
    rows = backend(fake).status(recorded_run(tmp_path))
    assert [(r.name, r.state, r.code) for r in rows] == [
        ("node1", "timeout", 0), ("node2", "timeout", 0), ("node3", "timeout", 0)]


def test_status_of_a_dry_run(tmp_path: Path) -> None:
    rows = backend(FakeCommands()).status(recorded_run(tmp_path, job_id=None))
    assert [r.state for r in rows] == ["not submitted"]


def test_squeue_failure_other_than_unknown_job_is_an_error(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=ok(code=1, err="slurm_load_jobs error: Unable to contact slurm controller"))
    with pytest.raises(BackendError, match="Unable to contact"):
        backend(fake).status(recorded_run(tmp_path))


# --- the secret environment ------------------------------------------------------------------

SECRET = "tok $(touch /tmp/x) 'q' \"d\"\nline2"
SECRETS_FILE = Path("slurm-logs") / ".r1.secrets" / "env"


def sbatch_seeing_the_secrets_file(tmp_path: Path, seen: list[bytes]) -> Callable[[tuple[str, ...]], Completed]:
    """A fake sbatch that checks the secrets' file is in place, private, as it submits."""
    def sbatch(argv: tuple[str, ...]) -> Completed:
        f = tmp_path / SECRETS_FILE
        assert f.stat().st_mode & 0o777 == 0o600 and f.parent.stat().st_mode & 0o777 == 0o700
        seen.append(f.read_bytes())
        return ok("77\n")
    return sbatch


def test_secret_values_go_to_a_private_file_and_never_to_sbatchs_environment(tmp_path: Path) -> None:
    seen: list[bytes] = []
    fake = FakeCommands(sbatch=sbatch_seeing_the_secrets_file(tmp_path, seen))
    code, run, _out, _err = run_up(tmp_path, fake, secrets={"TOKEN": SECRET, "OTHER": "b=c"},
                                   detach=True)
    assert code == 0
    assert seen == [f"TOKEN={SECRET}\0OTHER=b=c\0".encode()]
    assert fake.hidden["sbatch"] == {"TOKEN", "OTHER"}        # the controller would save them
    assert fake.called("sbatch") == [("sbatch", "--parsable", str(run.script_path("sbatch.sh")))]
    assert (tmp_path / SECRETS_FILE).exists(), "a detached job still needs them"
    assert run.meta()["slurm"]["secrets_file"] == str(tmp_path / SECRETS_FILE)
    for f in run.path.rglob("*"):
        assert not f.is_file() or SECRET.encode() not in f.read_bytes(), f


def test_the_secrets_file_goes_when_the_followed_job_ends(tmp_path: Path) -> None:
    fake = FakeCommands(sbatch=sbatch_seeing_the_secrets_file(tmp_path, []),
                        squeue=output_grows(tmp_path, ["0: hi\n"]),
                        sacct=ok("77|FAILED|1:0|node[1-2]\n"))
    with pytest.raises(RunFailed):
        run_up(tmp_path, fake, secrets={"TOKEN": SECRET})
    assert not (tmp_path / SECRETS_FILE).parent.exists()


def test_the_secrets_file_goes_when_sbatch_refuses_the_job(tmp_path: Path) -> None:
    fake = FakeCommands(sbatch=ok(code=1, err="sbatch: error: invalid partition specified"))
    with pytest.raises(BackendError):
        run_up(tmp_path, fake, secrets={"TOKEN": SECRET})
    assert (tmp_path / "slurm-logs").is_dir() and not (tmp_path / SECRETS_FILE).parent.exists()


def test_an_existing_secrets_folder_is_refused_not_trusted(tmp_path: Path) -> None:
    (tmp_path / SECRETS_FILE).parent.mkdir(parents=True, mode=0o777)
    fake = FakeCommands(sbatch=ok("77\n"))
    with pytest.raises(BackendError, match="cannot write the secret environment's file"):
        run_up(tmp_path, fake, secrets={"TOKEN": SECRET})
    assert fake.called("sbatch") == []


def test_sbatch_runs_without_the_hidden_names_in_its_environment(tmp_path: Path) -> None:
    commands = SlurmCommands(env={"PATH": os.environ["PATH"], "TOKEN": "v", "KEEP": "k"})
    said = commands.run(["env"], without={"TOKEN"}).stdout.splitlines()
    assert "KEEP=k" in said and not any(line.startswith("TOKEN=") for line in said)
    assert "TOKEN=v" in commands.run(["env"]).stdout.splitlines()


# --- down -----------------------------------------------------------------------------------

def test_down_scancels_and_waits_until_squeue_no_longer_lists_the_job(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=[ok("77|RUNNING|node[1-2]|None\n"), ok("77|COMPLETING|node[1-2]|None\n"),
                                GONE],
                        scancel=ok(), sacct=ok("77|CANCELLED by 0|0:15|node[1-2]\n"))
    report = backend(fake).stop_run(recorded_run(tmp_path))
    assert fake.called("scancel") == [("scancel", "77")]
    assert report == {"job 77": {"signalled": ["77"], "state": "CANCELLED"}}
    assert len(fake.called("squeue")) == 3


@pytest.mark.parametrize("running", [True, False])
def test_down_removes_a_detached_jobs_secrets_file(running: bool, tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    secrets = tmp_path / ".r1.secrets" / "env"
    secrets.parent.mkdir(mode=0o700)
    secrets.write_bytes(b"TOKEN=v\0")
    run.update(slurm={**run.meta()["slurm"], "secrets_file": str(secrets)})
    listed = [ok("77|RUNNING|node[1-2]|None\n"), GONE] if running else [GONE]
    fake = FakeCommands(squeue=listed, scancel=ok(),
                        sacct=ok("77|CANCELLED by 0|0:15|node[1-2]\n" if running else "77|FAILED|1:0|node1\n"))
    backend(fake).stop_run(run)
    assert not secrets.parent.exists()
    assert bool(fake.called("scancel")) == running


def test_down_reports_a_job_that_will_not_go(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=ok("77|COMPLETING|node1|None\n"), scancel=ok())
    report = backend(fake).stop_run(recorded_run(tmp_path))
    assert "still listed by squeue as COMPLETING" in report["job 77"]["error"]


def test_down_of_a_finished_job_cancels_nothing(tmp_path: Path) -> None:
    fake = FakeCommands(squeue=GONE, sacct=ok("77|COMPLETED|0:0|node1\n"))
    report = backend(fake).stop_run(recorded_run(tmp_path))
    assert fake.called("scancel") == [] and report["job 77"]["state"] == "COMPLETED"


# --- logs -----------------------------------------------------------------------------------

def test_logs_label_lines_by_node_and_filter_one_node(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    (tmp_path / "r1.out").write_text("cluster: start\n0: a\n1: b\n0: c\npartial")
    fake = FakeCommands(squeue=GONE)
    meta = run.meta()
    meta["nodes"] = [{"rank": 0, "name": "gpu7"}, {"rank": 1, "name": "gpu9"}]
    run.write_meta(meta)
    got = list(backend(fake).logs(run))
    assert got == [("batch", b"cluster: start\n"), ("gpu7 0", b"a\n"), ("gpu9 1", b"b\n"),
                   ("gpu7 0", b"c\n"), ("batch", b"partial\n")]
    assert [t for _, t in backend(fake).logs(run, node="gpu9")] == [b"b\n"]


def test_logs_follow_goes_on_through_a_requeue_and_records_the_nodes(tmp_path: Path) -> None:
    # `cluster logs -f` follows as `cluster up` does: squeue drops the requeued job for a
    # moment and the controller knows it as pending, so the second attempt is shown too.
    run = recorded_run(tmp_path)
    path = tmp_path / "r1.out"
    steps = [("RUNNING", "cluster: requeueing job 77 (restart 1 of 3) on SIGUSR2\n0: first\n"),
             (None, ""), ("RUNNING", "cluster: run r1 job 77 (restart 1)\n1: second\n"), (None, "")]
    squeue = squeue_steps(path, steps)
    scontrol = [ok("JobId=77 JobState=PENDING Reason=BeginTime Restarts=1 ExitCode=0:0\n"),
                ok("JobId=77 JobState=COMPLETED Reason=None Restarts=1 ExitCode=0:0\n")]
    fake = FakeCommands(squeue=squeue, scontrol=scontrol, sacct=ok("77|COMPLETED|0:0|node[1-2]\n"))
    got = list(backend(fake).logs(run, follow=True))
    assert ("node1 0", b"first\n") in got and ("node2 1", b"second\n") in got, got
    assert [n["name"] for n in run.meta()["nodes"]] == ["node1", "node2"]
    assert list(backend(fake).logs(run, node="node2")) == [("node2 1", b"second\n")]


def test_output_reader_and_labeller() -> None:
    lab = Labeller(["n1"])
    assert lab.split(b"0: x") == ("n1 0", b"x")
    assert lab.split(b" 12: y") == ("task 12", b"y")
    assert lab.split(b"srun: error: x") == ("batch", b"srun: error: x")
    assert OutputReader(Path("/nonexistent/file")).lines() == []


# --- a controller that blinks; polling that scales -------------------------------------------

TIMED_OUT = ok("", code=1, err="squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation")


def test_a_query_that_times_out_once_is_asked_again_and_following_goes_on(tmp_path: Path) -> None:
    chunks = ["0: before\n", "0: after\n"]
    grow = output_grows(tmp_path, chunks)
    replies = iter([grow, TIMED_OUT, TIMED_OUT, grow])

    def squeue(argv: tuple[str, ...]) -> Completed:
        reply = next(replies, grow)
        return reply(argv) if callable(reply) else reply
    fake = FakeCommands(sbatch=ok("77\n"), squeue=squeue, sacct=ok("77|COMPLETED|0:0|node1\n"))
    code, _run, out, _err = run_up(tmp_path, fake)
    assert code == 0 and "[node1 0] after" in out
    assert len(fake.called("squeue")) >= 5


def test_retries_have_a_budget_and_sbatch_is_never_repeated(tmp_path: Path) -> None:
    slept: list[float] = []
    fake = FakeCommands(squeue=TIMED_OUT, sbatch=ok(code=1, err="sbatch: error: Socket timed out"))
    b = SlurmBackend(fake, sleep=slept.append, retry=Retry(budget=20, first=1, cap=8))
    with pytest.raises(BackendError, match="Socket timed out"):
        b.queued("77")
    assert slept == [1, 2, 4, 8], "backoff doubles up to the cap, within the budget"
    with pytest.raises(BackendError):
        b.submit(tmp_path / "x.sh")
    assert len(fake.called("sbatch")) == 1, "a submission is never repeated (it may have gone through)"


def test_following_a_long_job_asks_squeue_less_and_less_often(tmp_path: Path) -> None:
    clock = [0.0]
    fake = FakeCommands(sbatch=ok("77\n"), sacct=ok("77|COMPLETED|0:0|node1\n"),
                        squeue=lambda argv: ok("77|RUNNING|node1|None\n") if clock[0] < 600 else GONE)

    def sleep(seconds: float) -> None:
        clock[0] += max(seconds, 0.01)
    b = SlurmBackend(fake, poll=1.0, max_poll=15.0, sleep=sleep, clock=lambda: clock[0])
    c, _out, _err = console()
    job = Job(run_id="r1", script="train.py")
    assert up(inventory(), job, Templates(), SlurmSettings(nodes=1), argv=["cluster", "up"],
              console=c, backend=b, cwd=str(tmp_path), runs_root=tmp_path / "runs") == 0
    calls = len(fake.called("squeue"))
    assert calls < 60, f"{calls} squeue calls in 10 minutes: polling did not back off"
    assert calls > 600 / 15 - 5, "never less often than max_poll"


# --- the secrets of a job that ended unfollowed: status and clean ------------------------------

FAILED_SCONTROL = "JobId=77 JobState=FAILED Reason=NonZeroExitCode Restarts={} ExitCode=1:0 NodeList=node1\n"


def run_with_secrets(tmp_path: Path, output: str = "") -> tuple[RunDir, Path]:
    """A detached run whose secrets' folder is still on disk, its output holding `output`."""
    run = recorded_run(tmp_path)
    secrets = tmp_path / ".r1.secrets" / "env"
    secrets.parent.mkdir(mode=0o700)
    secrets.write_bytes(f"TOKEN={SECRET}\0".encode())
    (tmp_path / "r1.out").write_text(output)
    run.update(slurm={**run.meta()["slurm"], "secrets_file": str(secrets)})
    return run, secrets.parent


@pytest.mark.parametrize("scontrol", [INVALID, ok(FAILED_SCONTROL.format(0))])
def test_status_removes_the_secrets_of_a_detached_job_that_failed(scontrol: Completed,
                                                                   tmp_path: Path) -> None:
    # the controller has forgotten the job (MinJobAge), or still knows it as FAILED
    run, folder = run_with_secrets(tmp_path, "cluster: run r1 job 77\n0: boom\n")
    fake = FakeCommands(squeue=INVALID, sacct=ok("77|FAILED|1:0|node1\n"), scontrol=scontrol)
    rows = backend(fake).status(run)
    assert [r.state for r in rows] == ["failed"]
    assert not folder.exists()


@pytest.mark.parametrize("squeue, scontrol", [
    (ok("77|REQUEUED|node1|None\n"), None),                  # squeue still lists it
    (ok("77|PENDING||BeginTime\n"), None),
    (GONE, ok("JobId=77 JobState=PENDING Reason=BeginTime Restarts=1 ExitCode=0:0\n")),
    (GONE, ok("JobId=77 JobState=REQUEUED Reason=None Restarts=1 ExitCode=0:0\n")),
    (GONE, ok("JobId=77 JobState=REQUEUE_HOLD Reason=JobHeldAdmin Restarts=1 ExitCode=0:0\n")),
    (GONE, ok("JobId=77 JobState=REQUEUE_FED Reason=None Restarts=1 ExitCode=0:0\n")),
    (GONE, ok("", code=1, err="scontrol: error: Unable to contact slurm controller (connect failure)")),
])
def test_status_keeps_the_secrets_of_a_job_that_may_run_again(squeue: Completed,
                                                              scontrol: Completed | None,
                                                              tmp_path: Path) -> None:
    run, folder = run_with_secrets(tmp_path)
    fake = FakeCommands(squeue=squeue, sacct=ok("77|FAILED|1:0|node1\n"),
                        **({"scontrol": scontrol} if scontrol else {}))
    b = SlurmBackend(fake, poll=0.0, sleep=lambda s: None, retry=Retry(budget=0))
    b.status(run)
    assert folder.exists()


def test_status_keeps_the_secrets_while_an_announced_requeue_is_still_to_come(tmp_path: Path) -> None:
    # The batch script said it requeues; the job briefly reads FAILED (Restarts=0) before it is
    # pending again: the next attempt needs the file. Once Restarts=1 that attempt has run.
    run, folder = run_with_secrets(tmp_path, "cluster: run r1 job 77 on node1 (restart 0)\n"
                                   "cluster: requeueing job 77 (restart 1 of 3) on SIGUSR2\n")
    fake = FakeCommands(squeue=GONE, sacct=ok("77|FAILED|1:0|node1\n"),
                        scontrol=[ok(FAILED_SCONTROL.format(0)), ok(FAILED_SCONTROL.format(1))])
    backend(fake).status(run)
    assert folder.exists()
    backend(fake).status(run)
    assert not folder.exists()


def test_clean_lists_then_removes_the_secrets_of_jobs_over_for_good(tmp_path: Path) -> None:
    from cluster.clean import clean_records, clean_secrets
    run, folder = run_with_secrets(tmp_path)
    fake = FakeCommands(squeue=GONE, sacct=ok("77|FAILED|1:0|node1\n"), scontrol=INVALID)
    look = backend(fake)
    look.forget_ended_secrets = False              # as `cluster clean --dry-run` asks
    dry = clean_secrets(tmp_path / "runs", True, look.leftover_secrets, look.forget_run_secrets)
    records = clean_records(tmp_path / "runs", 0, True, look.status,
                            secrets_going={d.path for d in dry})
    assert [(d.path, d.action) for d in dry] == [(str(folder), "would remove")]
    assert [d.action for d in records] == ["would remove"] and folder.exists()
    done = clean_secrets(tmp_path / "runs", False, look.leftover_secrets, look.forget_run_secrets)
    assert [(d.path, d.action) for d in done] == [(str(folder), "removed")] and not folder.exists()
    assert "TOKEN" not in "".join(d.line() for d in dry + done) and SECRET not in str(dry + done)


def test_clean_keeps_the_secrets_and_the_record_of_a_job_being_requeued(tmp_path: Path) -> None:
    from cluster.clean import clean_records, clean_secrets
    run, folder = run_with_secrets(tmp_path)
    fake = FakeCommands(squeue=GONE, sacct=ok("77|FAILED|1:0|node1\n"),
                        scontrol=ok("JobId=77 JobState=PENDING Reason=BeginTime Restarts=1\n"))
    b = backend(fake)
    decisions = clean_secrets(tmp_path / "runs", False, b.leftover_secrets, b.forget_run_secrets)
    assert [d.action for d in decisions] == ["kept"] and "PENDING" in decisions[0].why
    records = clean_records(tmp_path / "runs", 0, False, b.status)
    assert [d.action for d in records] == ["kept"] and "secrets" in records[0].why
    assert folder.exists() and run.path.exists()
