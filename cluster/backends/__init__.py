"""Backends: where a job runs. Each is one module behind the small protocol below.

    local   processes on this machine (one node, or N simulated nodes)
    ssh     every node over SSH (the only module that imports Fabric/paramiko)
    slurm   sbatch / squeue / sacct / scancel behind one subprocess seam

The flow every backend shares (plan, record, check all, start all, watch, stop all) lives in
cluster.launch, cluster.prepare and cluster.watch, not here: no backend has its own `up`.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..nodes import NodeExit, NodeStatus, signal_name

__all__ = ["Backend", "NodeExit", "NodeProcess", "NodeStatus", "signal_name"]

if TYPE_CHECKING:
    from ..runs import RunDir


class NodeProcess(Protocol):
    """One node's running work (or a scheduler's job, which speaks for several), as the
    watcher sees it."""
    node: Any                        # .label names it in the output

    def output(self) -> Iterator[bytes | tuple[str, bytes] | dict[str, Any]]:
        """Until it ends: output bytes; (label, bytes) for a job's nodes; control records
        (dicts: joined, beat, stack, dumped from a supervisor; info, nodes from a scheduler)."""

    def request_stacks(self) -> None:
        """Ask for every worker's stack (answered by 'stack' records, then 'dumped')."""

    def wait(self) -> NodeExit:
        """Block until the work has ended (or the connection is lost)."""

    def stop(self) -> dict[str, Any]:
        """Stop it (TERM, grace, KILL, verify; or cancel the job) and report."""


class Backend(Protocol):
    """What every backend offers the one launch flow (cluster.launch, cluster.prepare), in the
    spirit of torchx's schedulers: plan (a dry run prints it), check, start, and for recorded
    runs status, logs and stop."""
    name: str
    checks_nodes: bool               # True: check/reach/push probe every node before start

    def plan(self, inventory: Any, job: Any, templates: Any,
             ifnames: Mapping[str, str] | None = None) -> Any:
        """Pure: the LaunchPlan or SbatchPlan; str() of it is what would run."""

    def check(self, plan: Any, reach: bool = False) -> dict[str, dict[str, Any]]:
        """Phase one: what every node has (with reach, whether it can connect to the master
        port). Raises PreflightError naming every failing node."""

    def reach(self, plan: Any) -> dict[str, dict[str, Any]]:
        """Whether every node can connect to the master port (after check)."""

    def push(self, plan: Any) -> None:
        """Each node's script into its run directory (after check)."""

    def release(self) -> None:
        """Let every node the check prepared go without starting it."""

    def start(self, plan: Any, *, detach: bool = False,
              secrets: Mapping[str, Mapping[str, str]] | None = None,
              run: "RunDir | None" = None) -> list[NodeProcess]:
        """Phase two: start every node, or submit the job."""

    def started(self, plan: Any, procs: list[Any], run: "RunDir") -> dict[str, Any]:
        """What run.json keeps of the start (process groups; the job id)."""

    def ended(self, plan: Any, procs: list[Any], result: Any) -> dict[str, Any]:
        """What run.json keeps of the end (process groups; the job's final state)."""

    def start_note(self, procs: list[Any], plan: Any) -> str:
        """The line that tells the user what started."""

    def stop_run(self, run: "RunDir") -> dict[str, dict[str, Any]]:
        """`cluster down`: stop every node of a recorded run."""

    def status(self, run: "RunDir") -> list[NodeStatus]:
        """`cluster status`: one row per node."""

    def logs(self, run: "RunDir", *, node: str | None = None,
             follow: bool = False) -> Iterator[tuple[str, bytes]]:
        """`cluster logs`: (node label, chunk) pairs."""

    def close(self) -> None:
        """Release connections."""

    # Optional capabilities: a backend that has one defines the method; callers look for it
    # (getattr) instead of asking for the backend's name.
    #
    # preview(plan) -> (text, notes): what a dry run shows besides the plan, computed without
    #     contacting a node (ssh: the files --sync would send).
    # pull(run, paths, into, node=None) -> {node: PullResult | ClusterError}: `cluster pull`,
    #     each node's files under its workdir copied into into/<node>/ (backends/pull.py).
    # note: a callable(str) the launch flow points at the run's console, for what the backend
    #     has to tell the user (ssh: --sync's summary line).


# --- capabilities -------------------------------------------------------------------------------
# What a backend can do beyond the contract above, asked by name (SkyPilot's `supports()`),
# never by asking which backend it is.
NODE_CHECKS = "node_checks"            # every node is checked (python, run dir, master port) before start
RESTARTS = "restarts"                  # the launcher restarts a failed attempt (SLURM requeues instead)
EXEC = "exec"                          # runs cluster's node-side programs on each node: exec, top, clean, doctor
SHARED_FILESYSTEM = "shared_filesystem"  # every node sees the submitting folder (no copying needed)
SYNC = "sync"                          # --sync copies a local folder to every node's workdir
REMOTE_NODES = "remote_nodes"          # nodes are other machines, reached over a login (not simulated here)

CAPABILITIES: dict[str, frozenset[str]] = {
    "local": frozenset({NODE_CHECKS, RESTARTS, EXEC, SHARED_FILESYSTEM}),
    "ssh": frozenset({NODE_CHECKS, RESTARTS, EXEC, SYNC, REMOTE_NODES}),
    "slurm": frozenset({SHARED_FILESYSTEM, REMOTE_NODES}),
}


def supports(backend: "Backend | str", capability: str) -> bool:
    """Whether a backend (or a backend's name) has a capability."""
    name = backend if isinstance(backend, str) else backend.name
    return capability in CAPABILITIES.get(name, frozenset())
