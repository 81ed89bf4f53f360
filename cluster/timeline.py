"""A run's timeline: what happened to each node and when, recorded as it happens, from facts
(the launch flow's steps, a node's records and exit as the watcher receives them), never from
a sample.

    runs/<run-id>/events.jsonl    one event a line, appended as it happens (private, 0600)
    runs/<run-id>/timeline.json   the events grouped for the picture: a lane per node, each
                                  attempt a band (timeline(), pure); always written
    runs/<run-id>/timeline.png    the picture (cluster.timeline_png; needs matplotlib)

Each event has its wall clock time (`t`, for display) and the launcher's monotonic clock
(`m`), both read once when it is recorded: positions on the picture come from `m`, so a wall
clock that jumps (NTP) moves nothing. Beats and output lines come often: a node's first is
recorded, then at most one each THIN seconds, with how many it stands for (`n`).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .runs import write_private

Event = dict[str, Any]

# The kinds, a node's (node set) or the whole job's (node None).
CHECK = "check"            # the check of every node began
CHECKED = "checked"        # ... and ended (ok)
START = "start"            # the nodes are being started (attempt)
STARTED = "started"        # ... they were (nodes: the labels)
DETACHED = "detached"      # the launcher left: nothing after this is recorded
JOINED = "joined"          # a node: all its workers reached the rendezvous store
OUTPUT = "output"          # a node printed (its first line, then thinned)
BEAT = "beat"              # a node's heartbeat moved: a step of the reference trainer
FAILED = "failed"          # the first failure (a node's, or its torchrun's report)
STOP = "stop"              # every node named is being stopped (nodes, why)
HANG = "hang"              # the watchdog fired: no progress for `quiet` s
INTERRUPTED = "interrupted"
EXIT = "exit"              # a node ended (ok, how)
ENDED = "ended"            # an attempt's watch ended (how: finished, a node failed, a hang)
RESTART = "restart"        # the whole job starts again (why)
OUTCOME = "outcome"        # how the launch ended (ok, error)
SLOW = "slow"              # a node persistently slower than the others (issue 26 item 1)

THIN = 5.0                 # seconds between two recorded beats (or output lines) of a node

EVENTS, JSON_NAME, PNG_NAME = "events.jsonl", "timeline.json", "timeline.png"


class Recorder:
    """Events in, each handed to `sink` (EventsFile, a list's append in tests). Without a
    sink it records nothing: the watcher's default. Thread-safe (a pump thread per node)."""

    def __init__(self, sink: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, thin: float = THIN) -> None:
        self.sink, self.clock, self.wall, self.thin = sink, clock, wall, thin
        self.attempt = 0
        self.lock = threading.Lock()
        self.last: dict[tuple[str, str], float] = {}           # (kind, node) -> m recorded
        self.held: dict[tuple[str, str], Event] = {}           # thinned, not yet written
        self.kinds: set[str] = set()                            # the kinds recorded so far

    def event(self, kind: str, node: str | None = None, **detail: Any) -> None:
        if self.sink is None:
            return
        with self.lock:
            if kind in (EXIT, HANG, STOP):      # the last beat before an end is a fact too
                self._flush(node)
            self.sink(self._stamp(kind, node, detail))

    def beat(self, node: str) -> None:
        self._thinned(BEAT, node)

    def output(self, node: str) -> None:
        self._thinned(OUTPUT, node)

    def flush(self) -> None:
        """Write every held (thinned) event: at the end of an attempt."""
        with self.lock:
            self._flush(None)

    def _stamp(self, kind: str, node: str | None, detail: dict[str, Any]) -> Event:
        self.kinds.add(kind)
        ev: Event = {"t": round(self.wall(), 3), "m": round(self.clock(), 3), "kind": kind,
                     "attempt": self.attempt}
        if node is not None:
            ev["node"] = node
        ev.update(detail)
        return ev

    def _thinned(self, kind: str, node: str) -> None:
        """The first, then at most one each `thin` s; one held back carries the count."""
        if self.sink is None:
            return
        with self.lock:
            key = (kind, node)
            held = self.held.get(key)
            ev = self._stamp(kind, node, {"n": (held["n"] if held else 0) + 1})
            last = self.last.get(key)
            if last is not None and ev["m"] - last < self.thin:
                self.held[key] = ev
                return
            self.held.pop(key, None)
            self.last[key] = ev["m"]
            self.sink(ev)

    def _flush(self, node: str | None) -> None:
        """The held events of `node`, or of every node, in the order they happened."""
        keys = [k for k in self.held if node is None or k[1] == node]
        for ev in sorted((self.held.pop(k) for k in keys), key=lambda e: e["m"]):
            if self.sink is not None:
                self.sink(ev)


class EventsFile:
    """A sink: runs/<id>/events.jsonl, appended a line per event, private (0600)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)


def recorder_for(run_dir: Path) -> Recorder:
    return Recorder(EventsFile(run_dir / EVENTS))


def read_events(path: Path) -> list[Event]:
    """The recorded events, in order; a line cut short (the launcher killed mid-write) is
    left out."""
    try:
        text = path.read_text()
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and "kind" in ev:
            events.append(ev)
    return events


# -- events -> the timeline (pure) --

def timeline(events: Iterable[Event], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The events grouped for the picture. Times are seconds from the first event (`x`, from
    the monotonic clock); `start` is its wall clock time.

        lanes     node label -> its events (x, kind, attempt, detail), in order
        job       the whole job's events (check, start, stop, hang, restart, outcome)
        attempts  [{attempt, start, end, ended}] each attempt's band
        checks    [{attempt, start, end, ok}]
        stalled   [{attempt, at, hang}] where progress stopped, for each hang
        notes     what the picture cannot show (a detached run's later life)
    """
    meta = meta or {}
    evs = sorted(events, key=lambda e: (e.get("m", 0.0), e.get("t", 0.0)))
    out: dict[str, Any] = {"run_id": meta.get("run_id"), "backend": meta.get("backend"),
                           "start": evs[0]["t"] if evs else meta.get("created"),
                           "end": 0.0, "lanes": {}, "job": [], "attempts": [], "checks": [],
                           "stalled": [], "notes": [], "events": len(evs)}
    if not evs:
        out["notes"].append("no events were recorded for this run (it predates the timeline, "
                            "or never reached its check)")
        out["lanes"] = {n: [] for n in _meta_nodes(meta)}
        return out
    m0 = evs[0].get("m", 0.0)
    for ev in evs:
        item = {k: v for k, v in ev.items() if k not in ("t", "m", "node")}
        item["x"] = round(ev.get("m", m0) - m0, 3)
        if "node" in ev:
            out["lanes"].setdefault(ev["node"], []).append(item)
        else:
            out["job"].append(item)
        if ev["kind"] == STARTED:                     # a lane for every node started
            for node in ev.get("nodes") or ():
                out["lanes"].setdefault(node, [])
    out["end"] = max(item["x"] for item in _all(out))
    out["attempts"] = _attempts(out)
    out["checks"] = _checks(out["job"], out["end"])
    out["stalled"] = [{"attempt": h["attempt"], "at": round(max(0.0, h["x"] - h.get("quiet", 0.0)), 3),
                       "hang": h["x"]} for h in out["job"] if h["kind"] == HANG]
    if any(j["kind"] == DETACHED for j in out["job"]):
        out["notes"].append("detached: the launcher recorded only the check and the start; "
                            "what the nodes did after is in `cluster status` and their logs")
    return out


def _meta_nodes(meta: dict[str, Any]) -> list[str]:
    return [f"{n.get('name')} {n.get('rank')}" for n in meta.get("nodes") or []]


def _all(out: dict[str, Any]) -> list[dict[str, Any]]:
    return out["job"] + [item for lane in out["lanes"].values() for item in lane]


def _attempts(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Each attempt from its first event to its last, and how it ended."""
    spans: dict[int, dict[str, Any]] = {}
    for item in _all(out):
        span = spans.setdefault(item.get("attempt", 0), {"attempt": item.get("attempt", 0),
                                                         "start": item["x"], "end": item["x"],
                                                         "ended": None})
        span["start"], span["end"] = min(span["start"], item["x"]), max(span["end"], item["x"])
        if item["kind"] == ENDED:
            span["ended"] = item.get("how")
        elif item["kind"] == OUTCOME and span["ended"] is None:
            span["ended"] = "finished" if item.get("ok") else item.get("error")
    return [spans[k] for k in sorted(spans)]


def _checks(job: list[dict[str, Any]], end: float) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    for item in job:
        if item["kind"] == CHECK:
            checks.append({"attempt": item.get("attempt", 0), "start": item["x"], "end": None,
                           "ok": None})
        elif item["kind"] == CHECKED and checks:
            checks[-1].update(end=item["x"], ok=True)
        elif item["kind"] == OUTCOME and checks and checks[-1]["end"] is None:
            checks[-1].update(end=item["x"], ok=False)        # the check failed: nothing started
    for c in checks:
        if c["end"] is None:
            c["end"] = end
    return checks


def write_json(run_dir: Path, data: dict[str, Any]) -> Path:
    path = run_dir / JSON_NAME
    write_private(path, json.dumps(data, indent=1) + "\n")
    return path
