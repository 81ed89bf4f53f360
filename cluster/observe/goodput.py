"""Goodput: how much of a run's wall time trained, and where the rest went. Read from the
run's events (the timeline's one record), never measured apart; pure.

The wall time runs from the run's first event (its first check) to its last (the outcome), or
to `end` while it lives. Each attempt's stretch (its check to the next attempt's) is cut into
parts, every second counted once (a sweep over labelled intervals, the higher part winning
where two overlap), so the parts add up to the wall time:

    detection    last progress to the stop: a hang's quiet time and its stacks (the watchdog's
                 own `quiet`), or a lost node's silence up to the failure
    checkpoint   the checkpoint saves: each save's seconds as the program reports them (the
                 step lines' cumulative "saving"), ending at the launcher's news of it
    redone       work a restart repeated: from the attempt's newest checkpoint (or its first
                 step, with none) to its last progress, when another attempt followed
    startup      the first attempt's check, start, and its first step (its set-up and load)
    rendezvous   the start returned to every node's workers joined, or the program's first
                 heartbeat if sooner (torchrun's import, the rendezvous, the workers' spawn)
    restart      a later attempt's check, start and first step, and a failed attempt's time
                 from its failure to the next check (the stop, the set-aside, the gate)
    training     first step to last progress, less the parts above and the slow node's cost
    slow         the slow node's cost: the training time after a node is named slow, times
                 1 - (the job's median pace / the slow node's pace): what the job would have
                 saved at the median node's pace
    ending       the last progress to the launcher's end (a final save, torchrun's exit)

Progress is the nodes' beats that name a step (the reference trainer's, or any program's step
lines, docs/failures.md); a program that only touches $CLUSTER_HEARTBEAT_FILE: its beats
("beats"); one that never beats: training is counted from every node joined to the attempt's
first end ("joined"). `measured` says which.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import timeline as tl
from ..errors import InputError
from ..runs import RunDir

Event = dict[str, Any]

# The parts, in their order of precedence where two overlap (the first wins).
PARTS = ("detection", "checkpoint", "redone", "rendezvous", "startup", "restart", "ending",
         "slow", "training")
NAMES = {"training": "training", "startup": "start-up", "rendezvous": "rendezvous",
         "checkpoint": "checkpoint saves", "restart": "restarts", "redone": "work redone",
         "detection": "hang/failure detection", "slow": "slow node", "ending": "ending"}
SHORT = {"training": "train", "startup": "start", "rendezvous": "rdzv", "checkpoint": "ckpt",
         "restart": "restart", "redone": "redone", "detection": "detect", "slow": "slow",
         "ending": "end"}                      # a table's columns


@dataclass
class Attempt:
    """One attempt's facts, from its events."""
    number: int
    start: float                         # its first event (the check)
    end: float = 0.0                     # the next attempt's first event, or the run's end
    started: float | None = None         # STARTED: the start returned
    joined: float | None = None          # the last node's JOINED
    first: float | None = None           # its first beat
    last: float | None = None            # its last beat
    first_step: float | None = None      # its first beat that named a step (a step done)
    last_step: float | None = None       # ... and its last
    failed: float | None = None          # its first failure
    stalled: float | None = None         # a hang: where progress stopped ...
    stopped: float | None = None         # ... and the stop that followed
    exited: float | None = None          # its first node's exit
    saves: list[tuple[float, float]] = field(default_factory=list)    # (m, seconds)
    checkpoints: list[float] = field(default_factory=list)  # the newest checkpoints' m
    slow: tuple[float, float] | None = None   # (m named, the job's pace / its pace)
    followed: bool = False               # another attempt came after it


def goodput(events: Iterable[Event], end: float | None = None) -> dict[str, Any] | None:
    """The run's goodput and its parts (seconds), each attempt's, and the band's segments
    (x from the first event). None with no events, or for a detached run (its life after the
    start is not in the launcher's record)."""
    facts = Facts()
    for ev in events:
        facts.add(ev)
    return facts.result(end)


