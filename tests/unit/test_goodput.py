"""Goodput from a run's events (pure): the wall time cut into parts that add up to it, each
part from the events that measure it, on hand-made event lists with known answers."""
from __future__ import annotations

from typing import Any

import pytest

from cluster.observe import timeline as tl
from cluster.observe.goodput import PARTS, goodput, line


class Run:
    """Events written as a launcher records them, on a clock of our own."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.attempt = 0

    def at(self, m: float, kind: str, node: str | None = None, **detail: Any) -> "Run":
        ev = {"t": 1e9 + m, "m": m, "kind": kind, "attempt": self.attempt, **detail}
        if node is not None:
            ev["node"] = node
        self.events.append(ev)
        return self

    def start(self, m: float, started: float, joined: float) -> "Run":
        self.at(m, tl.CHECK).at(m, tl.CHECKED).at(m, tl.START)
        self.at(started, tl.STARTED, nodes=["a 0", "b 1"])
        return self.at(joined, tl.JOINED, "a 0").at(joined, tl.JOINED, "b 1")

    def steps(self, first: float, last: float, every: float = 1.0, step0: int = 1) -> "Run":
        t, step = first, step0
        while t <= last + 1e-9:
            self.at(t, tl.BEAT, "a 0", step=step, work=0.2, data=0.0)
            t, step = t + every, step + 1
        return self


def parts(g: dict[str, Any]) -> dict[str, float]:
    return {p: s for p, s in g["parts"].items() if s}


def test_a_clean_run_is_start_up_rendezvous_training_and_its_end() -> None:
    r = Run().start(0, started=1, joined=3).steps(5, 45)
    r.at(46, tl.EXIT, "a 0", ok=True).at(46, tl.EXIT, "b 1", ok=True).at(47, tl.OUTCOME, ok=True)
    g = goodput(r.events)
    assert g["wall"] == 47 and g["measured"] == "steps"
    assert parts(g) == {"startup": 1 + 2, "rendezvous": 2, "training": 40, "ending": 2}
    assert g["fraction"] == round(40 / 47, 4) and g["productive"] == 40
    assert line(g).startswith("goodput 85.1% of 47.0 s: training 40.0 s, start-up 3.0 s")


def test_a_restart_counts_the_work_it_redid_from_the_newest_checkpoint_and_adds_up() -> None:
    r = Run().start(0, started=1, joined=2).steps(4, 30)
    r.at(10, tl.CHECKPOINT, step=7, saving=0.5).at(20, tl.CHECKPOINT, step=17, saving=1.5)
    r.at(32, tl.FAILED, "b 1", what="boom").at(33, tl.STOP, nodes=["a 0"])
    r.at(34, tl.EXIT, "a 0", ok=False).at(34, tl.ENDED, how="x").at(34, tl.RESTART, why="x")
    r.attempt = 1
    r.start(35, started=36, joined=38).steps(40, 70, step0=18).at(71, tl.OUTCOME, ok=True)
    g = goodput(r.events)
    a0, a1 = g["attempts"]
    assert parts(a0) == {"startup": 1 + 2, "rendezvous": 1, "checkpoint": 0.5 + 1.0,
                         "training": 16 - 1.5, "redone": 10, "detection": 2, "restart": 3}
    assert parts(a1) == {"restart": 1 + 2, "rendezvous": 2, "training": 30, "ending": 1}
    assert a0["wall"] == 35 and a1["wall"] == 36 and g["wall"] == 71
    for row in (g, a0, a1):
        assert sum(row["parts"].values()) == pytest.approx(row["wall"], abs=1e-6)
    assert g["productive"] == pytest.approx(14.5 + 30)
    assert [s[2] for s in g["segments"]][:6] == ["startup", "rendezvous", "startup", "training",
                                                 "checkpoint", "training"]


def test_without_a_checkpoint_a_restart_redoes_the_whole_attempt() -> None:
    r = Run().start(0, started=1, joined=2).steps(4, 20).at(21, tl.FAILED, "a 0", what="x")
    r.at(22, tl.RESTART, why="x")
    r.attempt = 1
    r.start(23, 24, 25).steps(27, 30).at(31, tl.OUTCOME, ok=True)
    assert goodput(r.events)["attempts"][0]["parts"]["redone"] == 16
    assert goodput(r.events)["attempts"][0]["parts"]["training"] == 0


def test_a_hang_is_detection_from_where_progress_stopped_to_the_stop() -> None:
    r = Run().start(0, started=1, joined=2).steps(3, 20)
    r.at(80, tl.HANG, quiet=60.0).at(95, tl.STOP, nodes=["a 0", "b 1"])   # 15 s of stacks
    r.at(96, tl.EXIT, "a 0", ok=False).at(97, tl.OUTCOME, ok=False)
    g = goodput(r.events)
    assert parts(g) == {"startup": 2, "rendezvous": 1, "training": 17, "detection": 75,
                        "ending": 2}


def test_a_slow_node_costs_its_paces_excess_over_the_jobs_median_after_it_is_named() -> None:
    r = Run().start(0, started=1, joined=2).steps(3, 43)
    r.at(23, tl.SLOW, "b 1", compute_s=0.4, data_s=0.1, ref_compute_s=0.2, ref_data_s=0.05)
    r.at(44, tl.OUTCOME, ok=True)
    g = goodput(r.events)
    # 20 s after the verdict at half the pace the median node would have: 10 s lost
    assert parts(g) == {"startup": 2, "rendezvous": 1, "training": 20 + 10, "slow": 10,
                        "ending": 1}
    assert any(s[2] == "slow" for s in g["segments"])


def test_a_program_without_step_lines_or_heartbeat_is_measured_as_it_can_be() -> None:
    beats = Run().start(0, started=1, joined=3)
    beats.at(2, tl.BEAT, "a 0").at(10, tl.BEAT, "a 0").at(11, tl.OUTCOME, ok=True)
    g = goodput(beats.events)
    assert g["measured"] == "beats" and g["parts"]["training"] == 8
    assert "no step lines" in line(g)
    bare = Run().start(0, started=1, joined=3)
    bare.at(20, tl.EXIT, "a 0", ok=True).at(21, tl.EXIT, "b 1", ok=True).at(22, tl.OUTCOME, ok=True)
    g = goodput(bare.events)
    assert g["measured"] == "joined" and parts(g) == {"startup": 1, "rendezvous": 2,
                                                      "training": 17, "ending": 2}


def test_the_first_step_not_a_heartbeat_written_at_start_begins_the_training() -> None:
    """The heartbeat file's first change (written as the program starts) is no step: with
    step lines, only a beat that names a step counts."""
    r = Run().start(0, started=1, joined=3).at(2, tl.BEAT, "a 0").steps(12, 20)
    r.at(21, tl.OUTCOME, ok=True)
    # the first heartbeat (2) also ends the rendezvous, the join's scan seen later (3)
    assert parts(goodput(r.events)) == {"startup": 1 + 10, "rendezvous": 1, "training": 8,
                                        "ending": 1}


def test_so_far_a_detached_run_or_none_at_all() -> None:
    r = Run().start(0, started=1, joined=3).steps(5, 10)
    live = goodput(r.events, end=15)
    assert live["wall"] == 15 and live["parts"]["training"] == 5 and live["parts"]["ending"] == 5
    assert goodput([]) is None
    assert goodput(Run().start(0, 1, 2).at(1, tl.DETACHED).events) is None
    assert set(live["parts"]) == set(PARTS)


def _recorded_run(root: Any, run_id: str, source: str | None, events: list[dict[str, Any]],
                  meta_goodput: bool = False) -> None:
    import json
    from cluster.runs import RunDir
    rd = RunDir.create(run_id, root=root)
    (rd.path / tl.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))
    (rd.path / "inventory.yaml").write_text(f"source: {json.dumps(source)}\nhosts: []\n")
    rd.update(cwd="/", **({"goodput": {"fraction": 0.5, "wall": 2.0, "productive": 1.0,
                                       "parts": {p: 0.0 for p in PARTS} | {"training": 1.0,
                                                                          "startup": 1.0},
                                       "attempts": []}} if meta_goodput else {}))


def test_status_goodput_lists_the_last_runs_of_an_inventory_as_a_table_and_json(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher's record where it wrote one, else the events (a killed launcher); runs of
    another inventory, detached runs and dry runs left out; newest first."""
    import json
    from cluster.cli import run_cli
    monkeypatch.setenv("CLUSTER_RUNS_DIR", str(tmp_path / "runs"))
    clean = Run().start(0, started=1, joined=3).steps(5, 45).at(47, tl.OUTCOME, ok=True).events
    _recorded_run(tmp_path / "runs", "20261207-010000-aaaa", "/inv/a.yaml", clean)
    _recorded_run(tmp_path / "runs", "20261207-020000-bbbb", "/inv/a.yaml", [], meta_goodput=True)
    _recorded_run(tmp_path / "runs", "20261207-030000-cccc", "/inv/b.yaml", clean)
    _recorded_run(tmp_path / "runs", "20261207-040000-dddd", "/inv/a.yaml",
                  Run().start(0, 1, 2).at(1, tl.DETACHED).events)
    assert run_cli(["status", "--goodput", "-i", "/inv/a.yaml", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["fraction"]) for r in rows] == [("20261207-020000-bbbb", 0.5),
                                                         ("20261207-010000-aaaa", round(40 / 47, 4))]
    assert run_cli(["status", "--goodput", "--last", "1"]) == 0
    out = capsys.readouterr().out
    assert "20261207-030000-cccc" in out and "85.1%" in out and "aaaa" not in out
    assert run_cli(["status", "--goodput", "20261207-010000"]) == 0
    assert "attempt 1" in capsys.readouterr().out
    assert run_cli(["status", "--goodput", "20261207-040000"]) == 2          # detached
    assert "has no goodput" in capsys.readouterr().err


