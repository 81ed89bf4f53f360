"""The node ledger: what each node did across runs, and which nodes are quarantined for it.

This module is the ledger file's one owner; everything else asks it questions (`quarantined`,
`node`) or tells it what happened (`record`, `release`). One small JSON file per inventory in
the user's state folder, private (0700 folder, 0600 file):

    ~/.local/state/cluster/ledger/<stem>-<sha256[:12] of the inventory's resolved path>.json
    ~/.local/state/cluster/ledger/local.json      (a run with no inventory file)

    {"version": 1, "inventory": "/abs/hosts.yaml",
     "nodes": {"node2": {"events": [{"kind": "lost", "run_id": "...", "time": 1733..., "detail":
                                     "one line", "evidence": "a few lines"}, ...],
                         "released": {"time": 1733..., "why": "..."}}}}

Every change is a read-modify-write under an exclusive lock on a sidecar file (`<name>.lock`),
written to a temporary file in the same folder and renamed over the old one: two launchers at
once lose nothing, and a reader never sees half a file. Each node keeps its last MAX_EVENTS
events, so a long run with many restarts never grows it without bound.

A node is quarantined while it has at least `policy.strikes` strike events (STRIKE_KINDS)
within `policy.window_s` seconds and after its last release; it leaves quarantine by
`release` or by its strikes ageing out of the window. Events carry what the launcher saw (a
kind, one line, a few lines of evidence), never an environment value; whatever came from a
node is written as a JSON string and nothing else.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..runs import make_private_dir, state_root, write_private

VERSION = 1
MAX_EVENTS = 50            # per node: the newest are kept
MAX_DETAIL = 300           # characters of an event's one line
MAX_EVIDENCE = 2000        # characters of an event's evidence (its end: where a traceback ends)
LAST_RUNS = 5              # runs a node's state lists
HEALTHY, QUARANTINED = "healthy", "quarantined"
CLEAN = "clean"
STRIKE_KINDS = frozenset({"gate", "lost", "failed_first", "hang", "slow"})
KINDS = STRIKE_KINDS | {CLEAN}


@dataclass(frozen=True)
class Policy:
    """How many strikes within how many seconds quarantine a node."""
    strikes: int = 2
    window_s: float = 24 * 3600


@dataclass(frozen=True)
class Event:
    """One thing a node did in a run: kind (KINDS), the run, one line, a few lines of evidence;
    time None is the ledger's clock when it is recorded."""
    node: str
    kind: str
    run_id: str
    detail: str = ""
    evidence: str = ""
    time: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "run_id": self.run_id, "time": self.time,
                "detail": self.detail, "evidence": self.evidence}


@dataclass(frozen=True)
class NodeState:
    """A node as the ledger judges it now. `why` has one line per strike in the window (after
    the last release), `evidence` those strikes as recorded; `since` is when the strike that
    tipped it into quarantine came; `last_runs` (run id, "clean" | "failed"), newest first."""
    name: str
    status: str = HEALTHY
    why: tuple[str, ...] = ()
    since: float | None = None
    strikes: int = 0
    evidence: tuple[Event, ...] = ()
    last_runs: tuple[tuple[str, str], ...] = ()
    released: float | None = None
    released_why: str = ""

    @property
    def quarantined(self) -> bool:
        return self.status == QUARANTINED

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "why": list(self.why), "since": self.since,
                "strikes": self.strikes, "evidence": [e.to_json() for e in self.evidence],
                "last_runs": [{"run_id": r, "kind": k} for r, k in self.last_runs],
                "released": self.released, "released_why": self.released_why}


