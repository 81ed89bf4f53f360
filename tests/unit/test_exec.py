"""`cluster exec` on simulated local nodes: real processes through the same node-side program
(cluster/remote/execute.py) an SSH node runs; no network."""
from __future__ import annotations

import _thread
import io
import os
import threading
from pathlib import Path

import pytest

from cluster.backends.local import LocalTransport, local_inventory
from cluster.backends.supervised import SupervisedBackend
from cluster.console import Console
from cluster.errors import ClusterError, Interrupted, PreflightError, RunFailed
from cluster.execute import NodeResult, exec_args, run, summary_lines

from .test_supervisor import wait_for


class Unreachable(LocalTransport):
    def spawn(self, command: str):  # type: ignore[override]
        raise ClusterError("node1: cannot connect to 10.0.0.1:22: connection refused")


def console() -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(out, err, color=False), out, err


def hosts(n: int, tmp_path: Path):
    return [h.replace(workdir=str(tmp_path)) for h in local_inventory(n, gpus=[]).hosts]


def marked(marker: str) -> list[int]:
    """Live processes of an exec (CLUSTER_EXEC_ID in their environment) whose command line
    holds marker: what a test's command left behind."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"CLUSTER_EXEC_ID=" in env and marker.encode() in cmd and state not in "ZX":
            found.append(int(name))
    return found


@pytest.fixture
def backend():
    b = SupervisedBackend(lambda host: LocalTransport())
    yield b
    b.close()


def test_arguments_travel_whole_after_the_separator() -> None:
    host = local_inventory(1, gpus=[]).hosts[0]
    args = exec_args(host, "exec-1", ["echo", "$(id)", "a b"], 0.0)
    assert args[args.index("--") + 1:] == ["echo", "$(id)", "a b"]


def test_output_is_prefixed_and_every_node_reports_its_code(backend, tmp_path) -> None:
    con, out, err = console()
    script = 'echo "out $CLUSTER_NODE"; echo "err $CLUSTER_NODE" >&2; exit ${CLUSTER_NODE#local}'
    with pytest.raises(RunFailed) as info:
        run(hosts(3, tmp_path), backend, ["bash", "-c", script], con)
    lines = out.getvalue().splitlines()
    for n in range(3):
        assert f"[local{n}] out local{n}" in lines and f"[local{n}] err local{n}" in lines
    assert info.value.exit_code == 4
    assert "2 of 3 node(s) did not exit 0" in str(info.value)
    assert info.value.details.splitlines() == ["  local1: exit code 1", "  local2: exit code 2"]


def test_a_single_argument_is_never_evaluated_by_a_shell(backend, tmp_path) -> None:
    con, out, _ = console()
    canary = tmp_path / "canary"
    results = run(hosts(1, tmp_path), backend,
                  ["echo", f"$(touch {canary})", "`id`", "a  b;", "'q'"], con)
    assert results["localhost"].ok
    assert out.getvalue() == f"[localhost] $(touch {canary}) `id` a  b; 'q'\n"
    assert not canary.exists()


def test_all_zero_is_success_and_says_so(backend, tmp_path) -> None:
    con, _, err = console()
    results = run(hosts(2, tmp_path), backend, ["true"], con)
    assert all(r.code == 0 for r in results.values())
    assert "exec: all 2 node(s) exited 0" in err.getvalue()


def test_an_unreachable_node_is_exit_3_with_its_error_and_the_others_still_run(tmp_path) -> None:
    b = SupervisedBackend(lambda host: Unreachable() if host.name == "local1" else LocalTransport())
    con, out, _ = console()
    try:
        with pytest.raises(PreflightError) as info:
            run(hosts(2, tmp_path), b, ["echo", "ran"], con)
    finally:
        b.close()
    assert out.getvalue() == "[local0] ran\n"
    assert info.value.exit_code == 3
    assert "local1: unreachable: node1: cannot connect to 10.0.0.1:22" in info.value.details


def test_a_missing_command_is_127(backend, tmp_path) -> None:
    con, out, _ = console()
    with pytest.raises(RunFailed) as info:
        run(hosts(1, tmp_path), backend, ["no-such-command-here"], con)
    assert "no-such-command-here: command not found" in out.getvalue()
    assert "exit code 127" in info.value.details


def test_a_missing_workdir_runs_in_home_with_a_note(backend, tmp_path) -> None:
    con, out, err = console()
    host = local_inventory(1, gpus=[]).hosts[0].replace(workdir=str(tmp_path / "nowhere"))
    run([host], backend, ["pwd"], con)
    assert out.getvalue() == f"[localhost] {os.path.expanduser('~')}\n"
    assert "workdir" in err.getvalue() and "nowhere does not exist" in err.getvalue()


def test_what_the_command_left_running_ends_with_it(backend, tmp_path) -> None:
    con, _, err = console()
    run(hosts(1, tmp_path), backend, ["bash", "-c", "setsid sleep 3617 & echo started"], con)
    assert wait_for(lambda: not marked("sleep 3617"), 5), marked("sleep 3617")
    assert "stopped 1 process(es) the command left running" in err.getvalue()


def test_a_child_that_left_the_commands_identity_ends_with_it(backend, tmp_path) -> None:
    """`setsid env -i ...`: no CLUSTER_EXEC_ID to find it by, but still a descendant."""
    pidfile = tmp_path / "scrubbed.pid"
    script = f"setsid env -i sh -c 'echo $$ > {pidfile}; exec sleep 3618' & sleep 0.5; echo started"
    con, _, _ = console()
    try:
        run(hosts(1, tmp_path), backend, ["bash", "-c", script], con)
        pid = int(pidfile.read_text())
        assert wait_for(lambda: not Path(f"/proc/{pid}").exists()
                        or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX", 5)
    finally:
        if pidfile.exists() and Path(f"/proc/{pidfile.read_text().strip()}").exists():
            os.kill(int(pidfile.read_text()), 9)


def test_ctrl_c_stops_the_command_on_every_node_and_leaves_nothing(backend, tmp_path,
                                                                   ctrl_c_raises) -> None:
    con, out, _ = console()
    # A background child, one in a session of its own, and the foreground one.
    script = "sleep 3611 & setsid sleep 3612 & echo started; sleep 3613"
    started = threading.Event()

    class Watching(Console):
        def node_line(self, label: str, index: int, text: str) -> None:
            super().node_line(label, index, text)
            if out.getvalue().count("started") == 2:
                started.set()
    threading.Thread(target=lambda: started.wait(20) and _thread.interrupt_main(),
                     daemon=True).start()
    with pytest.raises(Interrupted) as info:
        run(hosts(2, tmp_path), backend, ["bash", "-c", script],
            Watching(out, io.StringIO(), color=False))
    assert info.value.exit_code == 130
    assert "the command was stopped on 2 node(s)" in str(info.value)
    assert marked("sleep 361") == [], "processes of the command outlived the Ctrl-C"


def test_summary_names_each_node_that_did_not_exit_0() -> None:
    results = {"a": NodeResult("a", code=0), "b": NodeResult("b", code=137),
               "c": NodeResult("c", error="refused"), "d": NodeResult("d", lost=True)}
    assert summary_lines(results) == ["  b: exit code 137 (SIGKILL)", "  c: unreachable: refused",
                                      "  d: connection lost while the command ran"]


def test_exec_under_slurm_refuses_and_says_what_to_use(tmp_path: Path, capsys) -> None:
    from cluster.cli import run_cli
    inv = tmp_path / "slurm.yaml"
    inv.write_text("backend: slurm\nhosts:\n  - {name: c1}\n")
    assert run_cli(["exec", "-i", str(inv), "--", "hostname"]) == 2
    assert "srun --nodes N --ntasks-per-node 1 CMD" in capsys.readouterr().err


def test_a_node_without_the_python_says_so_in_its_output(backend, tmp_path) -> None:
    con, out, _ = console()
    host = hosts(1, tmp_path)[0].replace(python=str(tmp_path / "no-python"))
    with pytest.raises(RunFailed) as info:
        run([host], backend, ["true"], con)
    assert "no-python" in out.getvalue() and "not found" in out.getvalue()
    assert "exit code 127" in info.value.details