class Facts:
    """What goodput needs of the events, taken as they come (a recorder's listener: O(1) an
    event, memory bounded by the attempts), and the goodput up to any moment (result()): the
    live metrics ask it at each scrape without reading the events file again."""

    def __init__(self) -> None:
        self.attempts: dict[int, Attempt] = {}
        self.first_m: float | None = None
        self.last_m: float | None = None
        self.beats = self.steps = self.detached = False
        self.saving: dict[int, float] = {}           # an attempt's cumulative "saving" so far
        self.lock = threading.Lock()

    def add(self, ev: Event) -> None:
        m = ev.get("m")
        if not isinstance(m, (int, float)) or not isinstance(ev.get("kind"), str):
            return
        with self.lock:
            self.first_m = m if self.first_m is None else min(self.first_m, m)
            self.last_m = m if self.last_m is None else max(self.last_m, m)
            n = ev.get("attempt", 0) if isinstance(ev.get("attempt"), int) else 0
            a = self.attempts.get(n)
            if a is None:
                a = self.attempts[n] = Attempt(n, m)
            a.start = min(a.start, m)
            self.beats |= ev["kind"] == tl.BEAT
            self.steps |= ev["kind"] == tl.BEAT and isinstance(ev.get("step"), int)
            self.detached |= ev["kind"] == tl.DETACHED
            _note(a, ev, m, self.saving)

    def result(self, end: float | None = None) -> dict[str, Any] | None:
        """The goodput up to `end` (the launcher's clock; default: the last event)."""
        with self.lock:
            if self.first_m is None or self.last_m is None or self.detached:
                return None
            attempts = [dataclasses.replace(self.attempts[k]) for k in sorted(self.attempts)]
            first_m, last_m = self.first_m, self.last_m
            measured = "steps" if self.steps else "beats" if self.beats else "joined"
        end = last_m if end is None else max(end, last_m)
        for a, nxt in zip(attempts, attempts[1:]):
            a.end, a.followed = nxt.start, True
        attempts[-1].end = end
        rows, segments = [], []
        for a in attempts:
            parts, segs = _cut(a, measured)
            rows.append(_row(parts, a.end - a.start, attempt=a.number))
            segments += [(round(x0 - first_m, 3), round(x1 - first_m, 3), part)
                         for x0, x1, part in segs]
        total = {p: sum(r["parts"][p] for r in rows) for p in PARTS}
        out = _row(total, end - first_m)
        out.update(measured=measured, attempts=rows, segments=_merged(segments))
        return out


def _row(parts: dict[str, float], wall: float, **extra: Any) -> dict[str, Any]:
    wall = max(wall, 0.0)
    return {**extra, "wall": round(wall, 3), "productive": round(parts["training"], 3),
            "fraction": round(parts["training"] / wall, 4) if wall > 0 else None,
            "parts": {p: round(parts[p], 3) for p in PARTS}}


# -- the facts --

# An attempt keeps at most this many saves and checkpoints: past it, two neighbouring saves
# become one (their seconds added, at the later one's time): the total stays exact.
KEEP_SAVES = 128


def _note(a: Attempt, ev: Event, m: float, saving: dict[int, float]) -> None:
    kind = ev["kind"]
    if kind == tl.STARTED:
        a.started = m
    elif kind == tl.JOINED:
        a.joined = m if a.joined is None else max(a.joined, m)
    elif kind == tl.BEAT:
        a.first = m if a.first is None else min(a.first, m)
        a.last = m if a.last is None else max(a.last, m)
        if isinstance(ev.get("step"), int):
            a.first_step = m if a.first_step is None else min(a.first_step, m)
            a.last_step = m if a.last_step is None else max(a.last_step, m)
    elif kind == tl.FAILED and a.failed is None:
        a.failed = m
    elif kind == tl.HANG:
        quiet = ev.get("quiet", 0.0)
        a.stalled = m - (quiet if isinstance(quiet, (int, float)) else 0.0)
    elif kind == tl.STOP and a.stopped is None and a.stalled is not None:
        a.stopped = m
    elif kind == tl.EXIT and a.exited is None:
        a.exited = m
    elif kind == tl.CHECKPOINT:
        _checkpoint(a, ev, m, saving)
    elif kind == tl.SLOW and a.slow is None:
        pace = _num(ev, "compute_s") + _num(ev, "data_s")
        ref = _num(ev, "ref_compute_s") + _num(ev, "ref_data_s")
        if pace > 0 and 0 < ref < pace:
            a.slow = (m, ref / pace)


