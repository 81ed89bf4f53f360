"""A run's timeline: the recorder on a fake clock (events in, JSON out), the watcher's events
from fake nodes, the grouping into lanes and attempts, the picture when matplotlib is there and
the one-line fallback to timeline.json when it is not."""
from __future__ import annotations

import builtins
import json
import time
import stat
from pathlib import Path
from typing import Any

import pytest

from cluster.observe import timeline as tl
from cluster.observe import timeline_png
from cluster.backends import NodeExit
from cluster.runs import RunDir
from cluster.observe.watch import Watcher
from tests.unit.test_watch import FakeNode, console


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def recorder(thin: float = tl.THIN) -> tuple[tl.Recorder, list[tl.Event], Clock]:
    events: list[tl.Event] = []
    clock = Clock()
    return tl.Recorder(events.append, clock=clock, wall=lambda: clock.now + 1e9, thin=thin), events, clock


def test_each_event_has_its_wall_and_monotonic_time_read_once() -> None:
    rec, events, clock = recorder()
    rec.event(tl.CHECK)
    clock.now = 102.5
    rec.event(tl.JOINED, "a 0", group_rank=0)
    assert events == [{"t": 1e9 + 100, "m": 100.0, "kind": "check", "attempt": 0},
                      {"t": 1e9 + 102.5, "m": 102.5, "kind": "joined", "attempt": 0,
                       "node": "a 0", "group_rank": 0}]


def test_without_a_sink_nothing_is_recorded() -> None:
    rec = tl.Recorder()
    rec.event(tl.CHECK)
    rec.beat("a 0")
    rec.flush()
    assert rec.kinds == set()


def test_beats_are_thinned_and_the_count_kept_then_flushed_at_the_exit() -> None:
    rec, events, clock = recorder(thin=5)
    for second in range(12):                 # a beat a second for 12 s
        clock.now = 100.0 + second
        rec.beat("a 0")
    beats = [e for e in events if e["kind"] == "beat"]
    assert [(b["m"], b["n"]) for b in beats] == [(100.0, 1), (105.0, 5), (110.0, 5)]
    clock.now = 113.0
    rec.event(tl.EXIT, "a 0", ok=True, how="exit code 0")
    assert [(e["kind"], e["m"], e.get("n")) for e in events[-2:]] == [("beat", 111.0, 1),
                                                                      ("exit", 113.0, None)]
    assert sum(e["n"] for e in events if e["kind"] == "beat") == 12       # every beat counted


def test_a_listener_is_told_every_beat_with_its_detail_and_a_faulty_one_is_left_out() -> None:
    """The live views (metrics, alerts) see each beat before thinning, with what the node
    said of its progress; the file keeps its bound; a listener that raises never stops the
    record."""
    rec, events, clock = recorder(thin=5)
    told: list[tl.Event] = []
    rec.listen(told.append)
    broken = []

    def faulty(ev: tl.Event) -> None:
        broken.append(ev)
        raise RuntimeError("a view's bug")
    rec.listen(faulty)
    for second in range(4):
        clock.now = 100.0 + second
        rec.beat("a 0", step=second, work=0.2, data=0.01)
    rec.checkpoint(3, saving=0.4)
    assert [(e["kind"], e.get("step")) for e in told] == [("beat", 0), ("beat", 1), ("beat", 2),
                                                         ("beat", 3), ("checkpoint", 3)]
    assert told[3]["work"] == 0.2 and told[4]["saving"] == 0.4
    assert len(broken) == 1 and rec.listeners == [told.append]
    assert [e.get("step") for e in events if e["kind"] == "beat"] == [0]       # thinned
    rec.flush()
    assert [e.get("step") for e in events if e["kind"] == "beat"] == [0, 3]    # the latest held


def test_output_is_recorded_first_then_thinned_per_node() -> None:
    rec, events, clock = recorder(thin=5)
    rec.output("a 0")
    rec.output("a 0")
    rec.output("b 1")
    rec.flush()
    assert [(e["node"], e["n"]) for e in events] == [("a 0", 1), ("b 1", 1), ("a 0", 1)]


def test_the_events_file_is_private_and_a_cut_line_is_left_out(tmp_path: Path) -> None:
    rec = tl.recorder_for(tmp_path)
    rec.event(tl.CHECK)
    rec.event(tl.STARTED, nodes=["a 0"])
    path = tmp_path / tl.EVENTS
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with path.open("a") as f:
        f.write('{"t": 1, "kind": "ex')              # the launcher killed mid-write
    assert [e["kind"] for e in tl.read_events(path)] == ["check", "started"]
    assert list(tl.read_events(tmp_path / "none.jsonl")) == []


