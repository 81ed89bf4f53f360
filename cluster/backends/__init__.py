"""Backends: where a job runs. Each is one module behind the small protocol below.

    local   processes on this machine (one node, or N simulated nodes)
    ssh     every node over SSH (the only module that imports Fabric/paramiko)
    slurm   sbatch / squeue / sacct / scancel behind one subprocess seam

The flow every backend shares (check all, start all, watch, stop all) lives in cluster.launch
and cluster.watch, not here.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..nodes import NodeExit, NodeStatus, signal_name

__all__ = ["Backend", "NodeExit", "NodeProcess", "NodeStatus", "signal_name"]

if TYPE_CHECKING:
    from ..plan import LaunchPlan, NodePlan
    from ..runs import RunDir


class NodeProcess(Protocol):
    """One node's running work, as seen from `cluster up`."""
    node: "NodePlan"

    def output(self) -> Iterator[bytes | dict[str, Any]]:
        """Chunks of the node's combined stdout/stderr until it ends, and among them the
        supervisor's control records (dicts: joined, beat, stack, dumped)."""

    def request_stacks(self) -> None:
        """Ask for every worker's stack (answered by 'stack' records, then 'dumped')."""

    def wait(self) -> NodeExit:
        """Block until the node's work has ended (or the connection is lost)."""

    def stop(self) -> dict[str, Any]:
        """TERM the node's process group and tagged processes, grace, KILL, verify."""


class Backend(Protocol):
    name: str

    def check(self, plan: "LaunchPlan") -> dict[str, dict[str, Any]]:
        """Phase one: every node reachable and ready. Raises PreflightError naming every
        failing node; starts nothing. Returns facts per node name."""

    def start(self, plan: "LaunchPlan", *, detach: bool = False) -> list[NodeProcess]:
        """Phase two: start every node's script. Only called after check() passed."""

    def stop_run(self, run: "RunDir") -> dict[str, dict[str, Any]]:
        """`cluster down`: stop every node of a recorded run."""

    def status(self, run: "RunDir") -> list[NodeStatus]:
        """`cluster status`: one row per node."""

    def logs(self, run: "RunDir", *, node: str | None = None,
             follow: bool = False) -> Iterator[tuple[str, bytes]]:
        """`cluster logs`: (node label, chunk) pairs."""

    def close(self) -> None:
        """Release connections."""


@dataclass
class PreflightReport:
    failures: dict[str, str] = field(default_factory=dict)   # node label -> reason
