"""Backends: where a job runs. Each is one module behind the small contract below, found in one
registry (torchx's scheduler registry and `create_scheduler`): a backend's module is imported
only when that backend is chosen, so a local run never loads SSH or SLURM code.

    local   processes on this machine (one node, or N simulated nodes)
    ssh     every node over SSH (the only module that imports Fabric/paramiko)
    slurm   sbatch / squeue / sacct / scancel behind one subprocess seam

The flow every backend shares (plan, record, check all, start all, watch, stop all) lives in
cluster.launch, cluster.recovery.check and cluster.observe.watch, not here: no backend has its own `up`. What a
backend can do beyond the contract is a capability, asked with `supports()` (SkyPilot's
`supports(provider, method)`), never by asking which backend it is.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

from ..errors import InputError
from ..nodes import NodeExit, NodeStatus, signal_name
from ..plan import Job, LaunchPlan, Plan, Templates
from ..request import Request
from ..runs import RunDir
from ..spec import Host, Inventory

if TYPE_CHECKING:
    from .supervised import SupervisedBackend

__all__ = ["AsksStop", "Backend", "BackendModule", "Finishes", "NodeChecks", "NodeExit", "NodeProcess", "NodeStatus",
           "Record", "REGISTRY", "NAMES", "Selectable", "choose", "create", "recorded", "node_checks",
           "signal_name", "supports"]

# A JSON object as nodes, supervisors and run.json say it: their schemas are theirs.
Record = dict[str, Any]
PlanT = TypeVar("PlanT", bound=Plan)
# Backend[Any]: a backend of whichever plan, before the flow binds it (cluster.launch takes
# the plan a backend makes back to that backend only).


class Named(Protocol):
    name: str


class Labelled(Protocol):
    @property
    def label(self) -> str:
        """How the output names it: 'gpu-a 0', or 'job 123' for a scheduler's job."""


class NodeProcess(Protocol):
    """One node's running work (or a scheduler's job, which speaks for several), as the
    watcher (cluster.observe.watch) sees it."""

    @property
    def node(self) -> Labelled: ...

    def output(self) -> Iterator[bytes | tuple[str, bytes] | Record]:
        """Until it ends: output bytes; (label, bytes) for a job's nodes; control records
        (joined, beat, stack, dumped from a supervisor; info, nodes from a scheduler)."""

    def request_stacks(self) -> None:
        """Ask for every worker's stack (answered by 'stack' records, then 'dumped')."""

    def wait(self) -> NodeExit:
        """Block until the work has ended (or the connection is lost)."""

    def stop(self) -> Record:
        """Stop it (TERM, grace, KILL, verify; or cancel the job) and report."""


@runtime_checkable
class Selectable(Protocol):
    """A NodeProcess whose output one thread reads among many (the capability of processes on
    a channel: local and SSH nodes): fileno() is readable when read_ready() has output, or
    the end (None), without blocking. A process without it is read by a thread of its own."""

    def fileno(self) -> int: ...

    def read_ready(self) -> list[bytes | Record] | None: ...


@runtime_checkable
class Finishes(Protocol):
    """A NodeProcess whose supervisor says when every worker on its node has exited 0 (a
    `done` record), and can then be told that every node's have (the word `finish`): it ends
    torchrun's agent at once instead of waiting out its exit barrier and the store's
    teardown, and reports the node's exit as 0."""
    def request_finish(self) -> None: ...


@runtime_checkable
class AsksStop(Protocol):
    """A NodeProcess whose stop can be asked for without waiting (the word on its channel):
    the watcher asks every node first, then waits for their reports on a few threads, not
    one thread per node."""

    def request_stop(self) -> None: ...


