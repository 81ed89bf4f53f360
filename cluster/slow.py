"""The slow node, named while the job runs. Pure: events in (a node's ranks' step times, at a
time the caller reads from its clock), verdicts out; the Watcher owns the clock and the line.

What is compared: each rank reports, per step, its own work only, apart from the time spent
waiting for the others (the reference trainer: train/steptime.py; any program: the file
protocol in docs/failures.md): `compute` (forward and backward up to the moment its last
gradient bucket is ready for the all-reduce) and `data` (waiting on its data loader). In a
synchronous job every rank's step takes as long as the slowest one's, so the whole step time
says nothing; the own work does.

How it decides:
- A node's pace is its slowest rank's (compute + data), the median of its reports over the last
  `window` seconds: a median, so that what lasts less than half the window (a garbage
  collection, an evaluation, a pause of the data loader, the noise of a shared machine) moves
  nothing, and what lasts more than half of it does.
- The reference is the job's median pace, over all the nodes that report (the node itself
  included); with 2 nodes it is the other node: the slower of two is named when it takes
  `ratio` times the faster one's time. With 3 nodes or more a named node is slower than half
  the job, so most of the job is never named: a first version compared each node with the
  median of the OTHER nodes, and a balanced run of three nodes on two shared cores (two nodes
  sharing one core, the third alone on the other) named the two that shared, at 1.30x and
  1.32x, each against the mean of the fast node and the other sharer.
- A node is named, once per attempt, when it has reported for `window` seconds and its pace is
  at least `ratio` x its reference. Which part is slow: the one (compute or data) whose excess
  over the reference nodes' median of that part is larger.
  A first version named a node only when its pace over the last 10 s stayed above the ratio
  for the whole window without a break: on a real run (three nodes on two shared cores, one
  throttled to a quarter CPU) the short-term ratio of the throttled node swung between 0.5
  and 2.5 with 10-20 s periods, and it was never named; the window's median named it.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from .spec import SlowNode

RECENT_S = 10.0     # a node with no report for this long is left out of the comparison


@dataclass
class Verdict:
    """A node named slow: its ranks, its pace over the reference, and the slow part."""
    node: str
    ranks: list[int]
    ratio: float
    part: str                 # "compute" or "data"
    compute: float            # the node's seconds per step, and the reference's
    data: float
    ref_compute: float
    ref_data: float
    after: float = 0.0        # seconds from its first report to the verdict
    reference: str = "the job's median"     # or, with two nodes, "the other node's"

    def line(self) -> str:
        """'slow node [b 1]: ranks 2,3 take 1.52x the job's median step (compute: 0.310 s vs
        0.204 s per step)'."""
        mine, ref = (self.compute, self.ref_compute) if self.part == "compute" \
            else (self.data, self.ref_data)
        ranks = ",".join(str(r) for r in self.ranks) or "?"
        return (f"slow node [{self.node}]: ranks {ranks} take {self.ratio:.2f}x {self.reference} "
                f"step ({self.part}: {mine:.3f} s vs {ref:.3f} s per step)")

    def record(self) -> dict[str, object]:
        return {"node": self.node, "ranks": self.ranks, "ratio": round(self.ratio, 3),
                "part": self.part, "compute_s": round(self.compute, 4),
                "data_s": round(self.data, 4), "ref_compute_s": round(self.ref_compute, 4),
                "ref_data_s": round(self.ref_data, 4), "after_s": round(self.after, 1),
                "reference": self.reference}


@dataclass
class _Node:
    first: float
    reports: deque[tuple[float, float, float]] = field(default_factory=deque)  # at, compute, data
    ranks: set[int] = field(default_factory=set)
    named: bool = False


class SlowNodes:
    """Feed it `report(node, times, at)`; `check(at)` returns the nodes named now (each once)."""

    def __init__(self, settings: SlowNode = SlowNode()) -> None:
        self.settings = settings
        self.nodes: dict[str, _Node] = {}
        self.named: list[Verdict] = []

    def report(self, node: str, times: dict[int, tuple[float, float]], at: float) -> None:
        """times: rank -> (compute, data) seconds per step, its mean since its last report."""
        if not times:
            return
        n = self.nodes.setdefault(node, _Node(first=at))
        n.ranks.update(times)
        # the node's slowest rank sets its pace (its other ranks wait for it too)
        compute, data = max(times.values(), key=lambda cd: cd[0] + cd[1])
        n.reports.append((at, compute, data))
        while n.reports and n.reports[0][0] < at - self.settings.window:
            n.reports.popleft()

    def check(self, at: float) -> list[Verdict]:
        paces = self._paces(at)
        new: list[Verdict] = []
        for name, (compute, data) in paces.items():
            node = self.nodes[name]
            others = [p for other, p in paces.items() if other != name]
            if not others:
                continue
            # two nodes: the other one; more: the job's median, the node itself included
            against = others if len(others) == 1 else list(paces.values())
            ref_c = statistics.median(c for c, _ in against)
            ref_d = statistics.median(d for _, d in against)
            # the upper median: with half the job slow, the slow half is not "a slow node"
            ref = statistics.median_high(c + d for c, d in against)
            ratio = (compute + data) / ref if ref > 0 else 1.0
            if node.named or ratio < self.settings.ratio or at - node.first < self.settings.window:
                continue
            node.named = True
            part = "compute" if compute - ref_c >= data - ref_d else "data"
            verdict = Verdict(name, sorted(node.ranks), ratio, part, compute, data, ref_c, ref_d,
                              after=at - node.first, reference="the other node's"
                              if against is others else "the job's median")
            self.named.append(verdict)
            new.append(verdict)
        return new

    def _paces(self, at: float) -> dict[str, tuple[float, float]]:
        """Each node's pace over the window (median compute, median data); a node that has not
        reported in the last RECENT_S seconds is left out."""
        paces = {}
        for name, n in self.nodes.items():
            if not n.reports or n.reports[-1][0] < at - RECENT_S:
                continue
            recent = [(c, d) for t, c, d in n.reports if t >= at - self.settings.window]
            paces[name] = (statistics.median(c for c, _ in recent),
                           statistics.median(d for _, d in recent))
        return paces
