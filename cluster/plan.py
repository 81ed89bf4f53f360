"""render(inventory, job) -> LaunchPlan: pure. Templates in, per-node scripts out.

The plan is the contract with the backends: it holds every node's script text, where it goes
and the run id. A backend never re-reads the inventory or re-renders. `--dry-run` prints it.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jinja2

from .errors import InputError
from . import network
from .spec import DEFAULT_STOP_GRACE, Gate, Host, Inventory, container_name, setup_block

PORT_BASE, PORT_SPAN = 29500, 1000
# What a container's environment holds besides the node's own `env`, by name: the values are
# taken on the node at start (the interface may be chosen there). The rest of the node's
# environment stays outside: the image keeps its own PATH and libraries.
CONTAINER_ENV = ("CLUSTER_RUN_ID", "CLUSTER_NODE", "CLUSTER_NODE_RANK", "CLUSTER_NNODES",
                 "CLUSTER_RESTART_COUNT", "CLUSTER_HEARTBEAT_FILE", "MASTER_ADDR", "MASTER_PORT",
                 "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE",
                 "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED")


@dataclass(frozen=True)
class Job:
    """What to run, independent of where."""
    run_id: str
    script: str
    args: tuple[str, ...] = ()
    master_port: int | None = None   # None: the master host's setting, else derived from run_id
    node_root: str | None = None      # None: <workdir>/.cluster/<run id>/<host> on each node
    attempt: int = 0                  # restarts so far (CLUSTER_RESTART_COUNT on the nodes)

    @property
    def rdzv_id(self) -> str:
        """A rendezvous of its own for every attempt: the last one's may still be closing."""
        return self.run_id if self.attempt == 0 else f"{self.run_id}-a{self.attempt}"


@dataclass(frozen=True)
class NodePlan:
    rank: int                         # the node's group rank, as torchrun will number it
    host: Host
    script: str                       # the rendered launch script
    run_dir: str                      # per-node directory on that node (may start with ~)
    env: tuple[tuple[str, str], ...]  # the environment the script sets that cluster decided
    container: str | None = None      # the container's name on the node, if it runs in one
    script_file: str | None = None    # the job's script, when the node's python opens it as a
                                      # file (relative to the workdir): checked before the start

    @property
    def secret_env(self) -> tuple[str, ...]:
        """Names whose values the launcher passes at start, never written anywhere."""
        return self.host.secret_env

    @property
    def label(self) -> str:
        return f"{self.host.name} {self.rank}"

    @property
    def script_path(self) -> str:
        return f"{self.run_dir}/launch.sh"


@dataclass(frozen=True)
class Recording:
    """What the run directory keeps of a plan (runs.RunDir.record writes it, privately)."""
    scripts: dict[str, str]                  # scripts/<name> -> its text
    env: dict[str, dict[str, str]]           # env.json: per node (or job), what cluster decided
    meta: dict[str, Any]                     # run.json fields particular to this kind of plan
    logs: tuple[str, ...] = ()               # logs/<name> to create, empty and private


class Plan(Protocol):
    """What every backend's plan offers the launch flow (LaunchPlan here, sbatch.SbatchPlan):
    str() of it is what would run; recording() what the run directory keeps of it."""

    @property
    def run_id(self) -> str: ...

    @property
    def master_port(self) -> int: ...

    @property
    def stop_grace(self) -> float: ...

    @property
    def logs_hint(self) -> str: ...

    @property
    def node_names(self) -> list[str]: ...

    @property
    def node_count(self) -> int: ...

    @property
    def log_names(self) -> dict[str, str]: ...

    def dry_run_note(self, run_path: Path) -> str: ...

    def recording(self) -> Recording: ...


