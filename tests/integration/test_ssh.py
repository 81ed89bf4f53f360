"""The SSH backend end to end: the real `cluster` CLI against real sshd nodes (one network
namespace each, see fixtures/sshnodes.py), real torchrun with gloo.

Every test runs `python -m cluster ...` in a temp dir with HOME pointing at a temp home whose
~/.ssh it controls; the `cli` fixture kills whatever a test left behind, here and on the nodes.
Timings are printed and recorded as junit properties.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, Cli, Proc, node_leftovers, wait_until
    from tests.integration.fixtures import processes_with_env
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, Proc, node_leftovers, wait_until  # type: ignore
    from fixtures import processes_with_env  # type: ignore

pytestmark = [pytest.mark.integration]

ALLREDUCE = ["--sync", str(PROGRAMS), "--", "allreduce.py"]


def report(record_property, name: str, seconds: float) -> None:
    record_property(name, round(seconds, 3))
    sys.stderr.write(f"\n[ssh timing] {name}: {seconds:.2f} s\n")


def results(proc: Proc) -> list[dict]:
    """The JSON lines the all-reduce program printed, by rank."""
    out = []
    for line in proc.out:
        _, _, text = line.partition("] ")
        if text.startswith("{") and '"sum"' in text:
            out.append({**json.loads(text), "label": line[1:line.index("] ")]})
    return sorted(out, key=lambda r: r["rank"])


def inventory(ssh_nodes4, cli: Cli, name: str = "inv.yaml", **overrides) -> str:
    return ssh_nodes4.write_inventory(cli.home / name, **overrides)


def run_procs(run_id: str) -> list[int]:
    return processes_with_env("CLUSTER_RUN_ID", run_id)


def sleeping_ranks(n: int):
    return lambda p: sum('"sleeping"' in line for line in p.out) >= n


# --- 1. all-reduce on 2 and 4 nodes; the default trainer ----------------------------------


@pytest.mark.parametrize("nodes", [2, 4])
def test_allreduce(ssh_nodes4, cli, nodes, record_property):
    inv = inventory(ssh_nodes4, cli)
    t0 = time.monotonic()
    proc = cli.run("up", "-i", inv, "--nodes", str(nodes), *ALLREDUCE)
    report(record_property, f"allreduce_{nodes}_nodes_s", time.monotonic() - t0)
    assert proc.popen.returncode == 0, proc.dump()
    got = results(proc)
    want_sum = nodes * (nodes + 1) / 2
    assert [r["rank"] for r in got] == list(range(nodes)), proc.dump()
    meta = json.loads((cli.cwd / "runs" / proc.run_id() / "run.json").read_text())
    ranked = {n["rank"]: n["name"] for n in meta["nodes"]}
    for r in got:
        assert r["world_size"] == nodes and r["sum"] == want_sum
        # the group rank torch gave this process ran on the host (its own hostname, not
        # what cluster says) that cluster's record, label and CLUSTER_NODE name for it
        assert r["host"] == r["node"] == ranked[r["rank"]], (r, ranked)
        assert r["label"] == f"{r['host']} {r['rank']}"
    # synced into each node's workdir; the run's own folder there is private (its scripts hold
    # env values)
    for i in range(1, nodes + 1):
        assert (Path(ssh_nodes4.workdir(i)) / "allreduce.py").is_file()
        run_dir = Path(ssh_nodes4.workdir(i)) / ".cluster" / proc.run_id()
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700, oct(run_dir.stat().st_mode)
        for sub in run_dir.iterdir():
            assert stat.S_IMODE(sub.stat().st_mode) & 0o077 == 0, (sub, oct(sub.stat().st_mode))


def test_default_trainer_with_ssh_config(ssh_nodes4, cli, record_property):
    """The built-in trainer is synced to <workdir>/cluster-train and takes the options after
    `--`. User, key and known_hosts come from ~/.ssh/config alone (the inventory names none)."""
    shutil.copy(ssh_nodes4.ssh_config_path, cli.home / ".ssh" / "config")
    (cli.home / ".ssh" / "known_hosts").unlink()
    inv = inventory(ssh_nodes4, cli, user=None, identity_file=None, port=None)
    t0 = time.monotonic()
    proc = cli.run("up", "-i", inv, "--nodes", "2", "--",
                   "--epochs", "1", "--no-resume", "--out", "out", timeout=300)
    report(record_property, "trainer_2_nodes_s", time.monotonic() - t0)
    assert proc.popen.returncode == 0, proc.dump()
    final = [line for line in proc.out if "FINAL" in line]
    assert final, proc.dump()
    info = json.loads(final[-1].split("FINAL", 1)[1])
    assert info.get("world_size") == 2 and info.get("epochs") == 1, final[-1]
    assert (Path(ssh_nodes4.workdir(2)) / "cluster-train" / "train.py").is_file()
    assert (Path(ssh_nodes4.workdir(1)) / "out" / "metrics.jsonl").is_file()   # --out was ours


# --- 2. kill -9 of one worker: fail fast, nothing left --------------------------------------


def test_worker_killed_stops_every_node(ssh_nodes4, cli, record_property):
    inv = inventory(ssh_nodes4, cli)
    proc = cli.start("up", "-i", inv, "--nodes", "3", "--sync", str(PROGRAMS), "--",
                     "allreduce.py", "--sleep", "120")
    proc.wait_for(sleeping_ranks(3), 120, "every rank asleep")
    run_id = proc.run_id()
    victim = next(r for r in results(proc) if r["node"] == "node2")
    assert victim["pid"] in run_procs(run_id)
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    gone = wait_until(lambda: not run_procs(run_id), 20, interval=0.1)
    assert gone is not None, f"left: {run_procs(run_id)}\n{proc.dump()}"
    report(record_property, "kill9_to_all_gone_s", gone)
    assert gone < 3.0
    assert proc.wait(60) == 4, proc.dump()
    report(record_property, "kill9_to_cluster_exit_s", time.monotonic() - t0)
    assert "node [node2 1] failed first" in proc.stderr, proc.dump()
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2, 3), 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2, 3)


# --- 3. Ctrl-C ------------------------------------------------------------------------------


def test_sigint_stops_every_node(ssh_nodes4, cli):
    inv = inventory(ssh_nodes4, cli)
    proc = cli.start("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--",
                     "allreduce.py", "--sleep", "120")
    proc.wait_for(sleeping_ranks(2), 120, "every rank asleep")
    run_id = proc.run_id()
    assert run_procs(run_id)
    os.kill(proc.popen.pid, signal.SIGINT)
    assert proc.wait(60) == 130, proc.dump()
    assert run_procs(run_id) == []
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2), 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)


# --- the controlling process dies: the supervisors see EOF and stop -------------------------


def test_sigkill_of_cluster_up_stops_remote(ssh_nodes4, cli, record_property):
    inv = inventory(ssh_nodes4, cli)
    proc = cli.start("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--",
                     "allreduce.py", "--sleep", "120")
    proc.wait_for(sleeping_ranks(2), 120, "every rank asleep")
    run_id = proc.run_id()
    proc.popen.kill()
    t0 = time.monotonic()
    proc.wait(10)
    gone = wait_until(lambda: not run_procs(run_id), 20)
    assert gone is not None, f"left after SIGKILL of cluster up: {run_procs(run_id)}"
    report(record_property, "sigkill_up_to_remote_gone_s", time.monotonic() - t0)
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2), 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)


# --- 4. one unreachable node: nothing starts -------------------------------------------------


def test_unreachable_node_starts_nothing(ssh_nodes4, cli):
    inv = inventory(ssh_nodes4, cli)
    ssh_nodes4.stop_sshd(3)
    try:
        proc = cli.run("up", "-i", inv, "--hosts", "node[1-3]", *ALLREDUCE, timeout=60)
    finally:
        ssh_nodes4.start_sshd(3)
    assert proc.popen.returncode == 3, proc.dump()
    assert "node3" in proc.stderr and "refused" in proc.stderr, proc.dump()
    assert "nothing was started" in proc.stderr
    run_id = cli.run_ids()[-1]
    assert run_procs(run_id) == []
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2, 3), 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2, 3)
    for i in (1, 2):
        assert not list(Path(ssh_nodes4.workdir(i)).glob(f".cluster/{run_id}/*/pgid"))


# --- 5. detach, status, logs -f, down ---------------------------------------------------------


def status_states(cli: Cli, run_id: str) -> dict[str, str]:
    proc = cli.run("status", run_id, timeout=60)
    assert proc.popen.returncode == 0, proc.dump()
    states = {}
    for line in proc.out:
        parts = line.split("│")
        if len(parts) < 6:
            continue
        cells = [c.strip() for c in parts[1:-1]]
        if cells[1].startswith("node"):
            states[cells[1]] = f"{cells[2]} {cells[3]}".strip()
    return states


def test_detach_status_logs_down(ssh_nodes4, cli):
    inv = inventory(ssh_nodes4, cli)
    up = cli.run("up", "-i", inv, "--nodes", "2", "--detach", *ALLREDUCE, "--sleep", "6")
    assert up.popen.returncode == 0, up.dump()
    run_id = up.run_id()
    assert status_states(cli, run_id) == {"node1": "running", "node2": "running"}
    logs = cli.run("logs", "-f", run_id, timeout=120)
    assert logs.popen.returncode == 0, logs.dump()
    for node in ("node1", "node2"):
        assert any(line.startswith(f"[{node} ") and '"sum": 3.0' in line for line in logs.out), logs.dump()
    assert wait_until(lambda: status_states(cli, run_id) == {"node1": "exited 0", "node2": "exited 0"},
                      30, 0.5) is not None, status_states(cli, run_id)

    long = cli.run("up", "-i", inv, "--nodes", "2", "--detach", *ALLREDUCE, "--sleep", "300")
    assert long.popen.returncode == 0, long.dump()
    long_id = long.run_id()
    assert wait_until(lambda: len(run_procs(long_id)) >= 4, 60) is not None
    down = cli.run("down", long_id, timeout=60)
    assert down.popen.returncode == 0, down.dump()
    assert run_procs(long_id) == []
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2), 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)
    # the stop's code on every node (every process ended within the grace after SIGTERM), not
    # torchrun's own under it (1 when it unwound in time, none when it was killed: a race)
    assert status_states(cli, long_id) == {"node1": "stopped 143", "node2": "stopped 143"}
    # every worker ended on SIGTERM within the grace: said so, not "signal 9" (torchrun itself
    # is killed a moment after its workers are gone, which is no kill of the work)
    status = cli.run("status", long_id, timeout=60)
    assert status.stdout.count("SIGTERM: ended within the 30 s grace") == 2, status.dump()
    assert "signal 9" not in status.stdout and "SIGKILL" not in status.stdout, status.dump()
    assert json.loads((cli.cwd / "runs" / long_id / "run.json").read_text())["stops"] == \
        {"node1": "term", "node2": "term"}


def test_logs_follow_every_node_at_once_over_ssh(ssh_nodes4, cli):
    """`cluster logs -f` over SSH interleaves nodes as their lines arrive: node2's line,
    printed between node1's two lines, is shown between them. Each line waits for the one
    before it to have been shown (a file the test makes), so the order is the arrival's."""
    go = Path(ssh_nodes4.workdir(2)) / f"go-{os.getpid()}"
    for f in (go.with_suffix(".b"), go.with_suffix(".a")):
        f.unlink(missing_ok=True)
    wait = "until [ -e {0} ]; do sleep 0.05; done"
    (cli.cwd / "tpl").mkdir()
    (cli.cwd / "tpl" / "node.sh.j2").write_text(
        "{% if rank == 0 %}echo a0; " + wait.format(go.with_suffix(".a")) + "; echo a1\n"
        "{% else %}" + wait.format(go.with_suffix(".b")) + "; echo b0\n{% endif %}")
    up = cli.run("up", "-i", inventory(ssh_nodes4, cli), "--nodes", "2", "--detach",
                 "--no-preflight", "--templates", "tpl", "--", "unused")
    assert up.popen.returncode == 0, up.dump()
    logs = cli.start("logs", "-f", up.run_id())
    logs.wait_for(lambda p: "[node1 0] a0" in p.out, 60, "a0")
    go.with_suffix(".b").touch()
    logs.wait_for(lambda p: "[node2 1] b0" in p.out, 60, "b0")
    go.with_suffix(".a").touch()
    assert logs.wait(60) == 0, logs.dump()
    shown = [line for line in logs.out if line.startswith("[")]
    assert shown == ["[node1 0] a0", "[node2 1] b0", "[node1 0] a1"], logs.dump()


