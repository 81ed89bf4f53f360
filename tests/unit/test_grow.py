"""Re-admission and the planned restart, on plain data and the watcher's fake nodes: the step
and checkpoint each attempt reports, a lost node looked at until it answers, the grow at the
next checkpoint, and what the restart budget counts (the whole flow runs on real nodes in
tests/integration/test_grow.py)."""
from __future__ import annotations

import threading
import time

from cluster.launch import Options, _retry, _spent
from cluster.nodes import NodeExit
from cluster.observe.watch import Watcher, WatchResult
from cluster.recovery.classes import PROGRAM, Verdict, decide
from cluster.recovery.grow import Readmission, rejoined
from cluster.spec import Host, Inventory
from tests.unit.test_watch import FakeNode, console


def hosts(*names: str) -> tuple[Host, ...]:
    return tuple(Host(name=n, address=n) for n in names)


def test_the_furthest_step_and_newest_checkpoint_of_an_attempt_are_kept() -> None:
    """Beats carry the ranks' counts as they grow; the node's record after its end has the
    step it failed at. A newer checkpoint is told at once, an older or equal one is not."""
    told: list[int] = []
    c, _, _ = console()
    a = FakeNode("a 0", [{"beat": 1.0, "at": {"step": 10, "checkpoint": 10}},
                         {"beat": 2.0, "at": {"step": 14, "checkpoint": 10}},
                         {"progress": {"step": 17, "checkpoint": 10}}], NodeExit(code=1))
    b = FakeNode("b 1", [{"beat": 1.5, "at": {"step": 12, "checkpoint": 20}},
                         {"beat": 1.6, "at": {"step": "x", "checkpoint": None}}], None)
    res = Watcher([a, b], c, {}, settle=5, on_checkpoint=told.append).run()
    assert (res.step, res.checkpoint) == (17, 20)
    assert told in ([10, 20], [20])           # b's may come first: then a's 10 is older


def test_a_planned_stop_stops_every_node_and_is_neither_a_failure_nor_ok() -> None:
    c, _, _ = console()
    nodes = [FakeNode("a 0", [], None), FakeNode("b 1", [], None)]
    why: list[str] = []
    threading.Timer(0.3, lambda: why.append("node3 answers again")).start()
    res = Watcher(nodes, c, {}, settle=5, poll=0.05,
                  planned=lambda: why[0] if why else None).run()
    assert res.planned == "node3 answers again"
    assert all(n.stop_calls == 1 for n in nodes)
    assert res.first_failure is None and not res.ok and not res.interrupted


def test_a_lost_node_is_looked_at_until_it_answers_and_grow_waits_for_a_checkpoint() -> None:
    said: list[str] = []
    answers = {"n2": False}
    r = Readmission(lambda h: answers[h.name], every=0.05, grow=True, say=said.append)
    try:
        r.attempt(below=True)
        r.lost(list(hosts("n2")))
        r.on_checkpoint(10)
        assert r.planned() is None                 # not back: no grow
        answers["n2"] = True
        deadline = time.monotonic() + 5
        while not said and time.monotonic() < deadline:
            time.sleep(0.02)
        assert said == ["n2 answers again: it rejoins at the next start (--grow: at the job's "
                        "next checkpoint)"]
        assert r.planned() is None                 # back, but no checkpoint since
        r.on_checkpoint(20)
        assert r.planned() == ("n2 answers again: restarting at full size from the checkpoint "
                               "of step 20 (--grow)")
        assert [h.name for h in r.take_back()] == ["n2"] and r.take_back() == []
        assert r.planned() is None
    finally:
        r.close()


def test_without_grow_or_at_full_size_a_checkpoint_plans_nothing() -> None:
    for grow, below in ((False, True), (True, False)):
        r = Readmission(lambda h: True, every=60, grow=grow, say=lambda s: None)
        r.attempt(below=below)
        r.back = list(hosts("n2"))
        r.on_checkpoint(5)
        assert r.planned() is None
        r.close()


def test_a_backend_without_answers_keeps_lost_nodes_out() -> None:
    r = Readmission(None, every=0.01, grow=True, say=lambda s: None)
    r.lost(list(hosts("n2")))
    assert r.thread is None and r.away == [] and r.take_back() == []


def test_a_node_back_joins_a_job_below_its_size_else_waits_as_a_spare() -> None:
    c, _, err = console()
    inv = Inventory(hosts=hosts("n1", "n3"))
    spares: list[Host] = []
    grown = rejoined(inv, list(hosts("n2", "n4")), spares, 3, None, c.info)
    assert [h.name for h in grown.hosts] == ["n1", "n3", "n2"]
    assert [h.name for h in spares] == ["n4"]
    assert "n2 rejoins the job: 3 of 3 node(s)" in err.getvalue()
    assert "n4 answers again: it waits as a spare" in err.getvalue()


def test_a_planned_restart_spends_none_of_the_restart_budget() -> None:
    history = [{"ended": "node [b 1] failed"}, {"ended": "stopped for a restart", "planned": True}]
    assert _spent(history) == 1
    failed = WatchResult(exits={"b 1": NodeExit(code=1)}, had_workers={"b 1"},
                         started=time.monotonic() - 100)
    failed.first_failure = ("b 1", failed.exits["b 1"])
    plan = type("P", (), {"nodes": []})()
    why = _retry(failed, plan, Options(restarts=2), history + [{"ended": "x"}])
    assert why is not None and why.endswith("(attempt 3 of 3, no restart left)"), why


def test_the_same_error_at_another_step_restarts_and_at_the_same_step_stops() -> None:
    err = Verdict(PROGRAM, "python_error", "RuntimeError: loss is nan at 0x7f3a")
    before = [{"cause": "RuntimeError: loss is nan at 0x55aa", "step": 40}]
    assert decide(before, err, step=41).action == "restart"
    stop = decide(before, err, step=40)
    assert stop.action == "stop" and "at step 40 both times" in stop.why


class Login:
    """A transport whose login works or fails, as a node that answers or not."""

    def __init__(self, works: bool) -> None:
        self.works, self.closed = works, False

    def open(self) -> None:
        if not self.works:
            raise OSError("No route to host")

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b""):
        from cluster.backends.transport import Result
        return Result(0, b"", b"")

    def close(self) -> None:
        self.closed = True


def test_answers_logs_in_anew_and_keeps_the_new_connection_for_the_next_check() -> None:
    from cluster.backends.supervised import SupervisedBackend
    logins = iter([Login(False), Login(True)])
    backend = SupervisedBackend(lambda host: next(logins))
    dead = Login(True)
    backend._transports["n2"] = dead                  # the connection that died with the node
    host = Host(name="n2", address="n2")
    try:
        assert backend.answers(host) is False and backend._transports["n2"] is dead
        assert backend.answers(host) is True
        assert backend._transports["n2"] is not dead and backend._transports["n2"].works
        deadline = time.monotonic() + 5
        while not dead.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dead.closed
    finally:
        backend.close()


def test_a_node_back_that_the_ledger_quarantined_stays_out(tmp_path) -> None:
    from cluster.recovery.ledger import Event, Ledger
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.record([Event("n2", "lost", "r1"), Event("n2", "lost", "r2")])   # 2 in 24 h
    said: list[str] = []
    spares: list[Host] = []
    grown = rejoined(Inventory(hosts=hosts("n1", "n3")), list(hosts("n2")), spares, 3, ledger,
                     said.append)
    assert [h.name for h in grown.hosts] == ["n1", "n3"] and spares == []
    assert said == ["n2 answers again but is quarantined: it stays out"]
