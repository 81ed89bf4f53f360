"""When a failed job starts again, and on which nodes: launch._retry and _without_lost on
plain data (the whole flow runs on real nodes in tests/integration/test_faults.py)."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster import api
from cluster.errors import InputError
from cluster.inventory import parse_yaml
from cluster.launch import Options, _retry, _without_lost
from cluster.nodes import NodeExit
from cluster.watch import Hang, WatchResult

PLAN = SimpleNamespace(nodes=[SimpleNamespace(label="a 0"), SimpleNamespace(label="b 1"),
                              SimpleNamespace(label="c 2")])


def failed(joined=("a 0", "b 1", "c 2"), seconds_ago=100.0, **exits) -> WatchResult:
    r = WatchResult(exits={"a 0": NodeExit(code=0), "b 1": NodeExit(code=1), "c 2": NodeExit(code=0),
                           **{k.replace("_", " "): v for k, v in exits.items()}},
                    joined=set(joined), started=time.monotonic() - seconds_ago)
    r.first_failure = ("b 1", r.exits["b 1"])
    return r


def test_a_failure_after_every_node_joined_restarts_while_the_budget_lasts() -> None:
    why = _retry(failed(), PLAN, Options(restarts=2), history=[{}])
    assert why is not None and "fresh rendezvous" in why and "(2 restart(s) left)" in why
    assert _retry(failed(), PLAN, Options(restarts=2), history=[{}, {}, {}]) is None
    assert _retry(failed(), PLAN, Options(restarts=0), history=[{}]) is None


def test_a_failure_before_every_node_joined_is_configuration_and_says_so() -> None:
    result = failed(joined=("a 0",))
    assert _retry(result, PLAN, Options(restarts=3), history=[{}]) is None
    assert result.not_retried == "it failed before [b 1], [c 2] had joined the rendezvous"


def test_restart_after_widens_the_window_of_configuration_failures() -> None:
    early = failed(seconds_ago=5)
    assert _retry(early, PLAN, Options(restarts=3, restart_after=60), history=[{}]) is None
    assert early.not_retried == "it failed in its first 60 s (--restart-after)"
    assert _retry(failed(seconds_ago=90), PLAN, Options(restarts=3, restart_after=60), history=[{}])


def test_a_hang_after_every_node_joined_restarts_too() -> None:
    hung = WatchResult(exits={n.label: NodeExit(signal=15) for n in PLAN.nodes},
                       joined={n.label for n in PLAN.nodes}, started=time.monotonic() - 200)
    hung.hang = Hang(seconds=120)
    why = _retry(hung, PLAN, Options(restarts=1), history=[{}])
    assert why is not None and why.startswith("hang: no progress for 120 s; restarting")
    assert _retry(hung, PLAN, Options(restarts=0), history=[{}]) is None


def test_a_lost_node_counts_as_joined_when_the_others_did() -> None:
    lost = failed(joined=("a 0", "b 1"), c_2=NodeExit(lost=True, reason="keepalive"))
    assert _retry(lost, PLAN, Options(restarts=1), history=[{}]) is not None


def test_an_interrupted_or_finished_job_never_restarts() -> None:
    stopped = failed()
    stopped.interrupted = True
    assert _retry(stopped, PLAN, Options(restarts=5), history=[{}]) is None
    done = WatchResult(exits={"a 0": NodeExit(code=0)}, started=time.monotonic())
    assert _retry(done, PLAN, Options(restarts=5), history=[{}]) is None


def test_lost_nodes_are_left_out_only_while_min_nodes_remain() -> None:
    inv = parse_yaml("hosts: [a, b, c]\n", "inv.yaml")
    result = failed(c_2=NodeExit(lost=True))
    assert [h.name for h in _without_lost(inv, result, Options(min_nodes=2)).hosts] == ["a", "b"]
    assert [h.name for h in _without_lost(inv, result, Options(min_nodes=3)).hosts] == ["a", "b", "c"]
    assert [h.name for h in _without_lost(inv, result, Options()).hosts] == ["a", "b", "c"]


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


@pytest.mark.parametrize("key, request_", [("restarts: 1\n", {}), ("hang_timeout: 30\n", {}),
                                           ("", {"max_restarts": 1}), ("", {"min_nodes": 1})])
def test_slurm_refuses_what_it_does_itself(tmp_path: Path, key: str, request_: dict) -> None:
    inv = tmp_path / "slurm.yaml"
    inv.write_text("backend: slurm\n" + key + "hosts: [{name: a, address: 10.0.0.1}]\n")
    with pytest.raises(InputError, match="requeue"):
        prepared_options(inv, **request_)