def test_a_dry_run_is_never_the_run_that_down_status_and_logs_act_on(ssh_nodes4, cli):
    """A detached run, then a dry run: `down` with no RUN stops the detached run (not the
    dry run, whose node folders never existed); the dry run named says what it is."""
    inv = inventory(ssh_nodes4, cli)
    up = cli.run("up", "-i", inv, "--nodes", "2", "--detach", *ALLREDUCE, "--sleep", "300")
    assert up.popen.returncode == 0, up.dump()
    run_id = up.run_id()
    assert wait_until(lambda: len(run_procs(run_id)) >= 4, 60) is not None
    dry = cli.run("up", "-i", inv, "--nodes", "2", "--dry-run", *ALLREDUCE)
    assert dry.popen.returncode == 0, dry.dump()
    dry_id = next(rid for rid in cli.run_ids() if rid != run_id)
    status = cli.run("status", timeout=60)
    assert status.popen.returncode == 0 and f"run {run_id}" in status.stdout, status.dump()
    assert "removed" not in status.stdout, status.dump()
    down = cli.run("down", timeout=60)
    assert down.popen.returncode == 0 and "Traceback" not in down.stderr, down.dump()
    assert wait_until(lambda: run_procs(run_id) == [], 10) is not None, run_procs(run_id)
    named = cli.run("down", dry_id, timeout=60)
    assert named.popen.returncode == 2, named.dump()
    assert f"run {dry_id} is a dry run: nothing of it was started" in named.stderr, named.dump()


