"""Node environments and the Python API on real sshd nodes with real torchrun: a venv
activated by `source` in the inventory's setup (and `python: auto` taking its interpreter),
values forwarded from the launching shell, torchrun options cluster does not model, and the
Python API.

Leftovers are checked by what is left in each node's network namespace (fixtures).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import (PROGRAMS, make_venv, node_leftovers,
                                            run_processes_in, wait_until)
except ImportError:  # run with tests/integration on sys.path
    from conftest import (PROGRAMS, make_venv, node_leftovers,  # type: ignore
                          run_processes_in, wait_until)

pytestmark = [pytest.mark.integration]

SYNC = ["--sync", str(PROGRAMS), "--"]


def records(text: str) -> list[tuple[str, dict]]:
    """(node label, JSON) of every '[label] {...}' line with an all-reduce result."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\[([^\]]+)\] (\{.*\})$", line)
        if m and '"sum"' in m.group(2):
            out.append((m.group(1), json.loads(m.group(2))))
    return out


def test_setup_sources_a_venv_auto_takes_its_python_and_values_are_forwarded(ssh_nodes4, cli):
    venv = make_venv(Path(ssh_nodes4.dir) / "venv")           # readable by the nodes' user
    inv = ssh_nodes4.write_inventory(
        cli.home / "inv.yaml", python="auto",
        setup=[f"source {venv}/bin/activate", "export FROM_SETUP=\"set on $(hostname)\""],
        env_forward=["FWD_*"], torchrun_args=["--log-dir=torchrun-logs"])
    cli.env.update(FWD_ONE="it's $(not run)", FWD_TWO="two", SHELL_NAME="from the shell")
    (cli.cwd / "extra.env").write_text("FROM_FILE='a \"b\" c'\n")
    proc = cli.run("up", "-i", inv, "--nodes", "2", "--env", "SHELL_NAME", "--env-file",
                   "extra.env", *SYNC, "allreduce.py", "--show-env",
                   "FROM_SETUP,FWD_ONE,FWD_TWO,SHELL_NAME,FROM_FILE,VIRTUAL_ENV")
    assert proc.popen.returncode == 0, proc.dump()
    got = records(proc.stdout)
    assert sorted(d["rank"] for _, d in got) == [0, 1], proc.dump()
    for _, d in got:
        assert Path(d["python"]).parent == venv / "bin"          # the venv's own interpreter
        assert d["env"] == {"FROM_SETUP": f"set on {d['host']}", "FWD_ONE": "it's $(not run)",
                            "FWD_TWO": "two", "SHELL_NAME": "from the shell",
                            "FROM_FILE": 'a "b" c', "VIRTUAL_ENV": str(venv)}
    for i in (1, 2):                          # torchrun took the option: its log directory
        assert (Path(ssh_nodes4.workdir(i)) / "torchrun-logs").is_dir()
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)      # a session may take a moment to close


def test_a_failing_setup_line_is_named_and_nothing_starts(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", setup=["true", "module load cuda/99"])
    proc = cli.run("up", "-i", inv, "--nodes", "2", *SYNC, "allreduce.py")
    assert proc.popen.returncode == 3, proc.dump()
    assert "setup line 2 failed (exit 127): module load cuda/99" in proc.stderr, proc.dump()
    assert records(proc.stdout) == []
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)      # a session may take a moment to close


