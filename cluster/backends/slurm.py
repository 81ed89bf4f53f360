"""SLURM: sbatch / squeue / sacct / scancel / scontrol behind one subprocess seam.

    plan      the batch script (cluster.sbatch, pure); the launch flow records it
    start     the secret values into a private file the job reads (never sbatch's environment,
              which the controller saves), then
              `sbatch --parsable` of the recorded script -> a JobProcess (slurm_output.py) that
              the one watcher follows like any node: the output file, labelled by node, until
              squeue no longer lists the job; then the final state (sacct, else `sacct -c` and
              the job completion file, else `scontrol show job`): COMPLETED is success.
    stop      (Ctrl-C, a signal) cancels the job (scancel) and waits until it is gone: a user
              who presses Ctrl-C wants the run stopped. `--detach` leaves it running.
    status    squeue while the job is queued or running, the final state afterwards; the
              secrets' file of a job over for good goes then (ended_for_good).
    logs      the job's one combined output file; srun --label prefixes each line with the task
              (= node) number, which is turned into the node's name (slurm_output.py).
    down      scancel, then wait until squeue no longer lists the job.

Every SLURM program runs through one `SlurmCommands` object (slurm_commands.py), given to
`SlurmBackend` through its constructor; unit tests pass a fake that answers by program name.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING
from pathlib import Path

import hostlist

from ..errors import BackendError, InputError
from ..request import Request
from ..spec import Host, Inventory, SlurmSettings, expand_names
from ..plan import Job, Templates
from ..runs import RunDir
from ..sbatch import SbatchPlan, render_sbatch
from . import Backend, NodeProcess, NodeStatus, Record
from .slurm_commands import IDEMPOTENT, TRANSIENT, Completed, Retry, SlurmCommands
from .slurm_secrets import forget_secrets, secret_values, secrets_file, write_secrets
from .slurm_output import (JobInfo, JobProcess, Labeller, OutputReader, node_names,
                           remember_nodes, unsettled_requeue)

SCRIPT_NAME = "sbatch.sh"


# --- what SLURM says about a job -----------------------------------------------------------


def cli_settings(base: SlurmSettings, *, nodes: int | None = None, partition: str | None = None,
                 time: str | None = None, account: str | None = None,
                 max_requeues: int | None = None) -> SlurmSettings:
    """The inventory's `slurm:` settings with the command line's options on top."""
    if nodes is not None and nodes < 1:
        raise InputError("Invalid value for --nodes: must be at least 1")
    return dataclasses.replace(
        base, nodes=base.nodes if nodes is None else nodes,
        partition=base.partition if partition is None else partition,
        time=base.time if time is None else time,
        account=base.account if account is None else account,
        max_requeues=base.max_requeues if max_requeues is None else max_requeues)


def _exit(text: str) -> tuple[int | None, int | None]:
    """'1:0' -> (1, None); '0:15' -> (0, 15)."""
    code, _, sig = text.strip().partition(":")
    return (int(code) if code.isdigit() else None,
            int(sig) if sig.isdigit() and int(sig) else None)


def _scontrol_info(job_id: str, text: str) -> JobInfo:
    """`scontrol -o show job` -> JobInfo."""
    def field(key: str) -> str:
        m = re.search(rf"(?:^|\s){key}=(\S*)", text)
        return m.group(1) if m else ""
    code, sig = _exit(field("ExitCode"))
    reason, restarts = field("Reason"), field("Restarts")
    return JobInfo(job_id, field("JobState"), code, sig, node_names(field("NodeList")),
                   reason="" if reason == "None" else reason, source="scontrol",
                   restarts=int(restarts) if restarts.isdigit() else None)


class SlurmBackend:
    """`cluster status/logs/down` of a SLURM run, and the submit/follow steps of `up`."""
    name = "slurm"

    def __init__(self, commands: SlurmCommands | None = None, *, cwd: str | None = None,
                 poll: float = 1.0,
                 max_poll: float = 15.0, stop_timeout: float = 120.0,
                 sleep: Callable[[float], None] = time.sleep, retry: Retry = Retry(),
                 warn: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 forget_ended_secrets: bool = True) -> None:
        self.commands = commands or SlurmCommands()
        self.poll = poll                 # first interval between squeue calls while following
        self.max_poll = max_poll         # ... growing to this while nothing changes
        self.stop_timeout = stop_timeout
        self.sleep = sleep
        self.retry = retry
        self.warn = warn or (lambda text: None)
        self.clock = clock
        self.cwd = cwd or os.getcwd()        # where jobs are submitted from (their --chdir)
        # status() removes the secrets' file of a job it finds over for good (off for a look
        # that must change nothing: `cluster clean --dry-run`)
        self.forget_ended_secrets = forget_ended_secrets

    # -- the launch flow (cluster.launch): plan, start. Nothing to check before: SLURM
    # allocates the nodes (no NODE_CHECKS capability).

    def plan(self, inventory: Inventory, job: Job, templates: Templates,
             ifnames: Mapping[str, str] | None = None) -> SbatchPlan:
        return render_sbatch(inventory, job, templates, inventory.slurm, cwd=self.cwd)

    def start(self, plan: SbatchPlan, *, detach: bool = False,
              secrets: Mapping[str, Mapping[str, str]] | None = None,
              run: RunDir | None = None) -> list[NodeProcess]:
        """sbatch the recorded script (the output folder made first: SLURM will not make it).
        The secret values go in a private file the job reads (write_secrets), and are left out
        of sbatch's environment, which the controller would save with the job."""
        assert run is not None, "the launch flow records the plan before it starts it"
        Path(plan.output).parent.mkdir(parents=True, exist_ok=True)
        if plan.secrets_file:
            write_secrets(Path(plan.secrets_file), secret_values(plan.secret_env, secrets or {}))
        try:
            job_id = self.submit(run.script_path(plan.SCRIPT_NAME), hide=plan.secret_env)
        except BaseException:
            forget_secrets(plan.secrets_file)          # no job will read them
            raise
        return [JobProcess(self, job_id, Path(plan.output), plan.run_id)]

    def started(self, plan: SbatchPlan, procs: list[NodeProcess], run: RunDir) -> Record:
        job = _job(procs)
        slurm = dict(run.meta().get("slurm") or {})
        slurm.update(job_id=job.job_id, submitted=time.time(),
                     script=str(run.script_path("sbatch.sh").resolve()))
        return {"slurm": slurm}

    def ended(self, plan: SbatchPlan, procs: list[NodeProcess], result: object) -> Record:
        """The job's final state, and the nodes SLURM gave it (for `cluster logs --node`)."""
        job = _job(procs)
        if job.final is not None and job.final.done:
            self._forget_secrets(plan.secrets_file)
        out: Record = {"final": dataclasses.asdict(job.final)} if job.final else {}
        if job.nodes:
            out["nodes"] = [{"rank": i, "name": n, "address": n} for i, n in enumerate(job.nodes)]
        return out

    def start_note(self, procs: list[NodeProcess], plan: SbatchPlan) -> str:
        return (f"run {plan.run_id}: submitted job {_job(procs).job_id} ({plan.nodes} node(s)); "
                f"output {plan.output}")

    def _run(self, *argv: str) -> Completed:
        """One SLURM call; a query that meets a controller out of reach is asked again with
        backoff (Retry), so one slurmctld timeout never ends the following of a running job."""
        if argv[0] not in IDEMPOTENT:
            return self.commands.run(argv)
        delays = self.retry.delays()
        while True:
            try:
                result = self.commands.run(argv)
                problem = result.stderr if result.code != 0 and TRANSIENT.search(result.stderr) else ""
            except BackendError as exc:
                if not TRANSIENT.search(str(exc)):
                    raise
                result, problem = None, str(exc)
            if not problem:
                assert result is not None
                return result
            delay = next(delays, None)
            if delay is None:
                if result is not None:
                    return result
                raise BackendError(f"{argv[0]} kept failing for {self.retry.budget:.0f} s: {problem}")
            self.warn(f"{argv[0]} failed ({problem.strip()[:200]}); asking again in {delay:g} s")
            self.sleep(delay)

    # -- submit, query, cancel --

    def submit(self, script: Path, *, hide: Collection[str] = ()) -> str:
        """sbatch the script, the names in `hide` (the secrets) left out of its environment."""
        r = self.commands.run(("sbatch", "--parsable", str(script)), without=hide)
        if r.code != 0:
            said = (r.stderr.strip() or r.stdout.strip() or "(no output)")
            raise BackendError(f"sbatch refused the job script {script} (exit code {r.code}):\n{said}")
        job_id = r.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise BackendError(f"sbatch {script} printed no job id: {r.stdout.strip()!r}")
        return job_id

    def queued(self, job_id: str) -> JobInfo | None:
        """The job as squeue lists it; None once squeue no longer does."""
        r = self._run("squeue", "-h", "-j", job_id, "-o", "%i|%T|%N|%r")
        if r.code != 0:
            if "invalid job id" in r.stderr.lower():
                return None
            raise BackendError(f"squeue -j {job_id} failed (exit code {r.code}): {r.stderr.strip()}")
        for line in r.stdout.splitlines():
            fields = line.split("|")
            if len(fields) >= 4 and fields[0].strip() == job_id:
                reason = fields[3].strip()
                return JobInfo(job_id, fields[1].strip(), nodes=node_names(fields[2]),
                               reason="" if reason == "None" else reason, source="squeue")
        return None

    def finished(self, job_id: str) -> JobInfo:
        """The final state: accounting (sacct), else the job completion file (`sacct -c`, and
        the file itself when sacct -c leaves the state out, as SLURM 22.05 does), else the
        controller's memory (`scontrol show job`, kept for MinJobAge)."""
        for how in (self._sacct, self._sacct_completion, self._scontrol):
            info = how(job_id)
            if info is not None and info.state:
                return info
        return JobInfo(job_id, "UNKNOWN", source="none",
                       reason="neither sacct, sacct -c nor scontrol knows this job")

    def job(self, job_id: str) -> JobInfo:
        return self.queued(job_id) or self.finished(job_id)

    def _sacct(self, job_id: str) -> JobInfo | None:
        r = self._run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,NodeList")
        return self._sacct_row(job_id, r, "sacct") if r.code == 0 else None

    def _sacct_completion(self, job_id: str) -> JobInfo | None:
        r = self._run("sacct", "-c", "-j", job_id, "-n", "-P", "-o", "JobID,State,ExitCode,NodeList")
        info = self._sacct_row(job_id, r, "sacct -c") if r.code == 0 else None
        if info is not None and not info.state:
            state = self._jobcomp_state(job_id)
            if state:
                info = dataclasses.replace(info, state=state, source="sacct -c + jobcomp")
        return info

    @staticmethod
    def _sacct_row(job_id: str, r: Completed, source: str) -> JobInfo | None:
        found = None
        for line in r.stdout.splitlines():           # the last row: a requeued job has several
            fields = line.split("|")
            if len(fields) >= 4 and fields[0].strip() == job_id:
                code, sig = _exit(fields[2])
                state = fields[1].split()[0] if fields[1].split() else ""
                found = JobInfo(job_id, state, code, sig, node_names(fields[3]), source=source)
        return found

    def _jobcomp_state(self, job_id: str) -> str:
        """JobState= of the job's last line in the job completion file (JobCompLoc)."""
        r = self._run("scontrol", "show", "config")
        m = re.search(r"^JobCompLoc\s*=\s*(\S+)", r.stdout, re.M) if r.code == 0 else None
        if not m:
            return ""
        try:
            text = Path(m.group(1)).read_text(errors="replace")
        except OSError:
            return ""
        state = ""
        for line in text.splitlines():
            if re.match(rf"JobId={re.escape(job_id)}\s", line):
                found = re.search(r"\bJobState=(\S+)", line)
                state = found.group(1) if found else state
        return state

    def _scontrol(self, job_id: str) -> JobInfo | None:
        r = self._run("scontrol", "-o", "show", "job", job_id)
        return _scontrol_info(job_id, r.stdout) if r.code == 0 else None

    def controller(self, job_id: str) -> JobInfo | None:
        """The job as the controller knows it (`scontrol show job`, any state), or None."""
        return self._scontrol(job_id)

    def cancel(self, job_id: str) -> None:
        r = self._run("scancel", job_id)
        if r.code != 0 and "invalid job id" not in r.stderr.lower():
            raise BackendError(f"scancel {job_id} failed (exit code {r.code}): {r.stderr.strip()}")

    def wait_gone(self, job_id: str, timeout: float) -> JobInfo | None:
        """Poll squeue until it no longer lists the job; the last listing if it still does."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.queued(job_id)
            if info is None or time.monotonic() >= deadline:
                return info
            self.sleep(min(self.poll, 0.5))

    # -- the Backend protocol (recorded runs) --

    def status(self, run: RunDir) -> list[NodeStatus]:
        slurm = run.meta().get("slurm") or {}
        job_id = slurm.get("job_id")
        if not job_id:
            return [NodeStatus(0, "job", "not submitted", detail="dry run" if run.meta().get("dry_run") else "")]
        info = self.job(job_id)
        remember_nodes(run, info)
        if self.forget_ended_secrets and info.done and self.leftover_secrets(run, info) == "":
            self._forget_secrets(secrets_file(run))    # a detached job that ended unfollowed
        detail = f"job {job_id} {info.state} ({info.source})" + (f": {info.reason}" if info.reason else "")
        names = info.nodes or tuple(n["name"] for n in run.meta().get("nodes") or ())
        state = info.state.lower()
        if not names:
            return [NodeStatus(0, f"job {job_id}", state, info.exit_code, detail=detail)]
        return [NodeStatus(rank, name, state, info.exit_code, detail=detail)
                for rank, name in enumerate(names)]

    def logs(self, run: RunDir, *, node: str | None = None,
             follow: bool = False) -> Iterator[tuple[str, bytes]]:
        meta = run.meta()
        slurm = meta.get("slurm") or {}
        path, job_id = Path(slurm.get("output", "")), slurm.get("job_id")
        names = [n["name"] for n in meta.get("nodes") or ()]
        job = JobProcess(self, job_id, path, run.run_id, names) if follow and job_id else None
        if job is not None:
            lines = _followed(run, job)
        else:
            labeller = Labeller(names)
            lines = ((label, text + b"\n") for label, text in map(labeller.split, OutputReader(path).rest()))
        for label, text in lines:
            if node is None or label.split(" ")[0] == node:
                yield label, text
        if job is not None and job.final is not None and job.final.done:
            self._forget_secrets(secrets_file(run))        # followed to the job's end

    def leftover_secrets(self, run: RunDir, info: JobInfo | None = None) -> str | None:
        """Whether the run's secrets' folder is still on disk, and may go: None when it is not
        there; "" when its job is over for good; else why it must stay."""
        path = secrets_file(run)
        if not path or not Path(path).parent.exists():
            return None
        over, why = self.ended_for_good(run, info)
        return "" if over else why

    def ended_for_good(self, run: RunDir, info: JobInfo | None = None) -> tuple[bool, str]:
        """Whether the run's job will never run again, and what says so, by the rule
        `cluster up` follows a job with: squeue no longer lists it, it reads as final, the
        controller agrees (or has forgotten it: it ended at least MinJobAge ago), and no
        requeue the batch script announced is still to come. Between `scontrol requeue` and
        the next attempt a job may leave squeue and read as FAILED for a moment; a job SLURM
        requeues by itself (node failure, preemption) stays known to the controller as
        REQUEUED or PENDING."""
        slurm = run.meta().get("slurm") or {}
        job_id = slurm.get("job_id")
        if not job_id:
            return False, "no job id recorded (a launch may be submitting it)"
        info = info or self.job(job_id)
        said = f"{info.describe()} ({info.source})"
        if info.source == "squeue" or not info.done:
            return False, said
        r = self._run("scontrol", "-o", "show", "job", job_id)
        if r.code != 0:
            if "invalid job id" in r.stderr.lower():
                return True, said
            return False, f"{said}; scontrol show job {job_id} failed: {r.stderr.strip()[:200]}"
        known = _scontrol_info(job_id, r.stdout)
        if not known.done:
            return False, f"{said}, but the controller knows it as {known.state or 'unknown'}"
        announced = unsettled_requeue(Path(slurm.get("output", "")))
        if announced and (known.restarts is None or known.restarts < announced):
            return False, (f"{said}, but its output announces a requeue (restart {announced}) "
                           f"that has not run yet")
        return True, said

    def forget_run_secrets(self, run: RunDir) -> str:
        """Remove the run's secrets' file and folder; what went wrong, or ""."""
        return forget_secrets(secrets_file(run))

    def _forget_secrets(self, path: str) -> None:
        problem = forget_secrets(path)
        if problem:
            self.warn(problem)

    def stop_run(self, run: RunDir) -> dict[str, Record]:
        job_id = (run.meta().get("slurm") or {}).get("job_id")
        if not job_id:
            return {"job": {"signalled": [], "error": "the run was never submitted"}}
        label = f"job {job_id}"
        before = self.queued(job_id)
        if before is None:
            final = self.finished(job_id)
            if final.done:                 # ended, perhaps detached and failed: its file may stay
                self._forget_secrets(secrets_file(run))
            return {label: {"signalled": [], "state": final.state}}
        self.cancel(job_id)
        left = self.wait_gone(job_id, self.stop_timeout)
        if left is not None:
            return {label: {"signalled": [job_id],
                            "error": f"still listed by squeue as {left.state} after "
                                     f"{self.stop_timeout:.0f} s"}}
        self._forget_secrets(secrets_file(run))
        return {label: {"signalled": [job_id], "state": self.finished(job_id).state}}

    def pull(self, run: RunDir, paths: Sequence[str], into: Path,
             node: str | None = None) -> Record:
        """`cluster pull` has nothing to copy: the job ran in its submit directory (--chdir),
        which the nodes reach as this machine does."""
        cwd = run.meta().get("cwd") or "its submit directory"
        raise InputError(f"run {run.run_id} ran under SLURM in {cwd} (the job's --chdir), which "
                         f"its nodes share with this machine: what they wrote there is already "
                         f"here (e.g. {cwd}/{paths[0] if paths else 'PATH'}). A file a node "
                         f"kept on its own disk is reachable only from a job step (srun, sgather)")

    def close(self) -> None:
        """Nothing held: every command is one subprocess."""


def _followed(run: RunDir, job: JobProcess) -> Iterator[tuple[str, bytes]]:
    """The job's lines as `cluster up` follows them (through a requeue), until it ends."""
    for item in job.output():
        if not isinstance(item, dict):
            yield item
        elif item.get("nodes"):
            remember_nodes(run, JobInfo(job.job_id, "", nodes=tuple(item["nodes"])))