class Ledger:
    """The ledger of one inventory (its file at `path`), judged by `policy` on `clock`."""

    def __init__(self, path: Path, policy: Policy = Policy(),
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.policy = policy
        self.clock = clock
        self.inventory: str | None = None     # the inventory file's path, written for a reader

    @classmethod
    def for_inventory(cls, source: str | None, policy: Policy = Policy(),
                      environ: Mapping[str, str] = os.environ) -> "Ledger":
        """The ledger of the inventory file `source` (None: a run without one, local.json)."""
        ledger = cls(state_root(environ) / "ledger" / file_name(source), policy)
        ledger.inventory = str(Path(source).expanduser().resolve()) if source else None
        return ledger

    # -- telling it --

    def record(self, events: Sequence[Event]) -> None:
        """Add events (of any nodes) under one lock, in one write."""
        checked = [stamped(e, self.clock) for e in events]
        if not checked:
            return
        with self._changing() as data:
            for e in checked:
                entry = data["nodes"].setdefault(e.node, {"events": []})
                entry["events"].append(e.to_json())
            for name in {e.node for e in checked}:
                events_of = data["nodes"][name]["events"]
                events_of.sort(key=lambda ev: ev["time"])
                del events_of[:-MAX_EVENTS]

    def release(self, node: str, why: str) -> None:
        """Forgive the node's strikes so far: it is healthy until new strikes quarantine it."""
        with self._changing() as data:
            entry = data["nodes"].setdefault(node, {"events": []})
            entry["released"] = {"time": self.clock(), "why": one_line(why)}

    # -- asking it --

    def node(self, name: str) -> NodeState:
        return self.states([name])[name]

    def all(self) -> dict[str, NodeState]:
        nodes = self._read()["nodes"]
        now = self.clock()
        return {name: judge(name, nodes[name], self.policy, now) for name in sorted(nodes)}

    def quarantined(self, names: Iterable[str]) -> dict[str, NodeState]:
        """Those of `names` that are quarantined now (only they are judged)."""
        return {n: s for n, s in self.states(names).items() if s.quarantined}

    def states(self, names: Iterable[str]) -> dict[str, NodeState]:
        """Each of `names` judged now, quarantined or not (a node never recorded is healthy)."""
        nodes = self._read()["nodes"]
        now = self.clock()
        return {n: judge(n, nodes.get(n) or {"events": []}, self.policy, now) for n in names}

    # -- the file --

    def _read(self) -> dict[str, Any]:
        """The file's content, checked; an empty ledger when there is no file yet."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {"version": VERSION, "nodes": {}}
        except OSError as exc:
            raise InputError(f"cannot read the node ledger {self.path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise self.damaged(f"not valid JSON ({exc})") from None
        problem = check(data)
        if problem:
            raise self.damaged(problem)
        return data

    def damaged(self, problem: str) -> InputError:
        return InputError(f"{self.path}: the node ledger is damaged: {problem}; remove the file "
                          f"to start a new one (every node's record there is lost with it)")

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, Any]]:
        """The ledger's content to change, under the lock; written back when the block ends
        without an error (an error changes nothing)."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            make_private_dir(self.path.parent)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise InputError(f"cannot write the node ledger in {self.path.parent}: "
                             f"{exc.strerror} (set XDG_STATE_HOME to a writable folder)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self._read()
            yield data
            data["inventory"] = self.inventory or data.get("inventory")
            try:
                write_private(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
            except OSError as exc:
                raise InputError(f"cannot write the node ledger {self.path}: "
                                 f"{exc.strerror}") from None
        finally:
            os.close(fd)          # closing it releases the lock


def file_name(source: str | None) -> str:
    """<stem>-<sha256[:12] of the resolved path>.json; local.json without an inventory file."""
    if source is None:
        return "local.json"
    resolved = Path(source).expanduser().resolve()
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", resolved.stem).lstrip(".")[:40] or "inventory"
    return f"{stem}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}.json"


def one_line(text: str, limit: int = MAX_DETAIL) -> str:
    """The first non-empty line, cut to `limit` characters."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def capped(text: str, limit: int = MAX_EVIDENCE) -> str:
    """The last `limit` characters (the end of a log or a traceback says the most)."""
    text = str(text)
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def stamped(e: Event, clock: Callable[[], float]) -> Event:
    """The event as it is written: its kind checked, its time set, its text cut to size."""
    if e.kind not in KINDS:
        raise ValueError(f"event kind {e.kind!r} is none of {', '.join(sorted(KINDS))}")
    if not isinstance(e.node, str) or not e.node:
        raise ValueError(f"event node {e.node!r} is not a node name")
    when = clock() if e.time is None else float(e.time)
    if not math.isfinite(when):
        raise ValueError(f"event time {e.time!r} is not a time")
    return Event(node=e.node, kind=e.kind, run_id=str(e.run_id), detail=one_line(e.detail),
                 evidence=capped(e.evidence), time=when)


def judge(name: str, record: Mapping[str, Any], policy: Policy, now: float) -> NodeState:
    """A node's state now, from its record: pure."""
    events = sorted(record.get("events") or [], key=lambda ev: ev["time"])
    released = record.get("released") or {}
    after = released.get("time", -math.inf)
    strikes = [ev for ev in events if ev["kind"] in STRIKE_KINDS and ev["time"] > after]
    current = [ev for ev in strikes if now - ev["time"] < policy.window_s]
    quarantined = len(current) >= policy.strikes
    return NodeState(
        name=name, status=QUARANTINED if quarantined else HEALTHY,
        why=tuple(f"{ev['kind']} in run {ev['run_id']}" + (f": {ev['detail']}" if ev["detail"]
                                                           else "") for ev in current),
        since=tipped([ev["time"] for ev in strikes], policy) if quarantined else None,
        strikes=len(current), evidence=tuple(as_event(name, ev) for ev in current),
        last_runs=last_runs(events), released=released.get("time"),
        released_why=released.get("why", ""))


def tipped(times: Sequence[float], policy: Policy) -> float | None:
    """When the quarantine that holds now began: the last strike that found fewer than
    `policy.strikes` strikes in the window before it and reached them with itself."""
    since = None
    for i, t in enumerate(times):
        before = sum(1 for u in times[:i] if t - u < policy.window_s)
        if before < policy.strikes <= before + 1:
            since = t
    return since


def last_runs(events: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    """The last LAST_RUNS runs the node took part in, newest first: failed when any of its
    events in that run was a strike, else clean."""
    runs: dict[str, str] = {}
    for ev in events:                        # oldest first: a run moves up with its newest
        failed = runs.pop(ev["run_id"], CLEAN) == "failed" or ev["kind"] in STRIKE_KINDS
        runs[ev["run_id"]] = "failed" if failed else CLEAN
    return tuple(reversed(list(runs.items())[-LAST_RUNS:]))


def as_event(node: str, ev: Mapping[str, Any]) -> Event:
    return Event(node=node, kind=ev["kind"], run_id=ev["run_id"], detail=ev["detail"],
                 evidence=ev["evidence"], time=ev["time"])


EVENT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "kind": str, "run_id": str, "detail": str, "evidence": str, "time": (int, float)}


def check(data: Any) -> str | None:
    """What is wrong with the file's content, naming the key; None when nothing is."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if data.get("version") != VERSION:
        return f"version: {data.get('version')!r}, this cluster reads version {VERSION}"
    nodes = data.get("nodes")
    if not isinstance(nodes, dict):
        return "nodes: not an object"
    for name, entry in nodes.items():
        problem = check_node(entry)
        if problem:
            return f"nodes.{name}{problem}"
    return None


def check_node(entry: Any) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("events"), list):
        return ".events: not a list"
    for i, ev in enumerate(entry["events"]):
        if not isinstance(ev, dict):
            return f".events[{i}]: not an object"
        for key, kind in EVENT_FIELDS.items():
            if not isinstance(ev.get(key), kind) or isinstance(ev.get(key), bool):
                return f".events[{i}].{key}: missing or not a {getattr(kind, '__name__', 'number')}"
        if ev["kind"] not in KINDS:
            return f".events[{i}].kind: {ev['kind']!r} is none of {', '.join(sorted(KINDS))}"
    released = entry.get("released")
    if released is not None and not (isinstance(released, dict)
                                     and isinstance(released.get("time"), (int, float))
                                     and isinstance(released.get("why"), str)):
        return ".released: not an object with a time and a why"
    return None
