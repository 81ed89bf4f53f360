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
from typing import Any, ClassVar

import hostlist
import yaml

from .errors import InputError
from .texts import HOSTNAME, redacted_url


DEFAULT_STOP_GRACE = 30.0     # SIGTERM to SIGKILL: time for a trainer to save a checkpoint
DEFAULT_KEEPALIVE = 60.0      # silence after which a node, or the launcher, counts as lost


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


# --- inventory keys --------------------------------------------------------------------------
# Each key of an inventory file is declared once, on its field below, with key(): its default,
# one line of help, the check that reads it (a reader of cluster.inventory.checks, with its
# arguments), how a host's value meets the defaults' and where it may be written. The parser
# walks these declarations, and `python -m cluster.inventory.keys` writes the key table of
# docs/inventory.md from them. A field without key() is not an inventory key.

REPLACE = "replaces"         # a host's value replaces the defaults'
MERGE = "merges"             # a host's names over the defaults' (env)
ADD = "adds"                 # a host's names added to the defaults' (secret_env, env_forward)
KEY_BY_KEY = "key by key"    # a section: each key a host gives over the defaults' one

EVERYWHERE = "defaults, host"   # host settings: under defaults or on one host
JOB_WIDE = "defaults"           # the same for every node of a job (one rendezvous)
HOST_ONLY = "host"              # what names one host


@dataclass(frozen=True)
class Key:
    """One inventory key as its field declares it (see key())."""
    help: str
    check: str | None                 # the parser's reader; None: read by the file's structure
    args: tuple[Any, ...] = ()        # the reader's arguments
    merge: str = REPLACE
    scope: str = EVERYWHERE
    example: str = ""                 # the hint when a section lacks this required key
    kind: str = ""                    # for the key table; empty: the reader says
    shown: str = ""                   # the table's default where the field has none


def key(default: Any, help: str, check: str | None, *args: Any, merge: str = REPLACE,
        scope: str = EVERYWHERE, example: str = "", kind: str = "", shown: str = "") -> Any:
    """A dataclass field that is an inventory key (default dataclasses.MISSING: required)."""
    meta = {"key": Key(help, check, args, merge, scope, example, kind, shown)}
    return field(default=default, metadata=meta)


def keys_of(cls: type) -> dict[str, Key]:
    """The inventory keys a model class declares, in declaration order."""
    return {f.name: f.metadata["key"] for f in dataclasses.fields(cls) if "key" in f.metadata}


IFNAME = re.compile(r"^[=^]?[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*\Z")
# An image reference as docker and podman take it (registry/path:tag@digest), or pyxis's
# forms (registry#path, a squashfs file): never a word the runtime would read as an option.
IMAGE = re.compile(r"^[A-Za-z0-9/.][A-Za-z0-9._/:@#+-]*\Z")
BACKENDS = ("ssh", "slurm", "local")        # the registry's names (cluster.backends; a test holds them equal)
ALLOCATING = ("slurm",)                     # those with backends.ALLOCATES: an inventory needs no hosts
HOST_KEY_POLICIES = ("strict", "accept-new", "off")


@dataclass(frozen=True)
class Network:
    ifname: str | None = key(
        None, "interface for NCCL and Gloo (a plain name sets both; an NCCL list such as "
        "^docker0,lo goes to NCCL only); omitted: the one holding the node's address",
        "matching", IFNAME, "an interface name or NCCL list", "e.g. eth0, ib0, ^docker0,lo")
    ib: str = key("auto", "InfiniBand for NCCL: on, off, or auto (on when "
                  "/sys/class/infiniband has devices)", "switch", kind="auto, on or off")


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
    image: str = key(dataclasses.MISSING, "the image; it must be on every node before "
                     "cluster up", "matching", IMAGE, "an image reference",
                     "e.g. nvcr.io/nvidia/pytorch:24.05-py3",
                     example="e.g. container: {runtime: docker, image: "
                     "nvcr.io/nvidia/pytorch:24.05-py3}")
    runtime: str = key("docker", "the container runtime on the node (under SLURM, pyxis "
                       "whatever this says)", "choice", CONTAINER_RUNTIMES)
    python: str = key("python3", "the interpreter inside the image whose torchrun runs",
                      "string")
    mounts: tuple[Mount, ...] = key((), "more bind mounts, SRC:DST[:FLAGS] (the workdir is "
                                    "always mounted)", "mounts",
                                    kind="list of SRC:DST[:FLAGS]")
    options: tuple[str, ...] = key((), "more RUNTIME run arguments, one word each, after "
                                   "cluster's own (not the ones cluster sets itself)",
                                   "run_options", kind="list of strings")