def test_the_watcher_records_join_beats_output_failure_stop_and_exits(tmp_path: Path) -> None:
    events: list[tl.Event] = []
    rec = tl.Recorder(events.append)
    c, _, _ = console()
    failing = FakeNode("b 1", [{"joined": True, "group_rank": 1}, {"beat": 1.0}, b"boom\n"],
                       NodeExit(code=3), delay=0.1)
    other = FakeNode("a 0", [{"joined": True, "group_rank": 0}, b"hello\n"], None)
    Watcher([other, failing], c, {}, timeline=rec).run()
    kinds = {(e["kind"], e.get("node")) for e in events}
    assert {("joined", "a 0"), ("joined", "b 1"), ("beat", "b 1"), ("output", "a 0"),
            ("output", "b 1"), ("failed", "b 1"), ("stop", None), ("exit", "a 0"),
            ("exit", "b 1")} <= kinds
    exits = {e["node"]: e for e in events if e["kind"] == "exit"}
    assert exits["b 1"]["ok"] is False and exits["b 1"]["how"] == "exit code 3"
    assert next(e for e in events if e["kind"] == "stop")["nodes"] == ["a 0"]


def launch_events() -> list[tl.Event]:
    """What launch and the watcher record for a job of two nodes that hangs, restarts, and
    finishes, on a fake clock."""
    rec, events, clock = recorder(thin=1)

    def at(now: float, kind: str, node: str | None = None, **detail: Any) -> None:
        clock.now = 100.0 + now
        rec.event(kind, node, **detail)
    at(0, tl.CHECK)
    at(1, tl.CHECKED)
    at(1, tl.START)
    at(2, tl.STARTED, nodes=["a 0", "b 1"])
    at(4, tl.JOINED, "a 0")
    at(4.5, tl.JOINED, "b 1")
    for s in (5, 6, 7):
        clock.now = 100.0 + s
        rec.beat("a 0")
    at(17, tl.HANG, quiet=10.0)
    at(18, tl.STOP, nodes=["a 0", "b 1"])
    at(19, tl.EXIT, "a 0", ok=False, how="killed by SIGTERM")
    at(19, tl.EXIT, "b 1", ok=False, how="killed by SIGTERM")
    at(19.5, tl.ENDED, how="hang: no progress for 10 s")
    at(19.5, tl.RESTART, why="restarting")
    rec.attempt = 1
    at(20, tl.CHECK)
    at(21, tl.CHECKED)
    at(22, tl.STARTED, nodes=["a 0", "b 1"])
    at(30, tl.EXIT, "a 0", ok=True, how="exit code 0")
    at(30, tl.EXIT, "b 1", ok=True, how="exit code 0")
    at(30, tl.ENDED, how="finished")
    at(30.5, tl.OUTCOME, ok=True, code=0)
    return events


def test_the_timeline_groups_lanes_attempts_checks_and_where_progress_stopped() -> None:
    data = tl.timeline(launch_events(), {"run_id": "r1", "backend": "local"})
    json.dumps(data)                                      # plain JSON
    assert data["run_id"] == "r1" and data["start"] == 1e9 + 100 and data["end"] == 30.5
    assert list(data["lanes"]) == ["a 0", "b 1"]
    assert [(i["kind"], i["x"]) for i in data["lanes"]["a 0"] if i["attempt"] == 0] == [
        ("joined", 4.0), ("beat", 5.0), ("beat", 6.0), ("beat", 7.0), ("exit", 19.0)]
    assert [(a["attempt"], a["start"], a["end"], a["ended"]) for a in data["attempts"]] == [
        (0, 0.0, 19.5, "hang: no progress for 10 s"), (1, 20.0, 30.5, "finished")]
    assert [(c["start"], c["end"], c["ok"]) for c in data["checks"]] == [(0.0, 1.0, True),
                                                                        (20.0, 21.0, True)]
    assert data["stalled"] == [{"attempt": 0, "at": 7.0, "hang": 17.0}]
    assert data["notes"] == []


