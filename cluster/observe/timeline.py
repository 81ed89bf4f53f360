"""A run's timeline: what happened to each node and when, recorded as it happens, from facts
(the launch flow's steps, a node's records and exit as the watcher receives them), never from
a sample.

    runs/<run-id>/events.jsonl    one event a line, appended as it happens (private, 0600)
    runs/<run-id>/timeline.json   the events grouped for the picture: a lane per node, each
                                  attempt a band (timeline(), pure); always written
    runs/<run-id>/timeline.png    the picture (cluster.observe.timeline_png; needs matplotlib)

Each event has its wall clock time (`t`, for display) and the launcher's monotonic clock
(`m`), both read once when it is recorded: positions on the picture come from `m`, so a wall
clock that jumps (NTP) moves nothing. Beats and output lines come often: a node's first is
recorded, then at most one each THIN seconds, with how many it stands for (`n`).

What is kept is bounded, whatever the run's length: every other event is kept (a node's
join, failure, exit, the stops: a few a node and attempt), but of a node's beats (and of its
output marks) an attempt at most KEEP lines. When one series reaches KEEP, the interval
between two recorded doubles and the file is thinned to it (EventsFile.compact: the first and
the last of each series kept, the counts carried): the series keep one spacing from the start
to the end, 5 s, 10 s, 20 s ... as the run goes on, about KEEP / 2 to KEEP lines each. Beats
recorded every 5 s grew the file without bound (1.2 GB at 128 nodes over 72 h); now it stays
under 4 MB there, about 25 KB a node, and the file is rewritten about once per doubling of the
run's age (9 times in 72 h, 0.15 s of CPU each at 128 nodes).

What is read is streamed: read_events() yields a line at a time and timeline() keeps the
frequent kinds to the same bound as it reads (bounded()), so a file of any size (one written
before the bound) is drawn in bounded memory.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..runs import write_private

Event = dict[str, Any]
Series = tuple[str, str, int]          # a frequent kind's events of one node and attempt

# The kinds, a node's (node set) or the whole job's (node None).
LAUNCH = "launch"          # the command began (its first import): recorded with that moment
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
RESTART = "restart"        # the whole job starts again (why, cause)
OUTCOME = "outcome"        # how the launch ended (ok, error)
SLOW = "slow"              # a node persistently slower than the others (issue 26 item 1)
CHECKPOINT = "checkpoint"  # a newer checkpoint was reported (step, saving: seconds saving so far)
ASIDE = "aside"            # a host set aside for the next attempt (host, why, spare)

THIN = 5.0                 # seconds between two recorded beats (or output lines) of a node
FREQUENT = (BEAT, OUTPUT, CHECKPOINT)  # the thinned kinds; every other kind is always kept
KEEP = 128                 # at most this many lines of one series (kind, node, attempt)
FEWEST = 3                 # ... and never fewer: its first, its first step, its last

EVENTS, JSON_NAME, PNG_NAME = "events.jsonl", "timeline.json", "timeline.png"


class Recorder:
    """Events in, each handed to `sink` (EventsFile, a list's append in tests). Without a
    sink it records nothing: the watcher's default. Thread-safe (a pump thread per node).

    Listeners (listen()) are told every event as it is recorded, the frequent kinds before
    they are thinned: the live views (metrics, alerts) see each beat, the file keeps a bound.
    A listener is called under the recorder's lock, so it must only take note (a dict's
    update, a queue's put); one that raises is left out from then on, never the run's."""

    def __init__(self, sink: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, thin: float = THIN,
                 keep: int = KEEP) -> None:
        self.sink, self.clock, self.wall, self.thin, self.keep = sink, clock, wall, thin, keep
        self.lines: dict[Series, int] = {}                     # frequent lines written, a series
        self.began: dict[Series, float] = {}                   # ... and the first one's m
        self.attempt = 0
        self.lock = threading.Lock()
        self.last: dict[tuple[str, str], float] = {}           # (kind, node) -> m recorded
        self.held: dict[tuple[str, str], Event] = {}           # thinned, not yet written
        self.stepped: set[Series] = set()                      # series whose first step is written
        self.kinds: set[str] = set()                            # the kinds recorded so far
        self.listeners: list[Callable[[Event], None]] = []

    def listen(self, listener: Callable[[Event], None]) -> None:
        self.listeners.append(listener)

    def event(self, kind: str, node: str | None = None, **detail: Any) -> None:
        if self.sink is None:
            return
        with self.lock:
            if kind in (EXIT, HANG, STOP):      # the last beat before an end is a fact too
                self._flush(node)
            ev = self._stamp(kind, node, detail)
            self._tell(ev)
            self.sink(ev)

    def launched(self, m: float) -> None:
        """The launch's own first moment (the command's start, before this recorder was
        made), on the recorder's clock: the run's first event."""
        if self.sink is None:
            return
        with self.lock:
            ev = self._stamp(LAUNCH, None, {})
            ev["t"] = round(ev["t"] - (ev["m"] - m), 3)
            ev["m"] = round(m, 3)
            self._tell(ev)
            self.sink(ev)

    def beat(self, node: str, **detail: Any) -> None:
        """A node's heartbeat moved; detail: what it said with it (step, work and data
        seconds per step), kept on the event."""
        self._thinned(BEAT, node, **detail)

    def output(self, node: str) -> None:
        self._thinned(OUTPUT, node)

    def checkpoint(self, step: int, **detail: Any) -> None:
        """A newer checkpoint reported (the job's, not a node's): thinned as beats are."""
        self._thinned(CHECKPOINT, None, step=step, **detail)

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

    def _thinned(self, kind: str, node: str | None, **detail: Any) -> None:
        """The first, then at most one each `thin` s; one held back carries the count. A
        node's first beat that names a step in an attempt is written at once (goodput's first
        step: the trainer beats once before its set-up)."""
        if self.sink is None:
            return
        with self.lock:
            key = (kind, node or "")
            held = self.held.get(key)
            ev = self._stamp(kind, node, {"n": (held["n"] if held else 0) + 1, **detail})
            self._tell(ev)
            last, pin = self.last.get(key), first_step(ev, self.stepped)
            if last is not None and ev["m"] - last < self.thin and not pin:
                self.held[key] = ev
                return
            self.held.pop(key, None)
            self.last[key] = ev["m"]
            self._write(ev)

    def _tell(self, ev: Event) -> None:
        for listener in list(self.listeners):
            try:
                listener(dict(ev))
            except Exception:  # a view's fault never stops the record (or the run)
                self.listeners.remove(listener)

    def _flush(self, node: str | None) -> None:
        """The held events of `node`, or of every node, in the order they happened."""
        keys = [k for k in self.held if node is None or k[1] == node]
        for ev in sorted((self.held.pop(k) for k in keys), key=lambda e: e["m"]):
            self._write(ev)

    def _write(self, ev: Event) -> None:
        """A frequent event to the sink; a series past `keep` lines doubles the interval and
        has the sink thin what it holds to it (a sink that cannot keeps what it has)."""
        if self.sink is None:
            return
        self.sink(ev)
        key = series(ev)
        self.lines[key] = self.lines.get(key, 0) + 1
        began = self.began.setdefault(key, ev["m"])
        while self.lines.get(key, 0) > max(self.keep, FEWEST):
            # at least double; enough to halve the full series at once (one rewrite, not one
            # per doubling up to the spacing it already has)
            self.thin = max(2 * self.thin, 2 * (ev["m"] - began) / self.keep)
            compact = getattr(self.sink, "compact", None)
            self.lines = compact(self.thin) if compact is not None else {}


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

    def compact(self, thin: float) -> dict[Series, int]:
        """Thin the file's frequent events to one each `thin` s a series (rethin), in place
        (a new file moved over the old one: a reader sees one or the other); the lines each
        series has now. Streamed: memory for the series, not for the file."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        lines: dict[Series, int] = {}
        with self.lock:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                for ev in rethin(read_events(self.path), thin):
                    if ev["kind"] in FREQUENT:
                        lines[series(ev)] = lines.get(series(ev), 0) + 1
                    out.write(json.dumps(ev, separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
        return lines


def recorder_for(run_dir: Path) -> Recorder:
    return Recorder(EventsFile(run_dir / EVENTS))


def read_events(path: Path) -> Iterator[Event]:
    """The recorded events, in order, a line at a time (never the whole file); a line cut
    short (the launcher killed mid-write) is left out."""
    try:
        f = path.open("rb")
    except OSError:
        return
    with f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and isinstance(ev.get("kind"), str):
                yield ev


# -- the bound on the frequent kinds --

def series(ev: Event) -> Series:
    attempt = ev.get("attempt", 0)
    return (ev["kind"], str(ev.get("node")), attempt if isinstance(attempt, int) else 0)


def first_step(ev: Event, stepped: set[Series]) -> bool:
    """Whether ev is its series' first beat that names a step (noted in `stepped`): never
    thinned away, so the moment training began stays in the record."""
    if ev["kind"] != BEAT or not isinstance(ev.get("step"), int) or series(ev) in stepped:
        return False
    stepped.add(series(ev))
    return True


def _n(ev: Event) -> int:
    """How many it stands for (a line of another hand's making: 1)."""
    n = ev.get("n", 1)
    return n if isinstance(n, int) else 1


def _m(ev: Event) -> float:
    m = ev.get("m", 0.0)
    return float(m) if isinstance(m, (int, float)) else 0.0


def rethin(events: Iterable[Event], thin: float) -> Iterator[Event]:
    """The events, each series of a frequent kind thinned to one each `thin` s: its first and
    its last kept, each one kept carrying the count (`n`) of those left out before it. Every
    other event kept, in its order. One streamed pass: a series' last, when it is too close to
    the one kept before it, comes at the end (the timeline orders by `m`, as it does the
    Recorder's held events)."""
    kept_at: dict[Series, float] = {}
    held: dict[Series, Event] = {}
    stepped: set[Series] = set()
    for ev in events:
        if ev["kind"] not in FREQUENT:
            yield ev
            continue
        key = series(ev)
        left_out = held.pop(key, None)
        ev = {**ev, "n": (left_out["n"] if left_out else 0) + _n(ev)}
        m, pin = _m(ev), first_step(ev, stepped)
        if key in kept_at and m - kept_at[key] < thin and not pin:
            held[key] = ev
            continue
        kept_at[key] = m
        yield ev
    yield from held.values()


def bounded(events: Iterable[Event], keep: int = KEEP) -> tuple[list[Event], int]:
    """The events as read, the frequent kinds held to `keep` a series as the Recorder holds
    them (all of them until one series is full, then an interval from THIN up that doubles
    each time one is full again): memory bounded by the nodes, not the file. And how many
    events were read."""
    thin = 0.0
    kept: list[Event] = []
    held: dict[Series, Event] = {}          # a series' latest, not yet kept: kept at the end
    kept_at: dict[Series, float] = {}
    began: dict[Series, float] = {}
    lines: dict[Series, int] = {}
    stepped: set[Series] = set()
    read = 0
    for ev in events:
        read += 1
        if ev["kind"] not in FREQUENT:
            kept.append(ev)
            continue
        key = series(ev)
        left_out = held.pop(key, None)
        ev = {**ev, "n": (left_out["n"] if left_out else 0) + _n(ev)}
        pin = first_step(ev, stepped)
        if key in kept_at and _m(ev) - kept_at[key] < thin and not pin:
            held[key] = ev
            continue
        kept.append(ev)
        kept_at[key] = _m(ev)
        began.setdefault(key, kept_at[key])
        lines[key] = lines.get(key, 0) + 1
        while lines.get(key, 0) > max(keep, FEWEST):
            thin = max(2 * thin, THIN, 2 * (kept_at[key] - began[key]) / keep)
            kept = list(rethin(kept, thin))
            lines = {}
            for e in kept:
                if e["kind"] in FREQUENT:
                    lines[series(e)] = lines.get(series(e), 0) + 1
                    kept_at[series(e)] = _m(e)
    return kept + list(held.values()), read


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
    kept, read = bounded(events)
    evs = sorted(kept, key=lambda e: (e.get("m", 0.0), e.get("t", 0.0)))
    out: dict[str, Any] = {"run_id": meta.get("run_id"), "backend": meta.get("backend"),
                           "start": evs[0]["t"] if evs else meta.get("created"),
                           "end": 0.0, "lanes": {}, "job": [], "attempts": [], "checks": [],
                           "stalled": [], "notes": [], "events": read}
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
