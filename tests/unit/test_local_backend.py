"""The local backend and what it shares with SSH (SupervisedBackend), with real processes;
a failing transport is injected through the constructor."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.backends.local import LocalTransport, local_inventory
from cluster.backends.supervised import SupervisedBackend
from cluster.errors import BackendError, ClusterError
from cluster.plan import Job, Templates, render

from .test_supervisor import tagged_pids, wait_for


@pytest.mark.parametrize("visible,nodes,want", [
    ("2,3", 2, ["2", "3"]),
    ("1,3,5,7", 2, ["1,3", "5,7"]),
    ("GPU-aaaa,GPU-bbbb", 2, ["GPU-aaaa", "GPU-bbbb"]),
])
def test_simulated_nodes_split_the_gpus_this_shell_may_use(monkeypatch, visible, nodes, want) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    inv = local_inventory(nodes)
    assert [dict(h.env)["CUDA_VISIBLE_DEVICES"] for h in inv.hosts] == want
    assert [h.nproc_per_node for h in inv.hosts] == [len(w.split(",")) for w in want]


def test_hidden_gpus_mean_cpu_processes(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    inv = local_inventory(2)
    assert all("CUDA_VISIBLE_DEVICES" not in dict(h.env) for h in inv.hosts)
    assert [h.nproc_per_node for h in inv.hosts] == [1, 1]


class FailsToStart(LocalTransport):
    """A node whose check passes but whose start fails (as an SSH node whose disk just filled
    up would): the word to start, the second thing written to it, cannot be delivered."""

    def spawn(self, command: str):
        channel = super().spawn(command)
        writes = {"n": 0}
        real = channel.write

        def write(data: bytes) -> None:
            writes["n"] += 1
            if writes["n"] == 2:
                raise BackendError("No space left on device")
            real(data)
        channel.write = write
        return channel


@pytest.mark.parametrize("detach", [True, False])
def test_a_partial_start_stops_the_nodes_that_did_start(tmp_path: Path, monkeypatch, detach) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "node.sh.j2").write_text("exec sleep 300\n")
    run_id = f"partial-{os.getpid()}-{int(detach)}"
    inv = local_inventory(2)
    plan = render(inv, Job(run_id=run_id, script="x", node_root=str(tmp_path / "nodes")),
                  Templates(tmp_path / "tpl"))
    backend = SupervisedBackend(lambda host: FailsToStart() if host.name == "local1"
                                else LocalTransport())
    try:
        backend.check(plan)
        with pytest.raises(BackendError) as info:
            backend.start(plan, detach=detach)
        assert "the started ones were stopped" in str(info.value)
        assert "local1" in info.value.details
        assert wait_for(lambda: not tagged_pids(run_id, "local0"), 10), "node local0 still runs"
        # local0 started (a detached start returns once it has), or, attached, its supervisor
        # saw the stop before it began: either way it ended as stopped.
        exit_file = tmp_path / "nodes" / "local0" / "exit"
        assert wait_for(exit_file.exists, 10)
        assert json.loads(exit_file.read_text())["stopped"] is True
        if detach:
            assert (tmp_path / "nodes" / "local0" / "pgid").exists()
    finally:
        backend.close()


def test_the_open_files_limit_is_raised_for_many_nodes_or_refused_clearly() -> None:
    import resource
    from cluster.errors import InputError
    from cluster.launch import ensure_open_files
    limits = {"now": (1024, 524288)}

    def get(_):
        return limits["now"]

    def set_(_, value):
        limits["now"] = value
    ensure_open_files(200, (get, set_))
    assert limits["now"] == (1024, 524288)                  # enough already: untouched
    ensure_open_files(1000, (get, set_))
    assert limits["now"][0] >= 4 * 1000 and limits["now"][1] == 524288
    limits["now"] = (1024, 2048)
    with pytest.raises(InputError, match="ulimit -Hn"):
        ensure_open_files(1000, (get, set_))
    assert resource.RLIMIT_NOFILE is not None


class _Saved:
    """A `supervisor.py logs` channel: one chunk of saved output, then its end."""
    def __init__(self, data: bytes) -> None:
        self.chunks = [data, b""]

    def read(self) -> bytes:
        return self.chunks.pop(0)

    def write(self, data: bytes) -> None:
        pass                     # the program's bundle

    def wait(self) -> int:
        return 0


class _SavedOutput(LocalTransport):
    def __init__(self, name: str) -> None:
        self.name = name

    def spawn(self, command: str):  # type: ignore[override]
        return _Saved(f"{self.name} said\n".encode())


class _Recorded:
    """A recorded run of nodes a and b, as RunDir shows it to a backend."""
    def hosts(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n, python="python3", setup=()) for n in "ab"]

    def meta(self) -> dict:
        return {"nodes": [{"name": n, "rank": r, "run_dir": "/r"} for r, n in enumerate("ab")]}


def test_logs_name_a_node_that_cannot_be_reached_unless_another_node_is_asked_for() -> None:
    def connect(host: SimpleNamespace) -> LocalTransport:
        if host.name == "b":
            raise ClusterError("b: connection refused")
        return _SavedOutput(host.name)
    backend = SupervisedBackend(connect)
    try:
        assert list(backend.logs(_Recorded(), node="a")) == [("a 0", b"a said\n")]
        with pytest.raises(ClusterError, match="^b 1: b: connection refused$"):
            list(backend.logs(_Recorded()))
        with pytest.raises(ClusterError, match="^b 1: b: connection refused$"):
            list(backend.logs(_Recorded(), node="b", follow=True))
    finally:
        backend.close()


def test_a_detached_start_that_fails_on_a_node_says_why_at_once(tmp_path: Path, monkeypatch) -> None:
    """local1's job cannot start (no bash on its PATH): its start fails within moments, not
    30 s later, with the supervisor's own error; the start raises and stops local0."""
    import dataclasses
    import sys
    import time
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "node.sh.j2").write_text("exec sleep 300\n")
    run_id = f"nobash-{os.getpid()}"
    inv = local_inventory(2)
    broken = dataclasses.replace(inv.hosts[1], python=sys.executable,
                                 setup=("export PATH=/nonexistent-bin",))
    inv = dataclasses.replace(inv, hosts=(inv.hosts[0], broken))
    plan = render(inv, Job(run_id=run_id, script="x", node_root=str(tmp_path / "nodes")),
                  Templates(tmp_path / "tpl"))
    backend = SupervisedBackend(lambda host: LocalTransport())
    try:
        backend.check(plan)
        t0 = time.monotonic()
        with pytest.raises(BackendError) as info:
            backend.start(plan, detach=True)
        assert time.monotonic() - t0 < 15
        assert "local1 1: start failed: the run did not start on this node: FileNotFoundError" in info.value.details
        assert "bash" in info.value.details, info.value.details
        assert "the started ones were stopped" in str(info.value)
        assert wait_for(lambda: not tagged_pids(run_id, "local0"), 10), "node local0 still runs"
    finally:
        backend.close()


class FailsToCheck(LocalTransport):
    """A node that cannot be checked (its login fails)."""

    def spawn(self, command: str):
        raise BackendError("connection refused")


def test_a_failed_check_leaves_no_run_folder_on_the_nodes_that_passed(tmp_path: Path,
                                                                        monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "node.sh.j2").write_text("exec sleep 300\n")
    plan = render(local_inventory(2), Job(run_id=f"nocheck-{os.getpid()}", script="x",
                                          node_root=str(tmp_path / "nodes")),
                  Templates(tmp_path / "tpl"))
    backend = SupervisedBackend(lambda host: FailsToCheck() if host.name == "local1"
                                else LocalTransport())
    try:
        with pytest.raises(ClusterError, match="1 of 2 node"):
            backend.check(plan)
        assert not (tmp_path / "nodes" / "local0").exists()
    finally:
        backend.close()