class Backend(Protocol[PlanT]):
    """What every backend does for the one launch flow: plan (a dry run prints it), start,
    and for recorded runs status, logs and stop. PlanT is its plan (plan.LaunchPlan,
    sbatch.SbatchPlan), which only it starts."""
    name: str

    def plan(self, inventory: Inventory, job: Job, templates: Templates,
             ifnames: Mapping[str, str] | None = None) -> PlanT:
        """Pure: str() of the plan is what would run."""

    def start(self, plan: PlanT, *, detach: bool = False,
              secrets: Mapping[str, Mapping[str, str]] | None = None,
              run: RunDir | None = None) -> list[NodeProcess]:
        """Start every node, or submit the job."""

    def started(self, plan: PlanT, procs: list[NodeProcess], run: RunDir) -> Record:
        """What run.json keeps of the start (process groups; the job id)."""

    def ended(self, plan: PlanT, procs: list[NodeProcess], result: object) -> Record:
        """What run.json keeps of the end (process groups; the job's final state)."""

    def start_note(self, procs: list[NodeProcess], plan: PlanT) -> str:
        """The line that tells the user what started."""

    def stop_run(self, run: RunDir) -> dict[str, Record]:
        """`cluster down`: stop every node of a recorded run."""

    def status(self, run: RunDir) -> list[NodeStatus]:
        """`cluster status`: one row per node."""

    def logs(self, run: RunDir, *, node: str | None = None,
             follow: bool = False) -> Iterator[tuple[str, bytes]]:
        """`cluster logs`: (node label, chunk) pairs."""

    def close(self) -> None:
        """Release connections."""

    # Optional attributes, looked for with getattr:
    # preview(plan) -> (text, notes): what a dry run shows besides the plan, computed without
    #     contacting a node (ssh: the files --sync would send).
    # pull(run, paths, into, node=None) -> {node: PullResult | ClusterError}: `cluster pull`.
    # note: a callable(str) the launch flow points at the run's console (ssh: --sync's line).
    # progress: told as each node finishes a phase (console.NodeProgress).
    # leftover_secrets(run) -> None | "" | why, forget_run_secrets(run) -> problem or "", and
    #     forget_ended_secrets (bool, status() removes them when set): a backend that leaves
    #     the secret values in a file for its job (slurm); `cluster clean` sweeps them.


class NodeChecks(Protocol):
    """The NODE_CHECKS capability: every node is checked before anything starts (phase one of
    cluster.recovery.check), by the process that start() then makes its supervisor."""

    def open_all(self, hosts: Sequence[Host]) -> None:
        """Start connecting to every host, in the background, before the plan is final; the
        check uses these connections and reports a failure to connect as that node's."""

    def check(self, plan: LaunchPlan, *, reach: bool = False) -> dict[str, Record]:
        """What every node has (with reach, whether it can connect to the master port).
        Raises PreflightError naming every failing node."""

    def reach(self, plan: LaunchPlan, timeout: float = 8.0) -> dict[str, Record]:
        """Whether every node can connect to the master port (after check)."""

    def release(self) -> None:
        """Let every node the check staged go without starting it."""

    def discard(self) -> None:
        """As release, after a failed check: the run folders the check made go too."""


class BackendModule(Protocol):
    """What a backend's module offers (the registry imports it when the backend is chosen):
    the steps of `cluster up` that are the backend's own."""

    def nodes(self, inventory: Inventory | None, request: Request) -> Inventory:
        """The nodes it runs on: the inventory (None: neither -i nor --hosts) narrowed by
        --nodes/--hosts/--exclude as this backend reads them."""

    def configure(self, inventory: Inventory, request: Request) -> Inventory:
        """Its own options over the inventory's (SLURM's --partition, --time, ...); refuses
        the options it does not take."""

    def create(self, inventory: Inventory, request: Request,
               sync: Sequence[tuple[str, str]] = ()) -> Backend[Any]:
        """The backend for a new run; sync: (local dir, subdir of the workdir) to copy."""

    def recorded(self, run: RunDir) -> Backend[Any]:
        """The backend for a recorded run (`cluster status/logs/down`)."""