def test_facts_taken_as_the_events_come_give_what_the_file_gives_and_stay_bounded() -> None:
    """A recorder's listener (every beat, before thinning) and the thinned file agree; an
    attempt's saves are held to KEEP_SAVES, their total exact."""
    from cluster.observe.goodput import KEEP_SAVES, Facts

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now
    clock, written = Clock(), []
    rec = tl.Recorder(written.append, clock=clock, wall=clock)
    facts = Facts()
    rec.listen(facts.add)
    rec.event(tl.CHECK)
    clock.now = 1.0
    rec.event(tl.STARTED, nodes=["a 0"])
    clock.now = 2.0
    rec.event(tl.JOINED, "a 0")
    for i in range(1000):                      # a step each 0.5 s, a 0.1 s save each 5 steps
        clock.now = 3.0 + i * 0.5
        rec.beat("a 0", step=i + 1)
        if i % 5 == 4:
            rec.checkpoint(i + 1, saving=round(0.1 * ((i + 1) // 5), 3))
    clock.now = 505.0
    rec.event(tl.EXIT, "a 0", ok=True)
    rec.flush()
    rec.event(tl.OUTCOME, ok=True)
    assert len(written) < 300                                  # the file is thinned ...
    live, filed = facts.result(), goodput(written)
    assert live is not None and filed is not None
    assert live["parts"] == pytest.approx(filed["parts"], abs=0.2)   # ... and says the same
    assert live["parts"]["checkpoint"] == pytest.approx(20.0, abs=0.01)   # 200 saves of 0.1 s
    assert len(facts.attempts[0].saves) <= KEEP_SAVES
    assert sum(live["parts"].values()) == pytest.approx(live["wall"], abs=1e-6)
