"""Which hosts run (cluster.recovery.pool.pick) and what an attempt's end holds against each
node (attempt_events, gate_events), by table."""
from __future__ import annotations

import pytest

from cluster.nodes import NodeExit
from cluster.recovery.findings import FAIL, Finding
from cluster.recovery.ledger import NodeState
from cluster.recovery.pool import attempt_events, gate_events, pick
from cluster.spec import Host

HOSTS = tuple(Host(name=f"n{i}", address=f"10.0.0.{i}") for i in range(1, 5))
SICK = {"n2": NodeState("n2", status="quarantined", why=["lost in run r1", "lost in run r2"],
                        strikes=2)}


def names(p) -> list[str]:
    return [h.name for h in p.hosts]


@pytest.mark.parametrize("nodes, min_nodes, want, note", [
    (None, None, ["n1", "n2", "n3", "n4"], "WARNING: running on quarantined n2"),
    (3, None, ["n1", "n3", "n4"], "leaving out quarantined n2"),
    (4, None, ["n1", "n2", "n3", "n4"], "only 3 are healthy"),
    (None, 3, ["n1", "n3", "n4"], "leaving out quarantined n2"),
    (None, 4, ["n1", "n2", "n3", "n4"], "WARNING"),
    (2, None, ["n1", "n3"], "leaving out"),
])
def test_pick(nodes, min_nodes, want, note) -> None:
    p = pick(HOSTS, SICK, nodes=nodes, min_nodes=min_nodes)
    assert names(p) == want
    assert len(p.notes) == 1 and note in p.notes[0], p.notes
    assert "n2 (2 failure(s) in the window, the last: lost in run r2)" in p.notes[0]


def test_pick_without_quarantine_is_the_first_n_and_says_nothing() -> None:
    assert names(pick(HOSTS, {}, nodes=2)) == ["n1", "n2"] and pick(HOSTS, {}).notes == ()


def test_a_quarantined_master_is_left_out_too() -> None:
    sick = {"n1": SICK["n2"]}
    assert names(pick(HOSTS, sick, nodes=3)) == ["n2", "n3", "n4"]


def test_attempt_events_lost_hardware_first_failure_slow_and_clean() -> None:
    exits = {"n1 0": NodeExit(code=1), "n2 1": NodeExit(code=255, lost=True, reason="timed out"),
             "n3 2": NodeExit(code=1)}
    events = attempt_events("r1", exits, ("n3 2", exits["n3 2"]),
                            {"n3 2": "RuntimeError: CUDA error: uncorrectable ECC error encountered"},
                            [{"node": "n4 3", "ratio": 1.6, "reference": "the job's median",
                              "part": "compute"}], ok=False)
    assert [(e.node, e.kind) for e in events] == [("n2", "lost"), ("n3", "failed_first"),
                                                 ("n4", "slow")]
    assert "uncorrectable ECC" in events[1].detail


def test_a_programs_own_error_is_held_against_no_node() -> None:
    exits = {"n1 0": NodeExit(code=1)}
    cause = {"n1 0": "ZeroDivisionError: division by zero"}
    assert attempt_events("r1", exits, ("n1 0", exits["n1 0"]), cause, [], ok=False) == []


def test_a_finished_run_is_clean_for_every_node() -> None:
    exits = {"n1 0": NodeExit(code=0), "n2 1": NodeExit(code=0)}
    assert [(e.node, e.kind) for e in attempt_events("r1", exits, None, {}, [], ok=True)] == [
        ("n1", "clean"), ("n2", "clean")]


def test_gate_events_only_for_the_hardware() -> None:
    findings = [Finding("n2", "ecc", FAIL, "GPU 5: 3 uncorrectable ECC error(s)"),
                Finding("n3", "gpu memory", FAIL, "GPU 3: PID 42 holds 70 GiB"),
                Finding("n3", "disk", FAIL, "1 GiB free")]
    assert [(e.node, e.kind, e.detail) for e in gate_events("r1", findings)] == [
        ("n2", "gate", "ecc: GPU 5: 3 uncorrectable ECC error(s)")]


def test_the_hangs_odd_one_out_is_held_against_its_node() -> None:
    from cluster.observe.hang import odd_node
    stack = 'Current thread 0x1 (most recent call first):\n  File "/x/train.py", line {} in {}\n'
    stacks = {"n1 0": [{"rank": 0, "text": stack.format(9, "all_reduce")}],
              "n2 1": [{"rank": 1, "text": stack.format(9, "all_reduce")}],
              "n3 2": [{"rank": 2, "text": stack.format(40, "load_batch")}]}
    odd = odd_node(stacks)
    assert odd is not None and odd[0] == "n3" and "load_batch" in odd[1]
    events = attempt_events("r1", {}, None, {}, [], ok=False, hang_odd=odd)
    assert [(e.node, e.kind) for e in events] == [("n3", "hang")]
    stacks["n2 1"] = [{"rank": 1, "text": stack.format(50, "save")}]
    assert odd_node(stacks) is None, "odd ones on two nodes: no one node to blame"


SPARES = tuple(Host(name=f"s{i}", address=f"10.0.1.{i}") for i in range(1, 3))


@pytest.mark.parametrize("held, spares, min_nodes, want, left, said", [
    ({"n2": "lost: x"}, SPARES, None, ["n1", "s1", "n3", "n4"], ["s2"],
     "n2 set aside (lost: x); s1 takes its place"),
    ({"n2": "lost", "n4": "gate"}, SPARES, None, ["n1", "s1", "n3", "s2"], [], "s2 takes its place"),
    ({"n2": "lost"}, (), 3, ["n1", "n3", "n4"], [], "no spare left: going on with 3 node(s)"),
    ({"n2": "lost"}, (), 4, ["n1", "n2", "n3", "n4"], [], "the same nodes start again"),
    ({"n9": "lost"}, SPARES, None, ["n1", "n2", "n3", "n4"], ["s1", "s2"], None),
])
def test_replace(held, spares, min_nodes, want, left, said) -> None:
    from cluster.recovery.pool import replace
    out = replace(HOSTS, held, spares, min_nodes=min_nodes)
    assert names(out) == want and [h.name for h in out.spares] == left
    assert (said is None and out.lines == ()) or any(said in line for line in out.lines), out.lines
