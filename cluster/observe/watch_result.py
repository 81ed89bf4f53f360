"""What one watch of an attempt found (cluster.observe.watch): each node's exit, the first
failure and its evidence, a hang's stacks, the furthest step and checkpoint, a planned stop.
Plain data; cluster.launch decides on it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..nodes import NodeExit

__all__ = ["Hang", "WatchResult"]


@dataclass
class Hang:
    """What the watchdog found: no progress on any node for `seconds`, and each worker's stack."""
    seconds: float
    stacks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)   # label -> records
    last_lines: dict[str, list[str]] = field(default_factory=dict)    # label -> before the dumps


@dataclass
class WatchResult:
    exits: dict[str, NodeExit] = field(default_factory=dict)        # label -> exit
    first_failure: tuple[str, NodeExit] | None = None
    interrupted: bool = False
    signum: int = 2                                                  # what interrupted it
    stops: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> stop report
    tails: dict[str, list[str]] = field(default_factory=dict)
    causes: dict[str, str] = field(default_factory=dict)   # label -> its worker's own error
    # label -> that error's rank (None: unprefixed) and traceback (its last frames, the error)
    tracebacks: dict[str, tuple[int | None, list[str]]] = field(default_factory=dict)
    # The other ranks' errors, after the first failure's ("[label] rank N: error"), in the
    # order they arrived: most often its consequence (gloo's "Connection closed by peer").
    then: list[str] = field(default_factory=list)
    joined: set[str] = field(default_factory=set)    # nodes whose workers were seen at the store
    # Nodes whose torchrun had started its workers, from events: its report of a failed worker,
    # or its supervisor stopping them or finding them left. torchrun starts them only after
    # the rendezvous of every node completed (cluster.launch decides restarts on this).
    had_workers: set[str] = field(default_factory=set)
    group_ranks: dict[str, int] = field(default_factory=dict)       # label -> torch's group rank
    nodes: list[str] = field(default_factory=list)   # the nodes a scheduler gave the job
    hang: Hang | None = None
    started: float = 0.0                              # monotonic time the watch began
    not_retried: str | None = None   # why a failed run is not restarted (cluster.launch decides)
    slow: list[dict[str, Any]] = field(default_factory=list)   # the slow nodes named (cluster.observe.slow)
    # The furthest training step any rank reported done, and the newest checkpoint's step
    # (the program's own counts, docs/failures.md); None where the program reports none.
    step: int | None = None
    checkpoint: int | None = None
    planned: str | None = None     # why the launcher stopped a healthy attempt (a grow)

    @property
    def ok(self) -> bool:
        return (self.first_failure is None and not self.interrupted and self.hang is None
                and self.planned is None)

    def leftovers(self) -> dict[str, list[int]]:
        return {k: v["left"] for k, v in self.stops.items() if v.get("left")}
