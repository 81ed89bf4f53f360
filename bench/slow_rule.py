#!/usr/bin/env python3
"""The slow-node rule's cost per report, before and after, measured in the same run.

The watcher feeds the rule (cluster.observe.slow) every node's step times as they come, on the thread
that reads every node's output, and checks after each report. This drives both the rule as it
was (BeforeSlowNodes below, a copy of cluster/slow.py at e8c3cd2, now cluster/observe/slow.py) and the rule now with
stand-in nodes: each reports once a second (2 ranks, times with 10% noise, one node 1.5x
slower), 60 s of reports fill the window first, then each report is followed by a check, as
in cluster/observe/watch.py. Prints the cost of one report (report + check), median of the repeats,
at each size, and the ratio; and checks that both name the same nodes, at the same times,
with the same figures, on a smaller job run for a few windows.

    python bench/slow_rule.py                     # 256 and 1,000 nodes
    python bench/slow_rule.py --nodes 64,256,1000 --repeats 5
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import platform
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.observe.slow import RECENT_S, SlowNodes, Verdict  # noqa: E402
from cluster.spec import SlowNode  # noqa: E402


class Rule(Protocol):
    def report(self, node: str, times: dict[int, tuple[float, float]], at: float) -> None: ...
    def check(self, at: float) -> list[Verdict]: ...


@dataclass
class _BeforeNode:
    first: float
    reports: deque[tuple[float, float, float]] = field(default_factory=deque)  # at, compute, data
    ranks: set[int] = field(default_factory=set)
    named: bool = False


class BeforeSlowNodes:
    """cluster.observe.slow.SlowNodes as it was before 2026-12-06 (at e8c3cd2), unchanged."""

    def __init__(self, settings: SlowNode = SlowNode()) -> None:
        self.settings = settings
        self.nodes: dict[str, _BeforeNode] = {}
        self.named: list[Verdict] = []

    def report(self, node: str, times: dict[int, tuple[float, float]], at: float) -> None:
        """times: rank -> (compute, data) seconds per step, its mean since its last report."""
        if not times:
            return
        n = self.nodes.setdefault(node, _BeforeNode(first=at))
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


def stand_ins(count: int, seed: int = 1) -> Callable[[int, float], dict[int, tuple[float, float]]]:
    """Node i's ranks' times at a moment: 0.2 s compute and 0.02 s data, +-10%; node 1 1.5x."""
    rng = random.Random(seed)

    def times(i: int, _at: float) -> dict[int, tuple[float, float]]:
        slow = 1.5 if i == 1 else 1.0
        return {2 * i + r: (0.2 * slow * rng.uniform(0.9, 1.1), 0.02 * rng.uniform(0.9, 1.1))
                for r in range(2)}
    return times


def fill(rule: Rule, count: int, seconds: int, times: Callable[..., dict[int, tuple[float, float]]]
         ) -> None:
    """`seconds` of reports from every node, once a second, without checks (the window)."""
    for second in range(seconds):
        for i in range(count):
            rule.report(f"n{i}", times(i, float(second)), float(second))


def per_report(rule: Rule, count: int, reports: int, start: float,
               times: Callable[..., dict[int, tuple[float, float]]]) -> float:
    """Seconds of one report and the check after it, over `reports` reports in node order: the
    CPU time of this thread (the watcher's reading thread's cost, whatever else the machine
    runs)."""
    began = time.thread_time()
    for k in range(reports):
        at = start + k / count
        rule.report(f"n{k % count}", times(k % count, at), at)
        rule.check(at)
    return (time.thread_time() - began) / reports


def cost(make: Callable[[], Rule], count: int, reports: int, repeats: int) -> float:
    results = []
    for repeat in range(repeats):
        rule, times = make(), stand_ins(count, seed=repeat)
        fill(rule, count, 60, times)
        results.append(per_report(rule, count, reports, 60.0, times))
    return statistics.median(results)


def verdicts(rule: Rule, count: int, seconds: int) -> list[tuple[float, dict[str, object]]]:
    """Every node reports once a second, each report checked; what was named, and when."""
    times, named = stand_ins(count), []
    for second in range(seconds):
        for i in range(count):
            at = second + i / count
            rule.report(f"n{i}", times(i, at), at)
            named += [(at, v.record()) for v in rule.check(at)]
    return named


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="256,1000", help="sizes, comma separated")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    settings = SlowNode()
    before_named = verdicts(BeforeSlowNodes(settings), 16, 150)
    same = before_named == verdicts(SlowNodes(settings), 16, 150)
    print(f"verdicts identical, 16 nodes x 150 s, each report checked: {same} "
          f"({len(before_named)} named: {[v['node'] for _, v in before_named]})")
    print(f"python {platform.python_version()} on {platform.processor() or platform.machine()}, "
          f"{a.repeats} repeats, median; CPU time of the checking thread")
    print(f"{'nodes':>6} {'before ms/report':>17} {'now ms/report':>14} {'before/now':>10} "
          f"{'before: CPU s per s of the job':>31}")
    for count in (int(n) for n in a.nodes.split(",")):
        # the rule before takes long at 1,000 nodes: a sample of its reports
        before = cost(lambda: BeforeSlowNodes(settings), count, max(10, 8000 // count), a.repeats)
        now = cost(lambda: SlowNodes(settings), count, count * 5, a.repeats)
        print(f"{count:>6} {before * 1e3:>17.3f} {now * 1e3:>14.4f} {before / now:>10.0f} "
              f"{before * count:>31.2f}")
    print("(a job whose nodes report once a second needs `nodes x ms/report` ms of the reading "
          "thread each second; past 1,000 ms it falls behind)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
