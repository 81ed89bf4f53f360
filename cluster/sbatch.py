"""render_sbatch(inventory, job, settings) -> SbatchPlan: pure. The SLURM batch script of a run.

One srun task per node, torchrun on each starting one worker per GPU (the torchrun consensus:
torchx, accelerate, torchtitan). `#SBATCH` lines are sorted and every value is shell-quoted, so
the same inputs always give the same text (golden files in tests/unit/golden/sbatch/).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import network
from .errors import InputError
from .spec import DEFAULT_STOP_GRACE, Inventory, SlurmSettings
from .texts import control_char
from .plan import Job, Recording, Templates, derived_port
from .errors import STOP_CODE

TEMPLATE = "sbatch.sh.j2"
# STOP_CODE (cluster.errors): torchrun exits 1 whatever its worker's code, so the batch script
# reads torchrun's report of it.


@dataclass(frozen=True)
class SbatchPlan:
    """Everything `cluster up --backend slurm` submits; str() is the exact script."""
    run_id: str
    script: str                               # the batch script text
    options: tuple[str, ...]                  # the #SBATCH options, sorted, values quoted
    output: str                               # the job's combined output file (absolute)
    workdir: str                              # the job's working directory (the submit dir)
    nodes: int
    nproc: int | str                          # per node; "auto": detected in the step
    master_port: int
    python: str
    command: tuple[str, ...]                  # script and its arguments
    env: tuple[tuple[str, str], ...]          # what cluster decided, then the user's own
    secret_env: tuple[str, ...] = ()          # names only: their values travel in secrets_file
    secrets_file: str = ""                    # where the launcher leaves them for the job
    stop_grace: float = DEFAULT_STOP_GRACE

    SCRIPT_NAME = "sbatch.sh"

    def __str__(self) -> str:
        return self.script

    @property
    def logs_hint(self) -> str:
        return self.output

    @property
    def node_names(self) -> list[str]:
        return []                             # SLURM names the nodes once the job starts

    @property
    def log_names(self) -> dict[str, str]:
        return {}                             # the job's output file is its log

    @property
    def node_count(self) -> int:
        return self.nodes

    def dry_run_note(self, run_path: Path) -> str:
        return f"batch script in {run_path}/scripts/{self.SCRIPT_NAME}; nothing was submitted"

    def recording(self) -> Recording:
        return Recording(
            scripts={self.SCRIPT_NAME: self.script}, env={"slurm": dict(self.env)},
            meta={"cwd": self.workdir, "master_port": self.master_port, "script": self.command[0],
                  "args": list(self.command[1:]), "nodes": [], "secret_env": list(self.secret_env),
                  "stop_grace": self.stop_grace,
                  "slurm": {"output": self.output, "nodes": self.nodes,
                            "nproc_per_node": self.nproc, "options": list(self.options),
                            **({"secrets_file": self.secrets_file} if self.secrets_file else {})}})


SBATCH_BARE = re.compile(r"^[A-Za-z0-9_.,:@%+=/\[\]-]+\Z")
# sbatch reads these words anywhere in a #SBATCH line as the separator of a heterogeneous job.
SBATCH_SEPARATORS = ("packjob", "hetjob")


def sbatch_quote(value: object) -> str:
    """A value as sbatch's own #SBATCH parser reads it back unchanged. That parser is not a
    shell: a backslash escapes the next character even inside quotes, and '#' outside quotes
    starts a comment. Double quotes with backslash-escaped '\\' and '"' survive it."""
    text = str(value)
    if SBATCH_BARE.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_sbatch_value(key: str, value: object) -> None:
    text = str(value)
    bad = control_char(text)
    if bad:
        raise InputError(f"Invalid value for slurm.{key}: control character {bad}")
    lowered = text.lower()
    for word in SBATCH_SEPARATORS:
        if word in lowered:
            raise InputError(f"Invalid value for slurm.{key}: {text!r} contains {word!r}, which "
                             f"sbatch reads in a #SBATCH line as a heterogeneous-job separator")


def signal_parts(signal: str) -> tuple[str, str]:
    """'USR2@90' or 'B:USR2@90' -> ('USR2', 'B:USR2@90'): the name bash traps, and the
    --signal value, always sent to the batch shell (B:) which forwards it to the step."""
    bare = signal.removeprefix("B:")
    name = bare.split("@", 1)[0].removeprefix("SIG")
    if not name or name in ("USR1", "10"):
        raise InputError(f"Invalid SLURM signal {signal!r}: USR1 is used by NCCL; pick another (e.g. USR2@90)")
    return name, f"B:{bare}"


def render_sbatch(inventory: Inventory, job: Job, templates: Templates, settings: SlurmSettings,
                  *, cwd: str) -> SbatchPlan:
    host = inventory.master                   # under SLURM: the placeholder holding the defaults
    nodes = settings.nodes or 1
    nproc: int | str = host.nproc_per_node
    if nproc == "auto":
        nproc = settings.gpus_per_node or host.gpus or "auto"
    port = job.master_port or host.master_port or derived_port(job.run_id)
    signal, signal_option = signal_parts(settings.signal)
    output = _output_path(settings.output_dir, cwd, job.run_id)
    secrets = secrets_path(output, job.run_id) if inventory.master.secret_env else ""
    job_name = settings.job_name or f"cluster-{job.run_id}"

    opts: dict[str, object] = {
        "chdir": cwd, "job-name": job_name, "nodes": nodes, "ntasks-per-node": 1,
        "output": output.replace("%", "%%"), "open-mode": "append", "signal": signal_option,
    }
    restarts = inventory.restarts          # failure requeues (--max-restarts)
    if settings.max_requeues > 0 or restarts > 0:
        opts["requeue"] = None
    else:
        opts["no-requeue"] = None
    if settings.gpus_per_node:
        if settings.gpu_style == "gres":
            opts["gres"] = f"gpu:{settings.gpus_per_node}"
        else:
            opts["gpus-per-node"] = settings.gpus_per_node
    for key, value in (("cpus-per-task", settings.cpus_per_task), ("time", settings.time),
                       ("partition", settings.partition), ("account", settings.account),
                       ("constraint", settings.constraint), ("nodelist", settings.nodelist),
                       ("exclude", settings.exclude)):
        if value is not None:
            opts[key] = value
    for key, value in settings.extra:   # validated at load; --nodelist may come twice
        if key in opts:
            by = "--hosts/--exclude or the inventory's hosts" if key in ("nodelist", "exclude") \
                else "a slurm setting"
            raise InputError(f"Invalid value for slurm.extra.{key}: --{key} is also set by {by}; "
                             "keep one")
        opts[key] = value
    for key, given in opts.items():
        if given is not None:
            check_sbatch_value(key, given)
    options = tuple(sorted(f"--{k}" if v is None else f"--{k}={sbatch_quote(v)}"
                           for k, v in opts.items()))

    net = network.policy(host)
    user_env = {**dict(host.env), **dict.fromkeys(host.secret_env, "")}
    container = host.container
    python = container.python if container else host.python
    if container and re.search(r"[:,]", cwd):
        raise InputError(f"the job's working directory {cwd!r} holds ':' or ',' and cannot be "
                         f"mounted into the container (pyxis splits --container-mounts on them)")
    text = templates.render(
        TEMPLATE, run_id=job.run_id, nodes=nodes, options=options,
        cpus_per_task=settings.cpus_per_task is not None, master_port=port, net=net,
        env=host.env, secret_env=host.secret_env, user_sets=user_env.__contains__, nproc=nproc,
        python=python, setup=host.setup, torchrun_args=host.torchrun_args,
        script=job.script, args=job.args, signal=signal,
        signal_option=signal_option, max_requeues=settings.max_requeues, container=container,
        restarts=restarts, stop_code=STOP_CODE, output=output,
        cwd=cwd, pyxis_image=pyxis_image(container.image) if container else None,
        secrets_file=secrets)

    decided = [("CLUSTER_RUN_ID", job.run_id), ("MASTER_PORT", str(port))]
    decided += network.decided_env(net)
    if "PYTHONUNBUFFERED" not in user_env:
        decided.append(("PYTHONUNBUFFERED", "1"))
    return SbatchPlan(run_id=job.run_id, script=text, options=options, output=output,
                      workdir=cwd, nodes=nodes, nproc=nproc, master_port=port,
                      python=python, command=(job.script, *job.args),
                      env=tuple(decided) + host.env, secret_env=host.secret_env,
                      secrets_file=secrets, stop_grace=inventory.stop_grace)


def pyxis_image(image: str) -> str:
    """An image as pyxis (enroot) takes it: a registry is separated by '#', not '/'
    (nvcr.io/nvidia/pytorch:24.05-py3 -> nvcr.io#nvidia/pytorch:24.05-py3), since enroot reads
    a first component as a Docker Hub user. A squashfs file (a path) and a reference already
    in enroot's form stay as they are. Docker's rule for a registry: the first component has a
    '.' or a ':', or is localhost."""
    if image.startswith(("/", ".")) or "#" in image or "/" not in image:
        return image
    first, rest = image.split("/", 1)
    if "." in first or ":" in first or first == "localhost":
        return f"{first}#{rest}"
    return image


def secrets_path(output: str, run_id: str) -> str:
    """Where the launcher leaves the run's secret values for its job: a private folder beside
    the job's output file, which the batch shell's node reaches (SLURM writes the output there
    from it). Never the job's environment: sbatch sends that to the controller, which saves it
    in its state folder."""
    return str(Path(output).parent / f".{run_id}.secrets" / "env")


def _output_path(output_dir: str, cwd: str, run_id: str) -> str:
    """One combined stdout+stderr file per run, appended to across requeues."""
    base = Path(output_dir).expanduser()
    if not base.is_absolute():
        base = Path(cwd) / base
    return str(base / f"{run_id}.out")
