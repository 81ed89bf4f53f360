"""Backends: where a job runs. Each is one module behind the small protocol below.

    local   processes on this machine (one node, or N simulated nodes)
    ssh     every node over SSH (the only module that imports Fabric/paramiko)
    slurm   sbatch / squeue / sacct / scancel behind one subprocess seam

The flow every backend shares (check all, start all, watch, stop all) lives in cluster.launch
and cluster.watch, not here.
"""
from __future__ import annotations

import signal as _signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..plan import LaunchPlan, NodePlan
    from ..runs import RunDir


@dataclass(frozen=True)
class NodeExit:
    """How one node's work ended."""
    code: int | None = None          # exit status, when it exited
    signal: int | None = None        # the signal that killed it, when one did
    lost: bool = False               # the connection to the node broke first
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.lost

    def describe(self) -> str:
        if self.lost:
            return f"connection lost{': ' + self.reason if self.reason else ''}"
        if self.signal:
            return f"killed by {signal_name(self.signal)}"
        if self.code is not None and self.code > 128 and self.code - 128 < 65:
            return f"exit code {self.code} ({signal_name(self.code - 128)})"
        return f"exit code {self.code}"


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


@dataclass
class NodeStatus:
    rank: int
    name: str
    state: str                       # running | exited | lost | unknown | pending | ...
    code: int | None = None
    pid: int | None = None
    uptime: float | None = None
    detail: str = ""


class NodeProcess(Protocol):
    """One node's running work, as seen from `cluster up`."""
    node: "NodePlan"

    def output(self) -> Iterator[bytes]:
        """Chunks of the node's combined stdout/stderr until it ends."""

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
