"""When a failed job starts again, and on which nodes: launch._retry and _next_hosts on
plain data (the whole flow runs on real nodes in tests/integration/test_faults.py)."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster import api
from cluster.errors import InputError
from cluster.inventory import parse_yaml
from cluster.console import Console
from cluster.launch import Options, _next_hosts, _retry, joined
from cluster.recovery.pool import attempt_events, culprits
from cluster.nodes import NodeExit
from cluster.observe.watch import Hang, Watcher, WatchResult

PLAN = SimpleNamespace(nodes=[SimpleNamespace(label="a 0"), SimpleNamespace(label="b 1"),
                              SimpleNamespace(label="c 2")])


def failed(had_workers=("b 1",), seconds_ago=100.0, **exits) -> WatchResult:
    """Node b failed; a and c were stopped (exit 143) without a word on their workers."""
    r = WatchResult(exits={"a 0": NodeExit(code=143), "b 1": NodeExit(code=1), "c 2": NodeExit(code=143),
                           **{k.replace("_", " "): v for k, v in exits.items()}},
                    had_workers=set(had_workers), started=time.monotonic() - seconds_ago)
    r.first_failure = ("b 1", r.exits["b 1"])
    return r


def test_a_failure_after_the_rendezvous_restarts_while_the_budget_lasts() -> None:
    why = _retry(failed(), PLAN, Options(restarts=2), history=[{}])
    assert why is not None and "fresh rendezvous" in why and "(attempt 2 of 3, 1 restart left)" in why
    assert _retry(failed(), PLAN, Options(restarts=2), history=[{}, {}, {}]) is None
    assert _retry(failed(), PLAN, Options(restarts=0), history=[{}]) is None


def test_the_restarts_left_are_counted_at_every_attempt() -> None:
    """--max-restarts 1 said '(1 restart(s) left)' as it started its last attempt: the count
    is of what is left once the restart being made is spent, at every attempt."""
    said = [_retry(failed(), PLAN, Options(restarts=1), history=[{}])]
    assert said[0] is not None and said[0].endswith("(attempt 2 of 2, no restart left)"), said
    said = [_retry(failed(), PLAN, Options(restarts=3), history=[{}] * n) for n in (1, 2, 3, 4)]
    assert [s and s.rsplit("(", 1)[1] for s in said] == [
        "attempt 2 of 4, 2 restarts left)", "attempt 3 of 4, 1 restart left)",
        "attempt 4 of 4, no restart left)", None]


def test_a_failure_before_the_rendezvous_is_configuration_and_names_no_node() -> None:
    """Nothing proves that any node's torchrun started workers: no node can be named as not
    joined (some may have been waiting in the rendezvous), and the job is not retried."""
    result = failed(had_workers=())
    result.joined = {"a 0"}                        # what a scan saw decides nothing
    assert _retry(result, PLAN, Options(restarts=3), history=[{}]) is None
    assert result.not_retried.startswith("it failed before its rendezvous was complete (no "
                                         "node's torchrun had started its workers), which is "
                                         "configuration (")
    assert joined(result) == set()


def test_a_node_that_fails_before_any_scan_saw_its_workers_is_restarted() -> None:
    """The issue's case: rank 2 dies right after init_process_group, before any supervisor's
    scan saw a worker at the store. Its torchrun's report of the failed worker proves that
    the rendezvous was complete, so every node had joined."""
    fast = failed(had_workers=("c 2",))
    fast.first_failure = ("c 2", fast.exits["c 2"])
    assert fast.joined == set()
    assert _retry(fast, PLAN, Options(restarts=1), history=[{}]) is not None
    assert joined(fast) == {"a 0", "b 1", "c 2"}


def test_the_watcher_takes_the_proof_from_the_nodes_events_not_from_a_scan() -> None:
    """Through the watcher: node c's torchrun reports its failed worker before any scan saw
    a worker anywhere; a and c are stopped. The job restarts, and the attempt's record says
    every node had joined."""
    from tests.unit.test_watch import CHILD_FAILED, FakeNode, console
    failing = FakeNode("c 2", CHILD_FAILED, NodeExit(code=1))
    result = Watcher([FakeNode("a 0", [], None), FakeNode("b 1", [], None), failing],
                     console()[0], {}).run()
    assert result.first_failure[0] == "c 2" and result.joined == set()
    assert result.had_workers == {"c 2"} and joined(result) == {"a 0", "b 1", "c 2"}
    assert _retry(result, PLAN, Options(restarts=1), history=[{}]) is not None
    before = FakeNode("c 2", [b"launch.sh: line 9: no-such-venv/bin/activate: No such file\n"],
                      NodeExit(code=1))
    early = Watcher([FakeNode("a 0", [], None), FakeNode("b 1", [], None), before],
                    console()[0], {}).run()
    assert _retry(early, PLAN, Options(restarts=1), history=[{}]) is None
    stopped = [FakeNode("a 0", [{"workers": 1}], None), FakeNode("b 1", [], None)]
    lost = FakeNode("c 2", [], NodeExit(lost=True, reason="keepalive"))
    result = Watcher([*stopped, lost], console()[0], {}).run()
    assert result.had_workers == {"a 0"}
    assert _retry(result, PLAN, Options(restarts=1), history=[{}]) is not None


def test_workers_stopped_or_left_or_a_finished_node_prove_the_rendezvous_too() -> None:
    stopped = failed(had_workers=())
    stopped.stops = {"a 0": {"signalled": [5], "killed": [], "left": [], "workers": 2}}
    assert _retry(stopped, PLAN, Options(restarts=1), history=[{}]) is not None
    finished = failed(had_workers=(), a_0=NodeExit(code=0))
    assert _retry(finished, PLAN, Options(restarts=1), history=[{}]) is not None
    none = failed(had_workers=())
    none.stops = {"a 0": {"signalled": [5], "killed": [], "left": [], "workers": 0}}
    assert _retry(none, PLAN, Options(restarts=1), history=[{}]) is None


def test_restart_after_widens_the_window_of_configuration_failures() -> None:
    early = failed(seconds_ago=5)
    assert _retry(early, PLAN, Options(restarts=3, restart_after=60), history=[{}]) is None
    assert early.not_retried.startswith("it failed in its first 60 s (--restart-after), which is "
                                        "configuration")
    assert _retry(failed(seconds_ago=90), PLAN, Options(restarts=3, restart_after=60), history=[{}])


def test_a_hang_after_the_rendezvous_restarts_too() -> None:
    hung = WatchResult(exits={n.label: NodeExit(signal=15) for n in PLAN.nodes},
                       stops={n.label: {"left": [], "workers": 1} for n in PLAN.nodes},
                       started=time.monotonic() - 200)
    hung.hang = Hang(seconds=120)
    why = _retry(hung, PLAN, Options(restarts=1), history=[{}])
    assert why is not None and why.startswith("hang: no progress for 120 s; restarting")
    assert _retry(hung, PLAN, Options(restarts=0), history=[{}]) is None
    hung.stops = {n.label: {"left": []} for n in PLAN.nodes}     # stuck in the rendezvous
    assert _retry(hung, PLAN, Options(restarts=1), history=[{}]) is None


def test_a_lost_node_counts_as_joined_when_the_others_had_workers() -> None:
    lost = failed(had_workers=(), c_2=NodeExit(lost=True, reason="keepalive"))
    lost.first_failure = ("c 2", lost.exits["c 2"])
    lost.stops = {"a 0": {"left": [], "workers": 1}, "b 1": {"left": [], "workers": 1}}
    assert _retry(lost, PLAN, Options(restarts=1), history=[{}]) is not None
    assert "c 2" in joined(lost)


def test_an_attempt_shrunk_by_min_nodes_is_judged_on_its_own_nodes() -> None:
    """After a loss under --min-nodes the next attempt runs on fewer nodes, with --nnodes
    fixed to them: the proof covers those nodes, not the ones left out."""
    second = WatchResult(exits={"a 0": NodeExit(code=143), "b 1": NodeExit(code=1)},
                         had_workers={"b 1"}, started=time.monotonic() - 100)
    second.first_failure = ("b 1", second.exits["b 1"])
    assert joined(second) == {"a 0", "b 1"}
    assert _retry(second, PLAN, Options(restarts=2, min_nodes=2), history=[{}, {}]) is not None


def test_an_interrupted_or_finished_job_never_restarts() -> None:
    stopped = failed()
    stopped.interrupted = True
    assert _retry(stopped, PLAN, Options(restarts=5), history=[{}]) is None
    done = WatchResult(exits={"a 0": NodeExit(code=0)}, started=time.monotonic())
    assert _retry(done, PLAN, Options(restarts=5), history=[{}]) is None


def next_hosts(result: WatchResult, options: Options, spares: list | None = None) -> list[str]:
    inv = parse_yaml("hosts: [a, b, c]\n", "inv.yaml")
    held = culprits(attempt_events("r", result.exits, result.first_failure, result.causes,
                                   result.slow, result.ok))
    return [h.name for h in _next_hosts(inv, held, spares if spares is not None else [], options,
                                        Console()).hosts]


def test_lost_nodes_are_left_out_only_while_min_nodes_remain() -> None:
    result = failed(c_2=NodeExit(lost=True))
    assert next_hosts(result, Options(min_nodes=2)) == ["a", "b"]
    assert next_hosts(result, Options(min_nodes=3)) == ["a", "b", "c"]
    assert next_hosts(result, Options()) == ["a", "b", "c"]


def test_a_lost_node_is_replaced_by_a_spare_in_its_place() -> None:
    spare = parse_yaml("hosts: [d, e]\n", "inv.yaml").hosts
    result = failed(b_1=NodeExit(lost=True))
    left = list(spare)
    assert next_hosts(result, Options(min_nodes=2), left) == ["a", "d", "c"]
    assert [h.name for h in left] == ["e"], "the spare is taken"


def prepared_options(inv: Path, **request) -> Options:
    prepared = api.prepare(api.Request(inventory_path=str(inv), command=("t.py",), **request),
                           {"PATH": "/usr/bin:/bin"})
    prepared.backend.close()
    return prepared.options


def test_the_inventorys_restarts_and_hang_timeout_reach_the_launch_and_options_win(
        tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("restarts: 2\nhang_timeout: 45\nhosts: [{name: a, address: 10.0.0.1}, "
                   "{name: b, address: 10.0.0.2}]\n")
    options = prepared_options(inv)
    assert (options.restarts, options.hang_timeout) == (2, 45.0)
    options = prepared_options(inv, max_restarts=0, hang_timeout=0.0)
    assert (options.restarts, options.hang_timeout) == (0, 0.0)
    inv.write_text("hosts: [{name: a, address: 10.0.0.1}]\n")
    assert (prepared_options(inv).restarts, prepared_options(inv).hang_timeout) == (0, 0.0)


@pytest.mark.parametrize("key, request_", [("hang_timeout: 30\n", {}), ("", {"min_nodes": 1})])
def test_slurm_refuses_what_it_does_itself(tmp_path: Path, key: str, request_: dict) -> None:
    inv = tmp_path / "slurm.yaml"
    inv.write_text("backend: slurm\n" + key + "hosts: [{name: a, address: 10.0.0.1}]\n")
    with pytest.raises(InputError, match="requeue"):
        prepared_options(inv, **request_)


@pytest.mark.parametrize("key, request_", [("restarts: 1\n", {}), ("", {"max_restarts": 1})])
def test_slurm_takes_restarts_for_its_batch_script_and_the_launcher_restarts_nothing(
        tmp_path: Path, key: str, request_: dict) -> None:
    inv = tmp_path / "slurm.yaml"
    inv.write_text("backend: slurm\n" + key + "hosts: [{name: a, address: 10.0.0.1}]\n")
    prepared = api.prepare(api.Request(inventory_path=str(inv), command=("t.py",), **request_),
                           {"PATH": "/usr/bin:/bin"})
    prepared.backend.close()
    assert prepared.options.restarts == 0 and prepared.inventory.restarts == 1


@pytest.mark.parametrize("key", ["hang_timeout"])
def test_slurm_inventory_names_the_line_of_a_launcher_only_key(tmp_path: Path, key: str) -> None:
    inv = tmp_path / "slurm.yaml"
    inv.write_text(f"backend: slurm\n{key}: 2\n")
    with pytest.raises(InputError) as raised:
        prepared_options(inv)
    assert str(raised.value).startswith(f"{inv}:2: {key}: is for local and ssh runs"), raised.value


def test_the_restart_line_names_the_workers_own_error_as_the_final_error_does(
        tmp_path: Path) -> None:
    """Issue 35 item 10: the restart line said only 'node [c 2] failed: exit code 1'. Through
    the watcher, node c's worker raised: the restart line leads with its error as the final
    error does (one code for both), and the attempt's record in run.json keeps it."""
    from cluster.errors import RunFailed
    from cluster.launch import _outcome, _record
    from cluster.runs import RunDir
    from tests.unit.test_watch import CHILD_FAILED, FakeNode, console
    raised = [b"[rank2]: Traceback (most recent call last):\n", b'[rank2]:   File "t.py"\n',
              b"[rank2]: RuntimeError: boom\n", *CHILD_FAILED[1:]]
    failing = FakeNode("c 2", raised, NodeExit(code=1))
    result = Watcher([FakeNode("a 0", [], None), FakeNode("b 1", [], None), failing],
                     console()[0], {}).run()
    assert result.first_failure[0] == "c 2" and result.causes["c 2"] == "RuntimeError: boom"
    why = _retry(result, PLAN, Options(restarts=1), history=[{}])
    assert why == ("node [c 2] failed: RuntimeError: boom (exit code 1); restarting the whole "
                   "job on a fresh rendezvous (attempt 2 of 2, no restart left)")
    plan = SimpleNamespace(run_id="r1", logs_hint="cluster logs r1", node_count=3,
                           node_names=["a", "b", "c"], master_port=29500)
    with pytest.raises(RunFailed) as info:
        _outcome(result, plan, console()[0])
    assert str(info.value).startswith(why.split(";")[0] + "; ")
    run = RunDir.create("r1", root=tmp_path / "runs")
    history: list = []
    _record(run, plan, SimpleNamespace(ended=lambda *_: {}), [], result, history, console()[0])
    attempt = run.meta()["attempts"][0]
    assert attempt["cause"] == "RuntimeError: boom"
    assert attempt["ended"] == "node [c 2] failed: exit code 1"     # the cause is kept apart
    silent = failed()                                  # no worker's error seen: as before
    assert _retry(silent, PLAN, Options(restarts=1), history=[{}]).startswith(
        "node [b 1] failed: exit code 1; restarting")