@dataclass(frozen=True)
class LaunchPlan:
    run_id: str
    nodes: tuple[NodePlan, ...]       # in group-rank order
    master_addr: str
    master_port: int
    rendezvous: str
    script: str
    args: tuple[str, ...]
    master_name: str = ""             # the inventory's first host: the rendezvous endpoint
    stop_grace: float = DEFAULT_STOP_GRACE
    tuning: Mapping[str, Any] | None = field(default=None, compare=False)   # cluster.tuning
    gate: Gate = Gate()               # what the check asks each node and how it judges

    @property
    def master(self) -> NodePlan:
        return next((n for n in self.nodes if n.host.name == self.master_name), self.nodes[0])

    def __str__(self) -> str:
        parts = []
        for n in self.nodes:
            parts.append(f"# ==== node {n.rank}: {n.host.name} ({n.host.address}) -> {n.script_path}\n")
            parts.append(n.script)
        return "".join(parts)

    @property
    def logs_hint(self) -> str:
        return f"runs/{self.run_id}/logs/"

    @property
    def node_names(self) -> list[str]:
        return [n.host.name for n in self.nodes]

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def log_names(self) -> dict[str, str]:
        """Each node's label -> its log file under runs/<id>/logs/."""
        return {n.label: f"{n.rank}-{n.host.name}.log" for n in self.nodes}

    def dry_run_note(self, run_path: Path) -> str:
        return f"{len(self.nodes)} node script(s) in {run_path}; nothing was contacted"

    def recording(self) -> Recording:
        return Recording(
            scripts={f"{n.rank}-{n.host.name}.sh": n.script for n in self.nodes},
            env={n.host.name: dict(n.env) for n in self.nodes},
            logs=tuple(self.log_names.values()),
            meta={"master_addr": self.master_addr, "master_port": self.master_port,
                  "master": self.master_name, "rendezvous": self.rendezvous,
                  "script": self.script, "args": list(self.args), "stop_grace": self.stop_grace,
                  "secret_env": sorted({s for n in self.nodes for s in n.secret_env}),
                  "nodes": [{"rank": n.rank, "name": n.host.name, "address": n.host.address,
                             "run_dir": n.run_dir} for n in self.nodes],
                  **({"nccl_tuning": dict(self.tuning)} if self.tuning else {})})


def derived_port(run_id: str, attempt: int = 0) -> int:
    """A master port from the run id, so two runs on the same hosts do not collide."""
    digest = int(hashlib.sha256(run_id.encode()).hexdigest(), 16)
    return PORT_BASE + (digest + attempt) % PORT_SPAN


def shquote(value: object) -> str:
    return shlex.quote(str(value))


def shpath(value: object) -> str:
    """Quote a path but let a leading ~ mean the home directory on the node that runs it."""
    text = str(value)
    if text == "~":
        return '"$HOME"'
    if text.startswith("~/"):
        return '"$HOME"/' + shlex.quote(text[2:]) if text[2:] else '"$HOME"'
    return shlex.quote(text)


def python_command(python: str, setup: tuple[str, ...] = ()) -> str:
    """The shell words that run this host's python for cluster's own programs (the probe, the
    staged process, the supervisor). With setup lines, through bash after them, so the
    interpreter and its torch are the ones the job will use; `auto` is the python3 they leave
    on PATH."""
    exe = "python3" if python == "auto" else shpath(python)
    if not setup:
        return exe
    script = setup_block(setup, to_stderr=True) + f'\nexec {exe} "$@"'
    return f"bash -c {shlex.quote(script)} cluster-setup"


# --- templates -----------------------------------------------------------------------------


def builtin_templates_dir() -> Path:
    """templates/ of a source checkout, or the installed copy (package cluster.templates)."""
    checkout = Path(__file__).resolve().parent.parent / "templates"
    if (checkout / "node.sh.j2").is_file():
        return checkout
    from importlib import resources
    return Path(str(resources.files("cluster.templates")))