def container_name(run_id: str, node: str, attempt: int = 0) -> str:
    """The container's name on the node: the run and the node, so that stopping finds it by
    identity (never by pattern). Docker and podman accept [a-zA-Z0-9][a-zA-Z0-9_.-]*."""
    raw = f"cluster-{run_id}-{node}" + (f"-a{attempt}" if attempt else "")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)


@dataclass(frozen=True)
class Host:
    name: str = key(dataclasses.MISSING, "host name; a hostlist (gpu[01-04]) makes several "
                    "hosts", None, scope=HOST_ONLY, kind="string or hostlist")
    address: str = key(dataclasses.MISSING, "how the launcher and the other nodes reach it "
                       "(default: the name)", None, scope=HOST_ONLY, kind="IP address or name",
                       shown="the name")
    user: str | None = key(None, "SSH login name (unset: ~/.ssh/config, then yours)", "string")
    port: int | None = key(None, "SSH port (unset: ~/.ssh/config or 22)", "port")
    identity_file: str | None = key(None, "SSH private key file (unset: the agent's keys and "
                                    "~/.ssh/config's)", "string")
    workdir: str = key("~/cluster-runs", "the node's working directory: scripts run there, "
                       "--sync copies there", "string")
    python: str = key("python3", "the interpreter whose torchrun runs (auto: the python3 that "
                      "setup leaves on PATH)", "string")
    nproc_per_node: int | str = key("auto", "processes per node (auto: gpus, else the GPUs "
                                    "nvidia-smi sees, else 1)", "nproc")
    master_port: int | None = key(None, "the rendezvous port on the first host (unset: derived "
                                  "from the run id)", "port", scope=JOB_WIDE)
    rendezvous: str = key("static", "static (ranks in inventory order, set by cluster, which "
                          "knows every node) or c10d (torch's dynamic rendezvous: ranks by "
                          "address, about a second more to start)", "choice", ("static", "c10d"),
                          scope=JOB_WIDE)
    network: Network = key(Network(), "the network NCCL and Gloo use (ifname, ib)", "section",
                           Network, merge=KEY_BY_KEY)
    env: tuple[tuple[str, str], ...] = key(
        (), "environment for the training processes, written shell-quoted", "env", merge=MERGE,
        kind="mapping of strings")
    secret_env: tuple[str, ...] = key(
        (), "names whose values come from the launching shell and never touch a disk (under "
            "SLURM: one private file the job reads, then removed; docs/slurm.md)",
        "secret_names", merge=ADD, kind="list of names")
    env_forward: tuple[str, ...] = key(
        (), "names and globs whose values are copied from the launching shell at cluster up",
        "forward_names", merge=ADD, kind="list of names or globs")
    setup: tuple[str, ...] = key(
        (), "shell lines run on the node before torchrun, in order (checked with bash -n)",
        "setup", kind="list of strings")
    torchrun_args: tuple[str, ...] = key(
        (), "torchrun options cluster does not model, after its own (not the ones it sets)",
        "torchrun_args", kind="list of strings")
    gpus: int | None = key(None, "GPUs on the host (what a hostfile's slots= sets)",
                           "integer", 0)
    spare: bool = key(False, "this host waits as a spare: it runs only in the place of a node "
                      "set aside, after every other host", "boolean", scope=HOST_ONLY,
                      kind="true or false")
    container: Container | None = key(None, "run torchrun in an image on the node (runtime, "
                                      "image, python, mounts, options)", "section", Container,
                                      merge=KEY_BY_KEY)
    notify: tuple[str, ...] = key(
        (), "URLs each of the run's alerts is POSTed to as JSON (Slack's webhooks get a "
            "message; docs/alerts.md; --notify adds more)", "urls", scope=JOB_WIDE,
        kind="list of http(s) URLs")
    line: int | None = None       # where it was defined, for later messages

    def replace(self, **changes: Any) -> "Host":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SshSettings:
    host_key_policy: str = key("strict", "known_hosts: strict (must match), accept-new (records "
                               "unknown keys) or off (warns)", "choice", HOST_KEY_POLICIES)
    connect_timeout: float = key(10.0, "seconds to wait for a connection", "seconds")
    config: str | None = key("~/.ssh/config", "the OpenSSH client configuration read for "
                             "hosts", "string")
    keepalive: float = key(DEFAULT_KEEPALIVE, "seconds of silence after which a node, or the "
                           "launcher, counts as lost (--keepalive)", "seconds")