# --- capabilities -------------------------------------------------------------------------------
# What a backend can do beyond the contract above, asked by name (SkyPilot's `supports()`),
# never by asking which backend it is.
NODE_CHECKS = "node_checks"            # every node is checked (python, run dir, master port) before start
# RESTARTS: the launcher watches each attempt and restarts a failed one (--max-restarts,
# --min-nodes, --hang-timeout); under SLURM a job requeues itself instead.
RESTARTS = "restarts"
# REQUEUES: the job restarts a failed attempt itself (--max-restarts): a SLURM job requeues
# without the node that failed first; the launcher only follows it.
REQUEUES = "requeues"
EXEC = "exec"                          # runs cluster's node-side programs on each node: exec, top, clean, doctor
SHARED_FILESYSTEM = "shared_filesystem"  # every node sees the submitting folder (no copying needed)
SYNC = "sync"                          # --sync copies a local folder to every node's workdir
REMOTE_NODES = "remote_nodes"          # nodes are other machines, reached over a login (not simulated here)
ALLOCATES = "allocates"                # a scheduler allocates the nodes: an inventory needs no hosts


# --- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A backend by name: its module (imported when chosen) and what it can do."""
    name: str
    module: str                      # relative to this package
    capabilities: frozenset[str]

    def load(self) -> BackendModule:
        # The module's functions are the hooks BackendModule names (a module is no class).
        return cast(BackendModule, importlib.import_module(self.module, __name__))


LOCAL = "local"                      # the default with no inventory, and what --local asks for
REGISTRY: dict[str, Entry] = {e.name: e for e in (
    Entry(LOCAL, ".local", frozenset({NODE_CHECKS, RESTARTS, EXEC, SHARED_FILESYSTEM})),
    Entry("ssh", ".ssh", frozenset({NODE_CHECKS, RESTARTS, EXEC, SYNC, REMOTE_NODES})),
    Entry("slurm", ".slurm", frozenset({SHARED_FILESYSTEM, REMOTE_NODES, ALLOCATES, REQUEUES})),
)}
NAMES = tuple(REGISTRY)
CAPABILITIES: dict[str, frozenset[str]] = {name: e.capabilities for name, e in REGISTRY.items()}


def supports(backend: Named | str, capability: str) -> bool:
    """Whether a backend (or a backend's name) has a capability."""
    name = backend if isinstance(backend, str) else backend.name
    return capability in CAPABILITIES.get(name, frozenset())


def entry(name: str) -> Entry:
    if name not in REGISTRY:
        raise InputError(f"unknown backend {name!r} (valid: {', '.join(NAMES)})")
    return REGISTRY[name]


def choose(given: str | None, force_local: bool, inventory: Inventory | None) -> str:
    """The backend, once: --backend (or --local), else the inventory's, else this machine."""
    if force_local:
        if given not in (None, LOCAL):
            raise InputError(f"--local and --backend {given} contradict each other")
        return LOCAL
    name = given or (inventory.backend if inventory is not None else LOCAL)
    entry(name)
    return name


def create(name: str, inventory: Inventory, request: Request = Request(),
           sync: Sequence[tuple[str, str]] = ()) -> Backend[Any]:
    return entry(name).load().create(inventory, request, sync)


def recorded(run: RunDir) -> Backend[Any]:
    """The backend of a recorded run, as its run.json names it."""
    return entry(run.meta()["backend"]).load().recorded(run)


def node_checks(backend: Named) -> NodeChecks | None:
    """The backend as NodeChecks when it has that capability; None when it has nothing to
    check before a start (a scheduler allocates its nodes)."""
    return cast(NodeChecks, backend) if supports(backend, NODE_CHECKS) else None


def with_exec(backend: Named) -> "SupervisedBackend":
    """The backend as the node-side programs' runner (EXEC: cluster exec, clean, top)."""
    from .supervised import SupervisedBackend
    if not supports(backend, EXEC) or not isinstance(backend, SupervisedBackend):
        raise InputError(f"the {backend.name} backend does not run programs on its nodes")
    return backend
