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

What it costs: a report and a check touch only what changed, never every node: each node keeps
its window's times sorted (its medians at hand), the job keeps every node's pace sorted (its
median at hand), and a report's check looks only at the nodes above the ratio, from the top.
A first version recomputed every node's median and, for every node, the job's median, at each
report: O(N^2 log N) on the thread that reads every node's output, 183 ms a report at 1,000
nodes (bench/slow_rule.py; docs/SCALE.md).
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from ..spec import SlowNode

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
    order: int                # its place among the nodes: verdicts come in this order
    reports: deque[tuple[float, float, float]] = field(default_factory=deque)  # at, compute, data
    computes: list[float] = field(default_factory=list)     # the window's, sorted
    datas: list[float] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)
    named: bool = False
    pace: tuple[float, float] | None = None     # its pace in the job's comparison, or out of it


class SlowNodes:
    """Feed it `report(node, times, at)`; `check(at)` returns the nodes named now (each once).
    Times never go back (the watcher's monotonic clock): an earlier one counts as the latest."""

    def __init__(self, settings: SlowNode = SlowNode()) -> None:
        self.settings = settings
        self.nodes: dict[str, _Node] = {}
        self.named: list[Verdict] = []
        self.now = -math.inf
        self.window: deque[tuple[float, str]] = deque()     # every report in the window, in order
        self.seen: OrderedDict[str, float] = OrderedDict()  # node -> its last report, oldest first
        self.changed: set[str] = set()                      # nodes whose pace is to be redone
        # the paces of the nodes compared, sorted: compute, data, and (compute + data, order, node)
        self.computes: list[float] = []
        self.datas: list[float] = []
        self.sums: list[tuple[float, int, str]] = []

    def report(self, node: str, times: dict[int, tuple[float, float]], at: float) -> None:
        """times: rank -> (compute, data) seconds per step, its mean since its last report. A
        rank's time that is not a finite number says nothing and is left out."""
        times = {r: cd for r, cd in times.items() if math.isfinite(cd[0]) and math.isfinite(cd[1])}
        if not times:
            return
        at = self._advance(at)
        n = self.nodes.get(node)
        if n is None:
            n = self.nodes[node] = _Node(first=at, order=len(self.nodes))
        n.ranks.update(times)
        # the node's slowest rank sets its pace (its other ranks wait for it too)
        compute, data = max(times.values(), key=lambda cd: cd[0] + cd[1])
        n.reports.append((at, compute, data))
        insort(n.computes, compute)
        insort(n.datas, data)
        self.window.append((at, node))
        self.seen[node] = at
        self.seen.move_to_end(node)
        self.changed.add(node)

    def check(self, at: float) -> list[Verdict]:
        at = self._advance(at)
        self._repace()
        count = len(self.sums)
        if count < 2:
            return []
        new: list[Verdict] = []
        for name, ref_c, ref_d, ref, reference in self._candidates():
            node = self.nodes[name]
            assert node.pace is not None
            compute, data = node.pace
            ratio = (compute + data) / ref if ref > 0 else 1.0
            if node.named or ratio < self.settings.ratio or at - node.first < self.settings.window:
                continue
            node.named = True
            part = "compute" if compute - ref_c >= data - ref_d else "data"
            verdict = Verdict(name, sorted(node.ranks), ratio, part, compute, data, ref_c, ref_d,
                              after=at - node.first, reference=reference)
            self.named.append(verdict)
            new.append(verdict)
        return new

    def _candidates(self) -> list[tuple[str, float, float, float, str]]:
        """The nodes that may be named now, in the order they first reported, each with its
        reference (compute, data, pace) and what that is."""
        if len(self.sums) == 2:         # two nodes: each against the other one
            (s1, _, a), (s2, _, b) = self.sums
            pa, pb = self.nodes[a].pace, self.nodes[b].pace
            assert pa is not None and pb is not None
            pairs = [(a, *pb, s2, "the other node's"), (b, *pa, s1, "the other node's")]
            return sorted(pairs, key=lambda c: self.nodes[c[0]].order)
        # more: the job's median, the node itself included; the upper median for the pace:
        # with half the job slow, the slow half is not "a slow node"
        ref_c, ref_d = _median(self.computes), _median(self.datas)
        ref = self.sums[len(self.sums) // 2][0]
        top = []
        for s, order, name in reversed(self.sums):      # from the slowest, while over the ratio
            if ref > 0 and s / ref < self.settings.ratio:
                break
            top.append((order, name))
        return [(name, ref_c, ref_d, ref, "the job's median") for _, name in sorted(top)]

    def _advance(self, at: float) -> float:
        """Time moves to `at`: reports older than the window leave it, nodes silent for
        RECENT_S seconds leave the comparison. Each report leaves once: O(1) a report."""
        at = self.now = max(at, self.now)
        horizon = at - self.settings.window
        while self.window and self.window[0][0] < horizon:
            _, name = self.window.popleft()
            n = self.nodes[name]
            _, compute, data = n.reports.popleft()
            _remove(n.computes, compute)
            _remove(n.datas, data)
            self.changed.add(name)
        while self.seen:
            name, last = next(iter(self.seen.items()))
            if last >= at - RECENT_S:
                break
            del self.seen[name]
            self.changed.add(name)
        return at

    def _repace(self) -> None:
        """Each changed node's pace over the window (median compute, median data) into the
        job's sorted paces; a node with no report in the last RECENT_S seconds is left out."""
        for name in self.changed:
            n = self.nodes[name]
            if n.pace is not None:
                compute, data = n.pace
                _remove(self.computes, compute)
                _remove(self.datas, data)
                _remove(self.sums, (compute + data, n.order, name))
                n.pace = None
            if name in self.seen and n.reports:
                compute, data = n.pace = (_median(n.computes), _median(n.datas))
                insort(self.computes, compute)
                insort(self.datas, data)
                insort(self.sums, (compute + data, n.order, name))
        self.changed.clear()


def _median(values: list[float]) -> float:
    """The median of sorted values, as statistics.median computes it."""
    half = len(values) // 2
    return values[half] if len(values) % 2 else (values[half - 1] + values[half]) / 2


def _remove(values: list[Any], value: Any) -> None:
    """Take one `value` out of sorted `values`."""
    del values[bisect_left(values, value)]