@dataclass(frozen=True)
class SlurmSettings:
    partition: str | None = key(None, "#SBATCH --partition", "string")
    account: str | None = key(None, "#SBATCH --account", "string")
    time: str | None = key(None, "#SBATCH --time, the job's time limit", "string")
    nodes: int | None = key(None, "#SBATCH --nodes when the inventory lists no hosts", "integer", 1)
    gpus_per_node: int | None = key(None, "GPUs per node, as gpu_style writes it", "integer", 1)
    cpus_per_task: int | None = key(None, "#SBATCH --cpus-per-task", "integer", 1)
    gpu_style: str = key("gpus", "gpus: --gpus-per-node; gres: --gres=gpu:N (older clusters)",
                         "choice", ("gpus", "gres"))
    signal: str = key("USR2@90", "--signal sent ahead of the time limit to requeue (not USR1, "
                      "NCCL's)", "slurm_signal", kind="SLURM signal")
    max_requeues: int = key(3, "requeues after a time limit or preemption", "integer", 0)
    output_dir: str = key("slurm-logs", "where the job's output files go", "string")
    job_name: str | None = key(None, "#SBATCH --job-name (unset: the run id)", "string")
    constraint: str | None = key(None, "#SBATCH --constraint", "string")
    nodelist: str | None = None    # hostlist of the nodes to run on (--hosts, or the inventory's)
    exclude: str | None = None     # hostlist of nodes never to use (--exclude)
    extra: tuple[tuple[str, str | None], ...] = key(
        (), "any other #SBATCH option: name (no dashes) to value, or true for a flag",
        "slurm_extra", kind="mapping")


@dataclass(frozen=True)
class HangAuto:
    """How `hang_timeout: auto` learns the timeout from the job's heartbeats (cluster.observe.hang_timeout
    says why these defaults)."""
    startup: float = key(1200.0, "seconds allowed before the heartbeats have shown the job's "
                         "pace (start-up: setup, data, compile, first steps)", "seconds")
    multiple: float = key(10.0, "the timeout is this many times the interval between "
                          "heartbeats", "number", 1)
    floor: float = key(30.0, "the learned timeout is never shorter (seconds)", "seconds")
    cap: float = key(1800.0, "the learned timeout is never longer (seconds)", "seconds")