def _job(procs: list[NodeProcess]) -> JobProcess:
    """The one job a SLURM start returns."""
    (job,) = procs
    if not isinstance(job, JobProcess):
        raise TypeError(f"not a SLURM job: {job!r}")
    return job


# --- the module's hooks (backends.BackendModule) -----------------------------------------------


def nodes(inventory: Inventory | None, request: Request) -> Inventory:
    """Which nodes SLURM may use. Hosts the inventory lists (narrowed by --hosts, --exclude and
    --nodes, as over SSH) become --nodelist; with none listed SLURM chooses, --hosts becomes
    --nodelist, --exclude --exclude and --nodes the count."""
    if inventory is None:
        inventory = Inventory(hosts=(Host(name="slurm", address="slurm"),), backend="slurm",
                              hosts_given=False)
    count, hosts, exclude = request.nodes, request.host_filter, request.exclude
    slurm = inventory.slurm
    if inventory.hosts_given:
        chosen = inventory.select(nodes=count, hosts=hosts, exclude=exclude)
        names = [h.name for h in chosen.hosts]
        slurm = dataclasses.replace(slurm, nodelist=hostlist.collect_hostlist(names),
                                    nodes=len(names))
        return dataclasses.replace(chosen, slurm=slurm)
    if hosts:
        names = expand_names(hosts, "--hosts")
        slurm = dataclasses.replace(slurm, nodelist=hostlist.collect_hostlist(names),
                                    nodes=max(len(names), count or slurm.nodes or 1))
    if exclude:
        slurm = dataclasses.replace(slurm, exclude=hostlist.collect_hostlist(
            expand_names(exclude, "--exclude")))
    return dataclasses.replace(inventory, slurm=slurm)