FIRST_FAILURE_API = """
import json, sys
import cluster
inv, programs = sys.argv[1:3]
run = cluster.up(inv, "allreduce.py", ["--raise-rank", "2"], nodes=3, sync_dir=programs,
                 echo=False, detach=True)
code = run.wait(180)
print(json.dumps({"code": code, "error": str(run.error), "run_id": run.run_id}))
"""


def test_a_detached_failure_names_the_first_node_and_its_workers_error(ssh_nodes4, cli):
    """Rank 2 (node3) raises; the others fail 3 s later in their barrier. run.wait() and
    `logs -f` name node3 and its RuntimeError, as an attached run does, not node1."""
    import subprocess
    inv = inventory(ssh_nodes4, cli)
    res = subprocess.run([sys.executable, "-c", FIRST_FAILURE_API, inv, str(PROGRAMS)],
                         cwd=cli.cwd, env=cli.env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["code"] == 4, got
    assert got["error"].startswith("node [node3 2] failed: RuntimeError: rank 2 gave up "
                                   "(exited with code 1)"), got
    logs = cli.run("logs", "-f", got["run_id"], timeout=120)
    assert logs.popen.returncode == 4, logs.dump()
    assert (f"run {got['run_id']} did not succeed: node [node3 2] failed: RuntimeError: rank 2 "
            f"gave up (exited with code 1)") in logs.stderr, logs.dump()


# --- 6. two runs on the same nodes: down A leaves B alone -----------------------------------


def test_two_runs_down_one(ssh_nodes4, cli):
    inv = inventory(ssh_nodes4, cli)
    a = cli.run("up", "-i", inv, "--nodes", "2", "--detach", *ALLREDUCE, "--sleep", "300")
    b = cli.run("up", "-i", inv, "--nodes", "2", "--detach", *ALLREDUCE, "--sleep", "8")
    assert a.popen.returncode == 0 and b.popen.returncode == 0, a.dump() + b.dump()
    a_id, b_id = a.run_id(), b.run_id()
    assert a_id != b_id
    assert wait_until(lambda: len(run_procs(a_id)) >= 4 and len(run_procs(b_id)) >= 4, 60) is not None
    down = cli.run("down", a_id, timeout=60)
    assert down.popen.returncode == 0, down.dump()
    assert run_procs(a_id) == []
    assert run_procs(b_id), "run B was stopped too"
    assert wait_until(lambda: status_states(cli, b_id) == {"node1": "exited 0", "node2": "exited 0"},
                      120, 1.0) is not None, status_states(cli, b_id)


# --- 7. host keys ---------------------------------------------------------------------------


def test_host_key_policies(ssh_nodes4, cli):
    inv = inventory(ssh_nodes4, cli)
    known = cli.home / ".ssh" / "known_hosts"
    known.write_text("")
    strict = cli.run("up", "-i", inv, "--nodes", "1", *ALLREDUCE, timeout=60)
    assert strict.popen.returncode == 3, strict.dump()
    assert "known_hosts" in strict.stderr and "ssh-keyscan" in strict.stderr, strict.dump()
    assert "accept-new" in strict.stderr

    accept = cli.run("up", "-i", inv, "--nodes", "1", "--host-key-policy", "accept-new",
                     *ALLREDUCE, timeout=120)
    assert accept.popen.returncode == 0, accept.dump()
    node1 = ssh_nodes4.nodes[0]
    assert node1.hostkey_pub.split()[1] in known.read_text()
    again = cli.run("up", "-i", inv, "--nodes", "1", *ALLREDUCE, timeout=120)  # now strict passes
    assert again.popen.returncode == 0, again.dump()

    # a changed key (node2's key recorded for node1) is refused even under accept-new
    known.write_text(f"{node1.address} {ssh_nodes4.nodes[1].hostkey_pub}\n")
    changed = cli.run("up", "-i", inv, "--nodes", "1", "--host-key-policy", "accept-new",
                      *ALLREDUCE, timeout=60)
    assert changed.popen.returncode == 3, changed.dump()
    assert "HOST KEY CHANGED" in changed.stderr and f"{known} line 1" in changed.stderr, changed.dump()
    assert known.read_text().count("\n") == 1