def test_a_forwarded_name_missing_from_the_shell_stops_before_any_node(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", env_forward=["WANDB_API_KEY_X"])
    cli.env.pop("WANDB_API_KEY_X", None)
    proc = cli.run("up", "-i", inv, "--nodes", "2", *SYNC, "allreduce.py")
    assert proc.popen.returncode == 2, proc.dump()
    assert "env_forward: WANDB_API_KEY_X is not set in this shell" in proc.stderr
    assert not (cli.cwd / "runs").exists()            # checked before anything was created


# --- the Python API ---------------------------------------------------------------------------

API_PROGRAM = textwrap.dedent("""
    import json, sys, time
    import cluster
    from cluster.errors import InputError

    inv, programs, mode = sys.argv[1:4]
    try:
        cluster.up("no-such-inventory.yaml")
        bad = None
    except InputError as exc:
        bad = str(exc)
    out = {"bad": bad}
    if mode == "finish":
        run = cluster.up(inv, "allreduce.py", [], nodes=2, sync_dir=programs, echo=False)
        out["code"] = run.wait(180)
        out["status"] = run.status()
    elif mode.startswith("detach"):
        run = cluster.up(inv, "allreduce.py", ["--sleep", "4"], nodes=2, sync_dir=programs,
                         echo=False, detach=True)
        out["record"] = (run.path / "run.json").is_file()
        out["wait_at_once"] = run.wait(0)             # started, so its nodes are running
        if mode == "detach-wait":
            out["code"] = run.wait(180)
            out["status"] = run.status()
    elif mode == "exit-attached":                     # this program ends while the run runs
        run = cluster.up(inv, "allreduce.py", ["--sleep", "120"], nodes=2, sync_dir=programs,
                         echo=False)
        out["record"] = (run.path / "run.json").is_file()
        deadline = time.monotonic() + 120
        while run.logs().count('"sleeping"') < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        out["status"] = run.status()
    else:
        run = cluster.up(inv, "allreduce.py", ["--sleep", "120"], nodes=2, sync_dir=programs,
                         echo=False)
        deadline = time.monotonic() + 120
        while run.logs().count('"sleeping"') < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        out["status"] = run.status()
        out["code"] = run.down(120)
    out.update(logs=run.logs(), error=str(run.error) if run.error else None, run_id=run.run_id,
               path=str(run.path))
    print(json.dumps(out))
""")


def api(cli, inv: str, mode: str) -> dict:
    res = subprocess.run([sys.executable, "-c", API_PROGRAM, inv, str(PROGRAMS), mode],
                         cwd=cli.cwd, env=cli.env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_python_api_runs_a_job_to_the_end(ssh_nodes4, cli):
    got = api(cli, ssh_nodes4.write_inventory(cli.home / "inv.yaml"), "finish")
    assert "no-such-inventory.yaml" in got["bad"]
    assert got["code"] == 0 and got["error"] is None, got
    assert set(got["status"].values()) == {"exited 0"}, got["status"]
    assert sorted(d["rank"] for _, d in records(got["logs"])) == [0, 1]
    assert Path(got["path"]).name == got["run_id"]
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)      # a session may take a moment to close


def test_python_api_detached_run_outlives_its_program(ssh_nodes4, cli):
    got = api(cli, ssh_nodes4.write_inventory(cli.home / "inv.yaml"), "detach")
    assert got["record"] and got["wait_at_once"] is None, got
    # the program has ended; the nodes still run the job, which then ends by itself
    assert run_processes_in(ssh_nodes4, 1) and run_processes_in(ssh_nodes4, 2), got
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 120) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)
    status = cli.run("status", got["run_id"])
    assert status.stdout.count("exited") == 2, status.dump()
    logs = cli.run("logs", got["run_id"])
    assert sorted(d["rank"] for _, d in records(logs.stdout)) == [0, 1], logs.dump()


def test_python_api_wait_on_a_detached_run_returns_its_end(ssh_nodes4, cli):
    got = api(cli, ssh_nodes4.write_inventory(cli.home / "inv.yaml"), "detach-wait")
    assert got["wait_at_once"] is None and got["code"] == 0 and got["error"] is None, got
    assert set(got["status"].values()) == {"exited 0"}, got
    # the program's own logins end as it exits; their sshd may take a moment to see it
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)