@dataclass(frozen=True)
class SlowNode:
    """When a node is named slow while the job runs (cluster.observe.slow says how it is measured)."""
    ratio: float = key(1.3, "a node is slow when its ranks' step work takes this many times "
                       "the job's median node's (with two nodes, the other one's)", "number", 1)
    window: float = key(60.0, "... as the median over this many seconds of its reports",
                        "seconds")


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where `cluster up` serves a run's live metrics while it watches it (cluster.observe.metrics;
    docs/metrics.md). `metrics: 9400` is `metrics: {port: 9400}`."""
    SHORTHAND: ClassVar[str] = "port"
    port: int | None = key(None, "serve the live metrics at http://ADDRESS:PORT/metrics while "
                           "an attached run is watched (0: any free port; unset: not served; "
                           "--metrics-port)", "listen_port", kind="port (0-65535)")
    address: str = key("127.0.0.1", "the address it binds (0.0.0.0: every interface; the "
                       "metrics have no secret, but anyone who reaches it reads them)",
                       "bind_address", kind="IP address or host name")


GATE_LEVELS = ("off", "basic", "deep")


@dataclass(frozen=True)
class Gate:
    """The health gate before every start and restart (cluster.recovery.hardware judges the
    nodes' facts against these; the defaults are for real GPU servers)."""
    SHORTHAND: ClassVar[str] = "level"       # `gate: deep` is `gate: {level: deep}`
    level: str = key("basic", "off; basic: each node's GPUs (all there, none held by another "
                     "process, ECC, XID), free disk and memory, at every start and restart; "
                     "deep: and first doctor --deep's collective, each node's bandwidth against "
                     "the job's median (--gate)",
                     "gate_level", kind="off, basic or deep")
    min_free_disk_gib: float = key(10.0, "free space the workdir, and checkpoint_dir, must each "
                                   "have (GiB)", "number", 0)
    checkpoint_dir: str | None = key(None, "the job's checkpoint folder (from the workdir), "
                                     "whose free space is checked too", "string")
    min_free_memory_gib: float = key(2.0, "memory a node must have available (GiB)", "number", 0)
    gpu_memory_held_mib: float = key(512.0, "GPU memory another process may hold on one of the "
                                     "job's GPUs before the node fails (MiB)", "number", 0)
    ecc_uncorrected: int = key(0, "uncorrectable ECC errors (since the driver loaded) a GPU "
                               "may have", "integer", 0)
    quarantine_after: int = key(2, "failures attributed to a node within quarantine_window "
                                "that quarantine it (cluster nodes)", "integer", 1)
    quarantine_window: float = key(86400.0, "seconds a node's failures count against it",
                                   "seconds")
    readmit_every: float = key(30.0, "seconds between two looks at a node the job lost, while "
                               "it runs: once it answers it rejoins at the next start (at the "
                               "next checkpoint with --grow)", "seconds")


@dataclass(frozen=True)
class Inventory:
    hosts: tuple[Host, ...] = key(dataclasses.MISSING, "the hosts, in order: names or mappings "
                                  "of host keys (not needed with backend: slurm)", None,
                                  kind="list")
    source: str | None = None
    backend: str = key("ssh", "how nodes are reached: ssh, slurm or local", "choice", BACKENDS)
    nodes: int | None = key(None, "how many of the hosts run (--nodes); the others wait as "
                            "spares", "integer", 1)
    ssh: SshSettings = key(SshSettings(), "SSH settings (see ssh below)", "section", SshSettings)
    slurm: SlurmSettings = key(SlurmSettings(), "SLURM settings (see slurm below)", "section",
                               SlurmSettings)
    stop_grace: float = key(DEFAULT_STOP_GRACE, "seconds from SIGTERM to SIGKILL when a run is "
                            "stopped (--stop-grace)", "seconds")
    restarts: int = key(0, "whole-job restarts after a failure (--max-restarts)", "integer", 0)
    hang_timeout: float | str = key(0.0, "seconds without progress before the stacks are taken "
                                    "and the run stopped (0: off); auto: learned from the "
                                    "heartbeats (see hang_auto)", "hang_timeout")
    hang_auto: HangAuto = key(HangAuto(), "how hang_timeout: auto learns (see hang_auto below)",
                              "section", HangAuto)
    slow_node: SlowNode = key(SlowNode(), "when a slow node is named (see slow_node below)",
                              "section", SlowNode)
    gate: Gate = key(Gate(), "the health gate before every start (off, basic or deep; see gate "
                     "below)", "section", Gate)
    metrics: MetricsEndpoint = key(MetricsEndpoint(), "serve the live metrics over HTTP "
                                   "(a port, or see metrics below)", "section", MetricsEndpoint)
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




# libyaml's safe dumper and loader where PyYAML has them (the same YAML, several times faster: a
# run's record of 1,000 hosts took half a second in pure Python); a run's inventory.yaml is read
# back by record_yaml.
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def record_yaml(text: str) -> Any:
    """A run directory's YAML (inventory.yaml), as dump wrote it."""
    return yaml.load(text, Loader=SAFE_LOADER)


def dump(inv: Inventory) -> str:
    """The inventory as loaded (every default applied), as YAML, for the run directory."""
    def host(h: Host) -> dict[str, Any]:
        d = dataclasses.asdict(h)
        d["env"] = dict(h.env)
        for key in ("secret_env", "env_forward", "setup", "torchrun_args"):
            d[key] = list(getattr(h, key))
        d["container"] = container_dict(h.container)
        d["notify"] = [redacted_url(u) for u in h.notify]      # a webhook's path is a token
        d.pop("line")
        return d
    data = {"source": inv.source, "backend": inv.backend, "stop_grace": inv.stop_grace,
            "restarts": inv.restarts, "hang_timeout": inv.hang_timeout,
            "hang_auto": dataclasses.asdict(inv.hang_auto),
            "slow_node": dataclasses.asdict(inv.slow_node),
            "gate": dataclasses.asdict(inv.gate),
            "metrics": dataclasses.asdict(inv.metrics),
            "ssh": dataclasses.asdict(inv.ssh),
            "slurm": {**dataclasses.asdict(inv.slurm), "extra": dict(inv.slurm.extra)},
            "hosts": [host(h) for h in inv.hosts]}
    return yaml.dump(data, Dumper=SAFE_DUMPER, sort_keys=False)


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
    d["notify"] = tuple(d.get("notify") or ())
    return Host(**d)


def ssh_from_dict(d: Mapping[str, Any]) -> SshSettings:
    return SshSettings(**d)


def slurm_from_dict(d: Mapping[str, Any]) -> SlurmSettings:
    d = dict(d)
    d["extra"] = tuple((d.get("extra") or {}).items())
    return SlurmSettings(**d)