class TemplateCache(jinja2.FileSystemBytecodeCache):
    """Compiled templates kept between launches in the user's own cache folder
    (~/.cache/cluster/templates): compiling a launch's templates took about 20 ms of the
    launcher's CPU, loading them takes about 1.4 ms (docs/SCALE.md). Jinja keys each by
    the template's file and checks its source's hash, so an edited template compiles anew.
    Code is loaded only from a folder of this user's alone; a file that cannot be read or
    written, or is not what Jinja wrote, only means compiling, as without the cache.
    What compiles is held in memory and written by save(), which a launch calls: checking a
    request (api.prepare, a dry run's render) creates nothing."""

    def __init__(self, folder: Path) -> None:
        # Jinja's own key holds the Python version, not Jinja's: an upgrade starts afresh.
        super().__init__(str(folder), f"{jinja2.__version__}-%s.cache")
        self.folder = folder
        self.held: list[jinja2.bccache.Bucket] = []

    @classmethod
    def at(cls, folder: Path) -> TemplateCache | None:
        """The cache in folder (made 0700 by save() if missing); None where the folder is
        not this user's alone (another owner, a link, group or others may write)."""
        return cls(folder) if _own_folder(folder, missing_ok=True) else None

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:       # truncated or foreign: marshal's and pickle's many errors
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        self.held.append(bucket)

    def save(self) -> None:
        """Write what compiled since the last save, making the folder if need be."""
        held, self.held = self.held, []
        try:
            if held:
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return
        if not _own_folder(self.folder, missing_ok=False):
            return
        for bucket in held:
            try:
                super().dump_bytecode(bucket)
            except OSError:     # a full disk, a folder made read-only since
                pass


def _own_folder(folder: Path, *, missing_ok: bool) -> bool:
    """Whether folder is a folder of this user's alone (or missing, when missing_ok)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return missing_ok
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


class Templates:
    """The Jinja environment: the user's --templates DIR first (override by name), then ours."""

    def __init__(self, override: str | Path | None = None,
                 cache: Path | None = None) -> None:
        """cache: where compiled templates are kept (TemplateCache); None compiles each."""
        dirs = [str(builtin_templates_dir())]
        self.own = None if override is None else Path(override)
        if override is not None:
            override = Path(override)
            if not override.is_dir():
                raise InputError(f"Invalid value for --templates: {override} is not a directory")
            dirs.insert(0, str(override))
        self.loader = jinja2.FileSystemLoader(dirs)
        self.env = jinja2.Environment(
            loader=self.loader, undefined=jinja2.StrictUndefined,
            trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
            bytecode_cache=None if cache is None else TemplateCache.at(cache))
        self.env.filters["shquote"] = shquote
        self.env.filters["shpath"] = shpath
        self.env.globals["setup_block"] = setup_block

    def save(self) -> None:
        """Keep what compiled in the cache, if there is one (a launch's step, not a check's)."""
        if isinstance(self.env.bytecode_cache, TemplateCache):
            self.env.bytecode_cache.save()

    def overrides(self, name: str) -> bool:
        """Whether the user's --templates directory has its own `name`."""
        return self.own is not None and (self.own / name).is_file()

    def render(self, name: str, **context: object) -> str:
        try:
            return self.env.get_template(name).render(**context)
        except jinja2.TemplateNotFound:
            raise InputError(f"template {name!r} not found in {self.loader.searchpath}") from None
        except jinja2.TemplateSyntaxError as exc:
            where = f"{exc.filename}:{exc.lineno}" if exc.lineno else name
            raise InputError(f"template {where}: {exc.message}") from None
        except jinja2.TemplateError as exc:      # no line to show: undefined names, raised errors
            raise InputError(f"template {name}: {exc.message}") from None


# --- render --------------------------------------------------------------------------------


def render(inventory: Inventory, job: Job, templates: Templates,
           ifnames: Mapping[str, str] | None = None) -> LaunchPlan:
    """ifnames: per host, the interface the node reported at the check (cluster.network)."""
    master = inventory.master
    port = job.master_port or master.master_port or derived_port(job.run_id)
    nodes = tuple(_node(rank, host, inventory, job, templates, port, (ifnames or {}).get(host.name))
                  for rank, host in enumerate(rank_order(inventory)))
    return LaunchPlan(run_id=job.run_id, nodes=nodes, master_addr=master.address,
                      master_port=port, rendezvous=master.rendezvous, script=job.script,
                      args=job.args, master_name=master.name, stop_grace=inventory.stop_grace,
                      tuning=inventory.tuning, gate=inventory.gate)


