"""`cluster nodes` and `cluster nodes release`, in-process (click's CliRunner), over a real
ledger in the test's state folder (tests/conftest.py sets XDG_STATE_HOME) and, for the check
before a release, real nodes of this machine (a local inventory)."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cluster.cli import main, run_cli
from cluster.errors import InputError
from cluster.recovery.ledger import Event, Ledger


@pytest.fixture
def inventory(tmp_path: Path, monkeypatch) -> Path:
    """Two local nodes: `good` has this python (with torch, for the deep check), `bad` a
    python that is not there (its check fails at once)."""
    monkeypatch.chdir(tmp_path)                 # the deep check's run record: runs/doctor-...
    path = tmp_path / "hosts.yaml"
    path.write_text(f"backend: local\nhosts:\n"
                    f"  - {{name: good, address: 127.0.0.1, python: {sys.executable}}}\n"
                    f"  - {{name: bad, address: 127.0.0.2, python: /nonexistent/python3}}\n")
    return path


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def quarantine(path: Path | None, node: str, *, hours_ago: float = 1.0) -> Ledger:
    ledger = Ledger.for_inventory(None if path is None else str(path))
    t = time.time() - hours_ago * 3600
    ledger.record([Event(node, "lost", "20261206-100000-aa11", "connection reset by peer", time=t),
                   Event(node, "hang", "20261206-110000-bb22", "no heartbeat for 300 s",
                         evidence="rank 3: in all_reduce", time=t + 60)])
    return ledger


def test_nodes_lists_the_inventory_and_the_ledger(inventory: Path) -> None:
    ledger = quarantine(inventory, "bad", hours_ago=2.5)
    ledger.record([Event("good", "clean", "20261206-110000-bb22"),
                   Event("old", "clean", "20261201-090000-cc33")])
    result = cli("nodes", "-i", str(inventory))
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│ ")
            and line.split()[1] in ("good", "bad", "old")}
    assert "healthy" in rows["good"] and "20261206-110000-bb22 clean" in rows["good"]
    assert "quarantined" in rows["bad"] and "(2 h ago)" in rows["bad"]
    assert "lost in run 20261206-100000-aa11: connection reset by peer" in rows["bad"]
    assert "old (not in the inventory)" in rows["old"]
    assert "nodes: 1 quarantined of 3" in result.stdout
    assert str(ledger.path) in result.stdout


def test_nodes_json_is_one_object(inventory: Path) -> None:
    ledger = quarantine(inventory, "bad")
    result = cli("nodes", "-i", str(inventory), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ledger"] == str(ledger.path)
    assert data["policy"] == {"strikes": 2, "window_s": 86400}
    assert list(data["nodes"]) == ["good", "bad"]
    bad = data["nodes"]["bad"]
    assert bad["status"] == "quarantined" and bad["strikes"] == 2 and bad["in_inventory"]
    assert bad["evidence"][1]["evidence"] == "rank 3: in all_reduce"
    assert bad["last_runs"] == [{"run_id": "20261206-110000-bb22", "kind": "failed"},
                                {"run_id": "20261206-100000-aa11", "kind": "failed"}]
    assert data["nodes"]["good"]["status"] == "healthy"


def test_without_an_inventory_the_ledger_is_this_machines(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    quarantine(None, "local1")
    data = json.loads(cli("nodes", "--json").stdout)
    assert data["ledger"].endswith("/cluster/ledger/local.json")
    assert data["nodes"]["localhost"]["status"] == "healthy"
    assert data["nodes"]["local1"]["status"] == "quarantined"
    assert data["nodes"]["local1"]["in_inventory"], "simulated nodes come and go with --nodes"


def test_release_force_releases_without_the_check(inventory: Path) -> None:
    ledger = quarantine(inventory, "bad")
    result = cli("nodes", "release", "bad", "-i", str(inventory), "--force")
    assert result.exit_code == 0, result.output
    assert "bad released without the deep check (--force)" in result.stderr
    state = ledger.node("bad")
    assert not state.quarantined and "--force" in state.released_why
    shown = cli("nodes", "-i", str(inventory)).stdout
    assert "released 20" in shown and "without the deep check" in shown


def test_release_of_a_healthy_node_says_so(inventory: Path) -> None:
    result = cli("nodes", "-i", str(inventory), "release", "good")
    assert result.exit_code == 0, result.output
    assert ("good is not quarantined (0 strike(s) in the last 24 h): nothing to release"
            in result.stderr)
    assert not Ledger.for_inventory(str(inventory)).path.exists(), "nothing written"


def test_release_keeps_a_node_that_fails_the_check(inventory: Path, capsys) -> None:
    ledger = quarantine(inventory, "bad")
    before = ledger.path.read_text()
    assert run_cli(["nodes", "release", "bad", "-i", str(inventory)]) == 3
    err = capsys.readouterr().err
    assert "bad stays quarantined: the deep check failed (python)" in err
    assert "FAIL bad: python: python '/nonexistent/python3' not found" in err
    assert ledger.node("bad").quarantined and ledger.path.read_text() == before


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_release_after_the_deep_check_passes(inventory: Path) -> None:
    ledger = quarantine(inventory, "good")
    result = cli("nodes", "release", "good", "-i", str(inventory))
    assert result.exit_code == 0, result.output
    assert "running a collective across 1 node(s)" in result.stderr
    assert "good released: the deep check passed in" in result.stderr
    assert not ledger.node("good").quarantined
    assert ledger.node("good").released_why.startswith("the deep check passed")


def test_release_of_a_node_not_in_the_inventory_needs_force(inventory: Path) -> None:
    quarantine(inventory, "old")
    result = cli("nodes", "release", "old", "-i", str(inventory))
    assert isinstance(result.exception, InputError)
    assert "old is not in " + str(inventory) in str(result.exception)
    assert "--force" in str(result.exception)
    assert Ledger.for_inventory(str(inventory)).node("old").quarantined


def test_a_damaged_ledger_is_named_and_left_alone(inventory: Path, capsys) -> None:
    ledger = quarantine(inventory, "bad")
    ledger.path.write_text("{")
    assert run_cli(["nodes", "-i", str(inventory)]) == 2
    err = capsys.readouterr().err
    assert f"cluster: error: {ledger.path}: the node ledger is damaged" in err
    assert run_cli(["nodes", "release", "bad", "-i", str(inventory), "--force"]) == 2
    assert ledger.path.read_text() == "{"


def test_a_missing_inventory_is_named(tmp_path: Path, capsys) -> None:
    assert run_cli(["nodes", "-i", str(tmp_path / "gone.yaml")]) == 2
    assert f"cannot read inventory {tmp_path / 'gone.yaml'}" in capsys.readouterr().err


def test_under_slurm_the_ledger_lists_its_nodes_and_release_needs_force(tmp_path: Path) -> None:
    """SLURM may choose the nodes (no hosts listed): none is 'not in the inventory', and the
    deep check cannot run from here."""
    path = tmp_path / "slurm.yaml"
    path.write_text("backend: slurm\nslurm:\n  partition: gpu\n")
    ledger = quarantine(path, "gpu07")
    data = json.loads(cli("nodes", "-i", str(path), "--json").stdout)
    gpu07 = data["nodes"]["gpu07"]
    assert gpu07["status"] == "quarantined" and gpu07["in_inventory"]
    result = cli("nodes", "release", "gpu07", "-i", str(path))
    assert isinstance(result.exception, InputError)
    said = str(result.exception)
    assert "inside an allocation, then `cluster nodes release gpu07 --force`" in said
    assert ledger.node("gpu07").quarantined