def test_a_failed_check_ends_its_band_at_the_outcome_and_a_detached_run_says_so() -> None:
    rec, events, clock = recorder()
    rec.event(tl.CHECK)
    clock.now += 3
    rec.event(tl.OUTCOME, ok=False, error="1 check(s) failed")
    data = tl.timeline(events, {"nodes": [{"name": "a", "rank": 0}]})
    assert data["checks"] == [{"attempt": 0, "start": 0.0, "end": 3.0, "ok": False}]
    assert data["attempts"][0]["ended"] == "1 check(s) failed"
    rec.event(tl.DETACHED)
    assert "detached" in tl.timeline(events)["notes"][0]
    empty = tl.timeline([], {"nodes": [{"name": "a", "rank": 0}]})
    assert list(empty["lanes"]) == ["a 0"] and "no events" in empty["notes"][0]


def run_dir(tmp_path: Path) -> RunDir:
    run = RunDir.create("r1", root=tmp_path / "runs")
    sink = tl.EventsFile(run.path / tl.EVENTS)
    for ev in launch_events():
        sink(ev)
    return run


def test_the_picture_is_drawn_when_matplotlib_is_there(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = run_dir(tmp_path)
    c, _, err = console()
    path = timeline_png.write(run, c)
    assert path == run.path / "timeline.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert f"timeline: {path}" in err.getvalue()
    assert json.loads((run.path / "timeline.json").read_text())["end"] == 30.5


def test_without_matplotlib_one_line_says_so_and_the_json_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def blocked(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", blocked)
    run = run_dir(tmp_path)
    c, _, err = console()
    path = timeline_png.write(run, c)
    assert path == run.path / "timeline.json" and not (run.path / "timeline.png").exists()
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0] and str(path) in lines[0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


class FakeBackend:
    """A backend without node checks whose nodes are test_watch's FakeNodes: in the first
    attempt node b fails after a finished, in the second both finish."""
    name = "fake"

    def __init__(self) -> None:
        self.attempts = 0

    def plan(self, inventory: Any, job: Any, templates: Any, ifnames: Any = None) -> Any:
        from cluster.plan import render
        return render(inventory, job, templates)

    def start(self, plan: Any, detach: bool, secrets: Any, run: Any) -> list[Any]:
        if detach:
            return [4321, 4322]                # a detached start hands back each node's pid
        self.attempts += 1
        fail = self.attempts == 1
        return [FakeNode("local0 0", [{"joined": True, "group_rank": 0}, b"hi\n"], NodeExit(code=0)),
                FakeNode("local1 1", [{"joined": True, "group_rank": 1}, {"beat": 1.0}],
                         NodeExit(code=1 if fail else 0), delay=0.2)]

    def start_note(self, procs: Any, plan: Any) -> str:
        return "started"

    def started(self, plan: Any, procs: Any, run: Any) -> dict[str, Any]:
        return {}

    def ended(self, plan: Any, procs: Any, result: Any) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("detach", [False, True])
def test_launch_records_each_step_and_an_attached_run_ends_with_its_timeline(
        tmp_path: Path, detach: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster import launch
    from cluster.backends.local import local_inventory
    from cluster.plan import Job, Templates
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "node.sh.j2").write_text("exec true\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")          # two CPU nodes, even on a GPU box
    run = RunDir.create("r1", root=tmp_path / "runs")
    c, _, err = console()
    job = Job(run_id="r1", script="x", node_root=str(tmp_path / "nodes"))
    code = launch.up(local_inventory(2), job, Templates(tmp_path / "tpl"), FakeBackend(), run,  # type: ignore[arg-type]
                     ["up"], c, launch.Options(restarts=1, detach=detach))
    assert code == 0
    events = tl.read_events(run.path / tl.EVENTS)
    kinds = [(e["kind"], e.get("node"), e["attempt"]) for e in events]
    if detach:
        assert [k for k, _, _ in kinds] == ["check", "checked", "start", "started", "detached",
                                            "outcome"]
        assert not (run.path / "timeline.json").exists() and "timeline" not in err.getvalue()
        assert "goodput" not in err.getvalue() and "goodput" not in run.meta()
        return
    for attempt in (0, 1):
        for node in ("local0 0", "local1 1"):
            assert ("joined", node, attempt) in kinds and ("exit", node, attempt) in kinds
        assert ("check", None, attempt) in kinds and ("started", None, attempt) in kinds
    assert ("failed", "local1 1", 0) in kinds and ("restart", None, 0) in kinds
    assert kinds[-1] == ("outcome", None, 1)
    assert "(drawn in the background" in err.getvalue()
    deadline = time.monotonic() + 60       # by a process of its own, beside the prompt
    while not (run.path / "timeline.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    data = json.loads((run.path / "timeline.json").read_text())
    assert [a["ended"] for a in data["attempts"]] == [
        "node [local1 1] failed: exit code 1", "finished"]
    assert "timeline: " in err.getvalue()
    # goodput: said, in run.json and on the outcome's event, its parts the wall time's
    recorded = run.meta()["goodput"]
    assert f"goodput {recorded['fraction'] * 100:.1f}% of {recorded['wall']:.1f} s" in err.getvalue()
    assert abs(sum(recorded["parts"].values()) - recorded["wall"]) < 0.01
    assert [a["attempt"] for a in recorded["attempts"]] == [0, 1]
    outcome = list(tl.read_events(run.path / tl.EVENTS))[-1]
    assert outcome["goodput"]["fraction"] == recorded["fraction"]
    assert data["goodput"]["segments"]                       # the picture's band


def test_a_hang_writes_every_nodes_held_beat_first_in_order() -> None:
    rec, events, clock = recorder(thin=5)
    for node, at in (("a 0", 0.0), ("b 1", 0.0), ("b 1", 1.0), ("a 0", 2.0)):
        clock.now = 100.0 + at
        rec.beat(node)
    clock.now = 120.0
    rec.event(tl.HANG, quiet=18.0)
    assert [(e["kind"], e.get("node"), e["m"]) for e in events[2:]] == [
        ("beat", "b 1", 101.0), ("beat", "a 0", 102.0), ("hang", None, 120.0)]


def test_events_jsonl_stays_under_4_mb_over_72_hours_at_128_nodes(tmp_path: Path) -> None:
    """128 nodes for 72 h on a fake clock, each beating and printing once a minute (one recorded
    each 5 s, as before, would have made 1.2 GB): the file stays under 4 MB, each node's beats
    at most KEEP lines, from its first beat to its last, every beat counted; the state events
    all there."""
    clock = Clock()
    path = tmp_path / tl.EVENTS
    rec = tl.Recorder(tl.EventsFile(path), clock=clock, wall=lambda: clock.now + 1.7e9)
    nodes = [f"gpu-node-{i:03d} {i}" for i in range(128)]
    rec.event(tl.STARTED, nodes=nodes)
    for node in nodes:
        rec.event(tl.JOINED, node, group_rank=0)
    hours, every = 72, 60.0
    beats = int(hours * 3600 / every)
    for k in range(beats):
        clock.now = 100.0 + k * every
        for node in nodes:
            rec.beat(node)
            rec.output(node)
    for node in nodes:
        rec.event(tl.EXIT, node, ok=True, how="exit code 0")
    rec.flush()
    size = path.stat().st_size
    assert size < 4_000_000, size
    events = list(tl.read_events(path))
    assert sum(e["kind"] == tl.JOINED for e in events) == 128
    assert sum(e["kind"] == tl.EXIT for e in events) == 128
    mine = [e for e in events if e["kind"] == tl.BEAT and e["node"] == nodes[5]]
    assert len(mine) <= tl.KEEP
    assert mine[0]["m"] == 100.0 and mine[-1]["m"] == 100.0 + (beats - 1) * every
    assert sum(e["n"] for e in mine) == beats                 # every beat counted
    assert not path.with_name(path.name + ".tmp").exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_large_events_file_is_read_and_grouped_in_bounded_memory(tmp_path: Path) -> None:
    """A file of 100,000 beats (one written before the bound: 9 MB) read line by line and
    its frequent kinds kept to the bound as they are read: the memory for it stays under
    3 MB, and the picture's data still spans the whole run, every beat counted."""
    import tracemalloc
    path = tmp_path / tl.EVENTS
    nodes = [f"n{i} {i}" for i in range(8)]
    with path.open("w") as f:
        f.write(json.dumps({"t": 1e9, "m": 0.0, "kind": "started", "attempt": 0, "nodes": nodes}) + "\n")
        for k in range(12_500):
            f.write("".join(json.dumps({"t": 1e9 + 5 * k, "m": 5.0 * k, "kind": "beat",
                                        "attempt": 0, "node": node, "n": 5}) + "\n"
                            for node in nodes))
    assert path.stat().st_size > 8_000_000
    tracemalloc.start()
    try:
        data = tl.timeline(tl.read_events(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3_000_000, peak
    assert data["events"] == 100_001
    lane = data["lanes"]["n3 3"]
    assert len(lane) <= tl.KEEP and lane[0]["x"] == 0.0 and lane[-1]["x"] == 5.0 * 12_499
    assert sum(i["n"] for i in lane) == 12_500 * 5


def test_thinning_again_keeps_the_first_and_last_of_each_series_and_the_counts() -> None:
    events = [{"kind": "started", "m": 0.0, "attempt": 0}]
    events += [{"kind": "beat", "m": float(s), "attempt": a, "node": "a 0", "n": 1}
               for a in (0, 1) for s in range(10 * a, 10 * a + 7)]
    events.append({"kind": "exit", "m": 20.0, "attempt": 1, "node": "a 0"})
    kept = list(tl.rethin(events, 3.0))
    assert [(e["kind"], e["m"], e.get("n")) for e in kept] == [
        ("started", 0.0, None), ("beat", 0.0, 1), ("beat", 3.0, 3), ("beat", 6.0, 3),
        ("beat", 10.0, 1), ("beat", 13.0, 3), ("beat", 16.0, 3), ("exit", 20.0, None)]
    events[-2]["m"] = 15.0                     # the last of a series is kept, however close
    kept = list(tl.rethin(events, 3.0))
    assert [(e["m"], e["n"]) for e in kept if e.get("attempt") == 1 and e["kind"] == "beat"] == [
        (10.0, 1), (13.0, 3), (15.0, 3)]


def test_a_lane_has_a_bar_only_in_the_attempts_that_started_its_node() -> None:
    """A lost node's lane ends with its attempt; its spare's lane begins with the next; a
    label no later attempt started has no bar there (the picture read node3 1 as starting
    until the end of a grown job). The stop before a planned restart says so."""
    job = [{"kind": tl.STARTED, "attempt": 0, "x": 1.0, "nodes": ["a 0", "b 1"]},
           {"kind": tl.RESTART, "attempt": 0, "x": 5.0, "why": "lost"},
           {"kind": tl.STARTED, "attempt": 1, "x": 6.0, "nodes": ["a 0", "c 1"]},
           {"kind": tl.RESTART, "attempt": 1, "x": 9.0, "why": "grow", "planned": True},
           {"kind": tl.STARTED, "attempt": 2, "x": 10.0, "nodes": []}]
    data = {"job": job}
    assert [timeline_png._started(data, "b 1", a) for a in (0, 1, 2)] == [True, False, True]
    assert [timeline_png._started(data, "c 1", a) for a in (0, 1)] == [False, True]


def test_the_launch_is_the_first_event_at_the_moment_the_command_began() -> None:
    """Goodput counts from the command's start (the CLI's first import), before the recorder
    existed: recorded with that moment on the recorder's clocks."""
    rec, events, clock = recorder()
    clock.now = 107.5
    rec.launched(106.0)
    rec.event(tl.CHECK)
    assert events[0] == {"t": 1e9 + 106.0, "m": 106.0, "kind": "launch", "attempt": 0}
    assert [e["kind"] for e in events] == ["launch", "check"]


def test_a_nodes_first_beat_that_names_a_step_is_never_thinned_away() -> None:
    """The trainer beats once before its set-up: thinning kept that one and held back its
    first step for THIN s, and goodput counted the steps before as start-up. The first step
    of each node and attempt is written at once, and kept when the file is thinned again."""
    rec, events, clock = recorder(thin=5)
    rec.beat("a 0")                            # set-up's beat, no step
    for i in range(1, 20):
        clock.now = 100.0 + i * 0.5
        rec.beat("a 0", step=i)
    rec.flush()
    beats = [(e["m"], e.get("step")) for e in events if e["kind"] == "beat"]
    assert beats[:2] == [(100.0, None), (100.5, 1)]
    again = list(tl.rethin(events, 50.0))
    assert [(e["m"], e.get("step")) for e in again if e["kind"] == "beat"][:2] == beats[:2]
    kept, _ = tl.bounded(events, keep=2)
    assert (100.5, 1) in [(e["m"], e.get("step")) for e in kept if e["kind"] == "beat"]
    rec.attempt = 1                            # each attempt has its own first step
    clock.now = 200.0
    rec.beat("a 0")
    clock.now = 201.0
    rec.beat("a 0", step=20)
    assert (events[-1]["attempt"], events[-1]["step"]) == (1, 20)