def rank_order(inventory: Inventory) -> tuple[Host, ...]:
    """The hosts in the order torchrun will number them, so that our labels, log names and
    CLUSTER_NODE_RANK agree with each node's real group rank. Static rendezvous takes the
    inventory's order (--node_rank). c10d numbers the nodes that joined by sorting their
    --local_addr as strings (torch.distributed.elastic's dynamic rendezvous), so 10.0.0.11
    comes before 10.0.0.9: follow the same order."""
    if inventory.master.rendezvous == "static":
        return inventory.hosts
    return tuple(sorted(inventory.hosts, key=lambda h: h.address))


def _node(rank: int, host: Host, inv: Inventory, job: Job, templates: Templates,
          port: int, resolved: str | None) -> NodePlan:
    net = network.policy(host, resolved)
    name = container_name(job.run_id, host.name, job.attempt) if host.container else None
    text = templates.render(
        "node.sh.j2", run_id=job.run_id, rdzv_id=job.rdzv_id, attempt=job.attempt, rank=rank,
        nnodes=len(inv.hosts), host=host,
        master_addr=inv.master.address, master_port=port, rendezvous=inv.master.rendezvous,
        net=net, env=host.env, secret_env=host.secret_env, nproc=_nproc(host),
        script=job.script, args=job.args, container=host.container, container_name=name,
        container_env=container_env(host))
    decided = [("CLUSTER_RUN_ID", job.run_id), ("CLUSTER_NODE", host.name),
               ("CLUSTER_NODE_RANK", str(rank)), ("CLUSTER_NNODES", str(len(inv.hosts))),
               ("CLUSTER_RESTART_COUNT", str(job.attempt)),
               ("MASTER_ADDR", inv.master.address), ("MASTER_PORT", str(port))]
    script_file = None if templates.overrides("node.sh.j2") else script_file_of(host, job.script)
    return NodePlan(rank=rank, host=host, script=text, run_dir=node_run_dir(host, job),
                    env=tuple(decided + network.decided_env(net)) + host.env, container=name,
                    script_file=script_file)


# torchrun options that make the script something other than a file its python opens.
NOT_A_FILE = ("-m", "--module", "--no-python", "--no_python")
CHANGES_DIRECTORY = re.compile(r"(^|[;&|(]\s*)(cd|pushd)(\s|$)")


def script_file_of(host: Host, script: str) -> str | None:
    """The script as a file the node's python will open from its workdir, or None where that
    cannot be told from here: a module (-m) or a program (--no-python), a setup line that
    changes directory first, or a path inside a container's image (outside the workdir,
    which alone is mounted)."""
    if any(a.split("=", 1)[0] in NOT_A_FILE for a in host.torchrun_args):
        return None
    if any(CHANGES_DIRECTORY.search(line) for line in host.setup):
        return None
    workdir = host.workdir.rstrip("/") + "/"
    if host.container and script.startswith("/") and not script.startswith(workdir):
        return None
    return script


def container_check(host: Host, name: str, templates: Templates, code: str) -> str:
    """A script that runs `code` with the image's python in the node's container, started as
    a run starts it (cluster doctor's look inside the image)."""
    if host.container is None:
        raise InputError(f"{host.name} has no container")
    return templates.render("container_check.sh.j2", host=host, container=host.container,
                            container_name=name, code=code)


def container_env(host: Host) -> tuple[str, ...]:
    """The names a node's container gets values for (secrets travel apart, on its stdin)."""
    return tuple(dict.fromkeys(CONTAINER_ENV + tuple(k for k, _ in host.env)))


def node_run_dir(host: Host, job: Job) -> str:
    """The node's own directory for this run (may start with ~, expanded on the node)."""
    attempt = f".{job.attempt}" if job.attempt else ""    # each attempt: its own supervisor files
    if job.node_root:
        return f"{job.node_root}/{host.name}{attempt}"
    return f"{host.workdir.rstrip('/')}/.cluster/{job.run_id}/{host.name}{attempt}"


def _nproc(host: Host) -> int | str:
    if host.nproc_per_node != "auto":
        return host.nproc_per_node
    return host.gpus if host.gpus else "auto"