def _checkpoint(a: Attempt, ev: Event, m: float, saving: dict[int, float]) -> None:
    """A save's seconds: the growth of the attempt's cumulative "saving" since its last."""
    if isinstance(ev.get("step"), int):
        a.checkpoints = a.checkpoints[-KEEP_SAVES:] + [m]
    total = ev.get("saving")
    if isinstance(total, (int, float)) and total > saving.get(a.number, 0.0):
        a.saves.append((m, total - saving.get(a.number, 0.0)))
        saving[a.number] = float(total)
        if len(a.saves) > KEEP_SAVES:
            pairs = zip(a.saves[::2], a.saves[1::2])
            a.saves = [(later[0], sooner[1] + later[1]) for sooner, later in pairs] + \
                a.saves[len(a.saves) // 2 * 2:]


def _num(ev: Event, key: str) -> float:
    value = ev.get(key)
    return float(value) if isinstance(value, (int, float)) else 0.0


# -- the cut --

Interval = tuple[float, float, str]


def _cut(a: Attempt, measured: str) -> tuple[dict[str, float], list[Interval]]:
    """The attempt's stretch cut into parts: seconds per part, and the segments in order."""
    intervals = _intervals(a, measured)
    cuts = sorted({a.start, a.end} | {x for i in intervals for x in i[:2] if a.start < x < a.end})
    rank = {p: i for i, p in enumerate(PARTS)}
    parts = dict.fromkeys(PARTS, 0.0)
    segments: list[Interval] = []
    for x0, x1 in zip(cuts, cuts[1:]):
        covering = [p for s, e, p in intervals if s <= x0 and x1 <= e]
        part = min(covering, key=rank.__getitem__) if covering else _idle(a)
        if part == "slow" and a.slow is not None:      # only the pace's excess is the cost
            parts["slow"] += (x1 - x0) * (1 - a.slow[1])
            parts["training"] += (x1 - x0) * a.slow[1]
        else:
            parts[part] += x1 - x0
        segments.append((x0, x1, part))
    return parts, segments


def _idle(a: Attempt) -> str:
    """What a second no interval covers counts as: before any step, the attempt's set-up."""
    return "startup" if a.number == 0 else "restart"


def _intervals(a: Attempt, measured: str) -> list[Interval]:
    """The labelled intervals of one attempt (they may overlap: the sweep ranks them)."""
    setup = _idle(a)
    first, last = _progress(a, measured)
    out: list[Interval] = []
    if a.started is not None:
        out.append((a.start, a.started, setup))
        # the joins are seen by a scan of the node's processes (every 0.25-2 s): the
        # program's first heartbeat, when sooner, says its workers were up
        seen = [x for x in (a.joined, a.first, first) if x is not None]
        joined = min(seen) if seen else a.started
        out.append((a.started, joined, "rendezvous"))
    if first is None or last is None:
        return out + _after(a, a.started or a.start)
    out.append((a.start, first, setup))
    out.append((first, last, "training"))
    if a.slow is not None and a.slow[0] < last:
        out.append((max(first, a.slow[0]), last, "slow"))
    if a.followed:
        newest = [m for m in a.checkpoints if first <= m <= last]
        out.append((max(newest) if newest else first, last, "redone"))
    out += [(m - seconds, m, "checkpoint") for m, seconds in a.saves]
    return out + _after(a, last)


def _progress(a: Attempt, measured: str) -> tuple[float | None, float | None]:
    """The attempt's first and last progress: its beats; a program that never beats, from
    every node joined to the attempt's first end (failure, stall, stop or last exit)."""
    if measured == "steps":
        return a.first_step, a.last_step
    if measured == "beats":
        return a.first, a.last
    if a.joined is None:
        return None, None
    ends = [x for x in (a.failed, a.stalled) if x is not None] or [a.exited or a.end]
    return a.joined, max(a.joined, min(ends))


def _after(a: Attempt, last: float) -> list[Interval]:
    """From the last progress on: the detection of a hang or failure, then the restart (with
    another attempt after it) or the ending."""
    out: list[Interval] = []
    if a.stalled is not None:
        out.append((min(a.stalled, last), a.stopped if a.stopped is not None else a.end,
                    "detection"))
    elif a.failed is not None and a.failed > last:
        out.append((last, a.failed, "detection"))
    out.append((last, a.end, "restart" if a.followed else "ending"))
    return out


def _merged(segments: list[Interval]) -> list[Interval]:
    """Neighbouring segments of one part as one."""
    out: list[Interval] = []
    for s in segments:
        if out and out[-1][2] == s[2] and abs(out[-1][1] - s[0]) < 1e-9:
            out[-1] = (out[-1][0], s[1], s[2])
        elif s[1] > s[0]:
            out.append(s)
    return out


# -- what is said --

def line(g: dict[str, Any]) -> str:
    """'goodput 81.2% of 62.1 s: training 50.4 s, start-up 4.1 s, ...' (the parts over 0)."""
    frac = g.get("fraction")
    head = (f"goodput {frac * 100:.1f}% of {g['wall']:.1f} s" if frac is not None
            else f"goodput: n/a ({g['wall']:.1f} s)")
    parts = [f"{NAMES[p]} {s:.1f} s" for p, s in _ordered(g["parts"]) if s >= 0.05]
    note = {"joined": " (no heartbeat: training counted from the rendezvous)",
            "beats": " (no step lines: training counted from the first heartbeat)"}.get(
                g.get("measured") or "", "")
    return f"{head}: {', '.join(parts)}{note}"


def _ordered(parts: dict[str, float]) -> list[tuple[str, float]]:
    """training first, then the rest largest first."""
    rest = sorted(((p, s) for p, s in parts.items() if p != "training"), key=lambda x: -x[1])
    return [("training", parts.get("training", 0.0))] + rest


# -- runs --

def of_run(rd: RunDir) -> dict[str, Any] | None:
    """A run's goodput: as its launcher recorded it at the end (run.json), else from its
    events (a launcher that was killed: up to its last event). Without the band's segments."""
    try:
        recorded = rd.meta().get("goodput")
    except InputError:
        recorded = None
    found = recorded if isinstance(recorded, dict) else goodput(tl.read_events(rd.path / tl.EVENTS))
    return None if found is None else {k: v for k, v in found.items() if k != "segments"}


def recent(root: Path, inventory: Path | None, last: int) -> list[tuple[RunDir, dict[str, Any]]]:
    """The newest `last` runs under root with a goodput (launched, attached), newest first;
    with `inventory`, only the runs of that inventory file."""
    found: list[tuple[RunDir, dict[str, Any]]] = []
    for path in sorted(root.glob("*/run.json"), key=lambda p: p.parent.name, reverse=True):
        rd = RunDir(path.parent)
        if inventory is not None and _source(rd) != inventory.resolve():
            continue
        g = of_run(rd)
        if g is not None:
            found.append((rd, g))
        if len(found) >= last:
            break
    return found


def _source(rd: RunDir) -> Path | None:
    try:
        source, cwd = rd.inventory().source, rd.meta().get("cwd") or "."
    except InputError:
        return None
    return (Path(cwd) / source).resolve() if source else None