def test_python_api_attached_run_stops_when_its_program_exits(ssh_nodes4, cli):
    got = api(cli, ssh_nodes4.write_inventory(cli.home / "inv.yaml"), "exit-attached")
    assert got["record"] and set(got["status"].values()) == {"running"}, got
    # nothing is left on either node: read from the nodes' namespaces, not from cluster
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)      # a session may take a moment to close
    meta = json.loads((cli.cwd / got["path"] / "run.json").read_text())
    assert meta["stopped_because"].startswith("the program that started it exited"), meta
    status = cli.run("status", got["run_id"])
    assert status.stdout.count("stopped") >= 2, status.dump()
    assert "stopped because the program that started it exited" in status.stdout, status.dump()


def test_python_api_down_stops_every_node(ssh_nodes4, cli):
    got = api(cli, ssh_nodes4.write_inventory(cli.home / "inv.yaml"), "down")
    assert set(got["status"].values()) == {"running"}, got
    assert got["code"] == 143 and "interrupted (SIGTERM)" in got["error"], got
    # nothing is left on either node: read from the nodes' namespaces, not from cluster
    assert wait_until(lambda: node_leftovers(ssh_nodes4, 1, 2) == {}, 30) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)


# --- the job's script, checked on every node before anything starts ---------------------------


def give_node(ssh_nodes, i: int, name: str, text: str) -> None:
    """A file in node i's workdir only, owned by the nodes' user (as a copy there would be)."""
    for path in [Path(ssh_nodes.workdir_root), Path(ssh_nodes.workdir(i))]:
        path.mkdir(exist_ok=True)
        os.chown(path, ssh_nodes.uid, ssh_nodes.gid)
    target = Path(ssh_nodes.workdir(i)) / name
    target.write_text(text)
    os.chown(target, ssh_nodes.uid, ssh_nodes.gid)


def test_a_script_missing_on_one_node_stops_the_launch_before_anything_starts(ssh_nodes4, cli):
    """Without --sync: node1's workdir has the script, node2's has not. Exit 3 names node2 and
    the path it looked at; no node started anything (read from the nodes' namespaces)."""
    give_node(ssh_nodes4, 1, "only-on-one.py", (PROGRAMS / "allreduce.py").read_text())
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    proc = cli.run("up", "-i", inv, "--hosts", "node[1-2]", "--", "only-on-one.py")
    assert proc.popen.returncode == 3, proc.dump()
    missing = f"{ssh_nodes4.workdir(2)}/only-on-one.py"
    assert f"node2: script: only-on-one.py is not a file on this node (looked for {missing}" \
           in proc.stderr, proc.dump()
    assert "node1: script" not in proc.stderr and "nothing was started" in proc.stderr
    assert "torch.distributed.run" not in proc.stdout + proc.stderr
    assert node_leftovers(ssh_nodes4, 1, 2) == {}


def test_a_script_missing_from_the_synced_folder_stops_the_launch(ssh_nodes4, cli):
    """With --sync: the check runs after the copy, so a script the folder lacks is named on
    every node (exit 3), and nothing starts."""
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    proc = cli.run("up", "-i", inv, "--nodes", "2", *SYNC, "not-in-programs.py")
    assert proc.popen.returncode == 3, proc.dump()
    for i in (1, 2):
        assert f"node{i}: script: not-in-programs.py is not a file on this node" in proc.stderr, \
            proc.dump()
    assert node_leftovers(ssh_nodes4, 1, 2) == {}


def test_a_module_script_is_not_taken_for_a_missing_file(ssh_nodes4, cli):
    """`torchrun -m allreduce` (the module from the synced folder): no file named 'allreduce'
    exists, and none should; the run starts and finishes."""
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", torchrun_args=["-m"])
    proc = cli.run("up", "-i", inv, "--nodes", "2", *SYNC, "allreduce")
    assert proc.popen.returncode == 0, proc.dump()
    assert sorted(d["rank"] for _, d in records(proc.stdout)) == [0, 1]
