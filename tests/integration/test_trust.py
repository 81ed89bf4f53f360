"""What users met on the first release, end to end on real sshd nodes with real torchrun:
secrets, a fixed master port reused at once, every stop signal (with SIGINT inherited as
ignored), and rank labels that agree with torch's own numbering under c10d.

Leftovers are checked by what is left in each node's network namespace (fixtures), not only by
the run-id scan the code under test uses.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import (PROGRAMS, Cli, node_leftovers, skip_unless_ssh_nodes,
                                            wait_until)
    from tests.integration.fixtures import SshNodes, processes_with_env
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, node_leftovers, skip_unless_ssh_nodes, wait_until  # type: ignore
    from fixtures import SshNodes, processes_with_env  # type: ignore

pytestmark = [pytest.mark.integration]

SYNC = ["--sync", str(PROGRAMS), "--"]


def lines(proc) -> list[tuple[str, int, dict]]:
    """(node, rank label, JSON) of every '[node rank] {...}' line."""
    out = []
    for line in proc.out:
        m = re.match(r"^\[(\S+) (\d+)\] (\{.*\})$", line)
        if m:
            out.append((m.group(1), int(m.group(2)), json.loads(m.group(3))))
    return out


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


# --- secrets ----------------------------------------------------------------------------------


def test_secret_env_never_touches_a_disk_a_log_or_a_command_line(ssh_nodes4, cli, canary):
    secret = f"hf_{os.getpid()}_Zq8$(touch {canary})'\"x"
    cli.env["HF_TOKEN"] = secret
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", secret_env=["HF_TOKEN"])
    proc = cli.start("up", "-i", inv, "--nodes", "2", *SYNC, "allreduce.py",
                     "--env-hash", "HF_TOKEN", "--sleep", "60")
    proc.wait_for(lambda p: sum('"sleeping"' in line for line in p.out) >= 2, 120, "ranks asleep")
    # during the run: no process on any node shows it on its command line
    for i in (1, 2):
        for pid in ssh_nodes4.network.processes_in(i):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert secret.encode() not in cmdline, f"node{i} pid {pid}: {cmdline!r}"
    want = hashlib.sha256(secret.encode()).hexdigest()
    assert [d["env_hash"] for _, _, d in lines(proc) if "env_hash" in d] == [want, want], proc.dump()
    os.kill(proc.popen.pid, signal.SIGINT)
    assert proc.wait(60) == 130, proc.dump()
    assert secret not in proc.stdout + proc.stderr
    for root in (cli.cwd / "runs", Path(ssh_nodes4.workdir(1)), Path(ssh_nodes4.workdir(2))):
        files = all_files(root)
        assert files, root
        for f in files:
            assert secret.encode() not in f.read_bytes(), f
    run = next((cli.cwd / "runs").iterdir())
    assert json.loads((run / "run.json").read_text())["secret_env"] == ["HF_TOKEN"]
    assert not canary.exists()


# --- a fixed master port, reused at once -------------------------------------------------------


def time_wait_on(ssh_nodes, node: int, port: int) -> bool:
    out = ssh_nodes.network.run_in(node, ["ss", "-tanH", "state", "time-wait",
                                          f"( sport = :{port} )"]).stdout
    return bool(out.strip())


def test_fixed_master_port_is_reused_at_once(ssh_nodes4, cli):
    """After a run the master port's connections sit in TIME_WAIT for a minute; torchrun's
    store listens there anyway (SO_REUSEADDR), and so must the probe let it."""
    port = 29000 + os.getpid() % 400
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    first = cli.run("up", "-i", inv, "--master-port", str(port), *SYNC, "allreduce.py", timeout=240)
    assert first.popen.returncode == 0, first.dump()
    if not time_wait_on(ssh_nodes4, 1, port):
        # make the condition certain: a connection the master's side closes first
        master = ssh_nodes4.nodes[0].address
        ssh_nodes4.network.run_in(1, [sys.executable, "-c", TIME_WAIT_MAKER, master, str(port)],
                                  check=True)
    assert time_wait_on(ssh_nodes4, 1, port), "the test needs TIME_WAIT on the master port"
    second = cli.run("up", "-i", inv, "--master-port", str(port), *SYNC, "allreduce.py", timeout=240)
    assert second.popen.returncode == 0, second.dump()
    assert "in use" not in second.stderr
    assert {d["sum"] for _, _, d in lines(second)} == {10.0}


TIME_WAIT_MAKER = """
import socket, sys, time
addr, port = sys.argv[1], int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("", port)); srv.listen()
cli = socket.create_connection((addr, port))
conn, _ = srv.accept(); conn.close(); time.sleep(0.1); cli.close(); srv.close()
"""


# --- stop signals, whatever the launcher inherited ---------------------------------------------


@pytest.mark.parametrize("sig,ignored,code", [
    (signal.SIGINT, (signal.SIGINT,), 130),       # `cluster up &` from a script: SIGINT ignored
    (signal.SIGTERM, (), 143),
    (signal.SIGHUP, (), 129),
], ids=["SIGINT-inherited-ignored", "SIGTERM", "SIGHUP"])
def test_each_stop_signal_stops_every_node(ssh_nodes4, cli, sig, ignored, code):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    proc = cli.start("up", "-i", inv, "--nodes", "2", *SYNC, "allreduce.py", "--sleep", "120",
                     ignore=ignored)
    proc.wait_for(lambda p: sum('"sleeping"' in line for line in p.out) >= 2, 120, "ranks asleep")
    run_id = proc.run_id()
    os.kill(proc.popen.pid, sig)
    assert proc.wait(60) == code, proc.dump()
    assert processes_with_env("CLUSTER_RUN_ID", run_id) == []
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2), 10) is not None, \
        node_leftovers(ssh_nodes4, 1, 2)
    meta = json.loads((cli.cwd / "runs" / run_id / "run.json").read_text())
    assert meta["interrupted"] == signal.Signals(sig).name


# --- c10d ranks: the labels are torch's own -----------------------------------------------------


@pytest.fixture(scope="module")
def ssh_nodes10():
    skip_unless_ssh_nodes()
    with SshNodes(10) as nodes:
        yield nodes


def test_c10d_labels_agree_with_torchs_ranks_on_ten_nodes(ssh_nodes10, tmp_path, record_property):
    """Addresses .1 to .10: as strings .10 sorts before .2, which is how torch's c10d
    rendezvous numbers the nodes. Every '[node rank]' label must be that node's real rank."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "known_hosts").write_text(Path(ssh_nodes10.known_hosts_path).read_text())
    work = tmp_path / "work"
    work.mkdir()
    cli = Cli(work, home)
    try:
        inv = ssh_nodes10.write_inventory(home / "inv.yaml", rendezvous="c10d")
        t0 = time.monotonic()
        proc = cli.run("up", "-i", inv, *SYNC, "allreduce.py", timeout=400)
        record_property("allreduce_10_nodes_s", round(time.monotonic() - t0, 2))
        assert proc.popen.returncode == 0, proc.dump()
        got = lines(proc)
        assert len(got) == 10, proc.dump()
        for node, label_rank, d in got:
            assert d["rank"] == label_rank, f"[{node} {label_rank}] is torch's rank {d['rank']}"
            assert d["host"] == node == d["node"]
        by_rank = [node for node, _, d in sorted(got, key=lambda x: x[2]["rank"])]
        assert by_rank[:3] == ["node1", "node10", "node2"], by_rank
        logs = sorted(p.name for p in next((work / "runs").iterdir()).joinpath("logs").iterdir())
        assert "1-node10.log" in logs and "9-node9.log" in logs
    finally:
        cli.cleanup()


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_master_addr_is_the_rank_0_nodes_not_always_the_first_hosts(ssh_nodes4, cli, rendezvous):
    """node2 listed first. static: node2 is rank 0 and every worker's MASTER_ADDR. c10d: torch
    numbers the nodes by their addresses as text, so node1 is rank 0 and the workers' MASTER_ADDR
    is node1's (the rendezvous store stays on node2, the first host, at master_port), with a
    MASTER_PORT torch chose there."""
    first, other = ssh_nodes4.network.node(2), ssh_nodes4.network.node(1)
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=[2, 1], rendezvous=rendezvous)
    proc = cli.run("up", "-i", inv, *SYNC, "allreduce.py", "--show-env", "MASTER_ADDR,MASTER_PORT")
    assert proc.popen.returncode == 0, proc.dump()
    got = lines(proc)
    assert sorted(d["rank"] for _, _, d in got) == [0, 1], proc.dump()
    rank0 = first if rendezvous == "static" else other
    assert [node for node, label, _ in got if label == 0] == [rank0.name], proc.dump()
    meta = json.loads((cli.cwd / "runs" / proc.run_id() / "run.json").read_text())
    assert meta["master_addr"] == first.address                 # the store: the first host
    for _, _, d in got:
        assert d["env"]["MASTER_ADDR"] == rank0.address, d
    ports = {d["env"]["MASTER_PORT"] for _, _, d in got}
    assert len(ports) == 1, ports
    assert (ports == {str(meta["master_port"])}) == (rendezvous == "static"), (ports, meta["master_port"])
