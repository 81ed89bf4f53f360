"""The node ledger (cluster/recovery/ledger.py): strikes, quarantine and release on a clock of
the test's own, the file's bounds, modes and damage, and two real processes writing at once."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.errors import InputError
from cluster.recovery.ledger import (MAX_EVENTS, MAX_EVIDENCE, Event, Ledger, Policy,
                                     file_name, tipped)

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0
DAY = 24 * HOUR


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(tmp_path: Path, clock: Clock) -> Ledger:
    return Ledger(tmp_path / "state" / "ledger" / "hosts.json", clock=clock)


def strike(node: str, run: str, kind: str = "lost", detail: str = "connection reset") -> Event:
    return Event(node=node, kind=kind, run_id=run, detail=detail)


def test_two_strikes_in_the_window_quarantine_a_node(ledger: Ledger, clock: Clock) -> None:
    ledger.record([strike("node2", "run-1")])
    assert ledger.node("node2").status == "healthy" and ledger.node("node2").strikes == 1
    clock.now += 3 * HOUR
    ledger.record([strike("node2", "run-2", "hang", "no heartbeat for 300 s"),
                   strike("node1", "run-2")])
    state = ledger.node("node2")
    assert state.status == "quarantined" and state.strikes == 2
    assert state.since == clock.now, "since: the strike that tipped it"
    assert state.why == ("lost in run run-1: connection reset",
                         "hang in run run-2: no heartbeat for 300 s")
    assert [e.kind for e in state.evidence] == ["lost", "hang"]
    assert state.last_runs == (("run-2", "failed"), ("run-1", "failed"))
    assert list(ledger.quarantined(["node1", "node2", "node3"])) == ["node2"]
    assert ledger.node("node3").status == "healthy", "a node never recorded is healthy"


def test_two_strikes_further_apart_than_the_window_do_not(ledger: Ledger, clock: Clock) -> None:
    ledger.record([strike("node2", "run-1")])
    clock.now += DAY + 1
    ledger.record([strike("node2", "run-2")])
    state = ledger.node("node2")
    assert state.status == "healthy" and state.strikes == 1
    assert state.why == ("lost in run run-2: connection reset",)


def test_strikes_age_out_of_the_window_and_the_node_is_healthy_again(ledger: Ledger,
                                                                     clock: Clock) -> None:
    ledger.record([strike("node2", "run-1", "gate", "GPU 3: XID 79"), strike("node2", "run-1")])
    assert ledger.node("node2").quarantined
    clock.now += DAY - 1
    assert ledger.node("node2").quarantined
    clock.now += 1
    state = ledger.node("node2")
    assert state.status == "healthy" and state.strikes == 0 and state.since is None
    assert ledger.quarantined(["node2"]) == {}


def test_since_stays_at_the_start_of_an_unbroken_quarantine(clock: Clock) -> None:
    policy = Policy(strikes=2, window_s=10)
    assert tipped([0, 5, 9, 14], policy) == 5, "each strike kept it quarantined: since the 2nd"
    assert tipped([0, 5, 30, 35], policy) == 35, "it lapsed between 15 and 35"
    assert tipped([0, 10], policy) is None, "10 s apart is outside a 10 s window"


def test_release_forgives_the_strikes_so_far(ledger: Ledger, clock: Clock) -> None:
    ledger.record([strike("node2", "run-1"), strike("node2", "run-2")])
    clock.now += 60
    ledger.release("node2", "the deep check passed\nin 3.1 s")
    state = ledger.node("node2")
    assert state.status == "healthy" and state.strikes == 0
    assert state.released == clock.now and state.released_why == "the deep check passed"
    assert state.last_runs == (("run-2", "failed"), ("run-1", "failed")), "its history stays"
    clock.now += 60
    ledger.record([strike("node2", "run-3")])
    assert ledger.node("node2").strikes == 1 and not ledger.node("node2").quarantined
    ledger.record([strike("node2", "run-4")])
    assert ledger.node("node2").quarantined, "new strikes after a release count again"


def test_clean_runs_do_not_strike(ledger: Ledger, clock: Clock) -> None:
    for i in range(10):
        ledger.record([Event("node1", "clean", f"run-{i}")])
        clock.now += 1
    ledger.record([strike("node1", "run-10"), Event("node1", "clean", "run-10")])
    state = ledger.node("node1")
    assert state.status == "healthy" and state.strikes == 1
    assert state.last_runs == (("run-10", "failed"), ("run-9", "clean"), ("run-8", "clean"),
                               ("run-7", "clean"), ("run-6", "clean"))


def test_every_strike_kind_counts(ledger: Ledger) -> None:
    for kind in ("gate", "lost", "failed_first", "hang", "slow"):
        ledger.record([strike(f"n-{kind}", "r1", kind), strike(f"n-{kind}", "r2", kind)])
    assert len(ledger.quarantined(ledger.all())) == 5


def test_a_thousand_events_keep_the_file_small(ledger: Ledger, clock: Clock) -> None:
    for i in range(1000):
        clock.now += 1
        ledger.record([Event("node1", "clean" if i % 2 else "slow", f"run-{i}", detail=f"step {i}",
                             evidence="x" * 100)])
    events = json.loads(ledger.path.read_text())["nodes"]["node1"]["events"]
    assert len(events) == MAX_EVENTS
    assert [e["run_id"] for e in events] == [f"run-{i}" for i in range(950, 1000)], "the newest"
    assert ledger.path.stat().st_size < 20_000


def test_detail_is_one_line_and_evidence_is_capped(ledger: Ledger) -> None:
    ledger.record([Event("node1", "failed_first", "run-1",
                         detail="\n  RuntimeError: CUDA error\nsecond line",
                         evidence="a" * 5000 + "the end")])
    event = ledger.node("node1").evidence[0]
    assert event.detail == "RuntimeError: CUDA error"
    assert len(event.evidence) == MAX_EVIDENCE and event.evidence.endswith("the end")


def test_a_node_value_is_written_as_a_json_string_only(ledger: Ledger) -> None:
    odd = 'x"}, "nodes": {}, "y": "\u0000\n'
    ledger.record([Event("node1", "gate", odd, detail=odd, evidence=odd)])
    data = json.loads(ledger.path.read_text())
    assert list(data["nodes"]) == ["node1"]
    assert data["nodes"]["node1"]["events"][0]["evidence"] == odd


def test_an_unknown_kind_is_refused_and_nothing_written(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="'crashed' is none of"):
        ledger.record([strike("node1", "r1"), Event("node2", "crashed", "r1")])
    assert not ledger.path.exists()


def test_the_folder_and_files_are_private_whatever_the_umask(ledger: Ledger) -> None:
    old = os.umask(0)
    try:
        ledger.record([strike("node1", "r1")])
    finally:
        os.umask(old)
    assert stat.S_IMODE(ledger.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(ledger.path.stat().st_mode) == 0o600
    lock = ledger.path.with_name(ledger.path.name + ".lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert sorted(p.name for p in ledger.path.parent.iterdir()) == ["hosts.json", "hosts.json.lock"]


def test_reading_writes_nothing(ledger: Ledger) -> None:
    assert ledger.all() == {} and not ledger.node("node1").quarantined
    assert not ledger.path.parent.exists()


def test_a_damaged_file_is_an_error_naming_it(ledger: Ledger) -> None:
    ledger.record([strike("node1", "r1")])
    ledger.path.write_text('{"version": 1, "nodes": {"node1": {"events": [')
    with pytest.raises(InputError, match="the node ledger is damaged: not valid JSON") as err:
        ledger.node("node1")
    assert str(ledger.path) in str(err.value) and "remove the file" in str(err.value)
    with pytest.raises(InputError):
        ledger.record([strike("node1", "r2")])
    assert ledger.path.read_text() == '{"version": 1, "nodes": {"node1": {"events": [', "unchanged"


@pytest.mark.parametrize("content, key", [
    ([], "not a JSON object"),
    ({"nodes": {}}, "version: None"),
    ({"version": 1, "nodes": []}, "nodes: not an object"),
    ({"version": 1, "nodes": {"n1": {"events": [{"kind": "lost", "run_id": "r", "time": "soon",
                                                 "detail": "", "evidence": ""}]}}},
     "nodes.n1.events[0].time: missing or not a number"),
    ({"version": 1, "nodes": {"n1": {"events": [{"kind": "boom", "run_id": "r", "time": 1,
                                                 "detail": "", "evidence": ""}]}}},
     "nodes.n1.events[0].kind: 'boom'"),
    ({"version": 1, "nodes": {"n1": {"events": [], "released": 5}}}, "nodes.n1.released"),
])
def test_a_damaged_entry_is_named_by_its_key(ledger: Ledger, content: object, key: str) -> None:
    ledger.path.parent.mkdir(parents=True)
    ledger.path.write_text(json.dumps(content))
    with pytest.raises(InputError, match=key.replace("[", r"\[").replace("]", r"\]")):
        ledger.all()


def test_one_file_per_inventory_in_the_state_folder(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yaml"
    digest = hashlib.sha256(str(inventory.resolve()).encode()).hexdigest()[:12]
    ledger = Ledger.for_inventory(str(inventory), environ={"XDG_STATE_HOME": str(tmp_path / "s")})
    assert ledger.path == tmp_path / "s" / "cluster" / "ledger" / f"hosts-{digest}.json"
    home = Ledger.for_inventory(None, environ={"HOME": str(tmp_path / "home")})
    assert home.path == tmp_path / "home" / ".local" / "state" / "cluster" / "ledger" / "local.json"
    assert file_name("/x/y/a b;c.yaml").startswith("a_b_c-")
    assert file_name("/x/y/hosts") != file_name("/x/z/hosts"), "the path tells them apart"


def test_the_file_names_its_inventory(tmp_path: Path) -> None:
    ledger = Ledger.for_inventory(str(tmp_path / "hosts.yaml"),
                                  environ={"XDG_STATE_HOME": str(tmp_path)})
    ledger.record([strike("node1", "r1")])
    assert json.loads(ledger.path.read_text())["inventory"] == str(tmp_path / "hosts.yaml")


WRITER = """
import sys, time
from pathlib import Path
from cluster.recovery.ledger import Event, Ledger
path, tag, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
ledger = Ledger(path)
while not go.exists():
    time.sleep(0.001)
start = time.time()
for i in range(200):
    ledger.record([Event(f"{tag}{i}", "lost", f"run-{tag}", detail=str(i))])
print(start, time.time())
"""


def test_two_processes_recording_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger" / "hosts.json"
    go = tmp_path / "go"
    # The repo first, then where this interpreter finds the project's needs (a --target
    # folder on PYTHONPATH on some machines): the child imports what the test does.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in sys.path if p])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag, str(go)], env=env,
                              stdout=subprocess.PIPE, text=True) for tag in ("a", "b")]
    time.sleep(0.3)                # both started and waiting, then both go at once
    go.touch()
    spans = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        spans.append(tuple(map(float, out.split())))
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, f"the two did not write at the same time: {spans}"
    nodes = json.loads(path.read_text())["nodes"]
    assert sorted(nodes) == sorted(f"{t}{i}" for t in "ab" for i in range(200))
    assert all(len(n["events"]) == 1 for n in nodes.values())