def test_the_programs_same_error_twice_stops_instead_of_burning_restarts() -> None:
    from cluster.launch import _verdict
    first, second = failed(), failed()
    for r in (first, second):
        r.causes = {"b 1": "ZeroDivisionError: division by zero"}
    verdict = _verdict(first, None)
    assert verdict is not None and verdict.cls == "program"
    history = [{"attempt": 0, "cause": "ZeroDivisionError: division by zero", "class": "program"}]
    assert _retry(first, PLAN, Options(restarts=5), history) is not None, "the first time restarts"
    history.append({"attempt": 1, "cause": "ZeroDivisionError: division by zero"})
    assert _retry(second, PLAN, Options(restarts=5), history, _verdict(second, None)) is None
    assert second.not_retried.startswith("the program failed the same way twice")


def test_a_node_class_failure_and_a_transient_one_restart() -> None:
    from cluster.launch import _verdict
    lost = failed(b_1=NodeExit(lost=True))
    lost.first_failure = ("b 1", lost.exits["b 1"])
    assert _verdict(lost, None).cls == "node"
    history = [{"attempt": 0}]
    assert _retry(lost, PLAN, Options(restarts=2), history, _verdict(lost, None)) is not None
    reset = failed()
    reset.causes = {"b 1": "RuntimeError: Connection reset by peer"}
    assert _verdict(reset, None).cls == "transient"


def test_each_host_set_aside_is_an_event_with_why_and_its_spare() -> None:
    from cluster.launch import _aside
    from cluster.observe import timeline as tl
    from cluster.spec import Host
    events: list[tl.Event] = []
    rec = tl.Recorder(events.append)
    a, b, c, s = (Host(name=n, address=n) for n in ("a", "b", "c", "s"))
    _aside(rec, [a, b, c], [a, s], {"b": "lost", "c": "GPU error"})
    assert [(e["kind"], e["host"], e["why"], e.get("spare")) for e in events] == \
        [("aside", "b", "lost", "s"), ("aside", "c", "GPU error", None)]
    assert all("node" not in e for e in events)          # the job's event: no lane of its own
