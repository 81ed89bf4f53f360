"""Connecting ahead (SupervisedBackend.open_all): every node's login starts while the launcher
records and renders, the check uses those connections, a failure to connect is still that
node's report, and a dry run contacts nothing. Fake transports: no node is contacted."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from cluster.api import prepare
from cluster.backends.local import LocalTransport, local_inventory
from cluster.backends.supervised import SupervisedBackend
from cluster.console import Console
from cluster.errors import ClusterError, PreflightError
from cluster.plan import Job, Templates, render
from cluster.request import Request


class Counted(LocalTransport):
    """A transport that says who opened it, and keeps its failure as SshTransport does."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.opened: list[str] = []
        self.error: ClusterError | None = None

    def open(self) -> None:
        self.opened.append(threading.current_thread().name)
        if self.fail:
            self.error = ClusterError("10.0.0.9:22: connection refused")
            raise self.error

    def spawn(self, command: str):  # type: ignore[override]
        if self.error is not None:
            raise self.error
        return super().spawn(command)


def _plan(tmp_path, nodes: int):
    return render(local_inventory(nodes, gpus=[]), Job(run_id="20260101-000000-abcd", script="t.py",
                                                   node_root=str(tmp_path)), Templates())


def test_every_node_is_opened_once_in_the_background_and_the_check_uses_it(tmp_path) -> None:
    made: dict[str, Counted] = {}

    def connect(host):
        made[host.name] = Counted(fail=host.name == "local1")
        return made[host.name]
    backend = SupervisedBackend(connect)
    plan = _plan(tmp_path, 3)
    try:
        backend.open_all([n.host for n in plan.nodes])
        with pytest.raises(PreflightError) as failed:
            backend.check(plan)
    finally:
        backend.close()
    assert sorted(made) == ["local0", "local1", "local2"]
    for name, transport in made.items():
        assert len(transport.opened) == 1, (name, transport.opened)     # never a second login
        assert transport.opened[0] != threading.main_thread().name, "opened in the background"
    # the one that could not connect is named, with why, and nothing started
    assert "1 of 3 node(s) failed" in str(failed.value)
    assert "local1 1: 10.0.0.9:22: connection refused" in failed.value.details


def test_a_dry_run_opens_no_connection(tmp_path, monkeypatch) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  - {name: a, address: 10.255.255.1}\n  - {name: b, address: 10.255.255.2}\n")
    monkeypatch.chdir(tmp_path)
    prepared = prepare(Request(inventory_path=str(inv), command=("t.py",), dry_run=True))
    opened: list[object] = []
    monkeypatch.setattr(prepared.backend, "open_all", lambda hosts: opened.append(hosts))
    assert prepared.run(Console(color=False), ["cluster", "up", "--dry-run"]) == 0
    assert opened == []


def test_a_local_run_loads_no_ssh_code(tmp_path) -> None:
    """`cluster up --local` (and every verb but up, doctor, exec...) never imports paramiko:
    each verb's module is imported at its first use."""
    code = ("import sys\nfrom cluster.cli import run_cli\n"
            "rc = run_cli(['up', '--local', '--dry-run'])\n"
            "print('loaded:', rc, 'paramiko' in sys.modules, 'cluster.cli.doctor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    said = out.stdout.splitlines()[-1] if out.stdout else ""
    assert said == "loaded: 0 False False", out.stdout[-500:] + out.stderr

