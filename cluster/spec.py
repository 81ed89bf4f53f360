"""The backend-free model: hosts, settings and the inventory, typed and validated.

cluster.inventory builds these from files (and checks them there, once); everything downstream
takes them as they are.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import hostlist
import yaml

from .errors import InputError

HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_-]{1,63})*$")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Set by cluster itself on every node: the identity that stopping relies on, and the rendezvous.
RESERVED_ENV_PREFIX = "CLUSTER_"
RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT"})

DEFAULT_STOP_GRACE = 30.0     # SIGTERM to SIGKILL: time for a trainer to save a checkpoint
DEFAULT_KEEPALIVE = 60.0      # silence after which a node, or the launcher, counts as lost


def control_char(value: str) -> str | None:
    """A description of the first control character in value ('\\n at position 4'), or None.
    No field that reaches a script may hold one: a newline ends a line of that script."""
    m = CONTROL.search(value)
    if m is None:
        return None
    return f"{m.group()!r} at position {m.start()}"


def setup_block(lines: tuple[str, ...] | list[str], *, to_stderr: bool = False) -> str:
    """A host's setup lines as shell text, each run in the current shell (so `source` and
    `module load` change what follows) with nothing on its input, and stopped with the line's
    number and text when one fails. `set +u` first: module and conda scripts read variables
    that may be unset."""
    out = ["set +u"]
    redirect = " </dev/null >&2" if to_stderr else " </dev/null"
    for number, line in enumerate(lines, 1):
        out.append("{ " + line)
        out.append(f"}}{redirect} || {{ rc=$?; printf 'cluster: setup line %s failed (exit %s): %s\\n' "
                   f"{number} \"$rc\" {shlex.quote(line)} >&2; exit 2; }}")
    return "\n".join(out)


def reserved_env(name: str) -> str | None:
    """Why an environment name may not be set by the user, or None."""
    if name.startswith(RESERVED_ENV_PREFIX):
        return (f"{name} is set by cluster itself (names starting with {RESERVED_ENV_PREFIX} are "
                f"reserved: they carry the run's identity; choose another name)")
    if name == "MASTER_ADDR":
        return (f"{name} is set by cluster itself, from the rendezvous: the address of the node "
                f"torch numbers 0 (to choose that node, list it first in the inventory with "
                f"`rendezvous: static`; under c10d it is the host whose address sorts first)")
    if name in RESERVED_ENV:
        return (f"{name} is set by cluster itself, from the rendezvous (choose the rendezvous "
                f"port with master_port / --master-port)")
    return None


def check_text(value: str, what: str) -> str:
    """Raise InputError for a control character in a field that reaches a script."""
    bad = control_char(value)
    if bad:
        raise InputError(f"Invalid value for {what}: control character {bad} "
                         f"(fields that reach a script may not hold them)")
    return value


@dataclass(frozen=True)
class Network:
    ifname: str | None = None     # None: chosen on the node at start (the one holding its address)
    ib: str = "auto"              # auto | on | off


CONTAINER_RUNTIMES = ("docker", "podman")


@dataclass(frozen=True)
class Mount:
    """A bind mount into the container: `source` on the node (may start with ~), `target`
    inside, `flags` as docker and podman write them (comma-separated: ro, rw, z, ...)."""
    source: str
    target: str
    flags: str = ""

    def __str__(self) -> str:
        return f"{self.source}:{self.target}" + (f":{self.flags}" if self.flags else "")


@dataclass(frozen=True)
class Container:
    """Run torchrun inside an image on the node (inventory key `container`)."""
    image: str
    runtime: str = "docker"           # docker | podman (SLURM uses pyxis whatever this says)
    python: str = "python3"           # the interpreter inside the image whose torchrun runs
    mounts: tuple[Mount, ...] = ()
    options: tuple[str, ...] = ()     # more `RUNTIME run` arguments, each one word


def container_name(run_id: str, node: str, attempt: int = 0) -> str:
    """The container's name on the node: the run and the node, so that stopping finds it by
    identity (never by pattern). Docker and podman accept [a-zA-Z0-9][a-zA-Z0-9_.-]*."""
    raw = f"cluster-{run_id}-{node}" + (f"-a{attempt}" if attempt else "")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    user: str | None = None
    port: int | None = None       # None: ~/.ssh/config or 22
    identity_file: str | None = None
    workdir: str = "~/cluster-runs"
    python: str = "python3"
    nproc_per_node: int | str = "auto"
    master_port: int | None = None  # None: derived from the run id
    rendezvous: str = "c10d"
    network: Network = Network()
    env: tuple[tuple[str, str], ...] = ()
    secret_env: tuple[str, ...] = ()  # names only: values come from the launching shell
    env_forward: tuple[str, ...] = ()  # names or globs copied from the launching shell at up
    setup: tuple[str, ...] = ()       # shell lines run on the node before torchrun, as written
    torchrun_args: tuple[str, ...] = ()  # options cluster does not model, passed to torchrun
    gpus: int | None = None
    container: Container | None = None   # None: torchrun runs on the node itself
    line: int | None = None       # where it was defined, for later messages

    def replace(self, **changes: Any) -> "Host":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SshSettings:
    host_key_policy: str = "strict"
    connect_timeout: float = 10.0
    config: str | None = "~/.ssh/config"
    keepalive: float = DEFAULT_KEEPALIVE


@dataclass(frozen=True)
class SlurmSettings:
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    gpu_style: str = "gpus"        # gpus: --gpus-per-node; gres: --gres=gpu:N (older clusters)
    signal: str = "USR2@90"
    max_requeues: int = 3
    output_dir: str = "slurm-logs"
    job_name: str | None = None
    constraint: str | None = None
    nodelist: str | None = None    # hostlist of the nodes to run on (--hosts, or the inventory's)
    exclude: str | None = None     # hostlist of nodes never to use (--exclude)
    extra: tuple[tuple[str, str | None], ...] = ()   # any other #SBATCH option (None: a flag)


@dataclass(frozen=True)
class Inventory:
    hosts: tuple[Host, ...]
    source: str | None = None
    backend: str = "ssh"
    ssh: SshSettings = SshSettings()
    slurm: SlurmSettings = SlurmSettings()
    stop_grace: float = DEFAULT_STOP_GRACE
    restarts: int = 0              # whole-job restarts after a failure (--max-restarts)
    hang_timeout: float = 0.0      # no progress this long: stacks, then stop (0: off)
    text: str = ""                 # the file as read, recorded in the run directory
    hosts_given: bool = True       # False: SLURM chooses the nodes (one placeholder host)
    # NCCL settings `cluster up` took from `cluster doctor --tune-nccl`'s cache (cluster.tuning)
    tuning: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def master(self) -> Host:
        return self.hosts[0]

    def select(self, *, nodes: int | None = None, hosts: str | None = None,
               exclude: str | None = None) -> "Inventory":
        """Narrow to --hosts (names or hostlists), minus --exclude, then the first --nodes."""
        chosen = list(self.hosts)
        by_name = {h.name: h for h in self.hosts}
        if hosts:
            names = expand_names(hosts, "--hosts")
            unknown = [n for n in names if n not in by_name]
            if unknown:
                raise InputError(f"Invalid value for --hosts: {', '.join(unknown)} not in "
                                 f"{self.source or 'the inventory'} (hosts: {', '.join(by_name)})")
            chosen = [by_name[n] for n in names]
        if exclude:
            drop = set(expand_names(exclude, "--exclude"))
            absent = drop - set(by_name)
            if absent:
                raise InputError(f"Invalid value for --exclude: {', '.join(sorted(absent))} "
                                 f"not in {self.source or 'the inventory'}")
            chosen = [h for h in chosen if h.name not in drop]
        if nodes is not None:
            if nodes < 1:
                raise InputError("Invalid value for --nodes: must be at least 1")
            if nodes > len(chosen):
                raise InputError(f"Invalid value for --nodes: {nodes} requested but only "
                                 f"{len(chosen)} host(s) selected from {self.source or 'the inventory'}")
            chosen = chosen[:nodes]
        if not chosen:
            raise InputError("no hosts left to run on after --hosts/--exclude")
        return dataclasses.replace(self, hosts=tuple(chosen))


def expand_names(expr: str, what: str) -> list[str]:
    """'gpu[01-02],cpu1' -> ['gpu01', 'gpu02', 'cpu1'] (SLURM hostlist syntax)."""
    try:
        names = hostlist.expand_hostlist(expr.strip())
    except hostlist.BadHostlist as exc:
        raise InputError(f"Invalid value for {what}: {expr!r} is not a host list ({exc})") from None
    for n in names:
        if not HOSTNAME.match(n):
            raise InputError(f"Invalid value for {what}: {n!r} is not a valid host name")
    return names




def dump(inv: Inventory) -> str:
    """The inventory as loaded (every default applied), as YAML, for the run directory."""
    def host(h: Host) -> dict[str, Any]:
        d = dataclasses.asdict(h)
        d["env"] = dict(h.env)
        for key in ("secret_env", "env_forward", "setup", "torchrun_args"):
            d[key] = list(getattr(h, key))
        d["container"] = container_dict(h.container)
        d.pop("line")
        return d
    data = {"source": inv.source, "backend": inv.backend, "stop_grace": inv.stop_grace,
            "restarts": inv.restarts, "hang_timeout": inv.hang_timeout,
            "ssh": dataclasses.asdict(inv.ssh),
            "slurm": {**dataclasses.asdict(inv.slurm), "extra": dict(inv.slurm.extra)},
            "hosts": [host(h) for h in inv.hosts]}
    return yaml.safe_dump(data, sort_keys=False)


def container_dict(container: Container | None) -> dict[str, Any] | None:
    """A container as plain YAML values (mounts as the strings the inventory takes)."""
    if container is None:
        return None
    return {"runtime": container.runtime, "image": container.image, "python": container.python,
            "mounts": [str(m) for m in container.mounts], "options": list(container.options)}


def container_from_dict(d: Mapping[str, Any] | None) -> Container | None:
    if not d:
        return None
    mounts = tuple(Mount(*m.split(":", 2)) for m in d.get("mounts") or ())
    return Container(image=d["image"], runtime=d.get("runtime", "docker"),
                     python=d.get("python", "python3"), mounts=mounts,
                     options=tuple(d.get("options") or ()))


def host_from_dict(d: Mapping[str, Any]) -> Host:
    """Inverse of dump() for one host: read back from a run directory."""
    d = dict(d)
    d["network"] = Network(**d.get("network") or {})
    d["env"] = tuple((d.get("env") or {}).items())
    for key in ("secret_env", "env_forward", "setup", "torchrun_args"):
        d[key] = tuple(d.get(key) or ())
    d["container"] = container_from_dict(d.get("container"))
    return Host(**d)


def ssh_from_dict(d: Mapping[str, Any]) -> SshSettings:
    return SshSettings(**d)


def slurm_from_dict(d: Mapping[str, Any]) -> SlurmSettings:
    d = dict(d)
    d["extra"] = tuple((d.get("extra") or {}).items())
    return SlurmSettings(**d)