def configure(inventory: Inventory, request: Request) -> Inventory:
    """The request's SLURM options over the inventory's; --max-restarts too, which the batch
    script spends on failure requeues (the REQUEUES capability: the launcher restarts nothing)."""
    r = request
    count = None if inventory.slurm.nodelist else r.nodes      # a nodelist fixed the count
    settings = cli_settings(inventory.slurm, nodes=count, partition=r.partition,
                            time=r.time_limit, account=r.account, max_requeues=r.max_requeues)
    restarts = inventory.restarts if r.max_restarts is None else r.max_restarts
    return dataclasses.replace(inventory, slurm=settings, restarts=restarts)


def create(inventory: Inventory, request: Request,
           sync: Sequence[tuple[str, str]] = ()) -> SlurmBackend:
    return SlurmBackend(cwd=os.getcwd(), warn=_stderr_warn)


def recorded(run: RunDir) -> SlurmBackend:
    return SlurmBackend(warn=_stderr_warn)


def _stderr_warn(text: str) -> None:
    sys.stderr.write(f"cluster: {text}\n")
    sys.stderr.flush()


if TYPE_CHECKING:       # mypy holds this module and its classes to the contract
    from . import BackendModule, slurm as _module
    _hooks: BackendModule = _module
    _backend: Backend[SbatchPlan] = SlurmBackend()
    _job_process: NodeProcess = JobProcess(SlurmBackend(), "", Path(), "")
